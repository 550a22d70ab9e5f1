"""How the analyses write numbers in their verdicts and evidence."""

from __future__ import annotations


def ms(ns) -> str:
    """A duration in ns as people read it: 0.42 ms, 187.3 ms, 2.50 s."""
    ms = ns / 1e6
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    return f"{ms:.1f} ms" if ms >= 1 else f"{ms:.2f} ms"

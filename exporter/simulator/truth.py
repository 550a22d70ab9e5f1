"""Ground truth written by libnccl.so.2 (one JSON line per outermost call)."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable

from exporter.records.contract import COLLECTIVE_OPS as _COLLECTIVE_OPS

COLLECTIVE_OPS = frozenset(_COLLECTIVE_OPS.values())


def _files(paths_or_dir) -> list[pathlib.Path]:
    if isinstance(paths_or_dir, (str, os.PathLike)):
        paths_or_dir = [paths_or_dir]
    out: list[pathlib.Path] = []
    for p in paths_or_dir:
        p = pathlib.Path(p)
        if p.is_dir():
            out.extend(sorted(x for x in p.iterdir() if x.is_file() and x.suffix in (".jsonl", ".json", ".truth")))
        elif p.exists():
            out.append(p)
    return out


def load_truth(paths_or_dir) -> list[dict]:
    """Parse truth files (a file, a directory of *.jsonl, or a list of them).

    Records are sorted by start_mono_ns. A torn last line (a rank killed
    mid-write) is skipped.
    """
    recs: list[dict] = []
    for f in _files(paths_or_dir):
        with open(f, "r", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    recs.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    recs.sort(key=lambda r: (r.get("start_mono_ns", 0), r.get("pid", 0), r.get("tid", 0)))
    return recs


def calls(records: Iterable[dict], op: str | None = None, fn: str | None = None) -> list[dict]:
    """Collective / point-to-point records, optionally filtered by op or fn."""
    return [r for r in records if r.get("op") in COLLECTIVE_OPS
            and (op is None or r["op"] == op) and (fn is None or r["fn"] == fn)]


def lifecycle(records: Iterable[dict], op: str | None = None, fn: str | None = None) -> list[dict]:
    """Everything that is not a collective: init, split, destroy, group, queries."""
    return [r for r in records if r.get("op") not in COLLECTIVE_OPS
            and (op is None or r["op"] == op) and (fn is None or r["fn"] == fn)]


def duration_ns(rec: dict) -> int:
    return rec["end_mono_ns"] - rec["start_mono_ns"]

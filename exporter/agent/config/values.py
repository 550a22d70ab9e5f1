"""The text forms of the agent's settings: one parser per kind of text a flag,
a TOML string or an environment variable holds. They raise
argparse.ArgumentTypeError, whose text argparse prints as is."""

from __future__ import annotations

import argparse
import re

from exporter.records import contract


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h)?\s*$")


def parse_duration(text) -> float:
    """'2m' -> 120.0 seconds; plain numbers are seconds."""
    m = _DURATION.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 30s, 2m, 1h, 500ms)")
    value, unit = float(m.group(1)), m.group(2) or "s"
    return value * {"us": 1e-6, "ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


def positive_int(text) -> int:
    """An integer >= 1."""
    try:
        n = int(str(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return n


def positive_duration(text) -> float:
    """A duration > 0, in seconds."""
    seconds = parse_duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0: {text!r}")
    return seconds


def positive_factor(text) -> float:
    """A number > 0 (--slow-relative)."""
    try:
        k = float(str(text))
    except ValueError:
        k = 0.0
    if not k > 0:
        raise argparse.ArgumentTypeError(f"not a factor > 0: {text!r} (try 3)")
    return k


def parse_idle_detach(text) -> float:
    """A duration in s; 'off' -> infinity (never detached)."""
    if str(text).strip().lower() == "off":
        return float("inf")
    return parse_duration(text)


def parse_srtt_sampling(text) -> tuple[float, float] | None:
    """'W/P' -> (W, P) in s, 0 < W <= P; 'always' -> None."""
    if str(text).strip().lower() == "always":
        return None
    window, _, period = str(text).partition("/")
    try:
        w, p = parse_duration(window), parse_duration(period)
    except argparse.ArgumentTypeError:
        w = p = 0.0
    if not 0 < w <= p:
        raise argparse.ArgumentTypeError(f"not WINDOW/PERIOD (0 < WINDOW <= PERIOD) or 'always': {text!r} "
                                         "(try 250ms/5s, 1s/10s, always)")
    return w, p


def parse_owner_window(text) -> float | None:
    """A duration > 0 in s; 'always' -> None."""
    if str(text).strip().lower() == "always":
        return None
    try:
        window = parse_duration(text)
    except argparse.ArgumentTypeError:
        window = 0.0
    if window <= 0:
        raise argparse.ArgumentTypeError(f"not a duration above 0 or 'always': {text!r} (try 3s, 10s, always)")
    return window


def parse_runq_wait_min(text) -> int:
    """'off' -> 0 (no scheduler events); a duration -> ns (0 -> 1: every wait)."""
    if str(text).strip().lower() == "off":
        return 0
    try:
        return max(1, round(parse_duration(text) * 1e9))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a duration or 'off': {text!r} (try 100us, 1ms, 0, off)") from None


def parse_listen(text) -> tuple[str, int]:
    """'HOST:PORT', ':PORT' or 'PORT' -> (host, port)."""
    host, _, port = str(text).rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected HOST:PORT, e.g. 0.0.0.0:{contract.DEFAULT_PORT}") from None
    if not 0 < number < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: port must be 1-65535")
    return host, number


def parse_slow_threshold(text) -> tuple[str | None, int]:
    """'50ms' -> (None, ns): every collective; 'ALL_REDUCE=200ms' -> ('ALL_REDUCE', ns)."""
    op, sep, duration = str(text).rpartition("=")
    ns = int(parse_duration(duration) * 1e9)
    if not sep:
        return None, ns
    if op.upper() not in contract.COLLECTIVE_OPS.values():
        raise argparse.ArgumentTypeError(f"{text!r}: unknown op {op!r}; ops: "
                                         + ", ".join(contract.COLLECTIVE_OPS.values()))
    return op.upper(), ns


def _milliseconds(text) -> float:
    """OTEL_METRIC_EXPORT_INTERVAL: milliseconds, the OpenTelemetry SDK's unit."""
    try:
        ms = float(text)
    except ValueError:
        ms = 0.0
    if ms <= 0:
        raise argparse.ArgumentTypeError(f"not a number of milliseconds above 0: {text!r}")
    return ms / 1000


def _text(text) -> str:
    return str(text).strip()

"""What the node query endpoint (endpoint.py) and its clients (client.py, `fleet`,
`mcp`) agree on: the paths, the bearer token file, the time forms of a window,
and which listen addresses are loopback (docs/fleet-live.md)."""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os

QUERY_PATH = "/api/v1/query"
RECORDING_PATH = "/api/v1/recording"
TIME_PATH = "/api/v1/time"

TOKEN_ENV = "NCCL_EXPORTER_QUERY_TOKEN"


class ProtocolError(ValueError):
    """Bad input to the protocol (one line)."""


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(path: str | None, flag: str = "--token-file") -> str | None:
    """The bearer token in file `path` (one word); without a path, $NCCL_EXPORTER_QUERY_TOKEN
    or None. ProtocolError names `flag` when the file cannot be read, is empty or holds more
    than one word."""
    if not path:
        return os.environ.get(TOKEN_ENV) or None
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as e:
        raise ProtocolError(f"{flag} {path}: {e.strerror or e}") from None
    if not token:
        raise ProtocolError(f"{flag} {path}: empty")
    if any(c.isspace() for c in token):
        raise ProtocolError(f"{flag} {path}: the token must be one word")
    return token


NS_MIN, NS_MAX = -(1 << 63), (1 << 63) - 1   # what a recording's INTEGER holds


def parse_time_ns(text: str | None) -> int | None:
    """'1700000000000000000' (ns since the epoch) or ISO 8601 -> ns; None/'' -> None.
    ValueError (one line) for anything else, and for a time a recording cannot hold."""
    if text is None or str(text).strip() == "":
        return None
    text = str(text).strip()
    if len(text) > 64:
        raise ValueError(f"not a time: {text[:20]!r}... ({len(text)} characters)")
    if text.lstrip("-").isdigit():
        ns = int(text)
    else:
        try:
            t = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
            if t.tzinfo is None:
                t = t.replace(tzinfo=_dt.timezone.utc)
            ns = int(t.timestamp()) * 1_000_000_000 + t.microsecond * 1000
        except (ValueError, OverflowError, OSError):
            raise ValueError(f"not a time: {text!r} (ns since the epoch, or ISO 8601 such as "
                             "2026-01-02T03:04:05Z)") from None
    if not NS_MIN <= ns <= NS_MAX:
        raise ValueError(f"time {text!r} is out of range: a recording holds 1677-09-21 .. 2262-04-11 "
                         "(signed 64-bit ns since the epoch)")
    return ns

"""Which processes a recording keeps (`trace --pid/--netns`): a Scope, and
the network-namespace helpers it needs (an inode from a path or number, a
process's namespace). The writer (writer.py) asks `pid in scope` once per
process."""

from __future__ import annotations

import os

from exporter.sinks.recording.schema import RecordingError


def netns_inode(spec: str | int) -> int:
    """--netns PATH|INODE -> the namespace inode ('net:[4026532]' also accepted)."""
    text = str(spec).strip()
    if text.startswith("net:[") and text.endswith("]"):
        text = text[5:-1]
    if text.isdigit():
        return int(text)
    try:
        return os.stat(text).st_ino
    except OSError as e:
        raise RecordingError(f"--netns {spec}: {e.strerror or e}") from None


def pid_netns(pid: int, proc: str = "/proc") -> int | None:
    try:
        return os.stat(f"{proc}/{pid}/ns/net").st_ino
    except OSError:
        return None


class Scope:
    """Which processes a recording keeps: given pids and/or one network namespace.

    Empty scope: everything. A process's namespace is read once, on its
    first event, and remembered (an event arrives while its process lives).
    """

    def __init__(self, pids=(), netns: int | None = None, proc: str = "/proc"):
        self.pids = set(int(p) for p in pids)
        self.netns = netns
        self.proc = proc
        self._verdict: dict[int, bool] = {}

    @property
    def everything(self) -> bool:
        return not self.pids and self.netns is None

    def __contains__(self, pid) -> bool:
        if self.everything:
            return True
        v = self._verdict.get(pid)
        if v is None:
            v = pid in self.pids or (self.netns is not None and pid_netns(pid, self.proc) == self.netns)
            self._verdict[pid] = v
        return v

    def describe(self) -> str:
        parts = []
        if self.pids:
            parts.append("pid " + ",".join(str(p) for p in sorted(self.pids)))
        if self.netns is not None:
            parts.append(f"netns {self.netns}")
        return " or ".join(parts) or "all processes"

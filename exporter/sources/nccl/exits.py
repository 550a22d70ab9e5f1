"""Ranks whose process ended while holding a communicator: a killed or crashed
rank, or a job that exited without ncclCommDestroy.

bpf/nccl.c writes `process_exits` (tgid -> ktime, the signal that ended it)
when the main thread of a traced process exits (the signal: the first fatal
one delivered to it, from the signal_deliver tracepoint); the agent's loop (NcclReader.prune) reads
and empties it before it forgets the process's communicators, so each exit
is matched to the (communicator, rank) pairs the process still held. An
entry stays for the series TTL (`run --series-ttl`), as the communicator's
other series do, and there are at most MAX_EXITS of them (the oldest go).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

from exporter.records import contract

MAX_EXITS = contract.MAX_COMMS


@dataclass(frozen=True)
class RankExit:
    pid: int
    comm: int         # the `comm` label (Communicator.comm)
    rank: int
    nranks: int
    time_s: float     # wall-clock time of the exit (Unix seconds)
    signal: str       # the signal that ended the process ("SIGKILL"), "" for an exit


def signal_name(sig: int) -> str:
    """"SIGKILL" for 9; "" for 0 (no signal: the process exited)."""
    if not sig:
        return ""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"SIG{sig}"


class ExitLog:
    """The exits the agent saw, per (communicator, rank)."""

    def __init__(self):
        self._exits: dict[tuple[int, int], tuple[RankExit, float]] = {}  # -> (exit, monotonic seen)

    def collect(self, table, communicators, clock, now: float | None = None) -> int:
        """Read and empty `process_exits`; record each exit for the
        communicators its process held. Returns how many ranks were recorded."""
        now = time.monotonic() if now is None else now
        n = 0
        for key, value in list(table.items()):
            pid = key.value
            sig = signal_name(value.code)
            when = clock.to_realtime(value.ktime_ns) / 1e9
            for c in communicators:
                if c.pid == pid and c.rank >= 0:
                    self._exits[(c.comm, c.rank)] = (RankExit(pid, c.comm, c.rank, c.nranks, when, sig), now)
                    n += 1
            try:
                del table[key]
            except KeyError:
                pass
        while len(self._exits) > MAX_EXITS:
            del self._exits[min(self._exits, key=lambda k: self._exits[k][1])]
        return n

    def expire(self, ttl: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for k in [k for k, (_e, seen) in self._exits.items() if now - seen >= ttl]:
            del self._exits[k]

    def exits(self) -> list[RankExit]:
        return [e for e, _seen in self._exits.values()]

"""Map reader: the BPF maps and ring buffer of bpf/nccl.c as plain records.

Everything downstream (Prometheus collector, trace printer, later the span
builder and the SQLite store) consumes these records and never touches BCC.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from . import contract
from .probes import COUNTERS, MAP_CAPACITY

EVENT_CALL = 1
EVENT_LIFECYCLE = 2


@dataclass(frozen=True)
class Series:
    """Calls of one op on one communicator by one rank, as counted in the kernel."""

    op: str
    comm_hash: int
    rank: int
    nranks: int
    calls: int
    bytes: int
    sum_ns: int
    buckets: tuple[int, ...]
    slot: int = -1  # index in the kernel's series_stats array


@dataclass(frozen=True)
class Communicator:
    pid: int
    handle: int
    comm_hash: int
    nccl_hash: int
    rank: int
    nranks: int


@dataclass(frozen=True)
class InflightCall:
    tid: int
    op: str
    comm_hash: int
    rank: int
    nranks: int
    start_ns: int  # CLOCK_MONOTONIC


@dataclass(frozen=True)
class CallEvent:
    """One NCCL call that crossed to user space (slow, lifecycle, or recorded)."""

    kind: int
    op: str
    pid: int
    tid: int
    start_ns: int  # CLOCK_MONOTONIC, as the kernel saw it
    end_ns: int
    start_real_ns: int  # wall clock, converted with the agent's clock offset
    comm: int
    comm_hash: int
    nccl_hash: int
    seq: int
    rank: int
    nranks: int
    count: int
    bytes: int
    datatype: int
    red_op: int
    root: int
    peer: int
    stream: int
    result: int
    color: int
    runq_wait_ns: int = 0  # the calling thread's run-queue wait during the call
    proxy_wait_ns: int = 0  # the process's NCCL proxy threads' run-queue wait during it

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def as_dict(self) -> dict:
        return {
            "op": self.op,
            "pid": self.pid,
            "tid": self.tid,
            "timestamp_ns": self.start_real_ns,
            "duration_ns": self.duration_ns,
            "comm_id_hash": format_comm(self.comm_hash),
            "nccl_comm_hash": format_comm(self.nccl_hash),
            "comm": hex(self.comm),
            "seq": self.seq,
            "rank": self.rank,
            "nranks": self.nranks,
            "count": self.count,
            "bytes": self.bytes,
            "datatype": contract.datatype_name(self.datatype) if self.datatype >= 0 else "",
            "red_op": contract.redop_name(self.red_op) if self.red_op >= 0 else "",
            "root": self.root,
            "peer": self.peer,
            "stream": hex(self.stream),
            "result": contract.result_name(self.result),
            "runq_wait_ns": self.runq_wait_ns,
            "proxy_wait_ns": self.proxy_wait_ns,
        }


def forget_dead(table, proc: str = "/proc") -> int:
    """Delete the entries of a map keyed by a struct with `tgid` whose process is gone."""
    dead = [k for k in table.keys() if not os.path.exists(f"{proc}/{k.tgid}")]
    for k in dead:
        try:
            del table[k]
        except KeyError:
            pass
    return len(dead)


def open_ring(bpf, name: str, decode, callback) -> None:
    """Deliver `callback(decode(data))` for each record of ring buffer `name`, from poll()."""

    def raw(_ctx, data, _size):
        callback(decode(data))

    bpf[name].open_ring_buffer(raw)


def format_comm(h: int) -> str:
    """Label value of a communicator hash; 'unknown' when the agent never saw it made."""
    return f"{h:016x}" if h else "unknown"


@dataclass
class ClockOffset:
    """CLOCK_REALTIME - CLOCK_MONOTONIC, sampled with the narrowest window."""

    offset_ns: int = field(default=0)

    def __post_init__(self):
        self.refresh()

    def refresh(self) -> None:
        best = None
        for _ in range(5):
            m0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            r = time.clock_gettime_ns(time.CLOCK_REALTIME)
            m1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            if best is None or m1 - m0 < best[0]:
                best = (m1 - m0, r - (m0 + m1) // 2)
        self.offset_ns = best[1]

    def to_realtime(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.offset_ns


class MapReader:
    """Reads the probe set's maps; decodes ring buffer events."""

    def __init__(self, bpf, clock: ClockOffset | None = None):
        self.bpf = bpf
        self.clock = clock or ClockOffset()

    def series(self) -> list[Series]:
        out = []
        stats = self.bpf["series_stats"]
        for k, slot in self.bpf["series_index"].items():
            v = stats[stats.Key(slot.value)]
            out.append(
                Series(
                    op=contract.op_name(k.op),
                    comm_hash=k.comm_hash,
                    rank=k.rank,
                    nranks=k.nranks,
                    calls=v.calls,
                    bytes=v.bytes,
                    sum_ns=v.sum_ns,
                    buckets=tuple(v.buckets),
                    slot=slot.value,
                )
            )
        return out

    def errors(self) -> dict[tuple[str, str], int]:
        return {
            (contract.op_name(k.op), contract.result_name(k.result)): v.value
            for k, v in self.bpf["call_errors"].items()
        }

    def communicators(self) -> list[Communicator]:
        return [
            Communicator(
                pid=k.tgid,
                handle=k.comm,
                comm_hash=v.comm_hash,
                nccl_hash=v.nccl_hash,
                rank=v.rank,
                nranks=v.nranks,
            )
            for k, v in self.bpf["communicators"].items()
        ]

    def forget_dead_processes(self, proc: str = "/proc") -> int:
        """Drop communicators of processes that are gone; returns how many."""
        return forget_dead(self.bpf["communicators"], proc)

    def inflight(self) -> list[InflightCall]:
        return [
            InflightCall(
                tid=k.value,
                op=contract.op_name(v.op),
                comm_hash=v.comm_hash,
                rank=v.rank,
                nranks=v.nranks,
                start_ns=v.start_ns,
            )
            for k, v in self.bpf["inflight"].items()
            if v.op and v.start_ns  # op 0: the thread's slot is idle; start 0: being filled
        ]

    def counters(self) -> dict[str, int]:
        table = self.bpf["counters"]
        return {name: table[table.Key(slot)].value for name, slot in COUNTERS.items()}

    def fill(self) -> dict[str, tuple[int, int]]:
        """map name -> (entries, capacity)."""
        out = {}
        for name, cap in MAP_CAPACITY.items():
            try:
                out[name] = (sum(1 for _ in self.bpf[name].keys()), cap)
            except KeyError:  # a probe file that is not part of this build
                continue
        return out

    def decode_event(self, data) -> CallEvent:
        e = self.bpf["events"].event(data)
        return CallEvent(
            kind=e.kind,
            op=contract.op_name(e.op),
            pid=e.pid,
            tid=e.tid,
            start_ns=e.start_ns,
            end_ns=e.end_ns,
            start_real_ns=self.clock.to_realtime(e.start_ns),
            comm=e.comm,
            comm_hash=e.comm_hash,
            nccl_hash=e.nccl_hash,
            seq=e.seq,
            rank=e.rank,
            nranks=e.nranks,
            count=e.count,
            bytes=e.bytes,
            datatype=e.datatype,
            red_op=e.red_op,
            root=e.root,
            peer=e.peer,
            stream=e.stream,
            result=e.result,
            color=e.color,
            runq_wait_ns=e.runq_wait_ns,
            proxy_wait_ns=e.proxy_wait_ns,
        )

    def on_event(self, callback) -> None:
        """Call `callback(CallEvent)` for each event, from poll()."""
        open_ring(self.bpf, "events", self.decode_event, callback)

    def poll(self, timeout_ms: int) -> None:
        self.bpf.ring_buffer_poll(timeout_ms)

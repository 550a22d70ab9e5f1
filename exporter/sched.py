"""Scheduler metrics of traced processes, read from bpf/sched.c's maps.

`SchedReader(bpf).families(node, rank_of)` gives the Prometheus families
nccl_runqueue_delay_seconds (histogram) and nccl_offcpu_seconds_total
(counter), labelled {node, rank, thread}; the plain accessors are for tests
and other consumers. `on_event(callback)` delivers run-queue waits as
SchedEvent records once `NcclProbes.set_runq_event_min()` asks for them
(recordings do: the sched_events table).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from . import contract
from .maps import ClockOffset, forget_dead, open_ring

# bpf/sched.c: SCHED_KIND_*
KINDS = {0: "other", 1: "caller", 2: "proxy"}
KIND_CODES = {name: code for code, name in KINDS.items()}

# bpf/sched.c: bucket 0: d <= 1 us; bucket k (1..RUNQ_MAX_LOG2): 2^(k-1) < d <= 2^k us;
# the last one: overflow.
RUNQ_MAX_LOG2 = 22
RUNQ_SLOTS = RUNQ_MAX_LOG2 + 2
# Upper bounds in seconds of the finite buckets: 1 us, 2 us, ... 2^22 us (~4.19 s).
RUNQ_BOUNDS = tuple((1 << k) * 1e-6 for k in range(RUNQ_MAX_LOG2 + 1))


def runq_bucket(ns: int) -> int:
    """The bucket bpf/sched.c puts a delay of `ns` nanoseconds in (for tests)."""
    us = (ns + 999) // 1000
    if us <= 1:
        return 0
    k = (us - 1).bit_length()  # log2_floor(us - 1) + 1
    return min(k, RUNQ_MAX_LOG2 + 1)


@dataclass(frozen=True)
class SchedStats:
    """Run-queue delay and off-CPU time of one (process, thread kind)."""

    pid: int
    thread: str  # caller | proxy | other
    count: int  # run-queue delay samples (switch-ins after waiting runnable)
    sum_ns: int
    offcpu_ns: int
    buckets: tuple[int, ...]

    @property
    def sum_seconds(self) -> float:
        return self.sum_ns / 1e9


@dataclass(frozen=True)
class SchedEvent:
    """One run-queue wait of a traced thread: runnable from timestamp for duration."""

    timestamp_ns: int       # CLOCK_MONOTONIC: when it became runnable
    timestamp_real_ns: int  # the same, wall clock
    duration_ns: int        # until it was switched in
    pid: int
    tid: int
    thread: str             # caller | proxy | other
    comm: str               # the thread's name
    cpu: int
    op: str                 # the NCCL call it was inside ("" for none)

    def as_dict(self) -> dict:
        return {
            "event": "runq_wait",
            "timestamp_ns": self.timestamp_real_ns,
            "duration_ns": self.duration_ns,
            "pid": self.pid,
            "tid": self.tid,
            "thread": self.thread,
            "comm": self.comm,
            "cpu": self.cpu,
            "op": self.op or None,
        }


def tgid_of(tid: int, proc: str = "/proc") -> int:
    """The process of a thread, from /proc (0 when it is gone)."""
    try:
        with open(f"{proc}/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class SchedReader:
    """Reads `sched_stats` and `thread_sched` of the loaded probe program,
    and the `sched_events` ring buffer."""

    def __init__(self, bpf, clock: ClockOffset | None = None):
        self.bpf = bpf
        self.clock = clock or ClockOffset()

    def decode_event(self, data) -> SchedEvent:
        e = self.bpf["sched_events"].event(data)
        return SchedEvent(
            timestamp_ns=e.runnable_ns,
            timestamp_real_ns=self.clock.to_realtime(e.runnable_ns),
            duration_ns=e.wait_ns,
            pid=e.pid or tgid_of(e.tid),  # a thread's first wait comes before its process is learnt
            tid=e.tid,
            thread=KINDS.get(e.kind, f"kind{e.kind}"),
            comm=bytes(e.comm).split(b"\0", 1)[0].decode("utf-8", "replace"),
            cpu=e.cpu,
            op=contract.OPS.get(e.op, "") if e.op else "",
        )

    def on_event(self, callback) -> None:
        """Call `callback(SchedEvent)` for each run-queue wait event, from bpf.ring_buffer_poll()."""
        open_ring(self.bpf, "sched_events", self.decode_event, callback)

    # --- plain accessors ---------------------------------------------------

    def stats(self) -> list[SchedStats]:
        out = []
        for k, v in self.bpf["sched_stats"].items():
            out.append(
                SchedStats(
                    pid=k.tgid,
                    thread=KINDS.get(k.kind, f"kind{k.kind}"),
                    count=v.count,
                    sum_ns=v.sum_ns,
                    offcpu_ns=v.offcpu_ns,
                    buckets=tuple(v.buckets),
                )
            )
        return out

    def by_process(self, pid: int) -> dict[str, SchedStats]:
        """thread kind -> stats of one process."""
        return {s.thread: s for s in self.stats() if s.pid == pid}

    def runqueue_wait_ns(self, pid: int, thread: str | None = None) -> int:
        """Cumulative run-queue delay of a process (one thread kind, or all)."""
        return sum(s.sum_ns for s in self.stats()
                   if s.pid == pid and (thread is None or s.thread == thread))

    def proxy_wait_ns(self, pid: int) -> int:
        """Cumulative run-queue wait of a process's NCCL proxy threads: the
        counter a span snapshots at a call's entry and return."""
        return self.runqueue_wait_ns(pid, "proxy")

    def tracked_threads(self) -> set[int]:
        """Thread ids that have a `thread_sched` entry."""
        return {k.value for k in self.bpf["thread_sched"].keys()}

    def forget_dead_processes(self, proc: str = "/proc") -> int:
        """Drop sched_stats of processes that are gone; returns how many entries."""
        return forget_dead(self.bpf["sched_stats"], proc)

    # --- Prometheus ------------------------------------------------------------

    def families(self, node: str, rank_of: Callable[[int], object]) -> list:
        """nccl_runqueue_delay_seconds and nccl_offcpu_seconds_total.

        rank_of(pid) -> the process's rank (int/str) or None: label "" when unknown.
        Processes with the same rank and kind on a node are summed.
        """
        buckets: dict[tuple, list[int]] = {}
        sums: dict[tuple, int] = defaultdict(int)
        offcpu: dict[tuple, int] = defaultdict(int)
        for s in self.stats():
            rank = rank_of(s.pid)
            labels = (node, "" if rank is None or rank == -1 else str(rank), s.thread)
            acc = buckets.setdefault(labels, [0] * RUNQ_SLOTS)
            for i, n in enumerate(s.buckets[:RUNQ_SLOTS]):
                acc[i] += n
            sums[labels] += s.sum_ns
            offcpu[labels] += s.offcpu_ns

        runq = HistogramMetricFamily(
            contract.RUNQUEUE_DELAY,
            "Time threads of NCCL processes waited runnable on a CPU run queue before "
            "they ran (woken or preempted, until switched in), by thread kind: caller "
            "(threads that call NCCL), proxy (NCCL's own 'NCCL ...' threads), other.",
            labels=["node", "rank", "thread"],
        )
        for labels in sorted(buckets):
            cum, total = [], 0
            for bound, n in zip(RUNQ_BOUNDS, buckets[labels]):
                total += n
                cum.append((_le(bound), total))
            total += buckets[labels][-1]
            cum.append(("+Inf", total))
            runq.add_metric(list(labels), cum, sums[labels] / 1e9)

        off = CounterMetricFamily(
            contract.OFFCPU,
            "Time threads of NCCL processes spent asleep (switched out while not "
            "runnable, until woken), by thread kind.",
            labels=["node", "rank", "thread"],
        )
        for labels in sorted(offcpu):
            off.add_metric(list(labels), offcpu[labels] / 1e9)
        return [runq, off]


def _le(bound: float) -> str:
    return f"{bound:.6g}"

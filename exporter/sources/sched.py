"""The scheduler source: bpf/sched.c loaded, and its maps and ring buffer as records.

Run-queue delay and off-CPU time per (process, thread kind) of traced
processes (`stats()`), and run-queue waits as SchedEvent records once
`set_runq_event_min()` asks for them (recordings do: the sched_events
table). Needs bpf/nccl.c loaded first (it owns the traced processes and
threads): without it nothing is traced and this source reports nothing.
"""

from __future__ import annotations

import os

from exporter.records import contract, histogram
from exporter.records.events import SchedEvent, SchedStats
from exporter.sources import kernel_btf
from exporter.sources.base import Source, shared_counter
from exporter.sources.bpf import ClockOffset, ProbeError, Program
from exporter.sources.expiry import OwnerExpiry, delete_keys
from exporter.sources.schedstat import SchedTable

KINDS = contract.THREAD_KINDS
KIND_CODES = {name: code for code, name in KINDS.items()}

# Capacity of each map this program owns, for nccl_exporter_map_capacity.
MAP_CAPACITY = {
    "thread_sched": contract.MAX_SCHED_THREADS,
    "sched_stats": contract.MAX_PROCESSES * len(KINDS),
}


def runq_bucket(ns: int) -> int:
    """The slot bpf/sched.c puts a delay of `ns` nanoseconds in (for tests)."""
    return histogram.RUNQ.slot_of(ns)


# The raw tracepoints bpf/sched.c reads, and the arguments it takes from ctx->args[].
RAW_TRACEPOINTS = {
    "sched_switch": ["bool", "struct task_struct *", "struct task_struct *", "unsigned int"],
    "sched_wakeup": ["struct task_struct *"],
    "sched_wakeup_new": ["struct task_struct *"],
}


def check_raw_tracepoints(path: str = kernel_btf.VMLINUX) -> None:
    """ProbeError unless the running kernel's tracepoints take the arguments
    bpf/sched.c reads. Without BTF, trust a kernel >= 5.18 (where
    sched_switch gained prev_state as its last argument)."""
    found = kernel_btf.tracepoint_args(list(RAW_TRACEPOINTS), path)
    if found is None:
        release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
        if release < (5, 18):
            raise ProbeError(f"kernel {os.uname().release} has no BTF and predates 5.18: "
                             "bpf/sched.c cannot trust sched_switch's raw arguments")
        return
    for tp, want in RAW_TRACEPOINTS.items():
        if found[tp] != want:
            raise ProbeError(f"raw tracepoint {tp} takes ({', '.join(found[tp] or ['?'])}) on this "
                             f"kernel; bpf/sched.c reads ({', '.join(want)})")


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


class SchedSource(SchedTable, Program, Source):
    """bpf/sched.c: reads `sched_stats` and `thread_sched`, and the
    `sched_events` ring buffer."""

    node_wide = "scheduler"

    HOT_TRACEPOINTS = tuple(RAW_TRACEPOINTS)  # every context switch and wakeup of the node
    layout = histogram.RUNQ  # the run-queue histogram's slots (SchedTotals has none)

    def __init__(self, clock: ClockOffset | None = None):
        check_raw_tracepoints()
        super().__init__("sched")
        self.clock = clock or ClockOffset()
        self.expiry = OwnerExpiry()

    def set_hot(self, on: bool) -> None:
        super().set_hot(on)
        if not on:
            # Detached, no thread's state can stay true: a thread runnable or
            # asleep "since" before the gap would show the whole gap as one
            # wait once attached again. Per-process totals are kept.
            delete_keys(self, [("thread_sched", k) for k in self["thread_sched"].keys()])
            self["task_filter"].clear()

    def losses(self) -> dict[str, int]:
        return {"kernel_sched_events": shared_counter(self, "SCHED_EVENTS_LOST")}

    def set_runq_event_min(self, min_wait_ns: int) -> None:
        """Run-queue waits of traced threads at least this long become events; 0: none."""
        cfg = self["sched_config"]
        cfg[cfg.Key(0)] = cfg.Leaf(int(min_wait_ns))

    def decode_event(self, data) -> SchedEvent:
        e = self["sched_events"].event(data)
        return SchedEvent(
            timestamp_ns=e.runnable_ns,
            timestamp_real_ns=self.clock.to_realtime(e.runnable_ns),
            duration_ns=e.wait_ns,
            pid=e.pid or tgid_of(e.tid),  # a thread's first wait comes before its process is learnt
            tid=e.tid,
            thread=KINDS.get(e.kind, f"kind{e.kind}"),
            thread_name=bytes(e.comm).split(b"\0", 1)[0].decode("utf-8", "replace"),
            cpu=e.cpu,
            op=contract.OPS.get(e.op, "") if e.op else "",
        )

    def on_event(self, callback) -> None:
        """Call `callback(SchedEvent)` for each run-queue wait event, from bpf.ring_buffer_poll()."""
        self.open_ring("sched_events", self.decode_event, callback)

    # --- plain accessors ---------------------------------------------------

    @staticmethod
    def _stats(k, v) -> SchedStats:
        return SchedStats(pid=k.tgid, thread=KINDS.get(k.kind, f"kind{k.kind}"), count=v.count,
                          sum_ns=v.sum_ns, offcpu_ns=v.offcpu_ns, buckets=tuple(v.buckets))

    def stats(self) -> list[SchedStats]:
        """Entries of sched_stats (kernel only, no retired totals)."""
        return [self._stats(k, v) for k, v in self["sched_stats"].items()]

    def expire_owners(self, ttl: float, rank_label, now: float | None = None, proc: str = "/proc") -> int:
        """Apply OwnerExpiry to sched_stats: a gone process's entries leave
        the map `ttl` after it was found gone, their counts kept in the label
        set's retired total while another process shares (rank, thread).
        Returns the entries deleted. For the agent's loop."""
        keyed = [(k, self._stats(k, v)) for k, v in self["sched_stats"].items()]
        return self._expire(keyed, self, ttl, rank_label, now, proc)

    def tracked_threads(self) -> set[int]:
        """Thread ids that have a `thread_sched` entry (keyed by task pointer)."""
        return {v.tid for v in self["thread_sched"].values()}


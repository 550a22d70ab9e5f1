"""The scheduler's totals without a BPF program: the kernel's own per-thread
accounting, read from /proc.

The kernel keeps, for every thread, the time it ran, the time it waited
runnable on a run queue and how many times it was switched in
(`/proc/<pid>/task/<tid>/schedstat`: sum_exec_runtime, run_delay, pcount,
in ns; present when the kernel has CONFIG_SCHED_INFO, as Debian's and most
distribution kernels do). Read once a second for the threads of traced
processes, the differences give the same per (process, thread kind) totals
as bpf/sched.c's `sched_stats` — run-queue delay, switch-ins, off-CPU time
(the wall-clock time between two reads that the thread neither ran nor
waited runnable) — without any program at the node's context switches and
wakeups. What it cannot give: the distribution of single waits (histogram
buckets), each NCCL call's own wait, and single wait events for recordings:
those need `--sched waits` (bpf/sched.c). docs/sched.md, "Two modes".
What recordings get instead: each read's differences as SchedInterval
records (sched_intervals: per process and thread kind, ~1 s each, only
those with a wait), enough for `explain` to tell a rank starved of CPU.

Thread kinds as bpf/sched.c decides them: `proxy` (name starts with
"NCCL "), `caller` (holds an NCCL call slot), `other`.
"""

from __future__ import annotations

import os
import threading
import time

from exporter.records.events import SchedInterval, SchedStats
from exporter.sources.base import Source
from exporter.sources.expiry import OwnerExpiry, delete_keys, sum_records

POLL_INTERVAL_S = 1.0  # the agent's loop reads this often: a thread that exits loses at most this much
NAME_REFRESH_S = 10.0  # a thread's name (its kind) is read again this often: NCCL names its threads after start


def read_schedstat(path: str) -> tuple[int, int, int] | None:
    """(ns run, ns waited runnable, switch-ins) of one thread; None when it is gone."""
    try:
        with open(path, "rb") as f:
            run_ns, wait_ns, switch_ins = f.read().split()[:3]
        return int(run_ns), int(wait_ns), int(switch_ins)
    except (OSError, ValueError):
        return None


class SchedTable:
    """What the sinks and the agent read of either scheduler source
    (SchedSource: bpf/sched.c's `sched_stats`; SchedTotals: /proc), built on
    the subclass's `stats()`, and the expiry of ended processes' records."""

    expiry: OwnerExpiry

    def stats(self) -> list[SchedStats]:
        raise NotImplementedError

    def by_process(self, pid: int) -> dict[str, SchedStats]:
        """thread kind -> stats of one process."""
        return {s.thread: s for s in self.stats() if s.pid == pid}

    def labelled(self, rank_label) -> list:
        """((rank, thread), SchedStats) pairs as the sink exports them: the
        records (the frozen rank of a process that is gone) and the retired
        totals of label sets (OwnerExpiry). rank_label(pid) -> str."""
        out = [((self.expiry.label_of(s.pid, rank_label), s.thread), s) for s in self.stats()]
        out += [((lset[1], lset[0]), kept["sched_stats"]) for lset, kept in self.expiry.retired.items()]
        return out

    def prune(self, ttl: float, rank_label) -> None:
        self.expire_owners(ttl, rank_label)

    def _expire(self, keyed, table, ttl: float, rank_label, now: float | None, proc: str) -> int:
        """OwnerExpiry over (key, SchedStats) pairs; deletes the expired keys
        from table["sched_stats"] and returns how many went."""
        now = time.monotonic() if now is None else now
        entries = [("sched_stats", k, s.pid, (s.thread,), s) for k, s in keyed]
        return delete_keys(table, self.expiry.expire(entries, ttl, now, rank_label, proc))


def thread_kind(name: str, tid: int, callers: set[int]) -> str:
    if name.startswith("NCCL "):
        return "proxy"
    return "caller" if tid in callers else "other"


class SchedTotals(SchedTable, Source):
    """Per (process, thread kind) run-queue delay, switch-ins and off-CPU time
    of traced processes, from /proc (module docstring). The same accessors as
    SchedSource (SchedTable, expire_owners) so the sinks take either;
    `layout` is None: the histogram has only a count and a sum (+Inf).

    traced_pids() -> iterable of pids; callers() -> set of thread ids that
    hold an NCCL call slot. Both read bpf/nccl.c's maps (the agent passes
    them, under its lock)."""

    name = "sched"
    layout = None  # no buckets (SchedSource: records/histogram.py's RUNQ)
    hot = False  # no tracepoint: nothing to attach or detach

    def __init__(self, traced_pids, callers, proc: str = "/proc", clock=time.monotonic_ns,
                 realtime=time.time_ns):
        self.traced_pids, self.callers = traced_pids, callers
        self.proc, self.clock, self.realtime = proc, clock, realtime
        self._callback = None  # on_event: SchedInterval records go there
        self._pending: list[SchedInterval] = []  # made by poll(), delivered by tick()
        self.expiry = OwnerExpiry()
        self._lock = threading.Lock()  # poll() from the agent's loop and from a scrape
        self._threads: dict[int, tuple[int, int, int, int, int]] = {}  # tid -> (pid, time, run, wait, n)
        self._names: dict[int, tuple[str, int]] = {}  # tid -> (name, when read)
        self._totals: dict[tuple[int, str], SchedStats] = {}  # (pid, kind) -> counts so far
        self._next_poll = 0.0

    def losses(self) -> dict[str, int]:
        """No ring buffer: nothing lost; the key is in every recording's meta (docs/schema.md)."""
        return {"kernel_sched_events": 0}

    def on_event(self, callback) -> None:
        """Send each read's SchedInterval records to callback (from tick, the agent's loop)."""
        self._callback = callback

    def tick(self, now: float) -> None:
        if now >= self._next_poll:
            self._next_poll = now + POLL_INTERVAL_S
            with self.lock:  # traced_pids and callers read the NCCL program's maps; a scrape polls too
                self.poll()
        with self._lock:
            pending, self._pending = self._pending, []
        for record in pending:  # outside the locks, as a ring buffer's records
            self._callback(record)

    def poll(self) -> None:
        """Read every thread of every traced process and add what each did
        since the last read to its (process, kind) totals. A thread seen for
        the first time only sets its baseline."""
        pids, callers = list(self.traced_pids()), self.callers()
        with self._lock:
            seen = set()
            # (pid, kind) -> [first start, last end, wait, switch-ins] of this read's intervals
            intervals: dict[tuple[int, str], list[int]] | None = {} if self._callback else None
            for pid in pids:
                try:
                    tids = [int(t) for t in os.listdir(f"{self.proc}/{pid}/task")]
                except (OSError, ValueError):
                    continue
                for tid in tids:
                    self._read_thread(pid, tid, callers, intervals)
                    seen.add(tid)
            for tid in [t for t in self._threads if t not in seen]:
                del self._threads[tid]  # exited (its last interval is lost)
                self._names.pop(tid, None)
            if intervals:
                to_real = self.realtime() - self.clock()
                self._pending += [SchedInterval(start + to_real, end - start, pid, kind, wait, n)
                                  for (pid, kind), (start, end, wait, n) in intervals.items() if wait > 0]

    def _read_thread(self, pid: int, tid: int, callers: set[int], intervals: dict | None) -> None:
        now = self.clock()
        cur = read_schedstat(f"{self.proc}/{pid}/task/{tid}/schedstat")
        if cur is None:
            return
        named = self._names.get(tid)
        if named is None or now - named[1] > NAME_REFRESH_S * 1e9:
            try:
                with open(f"{self.proc}/{pid}/task/{tid}/comm") as f:
                    named = self._names[tid] = (f.read().rstrip("\n"), now)
            except OSError:
                return
        prev = self._threads.get(tid)
        self._threads[tid] = (pid, now, *cur)
        if prev is None or prev[0] != pid:
            return
        run, wait, n = (c - p for c, p in zip(cur, prev[2:]))
        offcpu = max(0, now - prev[1] - run - wait)  # run time lags by up to a tick: never negative
        key = (pid, thread_kind(named[0], tid, callers))
        new = SchedStats(pid=pid, thread=key[1], count=n, sum_ns=wait, offcpu_ns=offcpu, buckets=(n,))
        old = self._totals.get(key)
        self._totals[key] = sum_records(old, new) if old else new
        if intervals is not None:
            span = intervals.get(key)
            if span is None:
                intervals[key] = [prev[1], now, wait, n]
            else:
                span[0], span[1] = min(span[0], prev[1]), max(span[1], now)
                span[2] += wait
                span[3] += n

    def stats(self) -> list[SchedStats]:
        self.poll()
        with self._lock:
            return list(self._totals.values())

    def expire_owners(self, ttl: float, rank_label, now: float | None = None, proc: str = "/proc") -> int:
        """OwnerExpiry over the totals, as SchedSource.expire_owners over its map."""
        with self._lock:
            return self._expire(list(self._totals.items()), {"sched_stats": self._totals},
                                ttl, rank_label, now, proc)

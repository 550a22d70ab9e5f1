"""`--sched totals` arithmetic (exporter/sources/schedstat.py) on a fake /proc
with a fake clock; the real kernel's numbers under a CPU hog are in
tests/test_sched.py::test_cpu_hog_raises_runqueue_delay_of_the_starved_rank_only[totals]."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from exporter.sources.schedstat import SchedTotals, read_schedstat


class FakeProc:
    def __init__(self, root: Path):
        self.root = root
        self.now = 1_000_000_000

    def thread(self, pid: int, tid: int, name: str, run: int, wait: int, n: int) -> None:
        d = self.root / str(pid) / "task" / str(tid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "schedstat").write_text(f"{run} {wait} {n}\n")
        (d / "comm").write_text(name + "\n")

    def exit(self, pid: int, tid: int) -> None:
        d = self.root / str(pid) / "task" / str(tid)
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


def test_differences_per_process_and_kind(tmp_path):
    proc = FakeProc(tmp_path)
    totals = SchedTotals(lambda: [10], lambda: {11}, proc=str(tmp_path), clock=lambda: proc.now)
    proc.thread(10, 10, "python", 5_000, 1_000, 3)        # other
    proc.thread(10, 11, "python", 0, 0, 0)                # caller (holds a call slot)
    proc.thread(10, 12, "NCCL Proxy 0", 100, 50, 1)       # proxy
    assert totals.stats() == []  # the first read is each thread's baseline only

    proc.now += 1_000_000  # 1 ms of wall-clock time
    proc.thread(10, 10, "python", 5_000 + 600_000, 1_000 + 100_000, 13)
    proc.thread(10, 11, "python", 200_000, 300_000, 4)
    proc.thread(10, 12, "NCCL Proxy 0", 100, 50 + 20_000, 2)
    got = {s.thread: s for s in totals.stats()}
    assert (got["other"].count, got["other"].sum_ns, got["other"].offcpu_ns) == (10, 100_000, 300_000)
    assert (got["caller"].count, got["caller"].sum_ns, got["caller"].offcpu_ns) == (4, 300_000, 500_000)
    assert (got["proxy"].count, got["proxy"].sum_ns, got["proxy"].offcpu_ns) == (1, 20_000, 980_000)
    assert got["other"].buckets == (10,)  # the +Inf bucket only
    assert totals.by_process(10).keys() == {"other", "caller", "proxy"}

    # A thread that exits loses its last interval; the totals stay.
    proc.exit(10, 12)
    proc.now += 1_000_000
    assert totals.by_process(10)["proxy"].sum_ns == 20_000
    assert totals.by_process(10)["other"].offcpu_ns == 1_300_000  # that 1 ms neither ran nor waited

    # Run time read a tick late can exceed the wall-clock interval: off-CPU never goes negative.
    proc.now += 1_000
    proc.thread(10, 10, "python", 5_000 + 600_000 + 4_000_000, 101_000, 14)
    assert totals.by_process(10)["other"].offcpu_ns == 1_300_000


def test_each_read_sends_its_waits_per_process_and_kind(tmp_path):
    """What recordings get of --sched totals: one SchedInterval per (process, kind) and read
    with a wait, on the wall clock, delivered by tick() (the agent's loop), not by a scrape."""
    proc = FakeProc(tmp_path)
    got = []
    totals = SchedTotals(lambda: [10], lambda: {11}, proc=str(tmp_path), clock=lambda: proc.now,
                         realtime=lambda: proc.now + 5_000)
    totals.lock = threading.Lock()  # the agent's
    totals.on_event(got.append)
    proc.thread(10, 11, "python", 0, 0, 0)               # caller
    proc.thread(10, 12, "NCCL Proxy 0", 0, 0, 0)         # proxy
    proc.thread(10, 13, "NCCL Service 0", 0, 0, 0)       # proxy too
    proc.thread(10, 14, "python", 0, 0, 0)               # other: no wait, no record
    totals.tick(0.0)
    assert got == []  # baselines only
    start = proc.now
    proc.now += 1_000_000_000
    proc.thread(10, 11, "python", 10, 400_000_000, 7)
    proc.thread(10, 12, "NCCL Proxy 0", 10, 30_000_000, 2)
    proc.thread(10, 13, "NCCL Service 0", 10, 20_000_000, 1)
    proc.thread(10, 14, "python", 10, 0, 3)
    totals.stats()  # a scrape reads /proc too: its intervals wait for the loop
    assert got == []
    totals.tick(0.5)  # not yet due to read again: delivers what the scrape read
    assert sorted((r.thread, r.runq_wait_ns, r.switch_ins, r.timestamp_real_ns, r.interval_ns, r.pid)
                  for r in got) == [("caller", 400_000_000, 7, start + 5_000, 1_000_000_000, 10),
                                    ("proxy", 50_000_000, 3, start + 5_000, 1_000_000_000, 10)]


def test_a_renamed_thread_changes_kind_at_the_next_name_read(tmp_path, monkeypatch):
    import exporter.sources.schedstat as m

    monkeypatch.setattr(m, "NAME_REFRESH_S", 0.0)
    proc = FakeProc(tmp_path)
    totals = SchedTotals(lambda: [20], set, proc=str(tmp_path), clock=lambda: proc.now)
    proc.thread(20, 21, "python", 0, 0, 0)
    totals.poll()
    proc.now += 10
    proc.thread(20, 21, "NCCL Service 0", 0, 7, 1)  # NCCL names its threads after they start
    assert {s.thread: s.sum_ns for s in totals.stats()} == {"proxy": 7}


def test_gone_process_leaves_after_the_ttl(tmp_path):
    proc = FakeProc(tmp_path / "proc")
    totals = SchedTotals(lambda: [30], set, proc=str(proc.root), clock=lambda: proc.now)
    proc.thread(30, 30, "python", 0, 0, 0)
    totals.poll()
    proc.now += 10
    proc.thread(30, 30, "python", 0, 5, 1)
    assert totals.labelled(lambda pid: "3") == [(("3", "other"), totals.stats()[0])]
    proc.exit(30, 30)
    os.rmdir(proc.root / "30" / "task")
    os.rmdir(proc.root / "30")
    t = time.monotonic()
    assert totals.expire_owners(60, lambda pid: "3", now=t, proc=str(proc.root)) == 0  # found gone
    assert totals.expire_owners(60, lambda pid: "3", now=t + 61, proc=str(proc.root)) == 1
    assert totals.labelled(lambda pid: "3") == []


def test_this_kernel_keeps_per_thread_run_queue_totals():
    """/proc/<pid>/task/<tid>/schedstat exists and counts (CONFIG_SCHED_INFO)."""
    got = read_schedstat(f"/proc/self/task/{os.getpid()}/schedstat")
    assert got is not None
    time.sleep(0.01)
    run, _wait, n = read_schedstat(f"/proc/self/task/{os.getpid()}/schedstat")
    assert n > got[2] and run > got[0]

"""User space marks a process's threads traced without a read-modify-write of
the traced_threads bitmap that the kernel updates atomically:
a bit the kernel set or cleared between user space's read and write was lost."""

from __future__ import annotations

import os
import threading

import pytest

from exporter.sources.nccl.probes import NcclProbes

pytestmark = pytest.mark.usefixtures("bpf")  # markers, root and the heavy lock: conftest


@pytest.fixture(scope="module")
def probes():
    p = NcclProbes(series_capacity=16)
    yield p
    p.close()


def bit(probes, tid: int) -> bool:
    bits = probes["traced_threads"]
    return bool(bits[bits.Key(tid // 64)].value & (1 << (tid % 64)))


class NoWrites:
    """traced_threads as user space may use it: read, never written."""

    def __init__(self, table):
        self.table = table

    def __getattr__(self, name):
        return getattr(self.table, name)

    def __getitem__(self, key):
        return self.table[key]

    def __setitem__(self, key, value):
        raise AssertionError("user space wrote traced_threads: it could undo a kernel update")


def test_trace_process_sets_bits_without_writing_the_map(probes, monkeypatch):
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{os.getpid()}/task"))
        get = NcclProbes.__getitem__
        monkeypatch.setattr(NcclProbes, "__getitem__",
                            lambda self, name: NoWrites(get(self, name)) if name == "traced_threads"
                            else get(self, name))
        probes.trace_process(os.getpid(), 3)
        monkeypatch.undo()
        assert all(bit(probes, tid) for tid in tids), [tid for tid in tids if not bit(probes, tid)]
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_kernel_updates_survive_user_space_tracing(probes):
    """Threads of a traced process start and exit (the kernel sets and clears
    their bits) while user space keeps tracing the same process."""
    pid = os.getpid()
    probes.trace_process(pid, 3)
    done = threading.Event()

    def churn():
        while not done.is_set():
            probes.trace_process(pid, 3)

    tracer = threading.Thread(target=churn)
    tracer.start()
    try:
        for _ in range(50):
            ready, stop = threading.Event(), threading.Event()
            seen = {}

            def worker(seen=seen, ready=ready, stop=stop):
                seen["tid"] = threading.get_native_id()
                ready.set()
                stop.wait()

            t = threading.Thread(target=worker)
            t.start()
            ready.wait()
            # A thread forked by a traced process is traced by the kernel (sched_process_fork).
            assert bit(probes, seen["tid"])
            stop.set()
            t.join()
    finally:
        done.set()
        tracer.join()

#!/usr/bin/env python3
"""How long from a process mapping a libnccl it never had to the probes being
attached, with discovery driven by the loader source (bpf/loader.c: a uprobe
on the dynamic loader's _dl_debug_state) instead of a /proc rescan timer.

Run as root from the repository root:

    .venv/bin/python bench/attach_latency.py [--reps 5] [--jobs 20]

For each library (the simulator's small libnccl.so.2, and the real NCCL
2.32.3 wheel's libnccl.so.2 when installed) and each repetition: a fresh
copy of the file (a new inode, never probed), a child that dlopens it and
prints its CLOCK_MONOTONIC just before; the agent-side loop (RingWaiter over
the loader's ring buffer, ProcessScanner on the pid, NcclProbes.attach) and
the time attach() returns. Prints, per library, the median and min..max of
  mapped -> seen   dlopen until the agent has found the file in the pid's maps
  mapped -> attached   ... until every probe of the file is attached

Then --jobs N (default 20) trials end to end through the agent itself
(agent/loop.py, default discovery, in this process): each a job that maps
a fresh copy of the simulator's libnccl, calls it 100 ms later (GetUniqueId,
CommInitRank, 50 AllReduces, CommDestroy) and exits. A trial counts when
every one of its calls was seen (record_all: one event per call). The goal:
N of N (bench/README.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHILD = """
import ctypes, sys, time
t = time.monotonic_ns()
ctypes.CDLL(sys.argv[1])
print(t, flush=True)
sys.stdin.read()
"""


def real_nccl() -> str | None:
    import glob

    hits = glob.glob(str(Path(sys.prefix) / "lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"))
    return hits[0] if hits else None


def measure(lib: str, reps: int) -> tuple[list[float], list[float]]:
    from exporter.sources.bpf import RingWaiter
    from exporter.sources.loader import LoaderSource
    from exporter.sources.nccl.libfind import ProcessScanner
    from exporter.sources.nccl.probes import NcclProbes

    seen_ms, attached_ms = [], []
    probes = NcclProbes()
    loader = LoaderSource()
    loader.attach_loaders()
    events = []
    loader.on_event(events.append)
    waiter = RingWaiter()
    waiter.add(loader)
    scanner = ProcessScanner()
    try:
        for _ in range(reps):
            with tempfile.TemporaryDirectory(prefix="attach-bench-") as d:
                copy = Path(d) / "libnccl.so.2"
                shutil.copy(lib, copy)
                child = subprocess.Popen([sys.executable, "-c", CHILD, str(copy)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                t_seen = t_attached = None
                deadline = time.monotonic() + 10
                while t_attached is None and time.monotonic() < deadline:
                    waiter.wait(100)
                    pids = {e.pid for e in events}
                    events.clear()
                    if child.pid not in pids:
                        continue
                    for found in scanner.scan([child.pid]):
                        if os.path.samefile(found.path, copy):
                            t_seen = time.monotonic_ns()
                            probes.attach(found.path)
                            t_attached = time.monotonic_ns()
                t_map = int(child.stdout.readline())
                child.stdin.close()
                child.wait()
                if t_attached is None:
                    raise SystemExit(f"{lib}: the mapping was never seen")
                seen_ms.append((t_seen - t_map) / 1e6)
                attached_ms.append((t_attached - t_map) / 1e6)
    finally:
        waiter.close()
        loader.close()
        probes.close()
    return seen_ms, attached_ms


JOB_CALLS = 50


def jobs(lib: str, trials: int) -> tuple[int, list[int]]:
    """Trials counted in full, and the calls seen in each trial."""
    import threading

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_loader import JOB
    from exporter.records.events import CallEvent
    from exporter.agent.loop import Agent, AgentConfig

    agent = Agent(AgentConfig(node="bench", record_all=True))
    seen: dict[int, int] = {}
    agent.listeners.append(lambda e: seen.__setitem__(e.pid, seen.get(e.pid, 0) + 1)
                           if isinstance(e, CallEvent) else None)
    stop = threading.Event()
    loop = threading.Thread(target=agent.run_until, args=(stop,), name="agent")
    per_trial = []
    try:
        agent.start_discovery()
        loop.start()
        with tempfile.TemporaryDirectory(prefix="attach-jobs-") as d:
            for i in range(trials):
                copy = Path(d) / f"job{i}" / "libnccl.so.2"
                copy.parent.mkdir()
                shutil.copy(lib, copy)
                child = subprocess.Popen([sys.executable, "-c", JOB, str(copy), "0.1", str(JOB_CALLS)],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                out, err = child.communicate(timeout=60)
                if child.returncode != 0:
                    raise SystemExit(f"job {i} failed: {err.strip()}")
                deadline = time.monotonic() + 2
                while seen.get(child.pid, 0) < JOB_CALLS + 3 and time.monotonic() < deadline:
                    time.sleep(0.05)
                per_trial.append(seen.get(child.pid, 0))
    finally:
        stop.set()
        if loop.is_alive():
            loop.join()
        agent.close(detach_in_background=True)
    return sum(n == JOB_CALLS + 3 for n in per_trial), per_trial


def show(name: str, xs: list[float]) -> str:
    return f"{name} {statistics.median(xs):7.1f} ms ({min(xs):.1f}..{max(xs):.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=20, help="end-to-end trials of a job calling 100 ms "
                    "after mapping a new libnccl (0: none)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (BPF)")
    from exporter.simulator.build import build_library

    libs = [("simulator libnccl.so.2", str(build_library()))]
    real = real_nccl()
    if real:
        libs.append(("NCCL 2.32.3 wheel libnccl.so.2", real))
    for name, lib in libs:
        seen, attached = measure(lib, a.reps)
        size = os.path.getsize(lib) / 2**20
        print(f"{name} ({size:.1f} MiB), {a.reps} reps: {show('mapped->seen', seen)}; "
              f"{show('mapped->attached', attached)}")
    if a.jobs:
        full, calls = jobs(libs[0][1], a.jobs)
        print(f"jobs calling 100 ms after mapping a new libnccl: {full} of {a.jobs} counted in full "
              f"(calls seen per trial, of {JOB_CALLS + 3}: {calls})")
        return 0 if full == a.jobs else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

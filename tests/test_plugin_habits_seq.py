"""NCCL's seqNumber is not the call count (docs/plugin.md, "NCCL habits": seqNumber;
"Which call a GPU interval belongs to"): collective calls NCCL gives no Coll event
and no seqNumber -- a count-0 collective, a copy-engine one, one run as a symmetric
kernel -- alone and inside ncclGroupStart/End, among calls it numbers. The real
agent records the job (`trace --db`, uprobes on the simulated libnccl, BPF hooks on
the plugin, which the simulator loads as NCCL does), through every profiler
interface version; each recorded call must carry its own GPU interval (the
simulator's truth) and NCCL's seqNumber, and the calls NCCL does not number none.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from conftest import REPO
from exporter.simulator.truth import gpu_kernels, load_truth

pytestmark = pytest.mark.usefixtures("bpf")  # markers, root and the heavy lock: conftest

VERSIONS = (4, 5, 6, 7)
CE, SYMK = 48, 80  # counts the simulator runs as a copy-engine collective, a symmetric kernel
KERNEL_US = 3000   # kernels this far apart: an interval is told from its neighbours by its start

JOB = r"""
import ctypes, sys
L = ctypes.CDLL(sys.argv[1])
c_p, c_i, c_sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
L.ncclAllReduce.argtypes = [c_p, c_p, c_sz, c_i, c_i, c_p, c_p]
L.ncclAllGather.argtypes = [c_p, c_p, c_sz, c_i, c_p, c_p]
L.ncclCommInitAll.argtypes = [ctypes.POINTER(c_p), c_i, ctypes.POINTER(c_i)]
L.ncclCommDestroy.argtypes = [c_p]
L.simStreamSynchronize.argtypes = [c_p]
n, iters, CE, SYMK = 2, int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
comms = (c_p * n)()
assert L.ncclCommInitAll(comms, n, None) == 0
keep = []
def ar(r, cnt):
    b = (ctypes.c_float * 256)(*[1.0] * 256)
    keep.append(b)
    assert L.ncclAllReduce(b, b, cnt, 7, 0, comms[r], None) == 0
for it in range(iters):
    for cnt in (64, CE, 0, SYMK, 64):       # alone
        for r in range(n):
            ar(r, cnt)
    assert L.ncclGroupStart() == 0
    for r in range(n):                       # one group, every kind of member on each communicator
        for cnt in (64, 0, CE, SYMK, 128, 64):
            ar(r, cnt)
        src, dst = (ctypes.c_float * 32)(), (ctypes.c_float * 64)()
        keep.append((src, dst))
        assert L.ncclAllGather(src, dst, 32, 7, comms[r], None) == 0
    assert L.ncclGroupEnd() == 0
for r in range(n):
    assert L.simStreamSynchronize(comms[r]) == 0
    assert L.ncclCommDestroy(comms[r]) == 0
print("unnumbered ok")
"""
ITERS = 3


@pytest.fixture(scope="module")
def recording(lib, plugin, tmp_path_factory):
    """One `trace --db` recording of the job, once per interface version (a process
    each): (database, {version: truth records})."""
    tmp = tmp_path_factory.mktemp("seq")
    db, log = tmp / "seq.db", tmp / "trace.log"
    job = tmp / "job.py"
    job.write_text(JOB)
    rec = subprocess.Popen([sys.executable, "-m", "exporter", "trace", "--db", str(db), "--node", "seqnode",
                            "--nccl-lib", str(lib)], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, cwd=REPO)
    truths = {}
    try:
        deadline = time.monotonic() + 120
        while "tracing NCCL calls" not in log.read_text():
            assert rec.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        for v in VERSIONS:
            truth = tmp / f"truth.v{v}.jsonl"
            env = dict(os.environ, NCCL_SIM_GPU="1", NCCL_SIM_GPU_KERNEL_US=str(KERNEL_US),
                       NCCL_SIM_GPU_LATE_EVERY="0", NCCL_PROFILER_PLUGIN=str(plugin),
                       NCCL_SIM_GPU_PROFILER_VERSION=str(v), NCCL_SIM_TRUTH=str(truth),
                       NCCL_SIM_GPU_CE_COUNT=str(CE), NCCL_SIM_GPU_SYMK_COUNT=str(SYMK))
            p = subprocess.run([sys.executable, str(job), str(lib), str(ITERS), str(CE), str(SYMK)], env=env,
                               capture_output=True, text=True, timeout=90)
            assert p.returncode == 0 and "unnumbered ok" in p.stdout, p.stdout + p.stderr
            truths[v] = load_truth(truth)
        time.sleep(1.0)
        rec.send_signal(signal.SIGTERM)
        assert rec.wait(60) == 0, log.read_text()
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
    return db, truths


@pytest.mark.parametrize("version", VERSIONS)
def test_calls_nccl_does_not_number_keep_every_call_on_its_own_gpu_interval(recording, version):
    """Every AllReduce/AllGather call of the job, alone or in a group: a call NCCL
    numbers has its own kernel's GPU interval (start within 300 us of the truth,
    kernels are 3 ms apart) and NCCL's seqNumber; a count-0, copy-engine or
    symmetric-kernel call has no GPU interval. Today's join on the uprobes' count
    gives grouped calls after the first unnumbered one, and the unnumbered calls
    themselves, other calls' intervals."""
    db, truths = recording
    truth = truths[version]
    pid = truth[0]["pid"]
    kernels = {(k["rank"], k["coll_op"], k["seq"]): k for k in gpu_kernels(truth) if not k["unnumbered"]}
    # The calls in order per rank, as the simulator saw them (seq: NCCL's, where it numbered them).
    calls = defaultdict(list)
    for t in truth:
        if t["op"] in ("ALL_REDUCE", "ALL_GATHER") and t["fn"].startswith("nccl"):
            calls[t["rank"]].append(t)
    conn = sqlite3.connect(db)
    rows = defaultdict(list)
    for r in conn.execute("SELECT rank, op, count, seq, timestamp_ns, gpu_start_offset_ns, gpu_duration_ns "
                          "FROM nccl_events WHERE pid = ? AND op IN ('ALL_REDUCE', 'ALL_GATHER') "
                          "ORDER BY timestamp_ns", (pid,)):
        rows[r[0]].append(r)
    assert sorted(rows) == [0, 1] and all(len(rows[r]) == len(calls[r]) == ITERS * 12 for r in (0, 1)), \
        {r: (len(rows[r]), len(calls[r])) for r in rows}
    wrong = []
    for rank in (0, 1):
        for t, (_r, op, count, seq, ts, offset, duration) in zip(calls[rank], rows[rank]):
            assert (op, count) == (t["op"], t["count"]), (t, op, count)
            if "seq" not in t:   # NCCL gave it no number: no Coll record, no GPU interval
                if duration is not None:
                    wrong.append(("unnumbered call joined", rank, op, count, seq))
                continue
            k = kernels[(rank, op, t["seq"])]
            if duration is None or seq != t["seq"] or abs(ts + offset - k["start_real_ns"]) > 300_000:
                wrong.append((rank, op, count, "seq", seq, "nccl", t["seq"],
                              "start off by", None if duration is None else ts + offset - k["start_real_ns"]))
    assert not wrong, "\n".join(map(str, wrong))

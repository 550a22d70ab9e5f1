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
import sqlite3
import subprocess
import sys
from collections import defaultdict

import pytest

from conftest import recording as traced
from tests.fixtures.libraries import sim_job_prelude
from exporter.simulator.truth import gpu_kernels, load_truth

VERSIONS = (4, 5, 6, 7)
CE, SYMK = 48, 80  # counts the simulator runs as a copy-engine collective, a symmetric kernel
KERNEL_US = 3000   # kernels this far apart: an interval is told from its neighbours by its start

JOB = sim_job_prelude(2) + r"""
iters, CE, SYMK = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
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
def recording(bpf, lib, plugin, tmp_path_factory):
    """One `trace --db` recording of the job, once per interface version (a process
    each): (database, {version: truth records})."""
    tmp = tmp_path_factory.mktemp("seq")
    db = tmp / "seq.db"
    job = tmp / "job.py"
    job.write_text(JOB)
    truths = {}
    with traced(db, lib, node="seqnode"):
        for v in VERSIONS:
            truth = tmp / f"truth.v{v}.jsonl"
            env = dict(os.environ, NCCL_SIM_GPU="1", NCCL_SIM_GPU_KERNEL_US=str(KERNEL_US),
                       NCCL_SIM_GPU_LATE_EVERY="0", NCCL_PROFILER_PLUGIN=str(plugin),
                       NCCL_SIM_GPU_PROFILER_VERSION=str(v), NCCL_SIM_TRUTH=str(truth),
                       NCCL_SIM_GPU_SYMK_COUNT=str(SYMK))
            if v >= 5:  # copy-engine collectives from NCCL 2.28 (v5); on 2.27 that call is an ordinary one
                env["NCCL_SIM_GPU_CE_COUNT"] = str(CE)
            p = subprocess.run([sys.executable, str(job), str(lib), str(ITERS), str(CE), str(SYMK)], env=env,
                               capture_output=True, text=True, timeout=90)
            assert p.returncode == 0 and "unnumbered ok" in p.stdout, p.stdout + p.stderr
            truths[v] = load_truth(truth)
    return db, truths


@pytest.mark.usefixtures("bpf")  # markers, root and the heavy lock: conftest
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
    assert sum(1 for c in calls[0] if "seq" not in c) == ITERS * (6 if version >= 5 else 4)  # count 0, CE, symmetric
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
    unnumbered = sum(1 for w in wrong if w[0] == "unnumbered call joined")
    missing = sum(1 for w in wrong if w[-1] is None)
    assert not wrong, (f"{len(wrong)} of {2 * ITERS * 12} calls: {unnumbered} unnumbered calls joined, "
                       f"{len(wrong) - unnumbered - missing} numbered calls on another interval or seq, "
                       f"{missing} without an interval\n" + "\n".join(map(str, wrong)))


# ------------------------------------------------ the pairing itself (pure logic) --
def _row(rowid, tid, ts, op, count=16, nbytes=64, comm="c1", root=None, rank=0, dur=10):
    return (rowid, tid, ts, dur, op, comm, count, nbytes, root, rank)


def test_launches_are_calls_alone_and_outermost_groups():
    """A call alone is its own launch; a group's calls launch at the ncclGroupEnd that
    brings the thread's depth to 0 (nested groups inside); a stray ncclGroupEnd, and
    a group with no collective, launch nothing; threads are apart."""
    from exporter.sinks.recording.gpu_join import launches

    rows = [_row(1, 7, 100, "ALL_REDUCE"),
            _row(2, 7, 200, "GROUP_START"), _row(3, 7, 210, "ALL_REDUCE"), _row(4, 7, 220, "GROUP_START"),
            _row(5, 7, 230, "BROADCAST", root=1), _row(6, 7, 240, "GROUP_END"), _row(7, 7, 250, "ALL_GATHER"),
            _row(8, 7, 300, "GROUP_END", dur=50),
            _row(9, 7, 400, "GROUP_END"), _row(10, 7, 500, "GROUP_START"), _row(11, 7, 510, "GROUP_END"),
            _row(12, 8, 205, "GROUP_START"), _row(13, 8, 215, "REDUCE", root=0)]  # thread 8: never launched
    got = [(s, e, [c[0] for c in calls]) for s, e, calls in launches(rows)]
    assert got == [(100, 110, [1]), (300, 350, [3, 5, 7])]


def test_pairing_skips_what_nccl_does_not_number():
    """Within a launch: a count-0 call is never paired; a call with no record of its
    key (a copy-engine or symmetric-kernel collective) is left without one; equal keys
    pair in call order against seqNumber order; rank and root are part of the key."""
    from exporter.sinks.recording.gpu_join import pair

    calls = [_row(1, 7, 0, "ALL_REDUCE", nbytes=256), _row(2, 7, 0, "ALL_REDUCE", count=0, nbytes=0),
             _row(3, 7, 0, "ALL_REDUCE", nbytes=192),                     # copy engine: no record
             _row(4, 7, 0, "ALL_REDUCE", nbytes=512), _row(5, 7, 0, "ALL_REDUCE", nbytes=256),
             _row(6, 7, 0, "BROADCAST", nbytes=64, root=1), _row(7, 7, 0, "ALL_REDUCE", nbytes=256, rank=1)]
    # (rowid, comm, op, seq, bytes, peer/root, enqueue_ns, rank): NCCL's order is by size
    records = [(20, "c1", "ALL_REDUCE", 12, 256, None, 5, 0), (21, "c1", "ALL_REDUCE", 11, 512, None, 5, 0),
               (22, "c1", "ALL_REDUCE", 10, 256, None, 5, 0), (23, "c1", "BROADCAST", 3, 64, 0, 5, 0),
               (24, "c1", "BROADCAST", 4, 64, 1, 5, 0), (25, "c1", "ALL_REDUCE", 10, 256, None, 5, 1)]
    assert pair(calls, records) == [(1, 22, 10), (4, 21, 11), (5, 20, 12), (6, 24, 4), (7, 25, 10)]

"""An agent that arrived after the job began (docs/communicators.md, "Communicators
made before the agent"; docs/fleet.md, "Recordings that began mid-job").

- Pure logic: a recording whose ranks' communicators have only local ids
  (`local-<pid>-<n>`, and `unknown` before the agent named them) and whose
  seqs start at different calls: `stragglers` and `explain` align the ranks
  by their call sequence and name the straggler.
- End to end: a 4-rank simulated job with a straggler (rank 2 sleeps 30 ms
  before every collective), `trace --db` started 5 s after the job began:
  every call is labelled with a local id (never one shared `unknown` after
  the agent's first loop turn), the world communicator's rank and size come
  from the launcher's environment, `explain` names rank 2 and `stragglers`
  lists it first.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import run_cli
from exporter.records.events import CallEvent, local_comm_hash

T0 = 1_700_000_000_000_000_000
MS = 1_000_000
STRAGGLER = 2


def synthetic(path: Path, n: int = 60) -> None:
    """4 ranks; ranks 1 and 3 recorded from the job's 2nd collective on (their
    seq 0 is everyone else's 1); rank 0's first 3 calls before the agent named
    its communicator (comm 0: unknown); rank 2 arrives 30 ms late every time."""
    from exporter.sinks.recording.writer import Recorder

    rec = Recorder(str(path), node="simnode", identify_processes=False)
    for rank in range(4):
        pid = 100 + rank
        first = 1 if rank in (1, 3) else 0
        for i in range(first, n):
            base = T0 + i * 50 * MS
            start = base + (30 * MS if rank == STRAGGLER else rank * 100_000)
            end = base + 31 * MS + rank * 20_000
            seq = i - first
            comm = 0 if (rank == 0 and i < 3) else local_comm_hash(pid, 1)
            if rank == 0 and i >= 3:
                seq = i - 3
            rec(CallEvent(kind=1, op="ALL_REDUCE", pid=pid, tid=pid, start_ns=start - T0, end_ns=end - T0,
                          start_real_ns=start, comm_ptr=0xAA, comm=comm, nccl_comm_hash=0, seq=seq, rank=rank,
                          nranks=4, count=1024, bytes=4096, datatype=7, red_op=0, root=-1, peer=-1,
                          stream=0, result=0, color=-1))
    rec.close()


def straggler_named(db) -> dict:
    """`explain` names STRAGGLER and `stragglers` lists it first (arriving last in ≥ 80 %
    of the collectives): its row."""
    r = run_cli("explain", str(db))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"straggler: rank {STRAGGLER} on "), r.stdout
    r = run_cli("stragglers", str(db), "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows[0]["rank"] == STRAGGLER and rows[0]["last_pct"] >= 80, rows[:4]
    return rows[0]


def test_recording_without_job_wide_ids_is_aligned_by_call_sequence(tmp_path):
    db = tmp_path / "mid.db"
    synthetic(db)
    conn = sqlite3.connect(db)
    assert {r[0] for r in conn.execute("SELECT DISTINCT comm_id_hash FROM nccl_events")} == \
        {"unknown", "local-100-1", "local-101-1", "local-102-1", "local-103-1"}
    conn.close()
    r = run_cli("stragglers", str(db), "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows[0]["rank"] == STRAGGLER and rows[0]["comm"] == "local-100-1~aligned", rows[:2]
    assert rows[0]["collectives"] >= 55 and rows[0]["last_pct"] == 100, rows[0]
    assert 25 <= rows[0]["median_lag_ms"] <= 35, rows[0]
    r = run_cli("explain", str(db))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"straggler: rank {STRAGGLER} on simnode arrives late"), r.stdout


def test_unalignable_recording_says_what_it_lacked(tmp_path):
    """One rank's calls only: nothing to align; explain says why and what to run instead."""
    from exporter.sinks.recording.writer import Recorder

    db = tmp_path / "one.db"
    rec = Recorder(str(db), node="simnode", identify_processes=False)
    for i in range(10):
        t = T0 + i * 50 * MS
        rec(CallEvent(kind=1, op="ALL_REDUCE", pid=7, tid=7, start_ns=t - T0, end_ns=t - T0 + MS,
                      start_real_ns=t, comm_ptr=0xAA, comm=local_comm_hash(7, 1), nccl_comm_hash=0, seq=i, rank=0,
                      nranks=4, count=1, bytes=4, datatype=7, red_op=0, root=-1, peer=-1, stream=0, result=0,
                      color=-1))
    rec.close()
    r = run_cli("explain", str(db))
    assert r.returncode == 0, r.stderr
    assert "communicators made before the recording began" in r.stdout, r.stdout
    assert "record from the job's start" in r.stdout


def test_a_process_with_one_announced_communicator_names_its_pointer_with_it():
    """The agent's loop names a pointer it did not see made: with NCCL's
    identity where the profiler plugin announced exactly one live
    communicator for the process (written with its own id = NCCL's hash, so a
    later plugin record may correct it, bpf/plugin.c), else a local id with
    the launcher's rank; a second announced communicator makes it a guess no
    more (local id)."""
    from types import SimpleNamespace as NS  # noqa: N814 - short, for the fake BCC rows below

    from exporter.records.events import PluginComm
    from exporter.sources.nccl.maps import NcclReader

    class Table(dict):
        def Key(self, *a):
            return a if len(a) > 1 else a[0]

        def Leaf(self, v=0):
            return NS(value=v, comm_hash=0, nccl_hash=0, rank=-1, nranks=-1)

        def keys(self):
            return [NS(tgid=k[0], comm=k[2]) for k in super().keys()]

    comms, gen = Table(), Table({0: NS(value=0)})
    slots = [(11, NS(cached_comm=0xA0, cached_hash=0, cached_gen=1)),
             (22, NS(cached_comm=0xB0, cached_hash=0, cached_gen=1))]
    tgids = {11: 100, 22: 200}

    class Probes:
        bpf = None

        def __getitem__(self, name):
            return {"communicators": comms, "comm_generation": gen}[name]

    probes = Probes()
    reader = NcclReader(probes)
    reader._call_slots = lambda: slots
    reader._tgid = lambda tid, proc: tgids[tid]
    reader.identity = lambda pid: {"rank": 5, "world_size": 8}
    world = 0x1111222233334444
    reader.announced = lambda: [PluginComm(100, world, 3, 4, 1, 0),
                                PluginComm(200, world, 1, 4, 1, 0), PluginComm(200, 0x99, 0, 2, 1, 0)]
    assert reader.name_unknown_comms() == 2
    one = comms[(100, 0, 0xA0)]
    assert (one.comm_hash, one.nccl_hash, one.rank, one.nranks) == (world, world, 3, 4)
    two = comms[(200, 0, 0xB0)]  # two announced: which is it? a local id, the launcher's rank
    assert (two.comm_hash, two.nccl_hash, two.rank, two.nranks) == (local_comm_hash(200, 1), 0, 5, 8)
    assert gen[0].value == 1  # threads re-read their cached identity


@pytest.mark.usefixtures("bpf", "netns")  # markers, root and the heavy lock: tests/conftest.py
@pytest.mark.parametrize("workload", ["allreduce", "train"])
def test_trace_started_mid_job_names_the_straggler(workload):
    """allreduce: one world communicator per process (rank and size from the
    launcher); train: a world and an even/odd split per process (local ids
    1 and 2, ranks unknown: the analysis names the launcher rank)."""
    from exporter.simulator.build import build_library
    from exporter.simulator.cluster import Cluster, cleanup_stale, start_job

    work = Path(tempfile.mkdtemp(prefix="nccl-midjob-"))
    cleanup_stale()
    lib = build_library(work / "lib")  # a private copy: only this job is traced
    db = work / "mid.db"
    trace = None
    try:
        with Cluster(4) as cluster:
            delays = {r: 2 for r in range(4)}
            delays[STRAGGLER] += 30
            # About 35 ms an iteration: ~50 s, killed when the trace ends (BCC's
            # compile takes several seconds on a loaded machine: the job must
            # outlast it).
            job = start_job(cluster, lib, workload, iterations=1500, rendezvous_dir=work / "rdv",
                            truth_dir=work / "truth", count=1024, compute_delay_ms=delays)
            try:
                time.sleep(5)
                assert all(rc is None for rc in job.poll()), job.result().summary()
                trace = subprocess.Popen(
                    [sys.executable, "-m", "exporter", "trace", "--nccl-lib", str(lib), "--db", str(db),
                     "--duration", "12s", "--sched", "totals"],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                out, err = trace.communicate(timeout=240)
                assert trace.returncode == 0, err
            finally:
                job.kill()
        conn = sqlite3.connect(db)
        comms = dict(conn.execute("SELECT comm_id_hash, COUNT(*) FROM nccl_events WHERE op = 'ALL_REDUCE' "
                                  "GROUP BY comm_id_hash").fetchall())
        named = {c: n for c, n in comms.items() if c.startswith("local-")}
        per_process = 1 if workload == "allreduce" else 2
        assert len(named) == 4 * per_process, comms                   # per process, never shared
        assert comms.get("unknown", 0) < 0.2 * sum(comms.values()), comms  # only before the first naming
        ranks = conn.execute("SELECT DISTINCT comm_id_hash, pid, rank, nranks FROM nccl_events "
                             "WHERE comm_id_hash LIKE 'local-%'").fetchall()
        assert {c for c, pid, _r, _n in ranks} == {f"local-{pid}-{n}" for _c, pid, _r, _n in ranks
                                                    for n in range(1, per_process + 1)}, ranks
        if workload == "allreduce":
            # Each process's only communicator: rank and size from the launcher (RANK, WORLD_SIZE).
            assert sorted(r[2] for r in ranks) == [0, 1, 2, 3] and {r[3] for r in ranks} == {4}, ranks
        else:
            # Two communicators: which is the world is unknown, so neither keeps the
            # launcher's rank (the first had it until the second was seen).
            latest = conn.execute(
                "SELECT comm_id_hash, rank, nranks FROM nccl_events e WHERE comm_id_hash LIKE 'local-%' AND "
                "timestamp_ns = (SELECT MAX(timestamp_ns) FROM nccl_events f "
                "WHERE f.comm_id_hash = e.comm_id_hash)").fetchall()
            assert len(latest) == 8 and {(r[1], r[2]) for r in latest} == {(-1, -1)}, latest
        conn.close()
        first = straggler_named(db)
        assert first["comm"].endswith("~aligned"), first
    finally:
        if trace is not None and trace.poll() is None:
            trace.kill()
            trace.wait()
        shutil.rmtree(work, ignore_errors=True)


def _identity(text: str) -> tuple[dict, dict]:
    """From a scrape: the label sets (family, op, comm, rank) of the job's
    AllReduce series, host and GPU, and of its communicators (comm,
    nccl_comm_hash, rank, nranks, pid); and each rank's last seq."""
    from conftest import parse_metrics
    from exporter.records import metrics

    labels, seqs = set(), {}
    for s in parse_metrics(text):
        if s.name in (metrics.COLLECTIVE_DURATION + "_count", metrics.GPU_DURATION + "_count") and \
                s.labels["op"] == "ALL_REDUCE":
            labels.add((s.name, s.labels["comm"], s.labels["rank"]))
        elif s.name == metrics.COMMUNICATOR_INFO:
            labels.add((s.name, s.labels["comm"], s.labels["nccl_comm_hash"], s.labels["rank"],
                        s.labels["nranks"], s.labels["pid"]))
        elif s.name == metrics.COLLECTIVE_LAST_SEQ and s.labels["op"] == "ALL_REDUCE":
            seqs[(s.labels["comm"], s.labels["rank"])] = s.value
    return labels, seqs


@pytest.mark.usefixtures("bpf", "netns")  # markers, root and the heavy lock: tests/conftest.py
def test_agent_attached_mid_gpu_job_labels_like_one_there_from_the_start():
    """The simulator's GPU-like mode with the profiler plugin: an agent
    attached 5 s into a 4-rank job (`run --db`) labels every series with the
    comm and rank an agent there from the start gives (NCCL's commHash, the
    communicator's ranks: bpf/plugin.c binds the call's communicator from the
    plugin's record) and counts seqs from NCCL's numbers; on its recording,
    `explain` names the straggler and `stragglers` lists it first, on the
    communicator itself (no call-sequence alignment needed)."""
    from conftest import ExporterProcess
    from exporter.simulator.build import build_library
    from exporter.simulator.cluster import Cluster, cleanup_stale, start_job
    from exporter.sources.nccl import hashing
    from exporter.sources.plugin.build import build_plugin

    work = Path(tempfile.mkdtemp(prefix="nccl-midjob-gpu-"))
    cleanup_stale()
    lib = build_library(work / "lib")
    env = {"NCCL_SIM_GPU": "1", "NCCL_SIM_GPU_KERNEL_US": "500", "NCCL_PROFILER_PLUGIN": str(build_plugin())}
    db = work / "late.db"
    try:
        with ExporterProcess(nccl_libs=[lib], node="n") as early, Cluster(4) as cluster:
            delays = {r: 2 for r in range(4)}
            delays[STRAGGLER] += 30
            job = start_job(cluster, lib, "allreduce", iterations=1500, rendezvous_dir=work / "rdv",
                            truth_dir=work / "truth", count=1024, compute_delay_ms=delays, extra_env=env)
            try:
                time.sleep(5)
                assert all(rc is None for rc in job.poll()), job.result().summary()
                with ExporterProcess(nccl_libs=[lib], node="n", extra_args=["--db", str(db)]) as late:
                    deadline = time.monotonic() + 20
                    while True:
                        want, want_seq = _identity(early.text())
                        got, got_seq = _identity(late.text())
                        if got == want or time.monotonic() > deadline:
                            break
                        time.sleep(1)
                    time.sleep(3)  # recording a few more seconds
                from exporter.simulator.truth import load_truth
                uid = bytes.fromhex(next(r for r in load_truth(work / "truth")
                                         if r.get("op") == "COMM_INIT_RANK")["uid"])
            finally:
                job.kill()
        world = hashing.format_hash(hashing.nccl_comm_hash(uid))
        assert got == want, (sorted(got ^ want), sorted(want))
        info = sorted((lbl[1], lbl[2], lbl[3], lbl[4]) for lbl in want if lbl[0].endswith("info"))
        assert info == [(world, world, str(r), "4") for r in range(4)], info
        assert {lbl[1] for lbl in want if lbl[0].endswith("_count")} == {world}
        assert len([lbl for lbl in want if lbl[0].endswith("_count")]) == 8  # host and GPU, 4 ranks
        # NCCL's seqNumber, not the count since the late agent attached
        assert set(got_seq) == set(want_seq) and \
            all(abs(got_seq[k] - want_seq[k]) <= 3 for k in want_seq), (got_seq, want_seq)

        conn = sqlite3.connect(db)
        comms = dict(conn.execute("SELECT comm_id_hash, COUNT(*) FROM nccl_events WHERE op = 'ALL_REDUCE' "
                                  "GROUP BY comm_id_hash").fetchall())
        conn.close()
        assert comms.get(world, 0) >= 0.9 * sum(comms.values()), comms
        first = straggler_named(db)
        assert first["comm"] == world, first
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.usefixtures("bpf", "netns")  # markers, root and the heavy lock: tests/conftest.py
def test_agent_attached_after_a_gpu_job_hung_knows_its_communicator():
    """Rank 0 of a GPU-mode job with the plugin stops before its third
    AllReduce; the others wait on the GPU: no NCCL call or plugin record
    follows. An agent started then still lists the communicator of every
    rank, with NCCL's commHash, rank and size, from the plugin's periodic
    announcement (nccl_exporter_comm_live, docs/plugin.md)."""
    from conftest import ExporterProcess, parse_metrics
    from exporter.records import metrics
    from exporter.simulator.build import build_library
    from exporter.simulator.cluster import Cluster, cleanup_stale, start_job
    from exporter.simulator.truth import load_truth
    from exporter.sources.nccl import hashing
    from exporter.sources.plugin.build import build_plugin

    work = Path(tempfile.mkdtemp(prefix="nccl-midjob-hung-"))
    cleanup_stale()
    lib = build_library(work / "lib")
    env = {"NCCL_SIM_GPU": "1", "NCCL_SIM_GPU_KERNEL_US": "500", "NCCL_PROFILER_PLUGIN": str(build_plugin())}
    try:
        with Cluster(4) as cluster:
            job = start_job(cluster, lib, "hang", iterations=1, rendezvous_dir=work / "rdv",
                            truth_dir=work / "truth", count=16, extra_args=["--hang-after", "2"],
                            extra_env=env)
            try:
                time.sleep(3)
                assert all(rc is None for rc in job.poll()), job.result().summary()
                with ExporterProcess(nccl_libs=[lib], node="n") as late:
                    deadline = time.monotonic() + 10
                    while True:
                        info = sorted((s.labels["comm"], s.labels["nccl_comm_hash"], s.labels["rank"],
                                       s.labels["nranks"]) for s in parse_metrics(late.text())
                                      if s.name == metrics.COMMUNICATOR_INFO)
                        if len(info) >= 4 or time.monotonic() > deadline:
                            break
                        time.sleep(0.5)
                uid = bytes.fromhex(next(r for r in load_truth(work / "truth")
                                         if r.get("op") == "COMM_INIT_RANK")["uid"])
            finally:
                job.kill()
        world = hashing.format_hash(hashing.nccl_comm_hash(uid))
        assert info == [(world, world, str(r), "4") for r in range(4)], info
    finally:
        shutil.rmtree(work, ignore_errors=True)

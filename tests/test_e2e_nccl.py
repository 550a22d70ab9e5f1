"""End to end: the real exporter, real uprobes, a simulated cluster in netns.

The simulated libnccl writes its own ground truth for every call; the
exporter's /metrics must agree with it exactly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict

import pytest

from exporter.records import metrics
from exporter.sources.nccl import hashing
from exporter.simulator.cluster import Cluster, run_job, start_job
from exporter.simulator.truth import calls, lifecycle, load_truth
from conftest import ExporterProcess, classic_bucket, series_by_labels, wait_for_detaching

# The probes time a call from uprobe to uretprobe; the library times itself
# from its first to its last instruction. The probe's window encloses the
# library's by the uprobe trap cost -- and by any preemption in between on
# this 2-core machine -- so a duration may land a little later, never earlier.
PROBE_SLACK_NS = 5_000_000

pytestmark = pytest.mark.usefixtures("bpf", "netns")  # markers, root and the heavy lock: conftest


def expected_comm_hashes(records, nccl: bool = True) -> dict[tuple[int, int], int]:
    """(pid, comm handle) -> the `comm` label, NCCL's own commHash (nccl=False:
    the agent's own id, what names children internally), from the lifecycle
    ground truth."""
    root = hashing.nccl_comm_hash if nccl else hashing.agent_comm_hash
    out: dict[tuple[int, int], int] = {}
    for r in sorted(lifecycle(records), key=lambda r: r["start_mono_ns"]):
        if r["result"] != 0:
            continue
        if r["op"] in ("COMM_INIT_RANK", "COMM_INIT_RANK_CONFIG", "COMM_INIT_RANK_SCALABLE"):
            out[(r["pid"], r["comm"])] = root(bytes.fromhex(r["uid"]))
        elif r["op"] == "COMM_INIT_ALL":
            h = root(bytes.fromhex(r["uid"]))
            for handle in r["comms"]:
                out[(r["pid"], handle)] = h
        elif r["op"] == "COMM_SPLIT" and r["comm"]:
            parent = out[(r["pid"], r["parent"])]
            if nccl:  # NCCL counts the splits of a parent from 1
                out[(r["pid"], r["comm"])] = hashing.split_nccl_comm_hash(parent, r["split_seq"] + 1, r["color"])
            else:
                out[(r["pid"], r["comm"])] = hashing.split_agent_comm_hash(parent, r["color"], r["split_seq"])
    return out


def truth_series(records):
    """(op, comm hex, rank) -> list of durations, and (op, comm, rank) -> bytes."""
    hashes = expected_comm_hashes(records)
    durations = defaultdict(list)
    nbytes = Counter()
    for r in calls(records):
        comm = hashing.format_hash(hashes[(r["pid"], r["comm"])])
        durations[(r["op"], comm, str(r["rank"]))].append(
            r["end_mono_ns"] - r["start_mono_ns"]
        )
        nbytes[(r["op"], comm, str(r["rank"]))] += r["bytes"]
    return durations, nbytes


def assert_buckets_hold(durations: list[int], per_bucket: list[int]) -> None:
    """Each true duration d lies in a (classic) bucket between that of d and of d + slack.

    For intervals that move monotonically with d this is the Hall condition:
    at every edge i, the exporter's count at or below i is at least the number
    of calls that cannot be above i, and at most those that can be at or below.
    """
    lo = Counter(classic_bucket(d) for d in durations)
    hi = Counter(classic_bucket(d + PROBE_SLACK_NS) for d in durations)
    got = must = can = 0
    for i in range(len(per_bucket)):
        got += per_bucket[i]
        must += hi[i]
        can += lo[i]
        assert must <= got <= can, f"bucket {i}: exporter {got}, truth allows {must}..{can}"


def test_mixed_job_counts_bytes_buckets_match_truth(simulator_lib, tmp_path):
    with ExporterProcess(nccl_libs=[simulator_lib]) as exporter, Cluster(4) as cluster:
        result = run_job(cluster, simulator_lib, "mixed", iterations=3, rendezvous_dir=tmp_path / "rdv",
                         truth_dir=tmp_path / "truth", timeout=120)
        assert result.ok, result.summary()
        families = exporter.scrape()

    records = result.truth
    durations, nbytes = truth_series(records)
    comms = {key[1] for key in durations}
    assert len(comms) >= 4, f"expected world, world2 and two split children, got {comms}"

    # Counts, per (op, comm, rank): exactly the ground truth, nothing more.
    hist = series_by_labels(families, metrics.COLLECTIVE_DURATION)
    got_counts = {
        (lbl["op"], lbl["comm"], lbl["rank"]): sum(buckets)
        for lbl, buckets in hist
    }
    want_counts = {key: len(ds) for key, ds in durations.items()}
    assert got_counts == want_counts

    # Bytes, per (op, comm, rank).
    got_bytes = {
        (s.labels["op"], s.labels["comm"], s.labels["rank"]): s.value
        for fam in families if fam.name + "_total" == metrics.COLLECTIVE_BYTES or fam.name == metrics.COLLECTIVE_BYTES
        for s in fam.samples if s.name == metrics.COLLECTIVE_BYTES
    }
    assert got_bytes == dict(nbytes)

    # Every recorded duration lies in the bucket the exporter put it in.
    for lbl, buckets in hist:
        key = (lbl["op"], lbl["comm"], lbl["rank"])
        assert_buckets_hold(durations[key], buckets)

    # The inner ncclBroadcast of every ncclBcast is not counted on its own,
    # and every op of the vocabulary the workload used is there.
    bcasts = len(calls(records, fn="ncclBcast"))
    assert bcasts > 0
    assert {k[0] for k in got_counts} >= {"ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "BROADCAST",
                                          "REDUCE", "SEND", "RECV", "ALL_TO_ALL", "GATHER", "SCATTER"}

    # Lifecycle calls: counted once per outermost call.
    life = series_by_labels(families, metrics.LIFECYCLE_DURATION)
    got_life = {lbl["op"]: sum(b) for lbl, b in life}
    want_life = Counter(r["op"] for r in lifecycle(records))
    assert got_life == dict(want_life)


def test_communicator_identity_and_hang_then_kill(simulator_lib, tmp_path):
    """Ranks 1..3 block in AllReduce waiting for rank 0: an in-flight call shows its
    age; killing the ranks mid-call leaves no in-flight entry behind."""
    with ExporterProcess(nccl_libs=[simulator_lib]) as exporter, Cluster(4) as cluster:
        job = start_job(cluster, simulator_lib, "hang", iterations=1, rendezvous_dir=tmp_path / "rdv",
                        truth_dir=tmp_path / "truth")
        try:
            deadline = time.monotonic() + 60
            inflight = []
            while time.monotonic() < deadline:
                families = exporter.scrape()
                inflight = [s for s in exporter.samples(families, metrics.INFLIGHT_OLDEST)
                            if s.labels["op"] == "ALL_REDUCE"]
                if len(inflight) == 3 and min(s.value for s in inflight) > 0.5:
                    break
                time.sleep(0.2)
            assert sorted(s.labels["rank"] for s in inflight) == ["1", "2", "3"], inflight
            assert all(s.value > 0.5 for s in inflight)
            # Each waiting call's size: count 1024 (start_job's default) x float32.
            size = {s.labels["rank"]: s.value for s in exporter.samples(families, metrics.INFLIGHT_BYTES)
                    if s.labels["op"] == "ALL_REDUCE"}
            assert size == {"1": 4096.0, "2": 4096.0, "3": 4096.0}, size

            # Communicator identity of the live world communicator.
            records = load_truth(tmp_path / "truth")
            uid = bytes.fromhex(lifecycle(records, op="COMM_INIT_RANK")[0]["uid"])
            info = exporter.samples(families, metrics.COMMUNICATOR_INFO)
            assert {s.labels["comm"] for s in info} == {hashing.format_hash(hashing.nccl_comm_hash(uid))}
            assert {s.labels["nccl_comm_hash"] for s in info} == {
                hashing.format_hash(hashing.nccl_comm_hash(uid))}
            assert sorted(s.labels["rank"] for s in info) == ["0", "1", "2", "3"]
            assert {s.labels["nranks"] for s in info} == {"4"}
            assert {int(s.labels["pid"]) for s in info} == set(job.pids)
        finally:
            job.kill()

        families = exporter.scrape()
        assert exporter.samples(families, metrics.INFLIGHT_OLDEST) == []
        entries = {s.labels["map"]: s.value
                   for s in exporter.samples(families, metrics.EXPORTER_MAP_ENTRIES)}
        assert entries["inflight"] == 0
        assert exporter.samples(families, metrics.COMMUNICATOR_INFO) == []


def test_job_started_after_exporter_is_traced_from_first_call(simulator_lib, tmp_path):
    """Default discovery (no --nccl-lib): a library file nobody had mapped when
    the exporter started is found once a job maps it, before its first call."""
    fresh = tmp_path / "venv-copy" / "libnccl.so.2"
    fresh.parent.mkdir()
    shutil.copy2(simulator_lib, fresh)
    wait_for_detaching()  # an earlier test's agent: attaching would take longer than the job's 1 s
    with ExporterProcess(nccl_libs=[]) as exporter, Cluster(4) as cluster:
        # Frameworks load libnccl at import and call it seconds later
        # (model set-up, rendezvous); one second stands for that here.
        result = run_job(cluster, fresh, "allreduce", iterations=20, rendezvous_dir=tmp_path / "rdv",
                         truth_dir=tmp_path / "truth", startup_delay_ms=1000, timeout=120)
        assert result.ok, result.summary()
        first = exporter.scrape()
        # A second job on the same, now-attached file is traced from its first
        # instruction, with no start-up delay at all.
        second = run_job(cluster, fresh, "allreduce", iterations=20, rendezvous_dir=tmp_path / "rdv2",
                         truth_dir=tmp_path / "truth2", timeout=120)
        assert second.ok, second.summary()
        both = exporter.scrape()

    # Discovery attaches to every libnccl on the host: look at this job's
    # communicators only, whatever else runs on the machine.
    def counted(families, records):
        comms = {hashing.format_hash(h) for h in expected_comm_hashes(records).values()}
        return sum(sum(b) for lbl, b in series_by_labels(families, metrics.COLLECTIVE_DURATION)
                   if lbl["comm"] in comms)

    assert counted(first, result.truth) == len(calls(result.truth)) == 4 * 20
    assert counted(both, second.truth) == len(calls(second.truth)) == 4 * 20
    # Counting by communicator id proves the init calls were seen too.
    life = {lbl["op"]: sum(b) for lbl, b in series_by_labels(both, metrics.LIFECYCLE_DURATION)}
    assert life["GET_UNIQUE_ID"] >= 2 and life["COMM_INIT_RANK"] >= 8


INIT_ALL_DRIVER = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
comms = (ctypes.c_void_p * 3)()
rc = lib.ncclCommInitAll(comms, 3, None)
print(rc, *[c or 0 for c in comms])
sys.stdout.flush()
input()  # keep the communicators alive until the test has looked
"""


def test_comm_init_all_counts_once_and_names_its_communicators(simulator_lib, tmp_path):
    truth = tmp_path / "initall.jsonl"
    with ExporterProcess(nccl_libs=[simulator_lib]) as exporter:
        proc = subprocess.Popen([sys.executable, "-c", INIT_ALL_DRIVER, str(simulator_lib)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "NCCL_SIM_TRUTH": str(truth)})
        try:
            rc, *handles = proc.stdout.readline().split()
            assert rc == "0"
            families = exporter.scrape()
        finally:
            proc.stdin.close()
            proc.wait(30)
    life = {lbl["op"]: sum(b) for lbl, b in series_by_labels(families, metrics.LIFECYCLE_DURATION)}
    # ncclCommInitAll calls ncclGetUniqueId inside the library: one call, not two.
    assert life == {"COMM_INIT_ALL": 1}
    (record,) = load_truth(truth)
    want = hashing.format_hash(hashing.nccl_comm_hash(bytes.fromhex(record["uid"])))
    info = exporter.samples(families, metrics.COMMUNICATOR_INFO)
    assert sorted((s.labels["comm"], s.labels["rank"], s.labels["nranks"]) for s in info) == [
        (want, "0", "3"), (want, "1", "3"), (want, "2", "3")]


def test_run_with_db_records_every_call_beside_the_metrics(simulator_lib, tmp_path):
    """`run --db`: /metrics as usual, and the same calls, every one of them, in the
    recording; stopping the exporter (SIGINT) flushes it and closes it cleanly."""
    import sqlite3

    db = tmp_path / "run.db"
    with ExporterProcess(nccl_libs=[simulator_lib], extra_args=["--db", str(db)]) as exporter, Cluster(4) as cluster:
        result = run_job(cluster, simulator_lib, "mixed", iterations=2, rendezvous_dir=tmp_path / "rdv",
                         truth_dir=tmp_path / "truth", timeout=120)
        assert result.ok, result.summary()
        time.sleep(0.5)  # the last events reach the ring buffer
        families = exporter.scrape()
    assert exporter.proc.returncode == 0, exporter.output()

    conn = sqlite3.connect(db)
    try:
        pids = ",".join(map(str, result.pids))
        got = Counter(conn.execute(f"SELECT pid, tid, op, count FROM nccl_events WHERE pid IN ({pids})"))
        per_series = Counter(conn.execute(
            f"SELECT op, comm_id_hash, CAST(rank AS TEXT) FROM nccl_events WHERE kind = 'call' AND pid IN ({pids})"))
        meta = dict(conn.execute("SELECT key, value FROM meta"))
    finally:
        conn.close()
    want = Counter((r["pid"], r["tid"], r["op"], r["count"]) for r in result.truth)
    assert got == want
    # The two sinks agree: the histogram's count per (op, comm, rank) is the number of rows.
    hist = Counter()
    for lbl, buckets in series_by_labels(families, metrics.COLLECTIVE_DURATION):
        hist[(lbl["op"], lbl["comm"], lbl["rank"])] += sum(buckets)
    assert hist == per_series
    assert "end_ns" in meta and meta["lost_total"] == meta.get("lost_kernel_skipped_retransmits", "0"), meta

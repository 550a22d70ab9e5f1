"""Many short jobs under one agent (docs/metrics.md, "Series lifecycle"): series (and the jobs'
tcp_srtt / sched_stats entries) leave the kernel maps and /metrics after
--series-ttl, a full series map counts calls in the overflow series (never
uncounted), and every job's counts stay exact.

A small version of bench/soak.py: ~24 two-rank jobs back to back, each with
a new communicator, against `run --series-capacity 3 --series-ttl 4s`.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from exporter.records import contract, metrics
from exporter.records.events import format_comm
from exporter.simulator.cluster import Cluster, run_job
from exporter.simulator.truth import calls, lifecycle
from exporter.sources.nccl import hashing
from conftest import ExporterProcess, series_by_labels

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("bpf", "netns")]  # markers, root and the heavy lock: conftest

CAPACITY = 3
TTL_S = 4
JOBS = 24
OVERFLOW = format_comm(contract.SERIES_OVERFLOW_COMM)


def job_comms(records) -> set[str]:
    return {hashing.format_hash(hashing.nccl_comm_hash(bytes.fromhex(r["uid"])))
            for r in lifecycle(records) if r["op"] == "COMM_INIT_RANK" and r["result"] == 0}


def calls_by_comm(families) -> Counter:
    out = Counter()
    for lbl, buckets in series_by_labels(families, metrics.COLLECTIVE_DURATION):
        if lbl["op"] == "ALL_REDUCE":
            out[lbl["comm"]] += sum(buckets)
    return out


def gauge(families, name: str, **labels) -> float:
    for fam in families:
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_many_short_jobs_exact_bounded_and_expired(tmp_path, simulator_lib):
    lib = simulator_lib
    args = ["--series-capacity", str(CAPACITY), "--series-ttl", f"{TTL_S}s"]
    seen_comms = set()
    with ExporterProcess(nccl_libs=[lib], extra_args=args) as exporter, Cluster(2) as cluster:
        before = calls_by_comm(exporter.scrape())[OVERFLOW]
        for i in range(JOBS):
            res = run_job(cluster, lib, "allreduce", iterations=3 + i % 3, rendezvous_dir=tmp_path / f"rdv{i}",
                          truth_dir=tmp_path / f"truth{i}", timeout=60)
            assert res.ok, res.summary()
            families = exporter.scrape()
            got = calls_by_comm(families)
            comms = job_comms(res.truth)
            assert len(comms) == 1 and not comms & seen_comms, "each job makes a new communicator"
            seen_comms |= comms
            (comm,) = comms
            # This job's calls: in its own series, or in the overflow series
            # (the map was full). Nothing is uncounted.
            want = len(calls(res.truth, op="ALL_REDUCE"))
            overflow = got[OVERFLOW] - before
            assert got[comm] + overflow == want, (i, got, want)
            before = got[OVERFLOW]
            entries = gauge(families, metrics.EXPORTER_MAP_ENTRIES, map="series_index")
            assert entries <= CAPACITY
            assert gauge(families, metrics.EXPORTER_MAP_CAPACITY, map="series_index") == CAPACITY
        # Jobs ran back to back, each needing 2 series while the last job's 2
        # were still alive: the map was full at times, and that was counted.
        families = exporter.scrape()
        assert calls_by_comm(families)[OVERFLOW] > 0
        assert gauge(families, metrics.EXPORTER_MAP_FULL, map="series_index") > 0
        # Every job ended: after the TTL (+ the loop's 2 s prune interval) their
        # series are gone from the kernel and from /metrics.
        deadline = time.monotonic() + TTL_S + 15
        while True:
            families = exporter.scrape()
            left = set(calls_by_comm(families)) - {OVERFLOW}
            entries = gauge(families, metrics.EXPORTER_MAP_ENTRIES, map="series_index")
            # Processes of ended jobs leave traced_processes too (the loop prunes
            # what user space re-added after they exited).
            traced = gauge(families, metrics.EXPORTER_MAP_ENTRIES, map="traced_processes")
            # Per-owner TCP and sched entries of the ended jobs go after the TTL too.
            owned = {m: gauge(families, metrics.EXPORTER_MAP_ENTRIES, map=m) for m in ("tcp_srtt", "sched_stats")}
            if not left and entries == 0 and traced == 0 and not any(owned.values()):
                break
            assert time.monotonic() < deadline, (f"still there after the TTL: {left}, {entries} series, "
                                                 f"{traced} traced processes, {owned}")
            time.sleep(0.5)
        assert not left & seen_comms


def test_fine_histogram_resolution_end_to_end(tmp_path, simulator_lib):
    """`run --histogram-resolution fine`: classic buckets at each quarter power
    of two (106 per series), derived from the kernel's schema-3 slots."""
    from exporter.records import histogram

    lib = simulator_lib
    with ExporterProcess(nccl_libs=[lib], extra_args=["--histogram-resolution", "fine"]) as exporter, \
            Cluster(2) as cluster:
        res = run_job(cluster, lib, "allreduce", iterations=4, rendezvous_dir=tmp_path / "rdv",
                      truth_dir=tmp_path / "truth", timeout=60)
        assert res.ok, res.summary()
        families = exporter.scrape()
    fine = histogram.CLASSIC["fine"]
    les = {float(s.labels["le"]) for f in families if f.name == metrics.COLLECTIVE_DURATION
           for s in f.samples if s.name.endswith("_bucket")}
    assert len(les) == len(fine.bounds(histogram.DURATION)) + 1 == 106
    count = sum(s.value for f in families if f.name == metrics.COLLECTIVE_DURATION for s in f.samples
                if s.name.endswith("_count") and s.labels["op"] == "ALL_REDUCE")
    assert count == len(calls(res.truth, op="ALL_REDUCE"))

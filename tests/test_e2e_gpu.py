"""End to end in the simulator's GPU-like mode (docs/simulator.md): the real
`nccl-exporter run` (uprobes on the simulated libnccl, BPF hooks on the
profiler plugin it builds) while a 2-rank job runs in network namespaces with
NCCL_SIM_GPU=1 and the plugin loaded the way NCCL loads it.

- Calls return once enqueued: the host histogram holds microseconds while
  the GPU histogram of the same communicator (same `comm` label) holds the
  kernels' time, bucket for bucket the simulator's own truth.
- A rank whose stream stalls: the GPU in-flight ages of both ranks grow
  while no call is in flight on the host (the hang the host side cannot see).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest

from conftest import CLASSIC, ExporterProcess, classic_bucket, run_cli, series_by_labels
from exporter.records import histogram, metrics
from exporter.simulator.cluster import Cluster, run_job, start_job
from exporter.simulator.truth import gpu_kernels

pytestmark = pytest.mark.usefixtures("bpf", "netns")  # markers, root and the heavy lock: conftest

KERNEL_US = 2000


def gpu_env(plugin, **extra) -> dict:
    env = {"NCCL_SIM_GPU": "1", "NCCL_SIM_GPU_KERNEL_US": str(KERNEL_US), "NCCL_SIM_GPU_LATE_EVERY": "3",
           "NCCL_SIM_GPU_DRIFT_PPM": "100", "NCCL_PROFILER_PLUGIN": str(plugin)}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def world_comm(families) -> str:
    """The `comm` label of the job's 2-rank communicator (nccl_communicator_info)."""
    comms = {s.labels["comm"] for s in ExporterProcess.samples(families, metrics.COMMUNICATOR_INFO)
             if s.labels["nranks"] == "2"}
    assert len(comms) == 1, comms
    return comms.pop()


def test_gpu_histogram_is_the_kernels_time_host_histogram_the_enqueue(lib, plugin, tmp_path):
    iterations = 20
    with ExporterProcess(nccl_libs=[lib]) as exporter, Cluster(2) as cluster:
        assert "profiler plugin" in exporter.output(), exporter.output()
        res = run_job(cluster, lib, "gpu", iterations, tmp_path / "rdv", tmp_path / "truth", count=4096,
                      compute_delay_ms={0: 3, 1: 3}, timeout=90, extra_env=gpu_env(plugin),
                      extra_args=["--sync-every", "5"])
        assert res.ok, res.summary()
        time.sleep(0.5)
        families = exporter.scrape()
    # the job's processes are gone (no nccl_communicator_info): its 2-rank
    # communicator is the one whose host series have ranks 0 and 1
    ranks_of = {}
    for lbl, _ in series_by_labels(families, metrics.COLLECTIVE_DURATION):
        ranks_of.setdefault(lbl["comm"], set()).add(lbl["rank"])
    (comm,) = [c for c, r in ranks_of.items() if r == {"0", "1"}]
    truth = res.truth

    host = {lbl["rank"]: b for lbl, b in series_by_labels(families, metrics.COLLECTIVE_DURATION)
            if lbl["op"] == "ALL_REDUCE" and lbl["comm"] == comm}
    gpu = {lbl["rank"]: b for lbl, b in series_by_labels(families, metrics.GPU_DURATION)
           if lbl["op"] == "ALL_REDUCE" and lbl["comm"] == comm}
    assert set(host) == set(gpu) == {"0", "1"}, (host.keys(), gpu.keys())
    for rank in ("0", "1"):
        # the GPU histogram: exactly the truth's kernel intervals (timer ticks, ns), in
        # the classic buckets of the text scrape
        want = Counter(classic_bucket(k["gpu_stop_timer"] - k["gpu_start_timer"])
                       for k in gpu_kernels(truth, "ALL_REDUCE")
                       if k["profiled"] and k["nranks"] == 2 and k["rank"] == int(rank))
        assert sum(want.values()) == iterations
        assert {i: n for i, n in enumerate(gpu[rank]) if n} == dict(want), rank
        # the host histogram: every call counted, the median call far below one kernel
        assert sum(host[rank]) == iterations
        assert CLASSIC.quantile(histogram.DURATION, host[rank], 0.5) < KERNEL_US * 1e-6 / 4, host[rank]
        # within the classic buckets' factor 2
        assert CLASSIC.quantile(histogram.DURATION, gpu[rank], 0.5) >= KERNEL_US * 1e-6 / 2


def test_stalled_stream_shows_gpu_inflight_while_host_shows_none(lib, plugin, tmp_path):
    env = gpu_env(plugin, NCCL_SIM_GPU_STALL_RANK=1, NCCL_SIM_GPU_STALL_AFTER=5, NCCL_SIM_GPU_LATE_EVERY=0,
                  NCCL_SIM_GPU_KERNEL_US=500)
    ages: list[dict] = []
    verdict = None
    with ExporterProcess(nccl_libs=[lib]) as exporter, Cluster(2) as cluster:
        job = start_job(cluster, lib, "gpu", 20, rendezvous_dir=tmp_path / "rdv", truth_dir=tmp_path / "truth",
                        count=1024, compute_delay_ms={0: 20, 1: 20}, extra_env=env,
                        # 8 s of stall: `hang` (asked at 2.5 s) reads twice, 1 s apart, before the abort
                        extra_args=["--sync-every", "0", "--finish", "abort", "--finish-delay-ms", "8000"])
        try:
            deadline = time.monotonic() + 60
            while None in job.poll() and time.monotonic() < deadline:
                families = exporter.scrape()
                gpu = {(s.labels["comm"], s.labels["rank"], s.labels["state"]): s.value
                       for s in ExporterProcess.samples(families, metrics.GPU_INFLIGHT_OLDEST)
                       if s.labels["op"] == "ALL_REDUCE"}
                host = [s for s in ExporterProcess.samples(families, metrics.INFLIGHT_OLDEST)
                        if s.labels["op"] == "ALL_REDUCE" and s.value > 0.05]
                active = {s.labels["pid"]: s.value
                          for s in ExporterProcess.samples(families, metrics.PROFILER_PLUGIN_ACTIVE)}
                if gpu:
                    ages.append({"gpu": gpu, "host": host, "comm": world_comm(families), "active": active})
                    if verdict is None and max(gpu.values()) > 2.5:
                        # `hang` reads the GPU side too: the host side alone says "not hung"
                        r = run_cli("hang", "--metrics", f"{exporter.base}/metrics", "--threshold", "2",
                                    "--format", "json")
                        verdict = (r.returncode, json.loads(r.stdout) if r.stdout else r.stderr)
                time.sleep(0.25)
            result = job.wait(timeout=60)
        finally:
            job.kill()
        assert result.ok, result.summary()
        time.sleep(0.5)
        after = exporter.scrape()
    assert len(ages) >= 4, ages
    comm = ages[-1]["comm"]
    last = ages[-1]["gpu"]
    # rank 0's AllReduce started on its GPU and waits for rank 1, whose stream
    # stopped: one running, the other queued, both growing for seconds
    assert last.get((comm, "0", "running"), 0) > 2.0, last
    assert last.get((comm, "1", "queued"), 0) > 2.0, last
    first = next(a["gpu"] for a in ages if (comm, "0", "running") in a["gpu"])
    assert last[(comm, "0", "running")] > first[(comm, "0", "running")] + 1.0
    # ... while the host side had nothing in flight: every call returned once enqueued
    assert all(not a["host"] for a in ages), [a["host"] for a in ages if a["host"]]
    # both ranks are known to have the plugin
    assert {pid: ages[-1]["active"].get(str(pid)) for pid in job.pids} == dict.fromkeys(job.pids, 1), ages[-1]
    # the abort reclaimed everything pending
    assert ExporterProcess.samples(after, metrics.GPU_INFLIGHT_OLDEST) == []
    # `hang` saw both ranks in the AllReduce on their GPUs: every rank joined, it does not complete
    assert verdict is not None and verdict[0] == 1, verdict
    (h,) = verdict[1]["hangs"]
    assert (h["comm"], h["op"], h["waiting_ranks"], h["missing"]) == (comm, "ALL_REDUCE", [0, 1], []), h
    assert {c["on"] for c in verdict[1]["in_flight"] if c["comm"] == comm} == {"gpu"}, verdict[1]["in_flight"]


def test_p99_alert_fires_from_gpu_time(lib, plugin, tmp_path):
    """A real Prometheus with the rules of alerts/ (windows and `for:` / 20,
    thresholds unchanged) scraping the agent while every AllReduce takes 400 ms
    on the (simulated) GPU and microseconds on the host: NcclAllReduceP99High
    fires with clock="gpu", and the host histogram alone stays far below 300 ms."""
    import json
    import subprocess
    import urllib.parse

    from conftest import free_port
    from tests.test_e2e_prometheus import PROMETHEUS, REPO, http_json, short_rules, stop, wait_ready

    if not os.access(PROMETHEUS, os.X_OK):
        pytest.skip("prometheus not installed (make deps)")
    rules = tmp_path / "rules"
    rules.mkdir()
    for f in sorted((REPO / "alerts").glob("*.yml")):
        (rules / f.name).write_text(short_rules(f.read_text()))
    prom = None
    with ExporterProcess(nccl_libs=[lib]) as exporter, Cluster(2) as cluster:
        port = free_port()
        (tmp_path / "prometheus.yml").write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(rules / "*.yml")],
            "scrape_configs": [{"job_name": "nccl-exporter",
                                "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
        }))
        log = tmp_path / "prometheus.log"
        try:
            prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{port}"],
                                    stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            wait_ready(f"http://127.0.0.1:{port}/-/ready", prom, log)
            api = f"http://127.0.0.1:{port}/api/v1"
            job = start_job(cluster, lib, "gpu", 400, rendezvous_dir=tmp_path / "rdv", truth_dir=tmp_path / "truth",
                            count=4096, compute_delay_ms={0: 1, 1: 1},
                            extra_env=gpu_env(plugin, NCCL_SIM_GPU_KERNEL_US=400_000),
                            extra_args=["--sync-every", "1"])
            try:
                firing, deadline = [], time.monotonic() + 120
                while not firing and time.monotonic() < deadline:
                    assert None in job.poll(), "the job ended before the alert fired"
                    firing = [a["labels"] for a in http_json(f"{api}/alerts")["data"]["alerts"]
                              if a["labels"]["alertname"] == "NcclAllReduceP99High" and a["state"] == "firing"]
                    time.sleep(1)
                comm = world_comm(exporter.scrape())  # while its processes live
                host_p99 = http_json(f"{api}/query?" + urllib.parse.urlencode({"query": (
                    'histogram_quantile(0.99, sum by (comm, le) '
                    '(rate(nccl_collective_duration_seconds_bucket{op="ALL_REDUCE"}[15s])))')}))
            finally:
                job.kill()
        finally:
            stop(prom)
    assert [(a["comm"], a["clock"]) for a in firing] == [(comm, "gpu")], firing
    host = {r["metric"]["comm"]: float(r["value"][1]) for r in host_p99["data"]["result"]}
    assert host[comm] < 0.05, host  # host time (enqueue, sync waits aside) could never fire it


def test_demo_shows_host_and_gpu_time_side_by_side(plugin):
    """`nccl-exporter demo --gpu`: every rank's row has host and GPU time, and
    the GPU time is the collective's (milliseconds), the host time the enqueue."""
    import re
    import subprocess
    import sys

    from conftest import REPO, free_port

    p = subprocess.run([sys.executable, "-m", "exporter", "demo", "--gpu", "--seconds", "3", "--ranks", "4",
                        "--lossy-rank", "1", "--straggler-rank", "2", "--listen", f"127.0.0.1:{free_port()}"],
                       capture_output=True, text=True, cwd=str(REPO), timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "Traceback" not in out, out
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+([\d.]+) ms\s+[\d.]+ ms\s+\|\s+(\d+)\s+([\d.]+) ms", out, re.M)
    assert sorted(int(r[0]) for r in rows) == [0, 1, 2, 3], out
    for _rank, host_calls, host_p50, gpu_calls, gpu_p50 in rows:
        assert int(host_calls) == int(gpu_calls) > 0, out
        assert float(host_p50) < 1.0 and float(gpu_p50) >= 1.5, out  # ms: the enqueue vs >= 3 ms kernels


def test_slow_gpu_operations_become_spans_over_their_gpu_interval(lib, plugin, tmp_path):
    """`run --otlp-endpoint --slow-threshold 1ms` on a GPU-mode job: every
    AllReduce (>= 3 ms on the GPU, microseconds on the host) arrives over real
    OTLP as a span whose bounds are its GPU interval (the simulator's truth,
    within the clock mapping's error), with the host enqueue as an event before
    it, the host series' communicator id, and one trace per (communicator,
    op, seq) shared by both ranks."""
    from exporter.sinks.spans import trace_id_for
    from tests.otlp_receiver import GrpcReceiver, attributes

    iterations = 10
    with GrpcReceiver() as receiver:
        with ExporterProcess(nccl_libs=[lib], extra_args=["--otlp-endpoint", receiver.endpoint,
                                                          "--slow-threshold", "1ms"]) as exporter, \
                Cluster(2) as cluster:
            res = run_job(cluster, lib, "gpu", iterations, tmp_path / "rdv", tmp_path / "truth", count=4096,
                          compute_delay_ms={0: 2, 1: 2}, timeout=90,
                          extra_env=gpu_env(plugin, NCCL_SIM_GPU_KERNEL_US=3000, NCCL_SIM_GPU_LATE_EVERY=0),
                          extra_args=["--sync-every", "5"])
            assert res.ok, res.summary()
            families = exporter.scrape()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                gpu = [(r, s) for r, s in receiver.spans() if attributes(s).get("nccl.clock") == "gpu"
                       and attributes(s)["nccl.op"] == "ALL_REDUCE" and attributes(s)["nccl.nranks"] == 2]
                if len(gpu) >= 2 * iterations:
                    break
                time.sleep(0.5)
    ranks_of = {}
    for lbl, _ in series_by_labels(families, metrics.COLLECTIVE_DURATION):
        ranks_of.setdefault(lbl["comm"], set()).add(lbl["rank"])
    (comm,) = [c for c, r in ranks_of.items() if r == {"0", "1"}]
    assert len(gpu) == 2 * iterations, [attributes(s) for _, s in gpu]
    truth = {(k["rank"], k["seq"]): k for k in gpu_kernels(res.truth, "ALL_REDUCE") if k["nranks"] == 2}
    traces: dict[int, set] = {}
    for _, s in gpu:
        a = attributes(s)
        k = truth[(a["nccl.rank"], a["nccl.seq"])]
        assert a["nccl.comm_id_hash"] == comm, a
        span_ns = s.end_time_unix_nano - s.start_time_unix_nano
        assert abs(span_ns - (k["gpu_stop_mono_ns"] - k["gpu_start_mono_ns"])) < 100_000, (span_ns, k)
        assert span_ns >= 3_000_000 and a["nccl.gpu_duration_ns"] == span_ns
        (enqueue,) = [ev for ev in s.events if ev.name == "nccl.enqueue"]
        assert enqueue.time_unix_nano <= s.start_time_unix_nano
        assert int.from_bytes(s.trace_id, "big") == trace_id_for(int(comm, 16), "ALL_REDUCE", a["nccl.seq"])
        traces.setdefault(a["nccl.seq"], set()).add(a["nccl.rank"])
    assert sorted(traces) == list(range(iterations)) and all(r == {0, 1} for r in traces.values())


def test_recording_holds_the_gpu_interval_and_the_gpu_time_query_finds_it(lib, plugin, tmp_path):
    """`trace --db` on a GPU-mode job with 60 ms kernels: every collective's
    nccl_events row gets its GPU interval (the simulator's truth within
    100 us); the documented seed query (host time) finds no slow AllReduce,
    its GPU-time variant finds every one."""
    import sqlite3

    from conftest import recording
    from tests.test_queries import documented_queries

    db = tmp_path / "gpu.db"
    with recording(db, lib, node="gpunode"), Cluster(2) as cluster:
        res = run_job(cluster, lib, "gpu", 6, tmp_path / "rdv", tmp_path / "truth", count=4096,
                      compute_delay_ms={0: 2, 1: 2}, timeout=90,
                      extra_env=gpu_env(plugin, NCCL_SIM_GPU_KERNEL_US=60_000, NCCL_SIM_GPU_LATE_EVERY=0),
                      extra_args=["--sync-every", "3"])
        assert res.ok, res.summary()
    conn = sqlite3.connect(db)
    truth = {(k["rank"], k["seq"]): k for k in gpu_kernels(res.truth, "ALL_REDUCE") if k["nranks"] == 2}
    rows = conn.execute("SELECT rank, seq, gpu_start_offset_ns, gpu_duration_ns FROM nccl_events "
                        "WHERE op = 'ALL_REDUCE' AND nranks = 2").fetchall()
    assert len(rows) == 12, rows
    for rank, seq, offset, duration in rows:
        k = truth[(rank, seq)]
        assert duration is not None and abs(duration - (k["gpu_stop_mono_ns"] - k["gpu_start_mono_ns"])) < 100_000
        assert offset is not None and offset > 0  # the GPU starts after the call was entered
    assert conn.execute("SELECT COUNT(*) FROM gpu_intervals WHERE op = 'ALL_REDUCE'").fetchone()[0] >= 12
    q = documented_queries()
    assert conn.execute(q["slow-allreduce-retransmits"]).fetchall() == []  # host time: microseconds
    gpu_rows = conn.execute(q["slow-allreduce-retransmits-gpu-time"]).fetchall()
    assert len(gpu_rows) == 12 and all(ms >= 60 for _rank, ms, _n in gpu_rows), gpu_rows


def test_broadcast_desync_intervals_are_counted_as_rejected_not_histogrammed(lib, plugin, tmp_path):
    """NCCL >= 2.29's Broadcast habit (NCCL_SIM_GPU_BCAST_DESYNC=2: after a
    Broadcast without an activation mask, later kernels deliver an older
    kernel's start timer) under the real agent: every interval the plugin
    flags (its log, written beside) is counted in
    nccl_exporter_gpu_intervals_rejected_total, and the GPU histograms hold
    exactly the others."""
    from tests.test_sim_gpu import parse_log

    env = gpu_env(plugin, NCCL_SIM_GPU_BCAST_DESYNC=2, NCCL_SIM_GPU_LATE_EVERY=0,
                  NCCL_EXPORTER_PROFILER_LOG=tmp_path / "plugin.%p.log")
    with ExporterProcess(nccl_libs=[lib]) as exporter, Cluster(4) as cluster:
        before = {s.labels["reason"]: s.value for s in ExporterProcess.samples(
            exporter.scrape(), "nccl_exporter_gpu_intervals_rejected_total")}
        res = run_job(cluster, lib, "mixed", 3, tmp_path / "rdv", tmp_path / "truth", count=64, timeout=90,
                      extra_env=env)
        assert res.ok, res.summary()
        time.sleep(0.5)
        families = exporter.scrape()
    log = parse_log(tmp_path.glob("plugin.*.log"))
    done = [r for r in log if r["event"] == "done"]
    flagged = Counter({0x80: "longer_than_host", 0x100: "start_before_enqueue", 0x200: "stop_before_start"}
                      [int(r["flags"], 16) & 0x380] for r in done if int(r["flags"], 16) & 0x380)
    assert flagged["longer_than_host"] > 0, Counter(r["flags"] for r in done)
    got = {s.labels["reason"]: s.value - before.get(s.labels["reason"], 0)
           for s in ExporterProcess.samples(families, "nccl_exporter_gpu_intervals_rejected_total")}
    assert got == {reason: flagged.get(reason, 0) for reason in
                   ("longer_than_host", "start_before_enqueue", "stop_before_start", "channel_lost")}
    # the histograms (this agent saw only this job: it traces the test's own libnccl
    # and plugin files): the records that passed, no more
    counted = sum(sum(b) for _, b in series_by_labels(families, metrics.GPU_DURATION))
    assert counted == len(done) - sum(flagged.values())

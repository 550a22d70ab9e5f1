"""NCCL's habits the plugin must survive inside other people's jobs
(docs/plugin.md, "NCCL habits"): unloads under a running thread, large
AlltoAlls, CollNet/NVLS collectives with no channel count, graph replays,
batched collectives, the activation mask. Each habit is played either by
NCCL's side in Python (tests/plugin/fake_nccl.py, one exact callback
sequence, in a subprocess so that a crash is a failed test) or by the
simulator's GPU mode (its NCCL_SIM_GPU_* switch), for every profiler
interface version where NCCL has the habit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest


from conftest import REPO
from test_sim_gpu import inproc
from tests.fixtures.libraries import sim_job_prelude

VERSIONS = (4, 5, 6, 7)


def play(plugin, version: int, body: str, env: dict | None = None, timeout: int = 120) -> dict:
    """Run `body` with P = Plugin(plugin, version) in a fresh process; it sets `out` (a dict), printed as the
    last line. Returns it, or fails with the process's output (a crash: its signal)."""
    script = "import sys, os, time, json, ctypes, _ctypes\n" \
             f"sys.path.insert(0, {str(REPO / 'tests' / 'plugin')!r})\n" \
             "from fake_nccl import *\n" \
             f"P = Plugin({str(plugin)!r}, {version})\nout = {{}}\n" + textwrap.dedent(body) + \
             "\nprint(json.dumps(out), flush=True)\n"
    e = dict(os.environ, **(env or {}))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=e, timeout=timeout)
    sig = f" (signal {signal.Signals(-p.returncode).name})" if p.returncode < 0 else ""
    assert p.returncode == 0, f"exit {p.returncode}{sig}: {p.stdout[-2000:]}{p.stderr[-3000:]}"
    import json
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["_stderr"] = p.stderr   # the plugin's WARN lines (no NCCL logger given)
    return out


# ------------------------------------------------ unloaded under a running thread --
@pytest.mark.parametrize("version", VERSIONS)
def test_nccl_closing_the_plugin_under_a_live_communicator_crashes_nothing(plugin, version):
    """NCCL dlcloses the plugin when its load count reaches 0; a communicator
    whose init failed before the plugin was loaded still unloads it in
    commFree (NCCL v2.28.9-1 init.cc:336 vs :1251, profiler.cc:107-119). The
    plugin's announcer thread must not then run in unmapped code: the library
    is pinned (-z nodelete, RTLD_NODELETE)."""
    out = play(plugin, version, """
        ctx = P.init(nranks=4)
        h = P.coll(ctx, seq=0, nch=1); P.stop(h)
        _ctypes.dlclose(P.dl._handle)     # the failed communicator's commFree
        time.sleep(0.2)                   # 40 announcer periods
        out["ok"] = 1
    """, env={"NCCL_EXPORTER_PROFILER_ANNOUNCE_MS": "5"})
    assert out["ok"] == 1


@pytest.mark.parametrize("version", VERSIONS)
def test_sim_failed_init_unload_leaves_the_job_running(lib, plugin, tmp_path, version):
    """The simulator's NCCL_SIM_GPU_UNLOAD=1 keeps NCCL's load count and
    NCCL_SIM_GPU_FAILED_INIT=2 plays two failed communicators' commFree after
    the first profiler init (ncclCommInitAll's two communicators run their
    inits in parallel): NCCL closes the plugin while communicators live, and
    the job goes on (without profiler events, as NCCL does)."""
    recs, log, p = inproc(lib, tmp_path, nranks=2, iters=4, plugin=plugin,
                          env={"NCCL_SIM_GPU_UNLOAD": "1", "NCCL_SIM_GPU_FAILED_INIT": "2",
                               "NCCL_EXPORTER_PROFILER_ANNOUNCE_MS": "5", "NCCL_SIM_GPU_KERNEL_US": "20000",
                               "NCCL_SIM_GPU_PROFILER_VERSION": str(version)})
    assert any(r.get("op") == "FAILED_COMM_FREE" for r in recs)
    assert p.returncode == 0


@pytest.mark.parametrize("version", (6, 7))   # 2.30.x (v6; 2.29 does not), and later until shown otherwise
def test_sim_init_error_unload_never_comes(lib, plugin, tmp_path, version):
    """The simulator's NCCL_SIM_GPU_INIT_ERROR_UNLOADS=1 plays 2.30's unload at
    an init that returns an error, and again in commFree (v2.30.7-1
    src/plugin/profiler.cc:253, :268), with NCCL's load count on
    (NCCL_SIM_GPU_UNLOAD=1). The plugin's init succeeds, also with settings it
    cannot use: NCCL never logs an init failure, keeps the plugin, and every
    operation of both communicators is recorded."""
    recs, log, p = inproc(lib, tmp_path, nranks=2, iters=6, plugin=plugin,
                          env={"NCCL_SIM_GPU_UNLOAD": "1", "NCCL_SIM_GPU_INIT_ERROR_UNLOADS": "1",
                               "NCCL_SIM_GPU_PROFILER_VERSION": str(version),
                               "NCCL_EXPORTER_PROFILER_POOL": "nonsense",
                               "NCCL_EXPORTER_PROFILER_CHAIN": "/nonexistent.so", "NCCL_DEBUG": "INFO"})
    assert "init failed" not in p.stderr and p.stderr.count("Closing profiler plugin") == 1   # at the last commFree
    done = [r for r in log if r["event"] == "done"]
    assert len([r for r in log if r["event"] == "init"]) == 2 and len(done) == 24, log


@pytest.mark.parametrize("version", VERSIONS)
def test_init_never_returns_an_error(plugin, version):
    """NCCL 2.30.x unloads the plugin at once when init returns an error and
    again in commFree (v2.30.7-1 profiler.cc:253, :268): the plugin's init
    returns success whatever it is given or lacks."""
    out = play(plugin, version, """
        codes = []
        ctx = P.init(nranks=8); codes.append(P.last_init)
        P.init(nranks=0, with_mask=False); codes.append(P.last_init)
        P.init(nranks=-1, rank=-5); codes.append(P.last_init)
        P.init(nranks=1 << 30); codes.append(P.last_init)
        out["codes"] = codes
        out["fini"] = P.finalize(ctx)
    """, env={"NCCL_EXPORTER_PROFILER_POOL": "nonsense", "NCCL_EXPORTER_PROFILER_CHAIN": "/nonexistent.so",
              "NCCL_EXPORTER_PROFILER_LOG": "/nonexistent/dir/x.log", "NCCL_EXPORTER_PROFILER_ANNOUNCE_MS": "-3"})
    assert out["codes"] == [0, 0, 0, 0] and out["fini"] == 0


def log_records(path) -> list[dict]:
    out = []
    if os.path.exists(path):
        for line in open(path).read().splitlines():
            if line.startswith("nccl-exporter-profiler event="):
                out.append(dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv))
    return out


F_NO_GPU_TIME, F_EXTRA_CHANNELS = 0x4, 0x8
F_UNTIMED, F_CHANNELS_UNKNOWN = 0x100000, 0x200000


# ------------------------------------------------------------- large AlltoAll --
@pytest.mark.parametrize("version", VERSIONS)
def test_two_alltoalls_at_2048_ranks_drop_nothing(plugin, version, tmp_path):
    """One ncclAlltoAll is 2 x nranks P2P tasks (NCCL v2.28.9-1
    src/enqueue.cc:2585-2588); two enqueued ahead of the GPU at 2,048 ranks are
    8,192 operations with a ProxyOp each (none for the rank itself). Nothing
    is dropped, everything completes, the pools end empty. On NCCL <= 2.30
    (v4..v6) the Send/Recv to itself gets no KernelCh events (enqueue.cc:805):
    those two are done, untimed, at their enqueue."""
    out = play(plugin, version, """
        n, me, pid = 2048, 5, os.getpid()
        ctx = P.init(nranks=n, rank=me)
        ops = []
        for a in range(2):
            for r in range(n):
                for f in ("Send", "Recv"):
                    h = P.p2p(ctx, f, peer=r, nch=1, rank=me)
                    P.stop(h)
                    ops.append((h, r, f))
        t = GPU_T0
        for h, r, f in ops:
            if r == me and P.ver <= 6:
                continue                      # no profiler proxy op: no KernelCh
            po = P.proxy_op(ctx, h, pid, r, f == "Send") if r != me else 0
            k = P.kch(ctx, h, 0, t); P.kch_stop(k, t + 1000); t += 2000
            P.stop(po)
        out.update(P.stats())
        out["handles"] = sum(1 for h, _, _ in ops if h)
        P.finalize(ctx)
    """, env={"NCCL_EXPORTER_PROFILER_LOG": str(tmp_path / "log")})
    assert out["handles"] == 8192 and out["dropped"] == 0 and out["proxy_dropped"] == 0, out
    assert out["completed"] == 8192 and out["abandoned"] == 0, out
    assert out["slots_used"] == 0 and out["pops_used"] == 0, out
    assert out["proxy_ops"] == 8192 - 4, out
    self_recs = [r for r in log_records(tmp_path / "log") if r["event"] == "done" and r["peer"] == "5"]
    assert len(self_recs) == 4
    for r in self_recs:
        untimed = bool(int(r["flags"], 16) & F_UNTIMED)
        assert untimed == (version <= 6) and (r["gpu_ns"] == "0") == untimed, r


@pytest.mark.parametrize("version", VERSIONS)
def test_a_drop_is_counted_and_logged_once(plugin, version):
    """A pool that is full anyway (sized down on purpose) drops with a counter
    and one WARN line, never more lines."""
    out = play(plugin, version, """
        ctx = P.init(nranks=2, rank=0)
        hs = [P.coll(ctx, seq=i, nch=1) for i in range(100)]
        out.update(P.stats())
    """, env={"NCCL_EXPORTER_PROFILER_POOL": "16", "NCCL_EXPORTER_PROFILER_POOL_MAX": "16"})
    assert out["dropped"] == 84 and out["slots_used"] == 16
    assert out["_stderr"].count("record pool (16) exhausted") == 1, out["_stderr"]


# ----------------------------------------------------------- CollNet / NVLS --
@pytest.mark.parametrize("version", VERSIONS)
def test_collnet_collective_with_no_channel_count_is_timed(plugin, version, tmp_path):
    """A CollNet/NVLS Coll says nChannels 0 (NCCL v2.28.9-1 src/enqueue.cc:568-597),
    its KernelCh events still come with its handle as parent: one done record
    with the interval over every channel, marked CHANNELS_UNKNOWN."""
    log = tmp_path / "log"
    out = play(plugin, version, """
        ctx = P.init(nranks=8, rank=0)
        for i in range(3):
            h = P.coll(ctx, seq=i, nch=0); P.stop(h)
            t = GPU_T0 + i * 10_000_000
            ks = [P.kch(ctx, h, c, t + 100 * c) for c in range(4)]
            for c, k in enumerate(ks):
                P.kch_stop(k, t + 50_000 + 10 * c)
        out.update(P.stats())
        P.finalize(ctx)
    """, env={"NCCL_EXPORTER_PROFILER_LOG": str(log)})
    assert out["completed"] == 3 and out["slots_used"] == 0 and out["abandoned"] == 0, out
    done = [r for r in log_records(log) if r["event"] == "done"]
    assert len(done) == 3
    for r in done:
        fl = int(r["flags"], 16)
        assert fl & F_CHANNELS_UNKNOWN and not fl & F_EXTRA_CHANNELS and r["gpu_ns"] == "50030", r
        assert r["channels"] == "4/4/0", r


@pytest.mark.parametrize("version", VERSIONS)
def test_sim_collnet_collectives_are_all_counted(lib, plugin, tmp_path, version):
    """The simulator's NCCL_SIM_GPU_COLLNET=1: every Coll says 0 channels, its
    KernelCh events still come; every AllReduce has its done record, timed."""
    recs, log, _ = inproc(lib, tmp_path, plugin=plugin, env={"NCCL_SIM_GPU_COLLNET": "1",
                                                             "NCCL_SIM_GPU_PROFILER_VERSION": str(version)})
    done = [r for r in log if r["event"] == "done" and r["kind"] == "coll"]
    assert len(done) == 12 and all(r["iface"] == f"v{version}" for r in done), log
    assert all(int(r["flags"], 16) & F_CHANNELS_UNKNOWN and int(r["gpu_ns"]) > 0 for r in done), done
    assert not [r for r in log if r["event"] == "abandoned"]


def sim_job(script: str, name: str, lib, plugin, tmp_path, version: int, iters: int, **habits: str):
    """Run one of the scripts below (ranks of the simulator's libnccl in GPU
    mode, the plugin loaded as NCCL loads it, the habits switched on by
    their NCCL_SIM_GPU_* variables) for `iters` iterations; it must print
    "<name> ok". Returns the plugin's log file."""
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    plog = tmp_path / "plugin.log"
    e = dict(os.environ, NCCL_SIM_GPU="1", NCCL_SIM_GPU_KERNEL_US="200", NCCL_PROFILER_PLUGIN=str(plugin),
             NCCL_EXPORTER_PROFILER_LOG=str(plog), NCCL_SIM_GPU_PROFILER_VERSION=str(version),
             NCCL_SIM_TRUTH=str(tmp_path / "truth.jsonl"), **habits)
    p = subprocess.run([sys.executable, str(path), str(lib), str(iters)], env=e, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and f"{name} ok" in p.stdout, p.stdout + p.stderr
    return plog


# ------------------------------------------------------------- graph replays --
GRAPH = sim_job_prelude(2) + r"""
iters = int(sys.argv[2])
for it in range(iters):       # out of place: a replay computes the same result again
    sb = [(ctypes.c_float * 64)(*[float(r + it)] * 64) for r in range(n)]
    rb = [(ctypes.c_float * 64)() for r in range(n)]
    keep.append((sb, rb))
    assert L.ncclGroupStart() == 0
    for r in range(n):
        assert L.ncclAllReduce(sb[r], rb[r], 64, 7, 0, comms[r], None) == 0
    assert L.ncclGroupEnd() == 0
for r in range(n):
    assert L.simStreamSynchronize(comms[r]) == 0
    assert L.ncclCommDestroy(comms[r]) == 0
print("graph ok")
"""


@pytest.mark.parametrize("version", VERSIONS)
def test_graph_replays_have_their_own_seq(lib, plugin, tmp_path, version):
    """NCCL_SIM_GPU_GRAPH_REPLAYS=3: each collective is captured and replayed
    3 times. NCCL bumps seqNumber for a replay only when the plugin gave the
    plan a Group (or CollApi) handle (v2.28.9-1 src/plugin/profiler.cc:419-427):
    the plugin does, so every replay is its own record with its own seq, the
    same on both ranks."""
    plog = sim_job(GRAPH, "graph", lib, plugin, tmp_path, version, 4, NCCL_SIM_GPU_GRAPH_REPLAYS="3")
    done = [r for r in log_records(plog) if r["event"] == "done" and r["kind"] == "coll"]
    assert len(done) == 2 * 4 * 3 and all(r["iface"] == f"v{version}" for r in done)
    for rank in ("0", "1"):
        seqs = sorted(int(r["seq"]) for r in done if r["rank"] == rank)
        assert seqs == list(range(12)), seqs


# -------------------------------------------------------- batched collectives --
BATCH = sim_job_prelude(2) + r"""
iters = int(sys.argv[2])
for it in range(iters):
    b = [[(ctypes.c_float * 128)() for _ in range(4)] for r in range(n)]
    keep.append(b)
    assert L.ncclGroupStart() == 0
    for r in range(n):    # three collectives of one group on each communicator
        assert L.ncclAllReduce(b[r][0], b[r][1], 64, 7, 0, comms[r], None) == 0
        assert L.ncclAllReduce(b[r][2], b[r][2], 64, 7, 0, comms[r], None) == 0
        assert L.ncclAllGather(b[r][0], b[r][3], 32, 7, comms[r], None) == 0
    assert L.ncclGroupEnd() == 0
for r in range(n):
    assert L.simStreamSynchronize(comms[r]) == 0
    assert L.ncclCommDestroy(comms[r]) == 0
print("batch ok")
"""
F_SHARED = 0x400000


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("batch", ["1", "0"])
def test_batched_collectives_share_one_interval_counted_once(lib, plugin, tmp_path, version, batch):
    """NCCL_SIM_GPU_BATCH=1: three collectives of one group on a communicator
    run as one kernel writing one start/stop per channel (NCCL v2.28.9-1
    src/device/common.h:309-327). Each gets its done record with the batch's
    interval; every one after the first is flagged SHARED, so the interval
    counts once. Without batching (separate kernels) none is."""
    plog = sim_job(BATCH, "batch", lib, plugin, tmp_path, version, 5, NCCL_SIM_GPU_BATCH=batch,
                   NCCL_SIM_GPU_LATE_EVERY="0")
    done = [r for r in log_records(plog) if r["event"] == "done" and r["kind"] == "coll"]
    assert len(done) == 2 * 5 * 3
    by_interval: dict = {}
    for r in done:
        by_interval.setdefault((r["rank"], r["gpu_start_timer"], r["gpu_stop_timer"]), []).append(r)
    shared = [r for r in done if int(r["flags"], 16) & F_SHARED]
    if batch == "1":
        assert len(by_interval) == 2 * 5 and all(len(g) == 3 for g in by_interval.values())
        for g in by_interval.values():   # one of each batch carries the interval, the other two are flagged
            assert sum(1 for r in g if not int(r["flags"], 16) & F_SHARED) == 1, g
        assert len(shared) == 2 * 5 * 2
    else:
        assert len(by_interval) == len(done) and not shared


# ------------------------------------------------------------------- the mask --
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mode,mask", [("counts", 0x6), ("gpu", 0x46), ("net", 0x5e), ("", 0x5e)])
def test_activation_mask_is_configurable(plugin, version, mode, mask, tmp_path):
    """NCCL_EXPORTER_PROFILER_MASK: counts (Coll|P2p: operations counted, no
    KernelCh asked for, so no GPU interval and none of KernelCh's cost to
    NCCL), gpu (+KernelCh), net (+ProxyOp|ProxyStep, the default). In counts
    mode each operation is done at its enqueue, flagged UNTIMED."""
    log = tmp_path / "log"
    out = play(plugin, version, """
        ctx = P.init(nranks=4, rank=0)
        out["mask"] = P.mask.value
        for i in range(5):
            h = P.coll(ctx, seq=i, nch=2); P.stop(h)
            ks = [P.kch(ctx, h, c, GPU_T0 + i * 1_000_000) for c in range(2)]
            for k in ks:
                P.kch_stop(k, GPU_T0 + i * 1_000_000 + 5000)
        out.update(P.stats())
        P.finalize(ctx)
    """, env={"NCCL_EXPORTER_PROFILER_MASK": mode, "NCCL_EXPORTER_PROFILER_LOG": str(log)})
    assert out["mask"] == mask and out["completed"] == 5 and out["slots_used"] == 0 and out["abandoned"] == 0, out
    done = [r for r in log_records(log) if r["event"] == "done"]
    assert len(done) == 5
    untimed = mode == "counts"
    assert all(bool(int(r["flags"], 16) & F_UNTIMED) == untimed and (r["gpu_ns"] == "0") == untimed for r in done)


@pytest.mark.parametrize("version", VERSIONS)
def test_sim_counts_mask_counts_every_collective(lib, plugin, tmp_path, version):
    """The simulator with the counts mask: NCCL sends no KernelCh events (its
    gating), every AllReduce is still counted, done and untimed."""
    recs, log, _ = inproc(lib, tmp_path, plugin=plugin, env={"NCCL_EXPORTER_PROFILER_MASK": "counts",
                                                             "NCCL_SIM_GPU_PROFILER_VERSION": str(version)})
    done = [r for r in log if r["event"] == "done" and r["kind"] == "coll"]
    assert len(done) == 12 and all(r["iface"] == f"v{version}" for r in done), log
    assert all(int(r["flags"], 16) & F_UNTIMED for r in done), log
    assert not [r for r in log if r["event"] == "abandoned"]


def test_agent_counts_a_batch_interval_once(plugin, bpf, tmp_path):
    """The agent (bpf/plugin.c): of a batch of three collectives sharing one
    interval, the histogram and its sum hold the interval once; the other two
    are counted in nccl_exporter_gpu_intervals_shared_total."""
    import shutil

    from exporter.sources.nccl.probes import NcclProbes
    from exporter.sources.plugin.source import PluginSource

    copy = tmp_path / "libnccl-profiler-habits.so"   # its own inode: other jobs' uprobes stay apart
    shutil.copy2(plugin, copy)
    probes = NcclProbes()
    src = None
    try:
        src = PluginSource()
        assert src.attach(str(copy))
        play(copy, 7, """
            ctx = P.init(nranks=4, rank=1, comm_hash=0x7777000011112222)
            t = GPU_T0
            for i in range(10):            # ten batches of three: one interval of 30 us each
                hs = [P.coll(ctx, seq=3 * i + j, nch=2) for j in range(3)]
                for h in hs: P.stop(h)
                t += 1_000_000
                ks = [P.kch(ctx, h, c, t) for h in hs for c in range(2)]
                for k in ks: P.kch_stop(k, t + 30_000)
            for i in range(5):             # five alone: 50 us each
                h = P.coll(ctx, seq=30 + i, nch=2); P.stop(h)
                t += 1_000_000
                ks = [P.kch(ctx, h, c, t) for c in range(2)]
                for k in ks: P.kch_stop(k, t + 50_000)
            P.finalize(ctx)
        """, env={"NCCL_EXPORTER_PROFILER_PROXY": "0"})
        series = [s for s in src.series() if s.comm == 0x7777000011112222]
        assert len(series) == 1 and series[0].op == "ALL_REDUCE"
        assert series[0].calls == 15 and series[0].sum_ns == 10 * 30_000 + 5 * 50_000, series
        assert src.shared() == 20
    finally:
        if src is not None:
            src.close()
        probes.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_collnet_collective_without_kernelch_ages_out_untimed(plugin, version, tmp_path):
    """A Coll of 0 channels that never gets a KernelCh (nothing NCCL can time
    for it) is reclaimed by age as done and UNTIMED, not abandoned."""
    log = tmp_path / "log"
    play(plugin, version, """
        ctx = P.init(nranks=2, rank=0)
        h = P.coll(ctx, seq=0, nch=0); P.stop(h)
        time.sleep(1.2)                                  # older than MAX_AGE_S
        hs = [P.coll(ctx, seq=1 + i, nch=1) for i in range(20)]   # a full pool reclaims by age
        out.update(P.stats())
    """, env={"NCCL_EXPORTER_PROFILER_LOG": str(log), "NCCL_EXPORTER_PROFILER_MAX_AGE_S": "1",
              "NCCL_EXPORTER_PROFILER_POOL": "16", "NCCL_EXPORTER_PROFILER_POOL_MAX": "16"})
    first = [r for r in log_records(log) if r.get("seq") == "0" and r["event"] in ("done", "abandoned")]
    assert len(first) == 1 and first[0]["event"] == "done", first
    assert int(first[0]["flags"], 16) & F_UNTIMED and int(first[0]["flags"], 16) & F_CHANNELS_UNKNOWN


A2A = sim_job_prelude(3) + r"""
iters = int(sys.argv[2])
for it in range(iters):
    sb = [(ctypes.c_float * (16 * n))(*range(16 * n)) for r in range(n)]
    rb = [(ctypes.c_float * (16 * n))() for r in range(n)]
    keep.append((sb, rb))
    assert L.ncclGroupStart() == 0
    for r in range(n):
        assert L.ncclAlltoAll(sb[r], rb[r], 16, 7, comms[r], None) == 0
    assert L.ncclGroupEnd() == 0
for r in range(n):
    assert L.simStreamSynchronize(comms[r]) == 0
    assert L.ncclCommDestroy(comms[r]) == 0
print("a2a ok")
"""


@pytest.mark.parametrize("version", VERSIONS)
def test_sim_alltoall_as_p2p_tasks_leaves_nothing_open(lib, plugin, tmp_path, version):
    """NCCL_SIM_GPU_ALLTOALL_P2P=1: each ncclAlltoAll is 2 x nranks P2p events
    (enqueue.cc:2585-2588), the pair to the rank itself without KernelCh on
    NCCL <= 2.30 (v4..v6). Every one is done at once, none abandoned at the
    destroy; the self pair untimed on v4..v6, timed on v7."""
    plog = sim_job(A2A, "a2a", lib, plugin, tmp_path, version, 4, NCCL_SIM_GPU_ALLTOALL_P2P="1")
    recs = log_records(plog)
    assert not [r for r in recs if r["event"] == "abandoned"]
    done = [r for r in recs if r["event"] == "done" and r["kind"] == "p2p"]
    assert len(done) == 3 * 4 * 2 * 3
    for r in done:
        self_pair = r["peer"] == r["rank"]
        untimed = bool(int(r["flags"], 16) & F_UNTIMED)
        assert untimed == (self_pair and version <= 6) and (r["gpu_ns"] == "0") == untimed, r


@pytest.mark.parametrize("version", VERSIONS)
def test_a_hung_collective_stays_in_flight_past_max_age(plugin, version, tmp_path):
    """A collective whose kernel has run for minutes (a real hang), and one
    queued behind it, are what the hang alerts (NcclCollectiveHung,
    NcclGpuQueueStalled: docs/alerts.md) must keep seeing in flight: the sweep
    ages them out only when the pool is full, never by age alone, while it
    keeps running for other communicators' operations."""
    log = tmp_path / "log"
    out = play(plugin, version, """
        ctx = P.init(nranks=2, rank=0, comm_hash=0x1111)
        hung = P.coll(ctx, seq=0, nch=1); k = P.kch(ctx, hung, 0, 1000); P.stop(hung)
        queued = P.coll(ctx, seq=1, nch=1); P.stop(queued)
        other = P.init(nranks=2, rank=1, comm_hash=0x2222)
        for i in range(12):                      # 2.4 s of sweeps (each start sweeps every 250 ms) past MAX_AGE_S
            h = P.coll(other, seq=i, nch=1); kk = P.kch(other, h, 0, 2000 + i); P.kch_stop(kk, 3000 + i); P.stop(h)
            time.sleep(0.2)
        out["ended"] = [l for l in open(os.environ["NCCL_EXPORTER_PROFILER_LOG"]).read().splitlines()
                        if "comm=0x0000000000001111" in l and ("event=done" in l or "event=abandoned" in l)]
        P.finalize(other); P.finalize(ctx)
    """, env={"NCCL_EXPORTER_PROFILER_LOG": str(log), "NCCL_EXPORTER_PROFILER_MAX_AGE_S": "1",
              "NCCL_EXPORTER_PROFILER_SETTLE_MS": "100"})
    assert out["ended"] == [], out["ended"]
    ended = [r for r in log_records(log) if r["comm"] == "0x0000000000001111" and r["event"] in ("done", "abandoned")]
    assert sorted(r["seq"] for r in ended) == ["0", "1"] and all(r["event"] == "abandoned" for r in ended), ended

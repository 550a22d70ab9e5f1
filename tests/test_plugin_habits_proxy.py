"""NCCL's habits on its proxy thread, reproduced by the simulator's GPU-like
mode (docs/simulator.md, "NCCL habits"; docs/plugin.md, "NCCL habits"), and
what the profiler plugin does with them: foreign PXN contexts, stale KernelCh
handles, ProxyOps never stopped, several GPUs of one process sharing a proxy,
restarted receive steps.

Every habit is run through each profiler interface version the simulator can
present (NCCL_SIM_GPU_PROFILER_VERSION: v4 as NCCL 2.27, v5 as 2.28, v6 as
2.29/2.30, v7 as 2.31+) where NCCL has it.
"""

from __future__ import annotations

import collections

import pytest

from exporter.simulator.truth import gpu_events
from exporter.sources.plugin.build import build_plugin_sanitized, sanitizer_env

from test_sim_gpu import inproc

VERSIONS = [4, 5, 6, 7]
NET_ENTRIES = 10  # NCCL_EXPORTER_NET_ENTRIES: 2 x top-K named peers + "other" per direction
NET_F_TABLE_FULL, NET_F_STEP_REUSED = 0x1, 0x2

# Each habit's switch in the simulator (docs/simulator.md); the sanitizer run
# (tests/test_plugin_habits_sanitized.py) goes through all of them.
HABITS = {
    "pxn_foreign_context": {"NCCL_SIM_GPU_PXN": "1"},
    "pxn_same_process": {"NCCL_SIM_GPU_PXN": "2"},
    "recv_step_restarted": {"NCCL_SIM_GPU_RECV_RESTART": "1"},
    "stale_kernelch_handle": {"NCCL_SIM_GPU_STALE_KCH": "3"},
    "proxyops_never_stopped": {"NCCL_SIM_GPU_PROXY_NO_STOP": "1"},
    "stale_handle_and_proxyops_never_stopped": {"NCCL_SIM_GPU_STALE_KCH": "3", "NCCL_SIM_GPU_PROXY_NO_STOP": "1"},
}
# The plugin's sweep, fast: each 100 ms (announcer) and a 200 ms wait for a
# stop NCCL may never send; the job pauses before its end to let it act.
SWEEP = {"NCCL_EXPORTER_PROFILER_ANNOUNCE_MS": "100", "NCCL_EXPORTER_PROFILER_SETTLE_MS": "200",
         "INPROC_PAUSE_S": "1.0"}
F_FINALIZED, F_REJECT_LOST_CHANNEL, F_NET_UNFINISHED = 0x20, 0x1000, 0x2000
NET_F_UNFINISHED = 0x4


def run(lib, plugin, tmp_path, version, env, **kw):
    e = {"NCCL_SIM_GPU_PROFILER_VERSION": str(version)}
    e.update(env)
    recs, log, proc = inproc(lib, tmp_path, plugin=plugin, env=e, **kw)
    assert {r["iface"] for r in gpu_events(recs, "PROFILER_INIT")} == {version}
    return recs, log, proc


def finals(log):
    return [r for r in log if r["event"] == "finalize"]


@pytest.mark.parametrize("version", VERSIONS)
def test_pxn_foreign_context_is_never_read(lib, plugin, tmp_path, version):
    """NCCL_SIM_GPU_PXN=1: every batch also gets a ProxyOp of another pid with
    that process's context (an inaccessible page here) and a parent shaped like
    the plugin's own handles, then its steps under the NULL the ProxyOp start
    returned, with the same context. The plugin decides "foreign" from the pid
    and the parent before it touches the context: no crash, the foreign ops are
    counted, every operation completes."""
    recs, log, _ = run(lib, plugin, tmp_path, version, {"NCCL_SIM_GPU_PXN": "1"})
    done = [r for r in log if r["event"] == "done"]
    assert len([r for r in done if r["kind"] == "coll"]) == 12 and len([r for r in done if r["kind"] == "p2p"]) == 12
    assert not [r for r in log if r["event"] == "abandoned"]
    fin = finals(log)
    assert len(fin) == 2 and max(int(r["proxy_foreign"]) for r in fin) > 0
    assert all(r["pending"] == "0" for r in fin)


@pytest.mark.parametrize("version", VERSIONS)
def test_pxn_in_one_process_two_proxy_threads_share_a_table(lib, plugin, tmp_path, version):
    """NCCL_SIM_GPU_PXN=2: one process, several GPUs, with PXN. Another proxy
    thread of the same process adds ProxyOps (our pid, our parent) to an
    operation while its own proxy thread does: 2 x 16 (peer, direction) pairs
    at the same moment. The table never holds more than its 8 named pairs (the
    rest is "other", TABLE_FULL); no record has more than 10 entries."""
    recs, log, _ = run(lib, plugin, tmp_path, version, {"NCCL_SIM_GPU_PXN": "2"})
    done = [r for r in log if r["event"] == "done"]
    assert len(done) == 24 and not [r for r in log if r["event"] == "abandoned"]
    waits = [r for r in log if r["event"] == "peer_wait"]
    per_op = collections.Counter(r["id"] for r in waits)
    assert per_op and max(per_op.values()) <= NET_ENTRIES
    full = {r["id"] for r in waits if int(r["net_flags"], 16) & NET_F_TABLE_FULL}
    assert full and any(r["peer"] == "other" for r in waits)
    assert all(int(r["net_flags"], 16) & NET_F_STEP_REUSED == 0 for r in waits)
    fin = finals(log)
    assert all(r["pending"] == "0" for r in fin) and max(int(r["proxy_ops"]) for r in fin) > 0


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_pxn_in_one_process_network_table_has_no_data_race(lib, tmp_path, version):
    """The same scenario with the plugin built with -fsanitize=thread: no data
    race in the network accounting (a race on the table's count is what can
    push it past its 8 entries). ThreadSanitizer sees every unsynchronised pair
    of accesses, whether or not this run's interleaving overflowed."""
    tsan = build_plugin_sanitized(tmp_path / "tsan", "thread")  # per test: the module's build may be older
    _, _, proc = run(lib, tsan, tmp_path, version, dict(sanitizer_env("thread"), NCCL_SIM_GPU_PXN="2"))
    reports = proc.stderr.split("WARNING: ThreadSanitizer")[1:]
    net = [r for r in reports if any(f in r for f in ("net_entry", "net_fill", "ph_enter", "ph_leave", "proxy_"))]
    assert not net, net[0][:3000]


@pytest.mark.parametrize("version", VERSIONS)
def test_restarted_receive_step_is_not_a_reused_step(lib, plugin, tmp_path, version):
    """NCCL_SIM_GPU_RECV_RESTART=1: every receive step is started twice before
    its first state (NCCL restarts it until its irecv is posted). That is the
    same step, not the step 8 before it still open: no STEP_REUSED, and the
    receive figures are those of one step each."""
    _, log, _ = run(lib, plugin, tmp_path, version, {"NCCL_SIM_GPU_RECV_RESTART": "1"})
    waits = [r for r in log if r["event"] == "peer_wait"]
    assert [r for r in waits if r["direction"] == "recv"]
    assert all(int(r["net_flags"], 16) & NET_F_STEP_REUSED == 0 for r in waits), waits[0]
    sent = sum(int(r["bytes"]) for r in waits if r["direction"] == "send")
    assert sent and sum(int(r["bytes"]) for r in waits if r["direction"] == "recv") == sent


def flags(r):
    return int(r["flags"], 16)


@pytest.mark.parametrize("version", VERSIONS)
def test_stale_kernelch_handle_lost_channel_is_finished_and_counted(lib, plugin, tmp_path, version):
    """NCCL_SIM_GPU_STALE_KCH=3 (NCCL <= 2.30): every third kernel of a
    communicator loses its last channel: no KernelCh start, and the stop goes
    out through the handle the previous kernel had on that channel. The older
    operation counts its channel's stop once; the operation that lost it is
    finished by the sweep (a newer one of its communicator ended, none older
    runs) as done with F_REJECT_LOST_CHANNEL, never left in flight until the
    communicator's end."""
    recs, log, _ = run(lib, plugin, tmp_path, version, dict(SWEEP, NCCL_SIM_GPU_STALE_KCH="3"))
    from exporter.simulator.truth import gpu_kernels
    stale = [t for t in gpu_kernels(recs) if t["stale_kch"]]
    assert stale
    done = [r for r in log if r["event"] == "done"]
    assert not [r for r in log if r["event"] == "abandoned"]
    lost = [r for r in done if flags(r) & F_REJECT_LOST_CHANNEL]
    assert len(lost) == len(stale) and len(done) == 24
    ok = [r for r in done if not flags(r) & F_REJECT_LOST_CHANNEL]
    assert all(r["channels"] == "2/2/2" for r in ok), [r for r in ok if r["channels"] != "2/2/2"][:2]
    assert all(r["channels"] == "1/1/2" for r in lost)
    fin = finals(log)
    assert max(int(r["lost_channel"]) for r in fin) == len(lost)


@pytest.mark.parametrize("version", VERSIONS)
def test_proxyops_never_stopped_do_not_hold_the_record(lib, plugin, tmp_path, version):
    """NCCL_SIM_GPU_PROXY_NO_STOP=1 (CollNet, SHM/P2P copy-engine modes): every
    ProxyOp is started, none is stopped. Once the kernel is done the record
    waits at most SETTLE_MS for them, then goes out marked F_NET_UNFINISHED (its
    network part NET_F_UNFINISHED); their pool entries are reclaimed."""
    _, log, _ = run(lib, plugin, tmp_path, version, dict(SWEEP, NCCL_SIM_GPU_PROXY_NO_STOP="1"))
    done = [r for r in log if r["event"] == "done"]
    assert len(done) == 24 and not [r for r in log if r["event"] == "abandoned"]
    assert all(flags(r) & F_NET_UNFINISHED for r in done)
    fin = finals(log)
    assert max(int(r["net_unfinished"]) for r in fin) == 24
    assert max(int(r["proxy_reclaimed"]) for r in fin) == max(int(r["proxy_ops"]) for r in fin) > 0


@pytest.mark.parametrize("version", VERSIONS)
def test_stale_stop_on_a_live_operation_counts_once(lib, plugin, tmp_path, version):
    """Both habits at once: the previous operation is still held by its open
    ProxyOps when the stale stop arrives through its handle. That second stop
    of a channel is ignored (dup_stops), so its interval is its own."""
    recs, log, _ = run(lib, plugin, tmp_path, version,
                       dict(SWEEP, NCCL_SIM_GPU_STALE_KCH="3", NCCL_SIM_GPU_PROXY_NO_STOP="1"))
    from exporter.simulator.truth import gpu_kernels
    truth = {(r["comm_hash"], r["rank"], r["coll_op"], r["seq"]): r for r in gpu_kernels(recs)}
    done = [r for r in log if r["event"] == "done" and r["kind"] == "coll"]
    assert done and not [r for r in log if r["event"] == "abandoned"]
    for r in done:
        if flags(r) & F_REJECT_LOST_CHANNEL:
            continue
        t = truth[(r["comm"][2:], int(r["rank"]), "ALL_REDUCE", int(r["seq"]))]
        assert int(r["gpu_stop_timer"]) == t["gpu_stop_timer"] and r["channels"] == "2/2/2", (r, t)
    assert max(int(r["dup_stops"]) for r in finals(log)) > 0


def test_sweep_beside_running_operations_reclaims_nothing_live(plugin, tmp_path):
    """The sweep runs on the announcer thread (here every 100 ms: a 1 ms period,
    rate-limited) while the driver's thread finishes operations under it: times
    that thread stores after the sweep read its clock are never taken for old
    ones. 20,000 operations of 8 channels, every other one's ProxyOps ending
    after its last KernelCh: nothing finished early, nothing orphaned, the pools
    back where they started (tests/plugin/driver.c netbench)."""
    import os
    import subprocess

    from conftest import REPO
    drv = tmp_path / "driver"
    subprocess.run(["gcc", "-O2", "-g", "-pthread", "-I", str(REPO / "plugin"), "-o", str(drv),
                    str(REPO / "tests/plugin/driver.c"), "-ldl"], check=True)
    env = dict(os.environ, NCCL_EXPORTER_PROFILER_ANNOUNCE_MS="1")
    p = subprocess.run([str(drv), str(plugin), "7", "netbench", "20000", "8", "2"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    kv = {l.split()[1]: dict(x.split("=", 1) for x in l.split()[2:] if "=" in x)
          for l in p.stdout.splitlines() if l.startswith("pools ")}
    assert kv["after"]["slots"] == kv["after"]["proxy_slots"] == "0"
    assert kv["after"]["late"] == kv["after"]["orphan"] == kv["after"]["dropped"] == "0", kv["after"]
    stats = dict(x.split("=", 1) for x in next(l for l in p.stdout.splitlines() if l.startswith("stats ")).split()[1:])
    assert stats["completed"] == "20000" and stats["abandoned"] == "0"


# slow: seconds of waiting for the defaults' SETTLE_MS, and a margin a loaded machine eats
@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("habit", ["stale_kernelch_handle", "proxyops_never_stopped"])
def test_records_waiting_for_a_stop_never_cost_a_drop(lib, plugin, tmp_path, version, habit):
    """A record that waits for a stop NCCL may never send (a lost channel,
    ProxyOps never stopped) is held SETTLE_MS (1 s by default). At a job's
    pace more of them than the pool holds pile up in that second: when the
    pool is full, the sweep ends them at once (with the same flags it gives
    them after SETTLE_MS) rather than drop the new operation. A pool of 16
    records, a job of 48 operations made in well under a second, then a
    pause for the sweep (its default SETTLE_MS)."""
    _, log, _ = run(lib, plugin, tmp_path, version,
                    dict(HABITS[habit], NCCL_EXPORTER_PROFILER_POOL="16", NCCL_EXPORTER_PROFILER_POOL_MAX="16",
                         NCCL_EXPORTER_PROFILER_ANNOUNCE_MS="100", INPROC_PAUSE_S="1.5"), iters=12)
    fin = finals(log)
    assert max(int(r["dropped"]) for r in fin) == 0, fin
    done = [r for r in log if r["event"] == "done"]
    assert len(done) == 48 and not [r for r in log if r["event"] == "abandoned"]
    want = F_NET_UNFINISHED if habit == "proxyops_never_stopped" else F_REJECT_LOST_CHANNEL
    assert any(flags(r) & want for r in done)


@pytest.mark.parametrize("version", VERSIONS)
def test_finalize_ends_a_record_held_by_open_proxyops_as_done(lib, plugin, tmp_path, version):
    """A communicator destroyed within SETTLE_MS of its last kernels: the
    records only its never-stopped ProxyOps held are done (F_NET_UNFINISHED,
    their GPU interval whole), not abandoned."""
    _, log, _ = run(lib, plugin, tmp_path, version, {"NCCL_SIM_GPU_PROXY_NO_STOP": "1"})
    done = [r for r in log if r["event"] == "done"]
    assert len(done) == 24 and not [r for r in log if r["event"] == "abandoned"]
    assert all(flags(r) & F_NET_UNFINISHED and int(r["gpu_ns"]) > 0 for r in done)


# slow: seconds of waiting for the defaults' SETTLE_MS, and a margin a loaded machine eats
@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("habit", ["stale_kernelch_handle", "proxyops_never_stopped"])
def test_an_idle_job_ends_what_waits_for_a_stop_within_settle_ms(lib, plugin, tmp_path, version, habit):
    """The job stops calling NCCL; what waits for a stop NCCL never sends ends
    within SETTLE_MS (default 1 s) and a quarter of it, whatever the announce
    period (here 10 s: the sweep has its own cadence while records are in
    flight). The job is destroyed 2.2 s after its last kernel: every record
    went out before the first finalize."""
    _, log, _ = run(lib, plugin, tmp_path, version,
                    dict(HABITS[habit], NCCL_EXPORTER_PROFILER_ANNOUNCE_MS="10000", INPROC_PAUSE_S="2.2"))
    first_fin = next(i for i, r in enumerate(log) if r["event"] == "finalize")
    before = [r for r in log[:first_fin] if r["event"] == "done"]
    assert len(before) == 24 and not [r for r in log if r["event"] == "abandoned"], \
        (len(before), [r for r in log if r["event"] == "abandoned"][:2])


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_sweeps_from_several_threads_have_no_data_race(lib, tmp_path, version):
    """The sweep runs from the announcer thread, at an operation's start and
    when the pool is full (here all three, with 16 records and both habits
    that make records wait for a stop): the plugin built with -fsanitize=thread
    reports no data race in its own code. Two sweeps at once wrote each
    communicator's oldest running operation, so one could take an operation as
    lost while an older one ran."""
    tsan = build_plugin_sanitized(tmp_path / "tsan", "thread")
    env = dict(sanitizer_env("thread"), **SWEEP, **HABITS["stale_handle_and_proxyops_never_stopped"],
               NCCL_EXPORTER_PROFILER_POOL="16", NCCL_EXPORTER_PROFILER_POOL_MAX="16")
    _, _, proc = run(lib, tsan, tmp_path, version, env, iters=12)
    reports = proc.stderr.split("WARNING: ThreadSanitizer")[1:]
    ours = [r for r in reports if "/plugin/" in r.split("\n\n")[0]]
    assert not ours, ours[0][:3000]

"""The agent side of the profiler plugin: bpf/plugin.c + PluginSource + the
Prometheus families, driven by tests/plugin/driver.c acting as NCCL.

GPU behaviour here is verified against NCCL's profiler interface and a
simulated caller (the driver's synthetic GPU), not on GPU hardware.

Every test loads BPF (root; the heavy lock: conftest). Each uses a
private copy of the plugin (its own inode), so other jobs running the shared
build do not reach these uprobes.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import time
from collections import Counter, defaultdict

import pytest

from conftest import exposition, parse_metrics, sample_value, sample_values
from exporter.records import histogram
from exporter.records.events import Communicator
from exporter.sources.plugin.build import build_plugin

from conftest import REPO
OPS = {"AllReduce": "ALL_REDUCE", "AllGather": "ALL_GATHER", "ReduceScatter": "REDUCE_SCATTER",
       "Broadcast": "BROADCAST", "Send": "SEND", "Recv": "RECV"}
NRANKS = {"0x1111222233334444": 4, "0x5555666677778888": 2, "0xabcdef0123456789": 4}


def parse_kv(line: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)


@pytest.fixture(scope="module")
def bins(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed")
    d = tmp_path_factory.mktemp("plugin-agent")
    # The driver holds before the finalize of its `pending` scenario when
    # DRIVER_HOLD_MS is set, so in-flight state is observable.
    subprocess.run(["gcc", "-O2", "-g", "-pthread", "-I", str(REPO / "plugin"), "-o", str(d / "driver"),
                    str(REPO / "tests/plugin/driver.c"), "-ldl"], check=True)
    plugin = d / "libnccl-profiler-agenttest.so"
    shutil.copy2(build_plugin(), plugin)
    return {"driver": d / "driver", "plugin": plugin, "dir": d}


@pytest.fixture
def sources(bins, bpf):
    from exporter.sources.nccl.probes import NcclProbes
    from exporter.sources.plugin.source import PluginSource

    probes = NcclProbes()
    plugin = None
    try:
        plugin = PluginSource()
        assert plugin.attach(str(bins["plugin"]))
        assert not plugin.attach(str(bins["plugin"]))  # the same file once
        yield probes, plugin
    finally:
        if plugin is not None:
            plugin.close()
        probes.close()


def driver_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_EXPORTER_", "DRIVER_"))}


def run_ops(bins, version: int, n: int, env: dict | None = None) -> list[dict]:
    p = subprocess.run([str(bins["driver"]), str(bins["plugin"]), str(version), "ops", str(n)],
                       capture_output=True, text=True, env={**driver_env(), **(env or {})}, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    truth = [parse_kv(l) for l in p.stdout.splitlines() if l.startswith("truth ")]
    assert len(truth) == n
    return truth


def expected_series(truth) -> dict[tuple, tuple[Counter, int]]:
    """(op, comm hash, rank, nranks) -> (bucket counts, sum ns) from the driver's truth."""
    out: dict[tuple, list] = defaultdict(lambda: [Counter(), 0])
    for t in truth:
        d = int(t["gpu_stop_timer"]) - int(t["gpu_start_timer"])
        k = (OPS[t["op"]], int(t["comm"], 16), int(t["rank"]), NRANKS[t["comm"]])
        out[k][0][histogram.bucket_of(d)] += 1
        out[k][1] += d
    return {k: (c, s) for k, (c, s) in out.items()}


@pytest.mark.parametrize("version", (4, 7))
def test_gpu_histograms_equal_the_drivers_truth(bins, sources, version):
    from exporter.sinks.prometheus import gpu_families

    _probes, plugin = sources
    truth = run_ops(bins, version, 60)
    want = expected_series(truth)
    got = {(s.op, s.comm, s.rank, s.nranks): s for s in plugin.series()}
    assert set(got) == set(want)
    for k, (buckets, sum_ns) in want.items():
        s = got[k]
        assert s.calls == sum(buckets.values())
        assert s.sum_ns == sum_ns
        assert {i: n for i, n in enumerate(s.buckets) if n} == dict(buckets), k
    assert plugin.inflight() == []  # every one done
    drops = plugin.drops()
    assert drops["bad_record"] == 0 and drops["no_gpu_time"] == 0 and drops["gpu_series_full"] == 0

    # as Prometheus sees it: the comm label is NCCL's commHash (no communicator known)
    text = exposition(gpu_families("n1", plugin, [], set()))
    total = sample_value(text, "nccl_collective_gpu_duration_seconds_count", op="ALL_REDUCE",
                         comm="1111222233334444", rank="2")
    assert total == sum(want[("ALL_REDUCE", 0x1111222233334444, 2, 4)][0].values())
    # one more truth check through the exposition: cumulative count at every le
    b = want[("ALL_REDUCE", 0x1111222233334444, 2, 4)][0]
    classic = histogram.CLASSIC[histogram.DEFAULT_CLASSIC]
    for i, bound in enumerate(classic.le_seconds(histogram.DURATION)):
        le = [s for s in parse_metrics(text) if s.name == "nccl_collective_gpu_duration_seconds_bucket"
              and s.labels["comm"] == "1111222233334444" and s.labels["op"] == "ALL_REDUCE"
              and float(s.labels["le"]) == bound]
        assert le and le[0].value == sum(n for j, n in b.items()
                                         if classic.bucket_of_slot(histogram.DURATION, j) <= i)


def test_implausible_intervals_are_counted_by_reason_not_histogrammed(bins, sources):
    """The driver delivers impossible timers for every 4th kernel (a stop 5 s in
    the future, both timers 5 s early, stops before starts: what NCCL >= 2.29
    sends after a Broadcast on its AllGatherV path). The plugin flags them; the
    agent counts them by reason and its histograms hold exactly the others."""
    _probes, plugin = sources
    good, bad = [], Counter()
    for kind, reason in (("long", "longer_than_host"), ("early", "start_before_enqueue"),
                         ("reversed", "stop_before_start")):
        truth = run_ops(bins, 7, 40, env={"DRIVER_IMPLAUSIBLE_EVERY": "4", "DRIVER_IMPLAUSIBLE": kind})
        good += [t for t in truth if t["implausible"] == "no"]
        bad[reason] += sum(t["implausible"] == kind for t in truth)
    assert bad == {"longer_than_host": 10, "start_before_enqueue": 10, "stop_before_start": 10}
    assert plugin.rejected() == dict(bad, channel_lost=0)
    want = expected_series(good)
    got = {(s.op, s.comm, s.rank, s.nranks): s for s in plugin.series()}
    assert {k: (s.calls, s.sum_ns) for k, s in got.items()} == \
        {k: (sum(c.values()), sum_ns) for k, (c, sum_ns) in want.items()}
    assert plugin.inflight() == [] and plugin.drops()["no_gpu_time"] == 0


def _hold(bins, ms: int):
    """Start the driver's `pending` scenario; return once it holds (one collective
    running on its "GPU", one queued) for `ms` before finalizing."""
    env = driver_env()
    env["DRIVER_HOLD_MS"] = str(ms)
    p = subprocess.Popen([str(bins["driver"]), str(bins["plugin"]), "7", "pending"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=env, bufsize=0)
    fd = p.stdout.fileno()
    deadline = time.monotonic() + 30
    out = b""
    while time.monotonic() < deadline:  # unbuffered: a line is seen when it is written
        r, _, _ = select.select([fd], [], [], 1)
        if r:
            chunk = os.read(fd, 65536)
            out += chunk
            if b"holding\n" in out:
                return p, out.decode().splitlines()
            if not chunk:
                break
    p.kill()
    raise AssertionError(f"the driver did not reach its hold: {out[-2000:]!r}")


def test_inflight_ages_queued_running_and_abandoned(bins, sources):
    from exporter.sinks.prometheus import gpu_families

    _probes, plugin = sources
    p, _ = _hold(bins, 1500)
    try:
        flights = {f.state: f for f in plugin.inflight()}
        assert set(flights) == {"queued", "running"}, plugin.inflight()
        run, q = flights["running"], flights["queued"]
        assert (run.op, run.comm, run.rank, run.nranks, run.pid) == \
            ("ALL_REDUCE", 0xABCDEF0123456789, 1, 4, p.pid)
        assert (q.op, q.seq, q.pid) == ("ALL_GATHER", 0, p.pid)
        assert run.seq == 1  # the second AllReduce: the first completed
        me = os.getpid()  # a "traced" process without the plugin
        ages = []
        for _ in range(2):
            text = exposition(gpu_families("n1", plugin, [], {me, p.pid}))
            ages.append((sample_value(text, "nccl_gpu_inflight_oldest_seconds", op="ALL_REDUCE",
                                      comm="abcdef0123456789", rank="1", state="running"),
                         sample_value(text, "nccl_gpu_inflight_oldest_seconds", op="ALL_GATHER",
                                      comm="abcdef0123456789", rank="1", state="queued")))
            assert sample_value(text, "nccl_profiler_plugin_active", pid=str(p.pid)) == 1
            assert sample_value(text, "nccl_profiler_plugin_active", pid=str(me)) == 0
            time.sleep(0.4)
        (r0, q0), (r1, q1) = ages
        assert 0 < r0 < r1 and 0 < q0 < q1, ages
        assert r1 - r0 >= 0.35 and q1 - q0 >= 0.35
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # finalize abandoned both (hook nccl_exporter_abandoned): nothing in flight;
    # the process is gone: no longer listed as having the plugin
    assert plugin.inflight() == []
    assert [x for x in plugin.processes() if x.pid == p.pid] == []
    assert plugin.series()  # the one completed AllReduce
    assert sum(s.calls for s in plugin.series()) == 1


def test_gpu_comm_label_is_nccls_commhash_as_on_host_series():
    """The GPU series' comm is NCCL's commHash, the label the host series of
    the same communicator carry (docs/communicators.md): nothing to match,
    and nothing changes when the job's communicators are gone."""
    from exporter.sinks.prometheus import gpu_families
    from exporter.records.events import GpuInflight, GpuSeries, PluginProcess

    comms = [Communicator(pid=1, comm_ptr=0x10, comm=0x1111222233334444, nccl_comm_hash=0x1111222233334444,
                          rank=2, nranks=4)]

    class FakePlugin:
        def series(self):
            return [GpuSeries("ALL_REDUCE", 0x1111222233334444, 2, 4, 1, 4096, 3000, (0, 1) + (0,) * 200),
                    GpuSeries("ALL_REDUCE", 0x5555666677778888, 0, 2, 1, 4096, 3000, (0, 1))]

        def inflight(self):
            return [GpuInflight(os.getpid(), 7, "ALL_REDUCE", 0x1111222233334444, 2, 4, 3, "running",
                                time.clock_gettime_ns(time.CLOCK_MONOTONIC) - 2_000_000_000)]

        def processes(self):
            return [PluginProcess(pid=os.getpid(), first_seen_ns=0, last_seen_ns=0, comms=1, dropped=0,
                                  iface_version=7)]

        def network(self):
            return []

        def foreign_proxy_ops(self):
            return {}

    for live in (comms, []):  # the job's communicators, then none (the job ended, series live on)
        text = exposition(gpu_families("n1", FakePlugin(), live, {os.getpid()}))
        assert sample_value(text, "nccl_collective_gpu_duration_seconds_count", comm="1111222233334444") == 1
        assert sample_value(text, "nccl_collective_gpu_duration_seconds_count", comm="5555666677778888") == 1
        assert sample_value(text, "nccl_gpu_inflight_oldest_seconds", comm="1111222233334444",
                            state="running") >= 1.9
    assert sample_values(text, "nccl_profiler_plugin_active") == [1]
    # no plugin source at all: every traced process is 0
    text = exposition(gpu_families("n1", None, comms, {os.getpid()}))
    assert sample_values(text, "nccl_profiler_plugin_active") == [0]


def test_exporter_serves_gpu_metrics(bins, tmp_path, launch_exporter):
    """The real `nccl-exporter run`: attaches the plugin it builds (here a private
    build dir), counts the driver's collectives, shows the held one in flight."""
    build_dir = tmp_path / "pb"
    lib = build_plugin(build_dir)
    env = dict(os.environ)
    env["NCCL_EXPORTER_PLUGIN_BUILD"] = str(build_dir)
    with launch_exporter(env=env) as ex:
        assert "attached the profiler plugin's hooks in " + str(lib) in ex.output()
        # every 5th kernel's timers are impossible: counted as rejected, not histogrammed
        p = subprocess.run([str(bins["driver"]), str(lib), "6", "ops", "40"], capture_output=True, text=True,
                           env={**driver_env(), "DRIVER_IMPLAUSIBLE_EVERY": "5", "DRIVER_IMPLAUSIBLE": "long"},
                           timeout=120)
        assert p.returncode == 0
        truth = [parse_kv(l) for l in p.stdout.splitlines() if l.startswith("truth ")]
        want = Counter((OPS[t["op"]], t["comm"][2:]) for t in truth if t["implausible"] == "no")
        text = ex.scrape()
        assert sample_value(text, "nccl_exporter_gpu_intervals_rejected_total", reason="longer_than_host") == 8
        assert sample_value(text, "nccl_exporter_gpu_intervals_rejected_total", reason="start_before_enqueue") == 0
        assert sample_value(text, "nccl_exporter_gpu_intervals_rejected_total", reason="stop_before_start") == 0
        for (op, comm), n in want.items():
            got = sample_values(text, "nccl_collective_gpu_duration_seconds_count", op=op, comm=comm)
            assert sum(got) == n, (op, comm, got)
        bins_local = dict(bins, plugin=lib)
        h, _ = _hold(bins_local, 1500)
        try:
            text = ex.scrape()
            assert sample_value(text, "nccl_profiler_plugin_active", pid=str(h.pid)) == 1, text
            assert sample_value(text, "nccl_gpu_inflight_oldest_seconds", op="ALL_REDUCE",
                                comm="abcdef0123456789", rank="1", state="running") > 0
            assert sample_value(text, "nccl_gpu_inflight_oldest_seconds", op="ALL_GATHER",
                                comm="abcdef0123456789", rank="1", state="queued") > 0
            assert h.wait(30) == 0
        finally:
            if h.poll() is None:
                h.kill()
                h.wait()
        text = ex.scrape()
        assert sample_values(text, "nccl_gpu_inflight_oldest_seconds") == []
        assert sample_value(text, "nccl_exporter_map_entries", map="gpu_inflight") == 0


def run_net(bins, n: int, nch: int, steps: int, log, env: dict | None = None) -> tuple[list[dict], dict, list[str]]:
    """The driver's `net` scenario (ProxyOp/ProxyStep as NCCL's proxy thread
    sends them, plus a PXN-like op per operation): its expectations, its pool
    lines and the plugin's logging-mode lines."""
    p = subprocess.run([str(bins["driver"]), str(bins["plugin"]), "7", "net", str(n), str(nch), str(steps)],
                       capture_output=True, text=True, timeout=120,
                       env={**driver_env(), "NCCL_EXPORTER_PROFILER_LOG": str(log), **(env or {})})
    assert p.returncode == 0, p.stderr[-2000:]
    expect = [parse_kv(l[len("net "):]) for l in p.stdout.splitlines() if l.startswith("net expect ")]
    pools = {l.split()[1]: parse_kv(l[len("pools"):]) for l in p.stdout.splitlines() if l.startswith("pools ")}
    return expect, pools, [l for l in log.read_text().splitlines() if "event=peer_wait" in l]


def test_network_figures_per_peer_from_proxy_steps(bins, sources, tmp_path):
    """ProxyOp/ProxyStep events (8 channels, 4 steps each, both directions)
    become, per (peer, direction), bytes and per-phase wall/step time that
    the agent sums: equal to the plugin's own per-operation figures (logging
    mode) and to what the driver spun (wall = steps x phase time over all
    channels; step time = channels x that), within the clock reads of the
    callbacks. The PXN-like op of another pid is ignored and counted."""
    from exporter.records import contract
    from exporter.sinks.prometheus import gpu_families

    _probes, plugin = sources
    n, nch, steps = 10, 8, 4
    expect, pools, lines = run_net(bins, n, nch, steps, tmp_path / "net.log")
    assert pools["before"]["proxy_slots"] == pools["after"]["proxy_slots"] == "0"
    assert pools["after"]["foreign"] == str(n) and pools["after"]["orphan"] == "0"
    assert pools["after"]["late"] == "0" and pools["after"]["proxy_ops"] == str(2 * nch * n)
    logged = defaultdict(lambda: defaultdict(int))
    for l in lines:
        kv = parse_kv(l)
        for k, v in kv.items():
            if k == "bytes" or k.endswith(("_wall_ns", "_step_ns")):
                logged[(int(kv["peer"]), kv["direction"])][k] += int(v)
    assert len(lines) == 2 * n  # one line per (peer, direction) per operation
    got = {(s.peer, s.direction): s for s in plugin.network()}
    assert set(got) == {(2, "send"), (0, "recv")}
    for e in expect:
        key = (int(e["peer"]), e["direction"])
        s = got[key]
        phases = contract.NETWORK_PHASES[e["direction"]]
        assert s.ops == n and s.bytes == n * int(e["bytes"]) == logged[key]["bytes"]
        for i, ph in enumerate(phases):
            assert s.wall_ns[i] == logged[key][f"{ph}_wall_ns"]  # the agent sums what the plugin sent
            assert s.step_ns[i] == logged[key][f"{ph}_step_ns"]
            want_wall = n * int(e["wall_ns"].split(",")[i])
            want_step = n * int(e["step_ns"].split(",")[i])
            # spun phase times; each transition adds the callbacks' own time (< 50 us per step here)
            assert want_wall <= s.wall_ns[i] <= want_wall + n * steps * 50_000, (key, ph)
            assert want_step <= s.step_ns[i] <= want_step + n * steps * nch * 50_000, (key, ph)
    assert plugin.drops()["bad_record"] == 0
    text = exposition(gpu_families("n1", plugin, [], set(), named_peers={}))
    assert sample_value(text, "nccl_network_wire_bytes_total", comm="000000000000feed", rank="1", peer="2",
                        direction="send") == n * nch * steps * 131072
    assert sample_value(text, "nccl_network_wait_seconds_total", comm="000000000000feed", rank="1", peer="0",
                        direction="recv", phase="recv_wait") == got[(0, "recv")].wall_ns[0] / 1e9
    assert sample_value(text, "nccl_network_step_wait_seconds_total", comm="000000000000feed", rank="1",
                        peer="2", direction="send", phase="send_wait") == got[(2, "send")].step_ns[2] / 1e9
    # the driver exited: its PXN count left with it; while it ran the map had it
    assert plugin.foreign_proxy_ops() == {} or set(plugin.foreign_proxy_ops().values()) == {n}


def test_proxy_accounting_pools_return_after_100k_operations(bins):
    """100,000 operations of 8 channels (16 ProxyOps and 128 steps each, every
    other one's ProxyOps ending after its last KernelCh) leave the record
    and ProxyOp pools as they started, with nothing dropped or late. No agent
    needed: the plugin's own counters (nccl_exporter_profiler_pools)."""
    p = subprocess.run([str(bins["driver"]), str(bins["plugin"]), "7", "netbench", "100000", "8", "4"],
                       capture_output=True, text=True, timeout=300, env=driver_env())
    assert p.returncode == 0, p.stderr[-2000:]
    pools = {l.split()[1]: parse_kv(l[len("pools"):]) for l in p.stdout.splitlines() if l.startswith("pools ")}
    assert pools["before"]["slots"] == pools["after"]["slots"] == "0"
    assert pools["before"]["proxy_slots"] == pools["after"]["proxy_slots"] == "0"
    after = pools["after"]
    assert after["proxy_ops"] == str(100000 * 16) and after["foreign"] == "100000"
    assert after["dropped"] == after["late"] == after["orphan"] == "0"
    stats = parse_kv(next(l for l in p.stdout.splitlines() if l.startswith("stats ")))
    assert stats["completed"] == "100000" and stats["abandoned"] == "0" and stats["dropped"] == "0"


def test_owner_loaded_again_shares_every_map_with_the_plugin(bins, bpf):
    """BCC keeps an exported map's name for the life of the process: each owner
    generation renames every map of bpf/traced.h (sources/bpf.py shared_maps).
    A map left out (`communicators` was) bound the second generation's plugin
    program to a closed map's reused descriptor: the verifier refused it."""
    from exporter.sources.nccl.probes import NcclProbes
    from exporter.sources.plugin.source import PluginSource

    with contextlib.ExitStack() as shifts:
        for _ in range(3):
            probes = NcclProbes()
            try:
                plugin = PluginSource()
                try:
                    assert plugin.attach(str(bins["plugin"]))
                finally:
                    plugin.close()
            finally:
                probes.close()
            shifts.enter_context(open(os.devnull))  # descriptors move on, as in a test suite

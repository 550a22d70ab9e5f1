"""The profiler plugin driven by a simulated NCCL caller (tests/plugin/driver.c).

The driver dlopens the plugin and makes NCCL's callbacks in NCCL's order with
NCCL's habits (parents stopped before children start, KernelCh from another
thread and sometimes only after the kernel ended, NULL handles suppressing
later calls, finalize with KernelCh pending, nranks = 1, unzeroed v4/v5
descriptors).  The plugin runs in its logging mode; the records it writes are
compared with the driver's own truth (what the synthetic GPU did).

Chain-loading: tests/plugin/chained.c, a second plugin exporting only v5 and
asking for its own mask, is loaded through NCCL_EXPORTER_PROFILER_CHAIN and
asserts that every handle it is given back is its own.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest

from exporter.sources.plugin import build as plugin_build
from exporter.sources.plugin.build import build_plugin

from conftest import REPO
HELPERS = REPO / "tests" / "plugin"
VERSIONS = (4, 5, 6, 7)

F_START_LATE = 0x1
F_FINALIZED = 0x20


@pytest.fixture(scope="module")
def bins(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed")
    d = tmp_path_factory.mktemp("plugin-bins")
    inc = ["-I", str(REPO / "plugin")]
    subprocess.run(["gcc", "-O2", "-g", "-pthread", *inc, "-o", str(d / "driver"),
                    str(HELPERS / "driver.c"), "-ldl"], check=True)
    subprocess.run(["gcc", "-O2", "-g", "-fPIC", "-shared", "-pthread", *inc, "-o", str(d / "chained.so"),
                    str(HELPERS / "chained.c")], check=True)
    return {"driver": d / "driver", "chained": d / "chained.so", "plugin": build_plugin(), "dir": d}


def parse_kv(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", line))


def run(bins, version, scenario, n=None, env=None, tmp=None, expect_rc=0):
    log = Path(tmp) / f"log-v{version}-{scenario}.txt"
    if log.exists():
        log.unlink()
    e = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_EXPORTER_", "CHAINED_", "DRIVER_"))}
    e["NCCL_EXPORTER_PROFILER_LOG"] = str(log)
    e.update(env or {})
    # bins["exec"]: what runs the driver, e.g. qemu-aarch64 (tests/test_plugin_platforms.py)
    args = [*bins.get("exec", ()), str(bins["driver"]), str(bins["plugin"]), str(version), scenario] + \
        ([str(n)] if n else [])
    p = subprocess.run(args, capture_output=True, text=True, env=e, timeout=120)
    assert p.returncode == expect_rc, p.stdout[-2000:] + p.stderr[-2000:]
    out = p.stdout.splitlines()
    truth = [parse_kv(l) for l in out if l.startswith("truth ")]
    sent = {l.split()[1]: int(l.split()[2]) for l in out if l.startswith("sent ")}
    stats = next((parse_kv(l) for l in out if l.startswith("stats ")), {})
    masks = [int(l.split()[1], 16) for l in out if l.startswith("mask ")]
    recs = [parse_kv(l) for l in log.read_text().splitlines()] if log.exists() else []
    return {"truth": truth, "sent": sent, "stats": stats, "recs": recs, "stderr": p.stderr, "masks": masks}


def key(r):
    return (r["comm"], r["kind"], r["op"], int(r["seq"]), int(r["peer"]))


def done_by_key(res):
    done = [r for r in res["recs"] if r.get("event") == "done"]
    by = {key(r): r for r in done}
    assert len(by) == len(done), "two records for one (comm, op, seq)"
    return by


@pytest.mark.parametrize("version", VERSIONS)
def test_gpu_interval_and_identity_per_record(bins, tmp_path, version):
    res = run(bins, version, "ops", 60, tmp=tmp_path)
    assert res["masks"] and all(m & 0x46 == 0x46 for m in res["masks"])
    by = done_by_key(res)
    assert len(res["truth"]) == 60 and len(by) == 60
    assert not [r for r in res["recs"] if r.get("event") == "abandoned"]
    assert res["stats"]["completed"] == "60" and res["stats"]["dropped"] == "0" and res["stats"]["stale"] == "0"
    on_time = []
    for t in res["truth"]:
        r = by[key(t)]
        # GPU interval = earliest KernelCh start .. latest KernelCh stop (raw timers)
        assert int(r["gpu_start_timer"]) == int(t["gpu_start_timer"])
        assert int(r["gpu_stop_timer"]) == int(t["gpu_stop_timer"])
        assert int(r["gpu_ns"]) == int(t["stop_mono"]) - int(t["start_mono"])
        nch = int(t["nch"])
        assert r["channels"] == f"{nch}/{nch}/{nch}"
        assert (r["count"], r["bytes"], r["rank"]) == (t["count"], t["bytes"], t["rank"])
        assert r["nranks"] == ("4" if t["comm"] == "0x1111222233334444" else "2")
        assert r["dtype"] == "7" and r["iface"] == f"v{version}"
        assert int(r["enqueue_mono_ns"]) <= int(t["start_mono"])  # enqueued before the GPU ran it
        if t["late"] == "1":  # start delivered only after the kernel ended: flagged, interval still exact
            assert int(r["flags"], 16) & F_START_LATE, (t, r)
        else:
            on_time.append(bool(int(r["flags"], 16) & F_START_LATE))
    # a busy 2-core box can delay the driver's own "on time" delivery too; rarely
    assert sum(on_time) <= len(on_time) // 5, on_time


@pytest.mark.parametrize("version", (4, 7))
def test_seq_numbers_per_comm_and_op(bins, tmp_path, version):
    res = run(bins, version, "ops", 60, tmp=tmp_path)
    groups: dict[tuple, list[int]] = {}
    for r in res["recs"]:
        if r.get("event") == "done":
            k = (r["comm"], r["kind"], r["op"]) + ((r["peer"],) if r["kind"] == "p2p" else ())
            groups.setdefault(k, []).append(int(r["seq"]))
    assert len(groups) >= 6
    for k, seqs in groups.items():
        assert sorted(seqs) == list(range(len(seqs))), k  # from 0, no gaps, per comm and op (p2p: and peer)
    opcodes = {r["op"]: r["opcode"] for r in res["recs"] if r.get("event") == "done"}
    assert opcodes == {"AllReduce": "1", "AllGather": "2", "Send": "6", "Recv": "7"}


@pytest.mark.parametrize("drift_ppm", (0, 50, -50, 500, -500))
def test_gpu_timer_maps_to_monotonic(bins, tmp_path, drift_ppm):
    """The synthetic GPU timer is CLOCK_MONOTONIC + ~1.7e18 ns (a Unix-epoch-like
    globaltimer) drifting by drift_ppm; mapped times must land within a few us."""
    res = run(bins, 7, "ops", 120, tmp=tmp_path,
              env={"DRIVER_DRIFT_PPM": str(drift_ppm), "NCCL_EXPORTER_PROFILER_CLOCK_WINDOW_MS": "10"})
    by = done_by_key(res)
    errs = []
    for t in res["truth"]:
        r = by[key(t)]
        errs.append(abs(int(r["gpu_start_mono_ns"]) - int(t["start_mono"])))
        errs.append(abs(int(r["gpu_stop_mono_ns"]) - int(t["stop_mono"])))
    med, worst = statistics.median(errs), max(errs)
    print(f"drift {drift_ppm} ppm: mapping error median {med / 1000:.1f} us, max {worst / 1000:.1f} us")
    # estimator: min over two 10 ms windows of (host delivery - timer): late by the
    # smallest delivery lag, stale by at most 2 windows of drift
    bound = 2 * 10_000_000 * abs(drift_ppm) / 1e6 + 50_000
    assert med < 20_000 and worst < bound, (med, worst, bound)


def test_finalize_with_pending_work_reclaims(bins, tmp_path):
    res = run(bins, 5, "pending", tmp=tmp_path)
    recs = res["recs"]
    done = [r for r in recs if r.get("event") == "done"]
    ab = {r["op"]: r for r in recs if r.get("event") == "abandoned"}
    assert len(done) == 1 and set(ab) == {"AllReduce", "AllGather"}
    hung, queued = ab["AllReduce"], ab["AllGather"]
    assert hung["channels"] == "4/0/4" and int(hung["gpu_start_timer"]) > 0 and hung["gpu_stop_timer"] == "0"
    assert queued["channels"] == "0/0/2" and queued["gpu_start_timer"] == "0"
    for r in ab.values():
        assert int(r["flags"], 16) & F_FINALIZED
    fin = [r for r in recs if r.get("event") == "finalize"]
    assert len(fin) == 1 and fin[0]["pending"] == "2"
    assert res["stats"]["abandoned"] == "2"


def test_one_rank_gives_no_records(bins, tmp_path):
    res = run(bins, 7, "nranks1", tmp=tmp_path)
    assert [r["event"] for r in res["recs"]] == ["init", "finalize"]
    assert res["recs"][0]["nranks"] == "1"


def test_pool_exhaustion_drops_and_counts(bins, tmp_path):
    res = run(bins, 7, "pool", 40, tmp=tmp_path, env={"NCCL_EXPORTER_PROFILER_POOL": "16"})
    assert res["stats"]["completed"] == "16" and res["stats"]["dropped"] == "24"
    assert res["stats"]["stale"] == "0" and res["stats"]["disabled"] == "0"
    assert len([r for r in res["recs"] if r.get("event") == "done"]) == 16
    assert res["stderr"].count("exhausted") == 1  # one line through NCCL's logger, not one per drop


# --- chain-loading -------------------------------------------------------------------

CHAINED_DEFAULT_TYPES = {"Group", "Coll", "P2p", "ProxyOp", "GroupApi", "CollApi", "P2pApi"}


def chained_counts(path: Path) -> dict[str, int]:
    return {l.split()[0]: int(l.split()[1]) for l in path.read_text().splitlines()}


@pytest.mark.parametrize("version", (7, 5, 4))
def test_chain_forwards_every_callback_with_its_own_handles(bins, tmp_path, version):
    out = tmp_path / "chained.txt"
    res = run(bins, version, "ops", 40, tmp=tmp_path,
              env={"NCCL_EXPORTER_PROFILER_CHAIN": str(bins["chained"]), "CHAINED_OUT": str(out),
                   "DRIVER_PROXY": "1"})
    c = chained_counts(out)
    assert {k: v for k, v in c.items() if k.startswith("bad_")} == \
        {"bad_handle": 0, "bad_parent": 0, "bad_ctx": 0, "bad_type": 0}
    assert c["inits"] == 2 and c["finals"] == 2
    # the merged mask: ours (Coll|P2p|KernelCh) and its own (GroupApi|ProxyOp)
    assert all(m & 0x46 == 0x46 and m & 0x108 == 0x108 for m in res["masks"])
    sent = res["sent"]
    for t, n in sent.items():
        want = n if t in CHAINED_DEFAULT_TYPES else 0  # what NCCL would send it with its mask alone
        assert c[f"start_{t}"] == want, (t, c[f"start_{t}"], want)
    assert c["stops"] == sum(v for k, v in c.items() if k.startswith("start_"))
    api_states = 2 * sent["GroupApi"] if version >= 5 else 0
    assert c["records"] == api_states + sent["ProxyOp"]
    assert "chained" in res["stderr"] and "v5" in res["stderr"]
    # and our own records are unaffected
    assert res["stats"]["completed"] == "40" and res["stats"]["stale"] == "0"
    assert len(done_by_key(res)) == 40


@pytest.mark.parametrize("null_types", ("0", "2", "40"))
def test_chain_kernelch_handles_kept_apart(bins, tmp_path, null_types):
    """The chained plugin asks for KernelCh too: both plugins hold a handle for
    each KernelCh (one wrapper); it may answer Coll (2) or KernelCh (40) with NULL."""
    out = tmp_path / "chained.txt"
    res = run(bins, 7, "ops", 40, tmp=tmp_path,
              env={"NCCL_EXPORTER_PROFILER_CHAIN": str(bins["chained"]), "CHAINED_OUT": str(out),
                   "CHAINED_MASK": "140", "CHAINED_NULL_TYPES": null_types})
    c = chained_counts(out)
    assert c["bad_handle"] == 0 and c["bad_parent"] == 0 and c["bad_ctx"] == 0
    assert c["start_KernelCh"] == res["sent"]["KernelCh"]
    assert res["stats"]["completed"] == "40" and res["stats"]["wrap_dropped"] == "0"
    assert len(done_by_key(res)) == 40


def test_chain_failures_leave_our_plugin_working(bins, tmp_path):
    res = run(bins, 7, "ops", 10, tmp=tmp_path, env={"NCCL_EXPORTER_PROFILER_CHAIN": str(tmp_path / "nope.so")})
    assert "cannot load" in res["stderr"] and res["stats"]["completed"] == "10"
    res = run(bins, 7, "ops", 10, tmp=tmp_path, env={"NCCL_EXPORTER_PROFILER_CHAIN": str(bins["plugin"])})
    assert "is this plugin" in res["stderr"] and res["stats"]["completed"] == "10"


# --- the builder -----------------------------------------------------------------------

def test_builder_rebuilds_only_when_stale(tmp_path, monkeypatch):
    lib = build_plugin(tmp_path)
    assert lib.name == "libnccl-profiler-exporter.so" and lib.is_absolute()
    m1 = lib.stat().st_mtime_ns
    assert build_plugin(tmp_path).stat().st_mtime_ns == m1
    os.utime(lib, (0, 0))
    assert build_plugin(tmp_path).stat().st_mtime_ns != 0
    monkeypatch.setattr(plugin_build, "CFLAGS", plugin_build.CFLAGS + ["-fno-such-flag-at-all"])
    os.utime(lib, (0, 0))
    with pytest.raises(RuntimeError) as e:
        build_plugin(tmp_path)
    assert str(e.value).startswith("gcc failed building libnccl-profiler-exporter.so") and "\n" not in str(e.value)


# --- implausible GPU intervals (docs/plugin.md, "Implausible GPU intervals") ----------

REJECT = {"long": 0x80, "early": 0x100, "reversed": 0x200}


@pytest.mark.parametrize("kind", sorted(REJECT))
def test_implausible_intervals_are_flagged_and_keep_out_of_the_clock(bins, tmp_path, kind):
    """Every 4th kernel delivers timers that cannot be right (driver.c,
    DRIVER_IMPLAUSIBLE): stops 5 s in the future, both timers 5 s early, or
    stops before starts. Each such record carries its one reason flag, no
    other record carries any, and the plausible records' mapping to
    CLOCK_MONOTONIC stays exact: the rejected timers fed no clock sample (a
    stop 5 s in the future would otherwise move every later mapping 5 s)."""
    res = run(bins, 7, "ops", 60, tmp=tmp_path,
              env={"DRIVER_IMPLAUSIBLE_EVERY": "4", "DRIVER_IMPLAUSIBLE": kind})
    by = done_by_key(res)
    bad = [t for t in res["truth"] if t["implausible"] == kind]
    assert len(bad) == 15
    errs = []
    for t in res["truth"]:
        flags = int(by[key(t)]["flags"], 16)
        if t["implausible"] == kind:
            assert flags & 0x380 == REJECT[kind], (t, hex(flags))
            assert not flags & F_START_LATE
        else:
            assert flags & 0x380 == 0, (t, hex(flags))
            errs.append(abs(int(by[key(t)]["gpu_start_mono_ns"]) - int(t["start_mono"])))
    assert max(errs) < 50_000, max(errs)
    fin = [r for r in res["recs"] if r.get("event") == "finalize"]
    assert int(fin[-1]["rejected"]) == 15


def test_plausible_intervals_pass_under_drift_and_late_starts(bins, tmp_path):
    """The checks' tolerance (1 ms + 2 windows x 500 ppm) holds every honest
    interval: late start deliveries, -500 ppm drift, 10 ms windows."""
    res = run(bins, 4, "ops", 120, tmp=tmp_path,
              env={"DRIVER_DRIFT_PPM": "-500", "NCCL_EXPORTER_PROFILER_CLOCK_WINDOW_MS": "10"})
    assert [r["flags"] for r in done_by_key(res).values() if int(r["flags"], 16) & 0x380] == []


# --- KernelPhase (v7 bit 15) ------------------------------------------------------------

def test_kernel_phase_never_asked_and_a_chained_request_warned_once(bins, tmp_path):
    """nccl-exporter never asks for KernelPhase events (NCCL 2.31 spends 4-13 %
    more GPU time with them); a chained plugin that does gets them, and the
    plugin says so once, as a WARN through NCCL's logger, for both communicators."""
    alone = run(bins, 7, "ops", 10, tmp=tmp_path)
    assert alone["masks"] and all(m & 0x8000 == 0 for m in alone["masks"])
    assert "KernelPhase" not in alone["stderr"]
    plain = run(bins, 7, "ops", 10, tmp=tmp_path,
                env={"NCCL_EXPORTER_PROFILER_CHAIN": str(bins["chained"]), "CHAINED_OUT": str(tmp_path / "c0.txt")})
    assert "KernelPhase" not in plain["stderr"] and all(m & 0x8000 == 0 for m in plain["masks"])
    res = run(bins, 7, "ops", 10, tmp=tmp_path,
              env={"NCCL_EXPORTER_PROFILER_CHAIN": str(bins["chained"]), "CHAINED_OUT": str(tmp_path / "c.txt"),
                   "CHAINED_MASK": "8108"})
    warns = [l for l in res["stderr"].splitlines() if "KernelPhase" in l]
    assert len(warns) == 1 and warns[0].startswith("NCCL-LOG[2]"), res["stderr"]
    assert "0x8108" in warns[0]
    assert [r for r in res["recs"] if r.get("event") == "warn"] == \
        [{"event": "warn", "what": "chained_kernel_phase", "chain_mask": "0x8108", "pid": res["recs"][0]["pid"]}]
    assert res["masks"][-1] & 0x8000 and res["masks"][-1] & 0x46 == 0x46
    assert res["stats"]["completed"] == "10"


ANNOUNCER_PROBE = r"""
import ctypes, os, sys, time
lib = ctypes.CDLL(sys.argv[1])
INIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64, ctypes.POINTER(ctypes.c_int),
                        ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
FINI = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
class V7(ctypes.Structure):  # ncclProfiler_v7: name, init, startEvent, stopEvent, recordEventState, finalize
    _fields_ = [("name", ctypes.c_char_p), ("init", INIT), ("start", ctypes.c_void_p), ("stop", ctypes.c_void_p),
                ("record", ctypes.c_void_p), ("finalize", FINI)]
p = V7.in_dll(lib, "ncclProfiler_v7")
def announcers():
    n = 0
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/comm") as f:
            n += f.read().startswith("nccl-announce")
    return n
mask = ctypes.c_int(0)
a, b = ctypes.c_void_p(), ctypes.c_void_p()
out = [announcers()]
p.init(ctypes.byref(a), 0x1111, ctypes.byref(mask), None, 1, 4, 0, None)
p.init(ctypes.byref(b), 0x2222, ctypes.byref(mask), None, 1, 2, 1, None)
time.sleep(0.05)
out.append(announcers())
p.finalize(a)
out.append(announcers())
p.finalize(b)          # the last one: the thread is joined
out.append(announcers())
p.init(ctypes.byref(a), 0x3333, ctypes.byref(mask), None, 1, 4, 0, None)  # and starts again
time.sleep(0.05)
out.append(announcers())
p.finalize(a)
out.append(announcers())
print(*out)
"""


@pytest.mark.parametrize("period_ms, want", [("20", "0 1 1 0 1 0"), ("0", "0 0 0 0 0 0")])
def test_announcer_thread_lives_with_the_communicators(bins, period_ms, want):
    """The thread that announces the live communicators (docs/plugin.md,
    "Communicators made before the agent") runs while there is one, one per
    process, is joined at the last finalize (NCCL unloads the plugin after
    it) and starts again with a new communicator; ANNOUNCE_MS=0: none."""
    import sys

    env = {**os.environ, "NCCL_EXPORTER_PROFILER_ANNOUNCE_MS": period_ms}
    r = subprocess.run([sys.executable, "-c", ANNOUNCER_PROBE, str(bins["plugin"])], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-2] == want, r.stdout + r.stderr

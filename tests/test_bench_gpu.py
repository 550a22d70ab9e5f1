"""The GPU check (bench/gpu/, docs/plugin.md "Running the GPU check") without a GPU.

End to end on the simulator's GPU-like mode: `bench/gpu/run.sh --simulate`
runs part a's workload on the simulator with the real plugin, parses the
plugin's log and the workload's calls and gives its verdicts (and part b's
kernel checks: a real uprobe through tracefs). Then the parsers and verdicts
of every part on crafted inputs, failing ones included. torch is not needed:
bench/gpu/workload.py is only compiled here.
"""

from __future__ import annotations

import copy
import os
import py_compile
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench.gpu import checks
from bench.gpu.checks import Verdict

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "bench" / "gpu" / "run.sh"


def run_check(tmp_path, *args, env=None):
    e = dict(os.environ, PYTHON=sys.executable, **(env or {}))
    p = subprocess.run(["sh", str(RUN), "--out", str(tmp_path / "out"), *args], capture_output=True, text=True,
                       env=e, timeout=240)
    verdicts = (tmp_path / "out" / "verdicts.txt").read_text() if (tmp_path / "out" / "verdicts.txt").exists() else ""
    return p, verdicts


# --- end to end on the simulator ------------------------------------------------------

@pytest.mark.slow  # runs the whole simulated bench/gpu script (~6 s): `make test`, not test-quick
def test_simulated_run_passes_part_a_and_reports_every_part(tmp_path):
    p, verdicts = run_check(tmp_path, "--simulate", "--parts", "adce")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = verdicts.splitlines()
    assert lines[0].startswith("part a: PASS - simulator GPU-like mode")
    for world, ranks in ((2, 2), (4, 4)):
        for r in range(ranks):
            assert any(l.strip().startswith(f"{world} ranks, rank {r}/{world}: PASS") for l in lines), verdicts
    assert sum("control rank" in l and "PASS" in l for l in lines) == 2
    assert [l.split(" - ")[0] for l in lines if l.startswith("part ")] == \
        ["part a: PASS", "part d: PASS", "part c: SKIP", "part e: SKIP"]
    # part d's GPU straggler (NCCL_SIM_SLOW_GPU on rank 1), named by the product's network-wait analysis
    assert any(l.strip().startswith("straggler: PASS - rank 1 of 2 busy 2 ms a network step") and
               "named: rank 0 \u2190 rank 1" in l for l in lines), verdicts
    assert lines[-1] == "bench/gpu verdict: PARTIAL (a PASS, d PASS, c SKIP, e SKIP)"
    assert p.stdout.rstrip().splitlines()[-1] == lines[-1]
    with tarfile.open(tmp_path / "out" / "part-a.tar.gz") as t:
        names = t.getnames()
    assert any(n.startswith("a-4/plugin.") for n in names) and "a-2/calls.0.jsonl" in names


@pytest.mark.slow  # runs the whole simulated bench/gpu script (~6 s): `make test`, not test-quick
def test_simulated_broadcast_desync_fails_part_a(tmp_path):
    """NCCL >= 2.29's Broadcast habit (NCCL_SIM_GPU_BCAST_DESYNC): no Coll record for
    the Broadcasts, later intervals judged implausible: part a says so and fails."""
    p, verdicts = run_check(tmp_path, "--simulate", "--parts", "a",
                            env={"BENCH_GPU_ENV": "NCCL_SIM_GPU_BCAST_DESYNC=2"})
    assert p.returncode == 1
    assert verdicts.startswith("part a: FAIL")
    assert "Broadcast: 3 calls, 0 Coll records (3 missing)" in verdicts
    assert "judged implausible" in verdicts and "0x80" in verdicts
    assert verdicts.splitlines()[-1].startswith("bench/gpu verdict: FAIL (a FAIL)")


@pytest.mark.require_root   # a real uprobe through tracefs: not pure logic, not in test-quick
def test_part_b_attaches_a_real_uprobe_here(tmp_path):
    p, verdicts = run_check(tmp_path, "--simulate", "--parts", "b")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "uprobe:" not in verdicts.splitlines()[0], verdicts   # the uprobe fired 5 times for 5 calls
    assert "BTF yes" in verdicts
    assert "bench_gpu_" not in Path("/sys/kernel/tracing/uprobe_events").read_text()   # removed again


def test_help_and_bad_parts_need_no_torch():
    p = subprocess.run(["sh", str(RUN), "--help"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert p.returncode == 0 and "--simulate" in p.stdout and "--budget-s" in p.stdout
    p = subprocess.run(["sh", str(RUN), "--parts", "axz"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert p.returncode == 2 and "unknown part(s) xz" in p.stderr and "Traceback" not in p.stderr


def test_device_side_scripts_compile(tmp_path):
    for f in ("workload.py", "simworkload.py", "__main__.py", "checks.py", "straggler.py"):
        py_compile.compile(str(REPO / "bench" / "gpu" / f), cfile=str(tmp_path / (f + "c")), doraise=True)


# --- part a's checks on crafted inputs --------------------------------------------------

PID = 4242


def rec(op, seq, nbytes, enq, start, stop, kind="coll", flags="0x0", event="done"):
    return {"event": event, "kind": kind, "op": op, "comm": "0x00000000000000aa", "rank": "0", "nranks": "2",
            "seq": str(seq), "peer": "-1", "bytes": str(nbytes), "enqueue_mono_ns": str(enq),
            "gpu_start_timer": str(1_700_000_000_000_000_000 + start),
            "gpu_stop_timer": str(1_700_000_000_000_000_000 + stop), "flags": flags, "iface": "v5", "pid": str(PID)}


def call(op, nbytes, elapsed, expect):
    return {"kind": "call", "rank": 0, "world": 2, "op": op, "bytes": nbytes, "elapsed_ns": elapsed, "ok": True,
            "expect": expect}


def good_rank():
    calls = [call("AllReduce", 4096, 30_000, {"coll": "AllReduce"}),
             call("AllReduce", 1 << 20, 900_000, {"coll": "AllReduce"}),
             call("Broadcast", 4096, 25_000, {"coll": "Broadcast"}),
             call("AllToAll", 4096, 40_000, {"Send": [2048, 2048], "Recv": [2048, 2048]})]
    recs = [{"event": "init", "comm": "0x00000000000000aa", "rank": "0", "nranks": "2", "iface": "v5",
             "mask": "0x46", "pid": str(PID)},
            rec("AllReduce", 0, 4, 100, 1_000, 9_000),             # the barrier at init
            rec("AllReduce", 1, 4096, 200, 10_000, 30_000),
            rec("AllReduce", 2, 1 << 20, 300, 40_000, 800_000),
            rec("Broadcast", 0, 4096, 400, 900_000, 920_000)]
    recs += [rec(op, i, 2048, 500 + i, 1_000_000 + i, 1_030_000, kind="p2p")
             for op in ("Send", "Recv") for i in range(2)]
    recs.append({"event": "finalize", "comm": "0x00000000000000aa", "rank": "0", "pending": "0", "pid": str(PID)})
    return calls, recs


def verdict_a(calls, recs, nccl=(2, 28, 9)):
    return checks.check_correctness([{"label": "2 ranks", "calls": calls, "records": recs, "control": False,
                                      "results": [{"rank": 0, "world": 2, "pid": PID, "nccl_version": list(nccl)}]}])


def test_correctness_passes_and_names_the_framework_barrier():
    v = verdict_a(*good_rank())
    assert v.status == "PASS", v.text()
    assert "framework calls: AllReduce 4 B seq 0 x1" in v.text() and "interface v5" in v.text()
    assert "4 calls matched" in v.text()


def mutate(fn):
    calls, recs = good_rank()
    fn(calls, recs)
    return verdict_a(calls, recs)


@pytest.mark.parametrize("name,fn,says", [
    ("record missing", lambda c, r: r.pop(4), "Broadcast: 1 calls, 0 Coll records (1 missing)"),
    ("seq twice", lambda c, r: r[3].update(seq="1"), "AllReduce on 0x00000000000000aa: seq [0, 1, 1]"),
    ("bytes differ", lambda c, r: r[2].update(bytes="8192"), "AllReduce: call of 4096 B has a record of 8192 B"),
    ("GPU longer than the events", lambda c, r: c[0].update(elapsed_ns=10_000), "GPU 20.0 us > events 10.0 us"),
    ("GPU under half from 1 MB", lambda c, r: c[1].update(elapsed_ns=2_000_000), "< half the events'"),
    ("implausible interval", lambda c, r: r[2].update(flags="0x80"), "1 intervals judged implausible"),
    ("abandoned", lambda c, r: r.append(rec("AllReduce", 3, 4096, 900, 0, 0, event="abandoned", flags="0x24")),
     "1 abandoned records"),
    ("P2p record missing", lambda c, r: r.pop(5), "P2p: 4 records expected, 3 found"),
    ("wrong result", lambda c, r: c[2].update(ok=False), "1 calls gave wrong results"),
    ("wrong interface", lambda c, r: r[0].update(iface="v4"), "NCCL 2.28.9 chose ['v4'], docs/plugin.md says v5"),
    ("no plugin", lambda c, r: r.clear(), "no communicator init in the plugin's log"),
    ("KernelPhase asked for", lambda c, r: r[0].update(mask="0x8046"),
     "activation mask has KernelPhase events: 0x8046"),
])
def test_correctness_fails_on_each_defect(name, fn, says):
    v = mutate(fn)
    assert v.status == "FAIL" and says in v.text(), (name, v.text())


def test_control_and_a_failed_rank():
    calls, _ = good_rank()
    run = {"label": "2 ranks (control, no plugin)", "calls": calls, "records": [], "control": True, "planned": 4,
           "results": [{"rank": 0, "world": 2, "pid": 1}, {"rank": 1, "error": "DistBackendError: boom"}]}
    v = checks.check_correctness([run])
    assert v.status == "FAIL" and "control rank 0: PASS" in v.text() and "DistBackendError: boom" in v.text()
    run["planned"] = 5
    assert "4 calls made, 5 planned" in checks.check_correctness([run]).text()


def test_parse_plugin_log_reads_the_documented_line():
    line = ("nccl-exporter-profiler event=done kind=coll op=AllReduce opcode=1 comm=0x1111222233334444 rank=2 "
            "nranks=4 seq=0 peer=-1 count=1024 bytes=4096 dtype=7 enqueue_mono_ns=490900119225 "
            "gpu_start_timer=1700000490900132380 gpu_stop_timer=1700000490900232380 gpu_ns=100000 flags=0x0 "
            "iface=v7 id=1 pid=8724")
    [r] = checks.parse_plugin_log("NCCL INFO something\n" + line + "\n")
    assert r["op"] == "AllReduce" and checks.gpu_ns(r) == 100_000 and r["pid"] == "8724"
    assert checks.parse_jsonl('{"a": 1}\nnot json\n{"b": \n') == [{"a": 1}]


# --- part d ------------------------------------------------------------------------

def fault_records(abandoned=1, finalized=True):
    recs = [{"event": "init", "comm": "0xa", "pid": "7", "rank": "0"}]
    recs += [{"event": "abandoned", "comm": "0xa", "pid": "7", "flags": "0x24"} for _ in range(abandoned)]
    if finalized:
        recs.append({"event": "finalize", "comm": "0xa", "pid": "7", "rank": "0", "pending": str(abandoned)})
    return recs


def survivor(outcome="DistBackendError", t=3.0, rc=0):
    return [{"rank": 0, "outcome": outcome, "t_error_s": t, "rc": rc}]


@pytest.mark.parametrize("plugin,control,recs,status,says", [
    (survivor(), survivor(t=2.5), fault_records(), "PASS", "time to error 3.0 s with plugin, 2.5 s without"),
    (survivor(t=40.0), survivor(t=30.0), fault_records(), "FAIL", "time to error 40.0 s vs 30.0 s"),
    (survivor(t=35.0), survivor(t=30.0), fault_records(), "PASS", "tolerance 6.0 s"),
    (survivor("RuntimeError"), survivor(), fault_records(), "FAIL", "outcome differs"),
    (survivor("hung", rc="hung"), survivor(), fault_records(), "FAIL", "rank 0 (plugin): hung rc=hung"),
    (survivor("crashed", rc=-6), survivor(), fault_records(), "FAIL", "crashed rc=-6"),
    (survivor(), survivor(), fault_records(abandoned=0), "FAIL", "no abandoned record"),
    (survivor(), survivor(), fault_records(finalized=False), "FAIL", "never finalized"),
])
def test_fault_verdicts(plugin, control, recs, status, says):
    v = checks.check_faults(plugin, control, recs)
    assert v.status == status and says in v.text(), v.text()


# --- part c ------------------------------------------------------------------------

def graph_inputs(n_records, flags="0x0"):
    res = {"pid": 9, "replays": 50, "captured": {"AllReduce": 1 << 20}, "replay_elapsed_ns": [400_000] * 50}
    recs = [{"event": "done", "op": "AllReduce", "bytes": str(1 << 20), "seq": str(5 + i), "pid": "9",
             "gpu_start_timer": "1000", "gpu_stop_timer": "301000", "flags": flags} for i in range(n_records)]
    return res, recs


@pytest.mark.parametrize("n,flags,status,says", [
    (50, "0x0", "PASS", "50 records for 50 replays; seq [5, 6, 7, 8, 9]... (50 distinct)"),
    (51, "0x0", "PASS", "51 records for 50 replays"),
    (1, "0x0", "FAIL", "1 GPU records for 50 replays"),
    (50, "0x100", "FAIL", "50 replayed intervals judged implausible"),
])
def test_graph_verdicts(n, flags, status, says):
    v = checks.check_graphs(*graph_inputs(n, flags))
    assert v.status == status and says in v.text(), v.text()


def test_graph_interval_longer_than_any_replay_fails():
    res, recs = graph_inputs(50)
    res["replay_elapsed_ns"] = [100_000] * 50
    assert "longer than any replay" in checks.check_graphs(res, recs).text()


# --- parts e, b and the run's line ---------------------------------------------------

def _waits(rank, peer, direction, seq, **wall):
    phases = {"send": ("send_gpu_wait", "send_peer_wait", "send_wait"),
              "recv": ("recv_wait", "recv_flush_wait", "recv_gpu_wait")}[direction]
    w = {"event": "peer_wait", "op": "AllReduce", "comm": "0x00000000000000aa", "rank": str(rank), "seq": str(seq),
         "id": str(100 * rank + seq), "peer": str(peer), "direction": direction, "bytes": "1048576", "pid": str(PID)}
    for ph in phases:
        w[f"{ph}_wall_ns"] = w[f"{ph}_step_ns"] = str(wall.get(ph, 100_000))
    return w


def straggler_log(late_gpu_ms: float = 0.0, slow_net_ms: float = 0.0) -> list[dict]:
    """A 2-rank ring's plugin log, 10 AllReduces of 20 ms GPU time: rank 1's GPU late, or its
    link to rank 0 slow."""
    out = []
    for seq in range(10):
        for rank in (0, 1):
            r = rec("AllReduce", seq, 1 << 20, 1_000 + seq, 2_000 + seq, 20_002_000 + seq)
            r.update(rank=str(rank), id=str(100 * rank + seq), gpu_ns="20000000", gpu_start_mono_ns=str(5_000 + seq))
            out.append(r)
        late = late_gpu_ms + slow_net_ms
        out += [_waits(0, 1, "recv", seq, recv_wait=int((1 + late) * 1e6)),
                _waits(1, 0, "recv", seq, recv_wait=1_000_000),
                _waits(1, 0, "send", seq, send_gpu_wait=int(late_gpu_ms * 1e6) or 100_000,
                       send_wait=int(slow_net_ms * 1e6) or 500_000),
                _waits(0, 1, "send", seq, send_wait=500_000)]
    return out


@pytest.mark.parametrize("late_gpu_ms, slow_net_ms, status, says", [
    (8.0, 0.0, "PASS", "named: rank 0 \u2190 rank 1"),
    (0.0, 0.0, "FAIL", "no verdict, not a GPU straggler at rank 1"),
    (0.0, 8.0, "FAIL", "the analysis says slow link 1 \u2192 0"),
])
def test_straggler_verdicts(late_gpu_ms, slow_net_ms, status, says):
    from bench.gpu import straggler

    v = straggler.check(straggler_log(late_gpu_ms, slow_net_ms), 1, 2, "8.0 ms")
    assert v.status == status and says in v.lines[0], v.text()
    assert v.lines[0].startswith("rank 1 of 2 busy 8.0 ms on its GPU before each AllReduce: 10 operations"), v.text()
    assert len(v.lines) == 3, "each link's figures"
    assert straggler.check([], 1, 2, "?").status == "FAIL"


def test_cost_summary_ratios_against_none():
    lines = checks.summarize_cost({"none": [0.010, 0.012], "plugin": [0.0101, 0.0126]})
    assert lines[0].startswith("none       11.000 ms/iteration (runs 10.000, 12.000)")
    assert "/ none 1.0300 (+3.00 %)" in lines[1]


def test_agent_env_names_every_blocker():
    v = checks.check_agent_env({"kernel": "4.4.0", "uprobe": "no tracefs with uprobe_events", "bpf_syscall": "ok",
                                "bcc": "python module bcc missing", "headers": "ok", "btf": False})
    assert v.status == "INFO"
    assert v.lines[0] == ("the agent cannot run here: uprobe: no tracefs with uprobe_events; "
                          "bcc: python module bcc missing")
    assert "kernel 4.4.0, BTF no" in v.lines[1]
    v = checks.check_agent_env({"kernel": "6.8", "uprobe": "ok", "bpf_syscall": "ok", "bcc": "ok (carried .debs)",
                                "headers": "ok", "btf": True})
    assert v.lines[0] == "the agent could run here" and v.lines[1].endswith("BCC ok (carried .debs)")


def test_final_line_is_the_worst_part():
    ok, info, skip = Verdict("a", "PASS"), Verdict("e", "INFO"), Verdict("c", "SKIP")
    assert checks.final_line([ok, info]) == "bench/gpu verdict: PASS (a PASS, e INFO)"
    assert checks.final_line([ok, skip]).startswith("bench/gpu verdict: PARTIAL")
    assert checks.final_line([ok, Verdict("d", "TIMEOUT"), skip]).startswith("bench/gpu verdict: FAIL")
    assert checks.final_line([]).startswith("bench/gpu verdict: PARTIAL")
    w = checks.worst("a", [copy.copy(ok), Verdict("x", "FAIL", ["broke", "detail"])])
    assert w.status == "FAIL" and w.lines == ["a: PASS", "x: FAIL - broke", "  detail"]


@pytest.mark.slow  # runs the whole simulated bench/gpu script (~6 s): `make test`, not test-quick
def test_a_part_without_time_left_is_skipped_and_the_run_says_partial(tmp_path):
    p, verdicts = run_check(tmp_path, "--simulate", "--parts", "ab", "--budget-s", "1")
    assert p.returncode == 0
    lines = verdicts.splitlines()
    assert [l.split(" (")[0] for l in lines] == ["part a: SKIP - no time left", "part b: SKIP - no time left",
                                                 "bench/gpu verdict: PARTIAL"]
    assert lines[-1] == "bench/gpu verdict: PARTIAL (a SKIP, b SKIP)"


# --- part p (network time per peer) -----------------------------------------------------

@pytest.mark.slow  # runs the whole simulated bench/gpu script (~6 s): `make test`, not test-quick
def test_simulated_proxy_part_passes(tmp_path):
    """--proxy on the simulator, whose proxy thread sends ProxyOp/ProxyStep as
    NCCL's does: ring AllReduce bytes per direction and wall phases check out."""
    p, verdicts = run_check(tmp_path, "--simulate", "--proxy")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert verdicts.splitlines()[0].startswith("part p: PASS - 12 ring AllReduces of 4 ranks"), verdicts
    assert verdicts.splitlines()[-1] == "bench/gpu verdict: PASS (p PASS)"


def test_proxy_check_fails_without_events_and_on_wrong_bytes():
    from bench.gpu.checks import check_proxy

    done = {"event": "done", "op": "AllReduce", "nranks": "4", "pid": "1", "id": "9", "rank": "0", "seq": "3",
            "bytes": str(8 << 20), "enqueue_mono_ns": "1000", "gpu_stop_mono_ns": str(1000 + 5_000_000)}
    v = check_proxy([done], 4)
    assert v.status == "FAIL" and "no network figures" in v.lines[0]

    def wait(direction, nbytes, wall=1000):
        w = {"event": "peer_wait", "pid": "1", "id": "9", "peer": "1", "direction": direction, "bytes": str(nbytes)}
        w["send_wait_wall_ns" if direction == "send" else "recv_wait_wall_ns"] = str(wall)
        return w

    ring = 2 * 3 * (8 << 20) // 4
    assert check_proxy([done, wait("send", ring), wait("recv", ring)], 4).status == "PASS"
    v = check_proxy([done, wait("send", ring // 2), wait("recv", ring)], 4)
    assert v.status == "FAIL" and "send: " in v.lines[1]
    v = check_proxy([done, wait("send", ring), wait("recv", ring, wall=50_000_000)], 4)
    assert v.status == "FAIL" and "recv_wait_wall_ns" in v.lines[1]

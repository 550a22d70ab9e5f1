"""The fault-injection benchmark (bench/faults/, docs/benchmark.md): its
scoring on hand-made ground truth and answers, and its 2-fault set run for
real (agent, simulated job in network namespaces, Prometheus with the shipped
alerts): the harness writes the truth before the answers, the scores are what
the files say, and nothing is left behind. Not the timings: those are
docs/benchmark.md's, measured by `make bench-faults`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.faults import score as scoring
from conftest import REPO


def truth(run, fault="straggler", culprit=None, onset=100.0, wait=60.0, healthy=False, cause="late_arrival"):
    return {"run": run, "fault": fault, "healthy": healthy, "cause": cause, "start": 0.0, "onset": onset,
            "wait_s": wait, "culprit": culprit if culprit is not None or healthy else {"rank": 2}}


def det(run, t, culprit, detector="prometheus", cause="late_arrival"):
    return {"run": run, "detector": detector, "t": t, "culprit": culprit, "cause": cause, "what": "x"}


def test_first_right_naming_median_p90_and_misses():
    truths = [truth(f"r{i}") for i in range(11)]
    # runs 0..9 named rank 2 after 10, 20, ..., 100 s; run 10 never (a miss); run 9's 100 s is past its 60 s wait
    dets = [det(f"r{i}", 100.0 + 10 * (i + 1), {"rank": 2}) for i in range(10)]
    cell = scoring.score(truths, dets, ["prometheus"])["faults"]["straggler"]["prometheus"]
    assert cell["runs"] == 11 and cell["detected"] == 6      # 10..60 s within the wait
    assert cell["median_s"] == 35.0 and cell["p90_s"] == 55.0
    assert cell["precision"] == 1.0 and cell["cause_right"] == 6


def test_wrong_culprit_lowers_precision_and_an_early_naming_is_a_false_alarm():
    truths = [truth("a"), truth("h", fault="healthy_jitter", healthy=True, culprit=None, cause=None)]
    dets = [det("a", 50.0, {"rank": 1}),                 # before the onset: a healthy job alarmed
            det("a", 110.0, {"rank": 3}),                # wrong rank
            det("a", 120.0, {"rank": 2}, cause="other"),  # right rank, wrong cause
            det("a", 125.0, {"rank": 2}),                # again, with the cause: counted once, the cause from it
            det("h", 30.0, {"rank": 0}), det("h", 40.0, {"rank": 0})]
    r = scoring.score(truths, dets, ["prometheus", "hang"])
    cell = r["faults"]["straggler"]["prometheus"]
    assert (cell["detected"], cell["median_s"], cell["precision"], cell["cause_right"]) == (1, 20.0, 0.5, 1)
    assert cell["cause_median_s"] == 25.0
    assert r["faults"]["straggler"]["hang"]["detected"] == 0
    healthy = r["healthy"]["prometheus"]
    # healthy time: run a's 100 s before its onset + run h's 160 s
    assert healthy["false_alarms"] == 2 and healthy["hours"] == round(260 / 3600, 3)
    assert r["healthy"]["hang"]["false_alarms"] == 0
    # all faults together: the right rank (once, however often named) and the wrong one
    assert r["namings"]["prometheus"] == {"right": 1, "wrong": 1, "precision": 0.5}
    assert r["namings"]["hang"] == {"right": 0, "wrong": 0, "precision": None}


def test_a_run_counts_once_for_the_cause_and_twice_for_precision():
    """Two right namings of one link (its ends, then the host's link): precision
    counts both, the run's detection and cause once."""
    t = truth("l", fault="lossy_link", culprit={"link": {"to": "198.18.0.2"}}, cause="lossy_link")
    dets = [det("l", 107.0, {"link": ["198.18.0.1", "198.18.0.2"]}, cause="lossy_link"),
            det("l", 150.0, {"link": ["198.18.0.2"]}, cause="lossy_link")]
    cell = scoring.score([t], dets, ["prometheus"])["faults"]["lossy_link"]["prometheus"]
    assert (cell["detected"], cell["median_s"], cell["precision"], cell["cause_right"]) == (1, 7.0, 1.0, 1)


def test_the_cause_may_come_after_the_culprit_named_with_a_symptom():
    """A starved rank is named late first (NcclRankLate), then with its cause
    (NcclRankCpuStarved): one right culprit, the cause right, timed apart."""
    t = truth("c", fault="cpu_starvation", culprit={"rank": 1}, cause="cpu_starvation")
    dets = [det("c", 110.0, {"rank": 1}, cause="late_arrival"),
            det("c", 114.0, {"rank": 1}, cause="cpu_starvation"),
            det("c", 300.0, {"rank": 1}, cause="cpu_starvation")]   # after the wait: not counted
    cell = scoring.score([t], dets)["faults"]["cpu_starvation"]["prometheus"]
    assert (cell["detected"], cell["median_s"], cell["precision"]) == (1, 10.0, 1.0)
    assert (cell["cause_right"], cell["cause_median_s"]) == (1, 14.0)
    cell = scoring.score([t], dets[:1])["faults"]["cpu_starvation"]["prometheus"]
    assert (cell["cause_right"], cell["cause_median_s"]) == (0, None)


def test_link_culprit_is_named_by_its_receiving_end():
    t = truth("l", fault="lossy_link", culprit={"link": {"to": "198.18.0.3"}}, cause="lossy_link")
    assert scoring.names_culprit(t, {"link": ["198.18.0.1", "198.18.0.3"]})
    assert not scoring.names_culprit(t, {"link": ["198.18.0.1", "198.18.0.2"]})
    assert not scoring.names_culprit(t, {"rank": 2})


def test_directed_link_culprit_needs_both_ends_in_order():
    """A slow link between two ranks: only that link, sender first, is right; the link the other way,
    another link into the receiver, or the receiver's host alone are not."""
    t = truth("s", fault="gpu_slow_link", culprit={"link": {"from": "198.18.0.2", "to": "198.18.0.3"}},
              cause="slow_link")
    assert scoring.names_culprit(t, {"link": ["198.18.0.2", "198.18.0.3"]})
    assert not scoring.names_culprit(t, {"link": ["198.18.0.3", "198.18.0.2"]})
    assert not scoring.names_culprit(t, {"link": ["198.18.0.1", "198.18.0.3"]})
    assert not scoring.names_culprit(t, {"link": ["198.18.0.3"]})
    assert not scoring.names_culprit(t, {"rank": 3})


def _detectors(alerts=(), verdict=None):
    """The harness's Detectors on a 4-rank job (comm abcdef0123…, rank r at 198.18.0.(r+1)), its
    Prometheus answering `alerts` and its explain `verdict`; returns (detectors, the lines written)."""
    import io
    from types import SimpleNamespace

    from bench.faults.run import Detectors

    out = io.StringIO()
    prom = SimpleNamespace(firing=lambda started: list(alerts))
    ranks_of = {("abcdef0123456789", str(r)): r for r in range(4)}
    ranks_of.update({("3b15efef2b1e58cf", "0"): 1, ("3b15efef2b1e58cf", "1"): 3})   # a 2-rank communicator
    d = Detectors(out, None, prom, ranks_of,
                  {f"198.18.0.{r + 1}": r for r in range(4)}, "r1", started=0.0)
    if verdict is not None:
        d._cli = lambda *a: subprocess.CompletedProcess(a, 0, json.dumps({"verdict": verdict}), "")
        d.agent = SimpleNamespace(query="http://x", token="t")
    return d, out


def test_harness_maps_link_alerts_and_explains_network_verdicts_to_culprits():
    """NcclLinkSlow's (comm, rank, peer) is the link peer -> rank; explain's GPU-straggler and slow-link
    verdicts (their real wording: analysis/network.verdict_line) name the sender rank and the link."""
    from exporter.offline.analysis import network

    d, out = _detectors(alerts=[{"alertname": "NcclLinkSlow", "comm": "abcdef0123456789", "rank": "3",
                                 "peer": "2", "cause": "slow_link"}])
    d._prometheus()
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert line["culprit"] == {"link": ["198.18.0.3", "198.18.0.4"]} and line["cause"] == "slow_link", line
    for verdict, culprit, cause in ((network.GPU_STRAGGLER, {"rank": 1}, "gpu_straggler"),
                                    (network.SLOW_LINK, {"link": ["198.18.0.2", "198.18.0.3"]}, "slow_link")):
        lk = network.Link("abcdef0123456789", "abcdef0123456789", sender=1, receiver=2, recv={"recv_wait": 9},
                          send={"send_wait": 9}, recv_x=5.0, send_x=5.0, gpu_x=5.0, verdict=verdict,
                          sender_at=("n1", 11))
        d, out = _detectors(verdict=network.verdict_line(lk))
        d.started = 0.0
        d._explain()
        (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
        assert line["culprit"] == culprit and line["cause"] == cause, (line, network.verdict_line(lk))
    # "rank N on NODE" is the process's (launcher's) rank, even where the verdict quotes a smaller
    # communicator, in which N is another process
    d, out = _detectors(verdict="straggler: rank 1 on bench arrives late (median lag 2.5 ms, last in 100 % of "
                                "ALL_REDUCE on comm 3b15efef\u2026) with no retransmits to explain it")
    d._explain()
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert line["culprit"] == {"rank": 1} and line["cause"] == "late_arrival", line


def test_the_full_set_in_parts_adds_up_to_the_whole_plan():
    from bench.faults.run import SETS, plan_part, main

    names, repeat = SETS["full"]
    _, whole = plan_part(names, repeat, seed=5)
    assert sorted(whole) == sorted(names * repeat) and whole != names * repeat  # shuffled
    got = []
    for k in (1, 2, 3):
        first, runs = plan_part(names, repeat, 5, k, 3)
        assert first == len(got)
        got += runs
    assert got == whole
    assert main(["--set", "full", "--part", "3/2"]) == 2 and main(["--part", "x"]) == 2


def test_score_cli_table_and_bad_input(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps(truth("a")) + "\n")
    (tmp_path / "d.jsonl").write_text(json.dumps(det("a", 112.0, {"rank": 2})) + "\n")
    p = subprocess.run([sys.executable, "-m", "bench.faults.score", tmp_path / "t.jsonl", tmp_path / "d.jsonl"],
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "| straggler | prometheus | 1 | 1 | 12.0 | 12.0 | 1.0 | 1 | 12.0 |" in p.stdout
    assert "| prometheus | 1 | 1 | 1.0 | 0.028 | 0 | 0.0 |" in p.stdout
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    p = subprocess.run([sys.executable, "-m", "bench.faults.score", tmp_path / "bad.jsonl", tmp_path / "d.jsonl"],
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "bad.jsonl:1: not JSON" in p.stderr, p.stderr


def test_score_refuses_parts_from_different_commits(tmp_path):
    """Two parts of one set whose detectors ran from different code are not one result."""
    files = []
    for i, commit in enumerate(["aaaa", "bbbb"]):
        (tmp_path / f"t{i}.jsonl").write_text(json.dumps(dict(truth("a"), commit=commit)) + "\n")
        (tmp_path / f"d{i}.jsonl").write_text(json.dumps(det("a", 112.0, {"rank": 2})) + "\n")
        files += [tmp_path / f"t{i}.jsonl", tmp_path / f"d{i}.jsonl"]
    cmd = [sys.executable, "-m", "bench.faults.score", *files]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "aaaa, bbbb" in p.stderr, p.stderr
    p = subprocess.run(cmd + ["--mixed-commits", "--format", "json"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0 and json.loads(p.stdout)["commits"] == ["aaaa", "bbbb"], p.stderr


# --- the harness, for real ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("bpf", "netns", "prometheus")
@pytest.mark.skipif(not os.access("/usr/bin/prometheus", os.X_OK), reason="prometheus not installed (make deps)")
def test_two_fault_set_writes_truth_first_scores_it_and_cleans_up(tmp_path):
    from exporter.simulator.cluster import _netns_list

    before = set(_netns_list())
    p = subprocess.run([sys.executable, "-m", "bench.faults.run", "--set", "suite", "--out", tmp_path, "--seed", "7"],
                       capture_output=True, text=True, cwd=REPO, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    truths = scoring.read_jsonl(tmp_path / "truth.jsonl")
    dets = scoring.read_jsonl(tmp_path / "detections.jsonl")
    result_commit = json.loads((tmp_path / "result.json").read_text())["commit"]
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=REPO)
    assert result_commit.startswith(head.stdout.strip() or "unknown"), result_commit
    assert sorted(t["fault"] for t in truths) == ["stopped_between", "straggler"]
    for t in truths:
        assert t["start"] < t["onset"] and t["culprit"]["rank"] in range(4) and t["wait_s"] > 0
        assert t["commit"] == result_commit, t   # which code the detectors ran from
    # the truth of a run is on disk before any answer about it after its onset
    for d in dets:
        t = next(t for t in truths if t["run"] == d["run"])
        assert t["start"] <= d["t"] <= t["onset"] + t["wait_s"] + 15, d
        assert set(d["culprit"]) <= {"rank", "link"} and d["detector"] in ("prometheus", "hang", "explain"), d
    # every alert that named a culprit is in its run's alert timeline, firing by the time it was seen
    spans = scoring.read_jsonl(tmp_path / "alerts.jsonl")
    for d in dets:
        if d["detector"] == "prometheus":
            t = next(t for t in truths if t["run"] == d["run"])
            assert any(s["run"] == d["run"] and s["alert"] == d["what"] and s["state"] == "firing"
                       and s["from_s"] <= d["t"] - t["onset"] + 1 for s in spans), (d, spans)
    # each run's culprit figures: every rank's time in call, through the run, on its own communicators
    figures = scoring.read_jsonl(tmp_path / "figures.jsonl")
    for t in truths:
        mine = [f for f in figures
                if f["run"] == t["run"] and f["series"] == "nccl:collective_time_seconds:median3_mean5s"]
        assert {f["labels"]["rank"] for f in mine} >= {"0", "1", "2", "3"}, (t["run"], mine)
        assert all(len(f["t_s"]) == len(f["v"]) > 0 for f in mine), mine
        # within the run, in seconds from its onset (the suite's 5-10 s warm-up may hold none before it)
        assert all(t["start"] - t["onset"] - 1 <= x <= t["wait_s"] + 15 for f in mine for x in f["t_s"]), mine
    result = json.loads((tmp_path / "result.json").read_text())
    rescored = scoring.score(truths, dets, ["prometheus", "hang", "explain"])
    assert result["faults"] == rescored["faults"] and result["healthy"] == rescored["healthy"]
    assert "| fault | detector |" in p.stdout
    assert result["runs"] == 2 and set(result["faults"]) == {"stopped_between", "straggler"}
    assert set(_netns_list()) <= before, "network namespaces left behind"
    for pid in result["processes"]:   # the agent (each start) and Prometheus
        assert not os.path.exists(f"/proc/{pid}"), f"process {pid} left running"

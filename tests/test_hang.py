"""Which rank never joined: `nccl-exporter hang`, MCP hang_status and the
NcclRankMissing alert on a real hang.

A 4-rank simulated job (one rank per network namespace) makes two AllReduces;
then rank 0 stops before its third while ranks 1-3 enter it. Real agents
(real uprobes) serve /metrics, a real Prometheus scrapes them with a copy of
alerts/nccl.yml whose hang threshold is 3 s instead of 300 s (and `for:`
divided by 20, as tests/test_e2e_prometheus.py does), and:

- `nccl-exporter hang` names rank 0, its last AllReduce (#1) and its process;
- MCP hang_status gives the same verdict;
- NcclRankMissing fires in Prometheus for rank 0 only.

Once with one agent for the whole job, once as two nodes: ranks 0-1 load one
copy of the library and ranks 2-3 another, each copy probed by its own agent
(a uprobe belongs to the file), so each agent sees only its node's ranks, and
`hang` is given both agents' --metrics (and, with only the second node's, it
still names rank 0 but says its process is not seen).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path

import pytest

from conftest import ExporterProcess, free_port, run_cli
from exporter.records import metrics
from exporter.offline import mcp_server
from tests.test_dashboards import dashboard_queries
from tests.test_e2e_prometheus import PROMETHEUS, http_json, short_rules, stop, wait_ready

REPO = Path(__file__).resolve().parent.parent
HANG_AFTER = 2            # AllReduces every rank completes; rank 0 stops before the next
THRESHOLD_S = 3           # the tests' hang threshold (production: 300 s alerts, 60 s `hang`)

# markers, root and the heavy lock come from the fixtures (tests/conftest.py)
e2e = [pytest.mark.usefixtures("bpf", "netns", "prometheus"),
       pytest.mark.skipif(not os.access(PROMETHEUS, os.X_OK), reason="prometheus not installed (make deps)")]


def rules_with_short_hang(text: str) -> str:
    """alerts/nccl.yml with short windows and the 5-minute hang threshold at THRESHOLD_S."""
    text = short_rules(text)
    assert text.count("(nccl_inflight_oldest_seconds) > 300") >= 2
    return text.replace("(nccl_inflight_oldest_seconds) > 300", f"(nccl_inflight_oldest_seconds) > {THRESHOLD_S}")


class Prometheus:
    def __init__(self, work: Path, targets: list[int]):
        rules = work / "rules"
        rules.mkdir()
        (rules / "nccl.yml").write_text(rules_with_short_hang((REPO / "alerts" / "nccl.yml").read_text()))
        self.port = free_port()
        (work / "prometheus.yml").write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(rules / "*.yml")],
            "scrape_configs": [{"job_name": "nccl-exporter",
                                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in targets]}]}],
        }))
        self.log = work / "prometheus.log"
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_ready(f"http://127.0.0.1:{self.port}/-/ready", self.proc, self.log)
        self.api = f"http://127.0.0.1:{self.port}/api/v1"

    def firing(self, name: str) -> list[dict]:
        return [a["labels"] for a in http_json(f"{self.api}/alerts")["data"]["alerts"]
                if a["labels"].get("alertname") == name and a["state"] == "firing"]

    def query(self, expr: str) -> list[dict]:
        return http_json(f"{self.api}/query?" + urllib.parse.urlencode({"query": expr}))["data"]["result"]


def hang_scenario(two_nodes: bool):
    """Runs the scenario; yields (agents, job, prometheus, world comm) while the job hangs."""
    from exporter.simulator.build import build_library
    from exporter.simulator.cluster import Cluster, cleanup_stale, start_job

    work = Path(tempfile.mkdtemp(prefix="nccl-hang-"))
    cleanup_stale()
    # Private copies of the simulated library: only this test's job is traced.
    lib_a = build_library(work / "lib-a")
    lib_b = work / "lib-b" / lib_a.name
    lib_b.parent.mkdir()
    shutil.copy2(lib_a, lib_b)
    agents: list[ExporterProcess] = []
    prom = None
    try:
        if two_nodes:
            agents.append(ExporterProcess(nccl_libs=[lib_a], node="node-a", startup_timeout=180).__enter__())
            agents.append(ExporterProcess(nccl_libs=[lib_b], node="node-b", startup_timeout=180).__enter__())
            libs = {0: lib_a, 1: lib_a, 2: lib_b, 3: lib_b}
        else:
            agents.append(ExporterProcess(nccl_libs=[lib_a], node="node-a", startup_timeout=180).__enter__())
            libs = {i: lib_a for i in range(4)}
        prom = Prometheus(work, [a.port for a in agents])
        with Cluster(4) as cluster:
            job = start_job(cluster, libs, "hang", iterations=1, rendezvous_dir=work / "rdv",
                            truth_dir=work / "truth", count=16, extra_args=["--hang-after", str(HANG_AFTER)])
            try:
                # Ranks 1-3 inside their third AllReduce for longer than the threshold.
                deadline = time.monotonic() + 90
                waiting = []
                while time.monotonic() < deadline:
                    assert all(rc is None for rc in job.poll()), job.result().summary()
                    waiting = [s for a in agents for s in a.samples(a.scrape(), metrics.INFLIGHT_OLDEST)
                               if s.labels["op"] == "ALL_REDUCE" and s.value > THRESHOLD_S + 1]
                    if len(waiting) == 3:
                        break
                    time.sleep(0.5)
                assert sorted(s.labels["rank"] for s in waiting) == ["1", "2", "3"], waiting
                info = [s.labels for a in agents for s in a.samples(a.scrape(), metrics.COMMUNICATOR_INFO)]
                (world,) = {i["comm"] for i in info if i["nranks"] == "4"}
                yield agents, job, prom, world
            finally:
                job.kill()
    finally:
        stop(prom.proc if prom else None)
        for a in agents:
            a.__exit__(None, None, None)
        shutil.rmtree(work, ignore_errors=True)


def check_verdict(verdict: str, evidence: list[str], world: str, pid0: int, node0: str) -> None:
    assert verdict.startswith(f"comm {world[:8]}… (4 ranks): ranks 1–3 waiting in AllReduce #{HANG_AFTER} for "), \
        verdict
    assert f"; rank 0 on {node0} never entered it: its last AllReduce #{HANG_AFTER - 1} returned " in verdict, \
        verdict
    assert 3 <= len(evidence) <= 5, evidence
    text = "\n".join(evidence)
    assert f"rank 0 (pid {pid0} on {node0}): last call on this communicator AllReduce #{HANG_AFTER - 1}" in text
    assert "process alive" in text
    # Rank 0 sleeps (time.sleep) outside NCCL: its calling thread is off-CPU.
    assert "asleep or blocked outside NCCL" in text, text


def check_alert(prom: Prometheus, world: str, node0: str) -> None:
    deadline = time.monotonic() + 60
    got = []
    while time.monotonic() < deadline and not got:
        got = prom.firing("NcclRankMissing")
        time.sleep(1)
    assert [(a["comm"], a.get("op"), a["rank"], a["node"]) for a in got] == \
        [(world, "ALL_REDUCE", "0", node0)], got
    # The dashboard's panel names it too (its 60 s threshold at the test's).
    (panel,) = [(e) for dash, title, ref, e in dashboard_queries()
                if title.startswith("Hang: ranks missing") and ref == "A"]
    got = prom.query(panel.replace("> 60", f"> {THRESHOLD_S}"))
    assert [(g["metric"]["comm"], g["metric"]["rank"], g["value"][1]) for g in got] == \
        [(world, "0", str(HANG_AFTER - 1))], got
    # Rank 0's last AllReduce; its peers wait in the next.
    (v,) = prom.query(f'nccl_collective_last_seq{{comm="{world}",op="ALL_REDUCE",rank="0"}}')
    assert v["value"][1] == str(HANG_AFTER - 1)


@e2e[0]
@e2e[1]
def test_hang_names_the_rank_that_never_joined():
    for agents, job, prom, world in hang_scenario(two_nodes=False):
        url = agents[0].url
        r = run_cli("hang", "--threshold", f"{THRESHOLD_S}s", "--metrics", url)
        assert r.returncode == 1, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        check_verdict(lines[0], [line.removeprefix("  - ") for line in lines[1:]], world, job.pids[0], "node-a")

        out = mcp_server.hang_status(url, THRESHOLD_S)
        assert out["hung"] is True
        check_verdict(out["verdict"], out["evidence"], world, job.pids[0], "node-a")
        (h,) = [h for h in out["hangs"] if h["comm"] == world]
        assert (h["op"], h["seq"], h["waiting_ranks"]) == ("ALL_REDUCE", HANG_AFTER, [1, 2, 3])
        assert [m["rank"] for m in h["missing"]] == [0]

        # Below the hang threshold: not hung, exit 0.
        r = run_cli("hang", "--threshold", "10m", "--metrics", url)
        assert r.returncode == 0 and r.stdout.startswith("not hung: the oldest NCCL call in flight is"), r.stdout
        check_alert(prom, world, "node-a")


@e2e[0]
@e2e[1]
def test_hang_across_two_nodes():
    for agents, job, prom, world in hang_scenario(two_nodes=True):
        a, b = agents
        # Each agent sees only its node's ranks.
        assert {s.labels["rank"] for s in a.samples(a.scrape(), metrics.COMMUNICATOR_INFO)} == {"0", "1"}
        assert {s.labels["rank"] for s in b.samples(b.scrape(), metrics.COMMUNICATOR_INFO)} == {"2", "3"}
        r = run_cli("hang", "--threshold", f"{THRESHOLD_S}s", "--metrics", a.url, "--metrics", b.url)
        assert r.returncode == 1, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        check_verdict(lines[0], [line.removeprefix("  - ") for line in lines[1:]], world, job.pids[0], "node-a")
        assert "2 on node-b" in r.stdout and "1 on node-a" in r.stdout

        out = mcp_server.hang_status([a.url, b.url], THRESHOLD_S)
        check_verdict(out["verdict"], out["evidence"], world, job.pids[0], "node-a")

        # Only node-b's agent: the hang is found, and ranks 0 and 1 (the
        # communicator has 4) are said to be unseen, not blamed.
        r = run_cli("hang", "--threshold", f"{THRESHOLD_S}s", "--metrics", b.url)
        assert r.returncode == 1
        assert "ranks 2, 3 waiting in AllReduce #2" in r.stdout, r.stdout
        assert "ranks 0, 1 not seen by the agents read" in r.stdout and "never entered" not in r.stdout
        check_alert(prom, world, "node-a")


def test_hang_bad_input_is_one_line():
    r = run_cli("hang", "--metrics", "file:///etc/passwd")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "http(s) URL" in r.stderr
    port = free_port()
    r = run_cli("hang", "--metrics", f"http://127.0.0.1:{port}/metrics")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no agent answered" in r.stderr
    r = run_cli("hang", "--threshold", "soon")
    assert r.returncode == 2 and "not a duration" in r.stderr


# --- the verdict's logic, on pages as agents serve them -----------------------------------

def page_read(lines: list[str], at: float = 1000.0):
    from prometheus_client.parser import text_string_to_metric_families

    from exporter.offline.analysis import hang

    text = "".join(line + "\n" for line in lines)
    return hang.Read(at=at, samples=[(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
                                     for s in f.samples], answered=["page"])


def info(comm, rank, nranks, pid, node="n"):
    return (f'nccl_communicator_info{{node="{node}",comm="{comm}",nccl_comm_hash="",rank="{rank}",'
            f'nranks="{nranks}",pid="{pid}",launcher="",launcher_rank="",world_size=""}} 1')


def inflight(comm, op, rank, age, node="n"):
    return f'nccl_inflight_oldest_seconds{{node="{node}",op="{op}",comm="{comm}",rank="{rank}"}} {age}'


def last_seq(comm, op, rank, seq, node="n"):
    return f'nccl_collective_last_seq{{node="{node}",op="{op}",comm="{comm}",rank="{rank}"}} {seq}'


C = "4a3f00000000beef"


def test_desync_is_named():
    """Ranks 1-3 in AllReduce #8; rank 0 in Broadcast #3 of the same communicator."""
    from exporter.offline.analysis import hang

    lines = [info(C, r, 4, 100 + r) for r in range(4)]
    lines += [inflight(C, "ALL_REDUCE", r, 90) for r in (1, 2, 3)] + [inflight(C, "BROADCAST", 0, 88)]
    lines += [last_seq(C, "ALL_REDUCE", r, 7) for r in range(4)] + [last_seq(C, "BROADCAST", 0, 2)]
    a = hang.analyse(page_read(lines), None, 60)
    assert a.hung
    assert a.verdict == ("comm 4a3f0000… (4 ranks): ranks 1–3 waiting in AllReduce #8 for 90.0 s; "
                         "desync: rank 0 in Broadcast #3 instead (for 88.0 s)"), a.verdict
    assert a.as_dict()["hangs"][0]["desync"] == [{"rank": 0, "op": "BROADCAST", "seq": 3, "age_s": 88.0,
                                                  "bytes": None}]


def test_a_rank_stopped_a_seq_behind_is_stopped_not_desynchronized():
    """Rank 1 stopped (SIGSTOP) late in AllReduce #8: ranks 0, 2, 3 finished their part and
    wait in #9. The stopped rank is named stopped inside, never a desync."""
    from exporter.offline.analysis import hang

    lines = [info(C, r, 4, 100 + r) for r in range(4)]
    lines += [inflight(C, "ALL_REDUCE", r, 88 if r == 1 else 87) for r in range(4)]
    lines += [last_seq(C, "ALL_REDUCE", r, 7 if r == 1 else 8) for r in range(4)]
    lines += ['nccl_inflight_stopped_seconds{node="n",op="ALL_REDUCE",comm="%s",rank="1"} 88' % C]
    a = hang.analyse(page_read(lines), None, 60)
    h = a.as_dict()["hangs"][0]
    assert a.hung and h["desync"] == [] and [s["rank"] for s in h["stopped"]] == [1], a.verdict
    assert "desync" not in a.verdict and "rank 1 (n) stopped inside AllReduce #8:" in a.verdict, a.verdict


def inflight_bytes(comm, op, rank, size, node="n"):
    return f'nccl_inflight_bytes{{node="{node}",op="{op}",comm="{comm}",rank="{rank}"}} {size}'


def test_desync_by_count_is_named():
    """Every rank in AllReduce #8, rank 2 with twice the others' count: rank 2 is named desync,
    the others wait; the JSON carries both sizes."""
    from exporter.offline.analysis import hang

    lines = [info(C, r, 4, 100 + r) for r in range(4)]
    lines += [inflight(C, "ALL_REDUCE", r, 90 - r) for r in range(4)]
    lines += [inflight_bytes(C, "ALL_REDUCE", r, 8192 if r == 2 else 4096) for r in range(4)]
    lines += [last_seq(C, "ALL_REDUCE", r, 7) for r in range(4)]
    a = hang.analyse(page_read(lines), None, 60)
    assert a.hung
    assert a.verdict == ("comm 4a3f0000… (4 ranks): ranks 0, 1, 3 waiting in AllReduce #8 for 90.0 s; "
                         "desync: rank 2 in AllReduce #8 with another count (8192 bytes vs 4096; for 88.0 s)"), \
        a.verdict
    h = a.as_dict()["hangs"][0]
    assert h["waiting_ranks"] == [0, 1, 3] and h["bytes"] == 4096
    assert h["desync"] == [{"rank": 2, "op": "ALL_REDUCE", "seq": 8, "age_s": 88.0, "bytes": 8192}]


def test_same_count_everywhere_or_a_tie_names_no_desync():
    """One size on every rank: no desync. Two ranks with two sizes: no majority, no one named."""
    from exporter.offline.analysis import hang

    lines = [info(C, r, 4, 100 + r) for r in range(4)]
    lines += [inflight(C, "ALL_REDUCE", r, 90) for r in range(4)]
    lines += [inflight_bytes(C, "ALL_REDUCE", r, 4096) for r in range(4)]
    a = hang.analyse(page_read(lines), None, 60)
    assert a.hung and a.as_dict()["hangs"][0]["desync"] == []
    lines = [info(C, r, 2, 100 + r) for r in range(2)]
    lines += [inflight(C, "ALL_REDUCE", r, 90) for r in range(2)]
    lines += [inflight_bytes(C, "ALL_REDUCE", r, 4096 * (r + 1)) for r in range(2)]
    a = hang.analyse(page_read(lines), None, 60)
    assert a.hung and a.as_dict()["hangs"][0]["desync"] == []


def gpu_inflight(comm, op, rank, age, state="running", node="n"):
    return (f'nccl_gpu_inflight_oldest_seconds{{node="{node}",op="{op}",comm="{comm}",rank="{rank}",'
            f'state="{state}"}} {age}')


def test_a_rank_missing_from_a_hang_on_the_gpu_is_named():
    """On a GPU a call returns once enqueued: ranks 1-3 enqueued AllReduce #8
    (their last returned call) and it runs on their GPUs; nothing is in flight
    on any host. Rank 0 never enqueued it (its last is #7)."""
    from exporter.offline.analysis import hang

    lines = [info(C, r, 4, 100 + r) for r in range(4)]
    lines += [gpu_inflight(C, "ALL_REDUCE", r, 80) for r in (1, 2)] + [gpu_inflight(C, "ALL_REDUCE", 3, 79, "queued")]
    lines += [last_seq(C, "ALL_REDUCE", r, 8) for r in (1, 2, 3)] + [last_seq(C, "ALL_REDUCE", 0, 7)]
    a = hang.analyse(page_read(lines), None, 60)
    assert a.hung, a.verdict
    assert a.verdict.startswith("comm 4a3f0000… (4 ranks): ranks 1–3 waiting in AllReduce #8 on their GPUs "
                                "(the host calls returned at enqueue) for 80.0 s; rank 0 on n never entered it: "
                                "its last AllReduce #7"), a.verdict
    assert [m["rank"] for m in a.as_dict()["hangs"][0]["missing"]] == [0]
    assert {c["on"] for c in a.in_flight} == {"gpu"}
    # a rank in flight on its host and its GPU is counted once, as on the host
    lines += [inflight(C, "ALL_REDUCE", 1, 81), last_seq(C, "ALL_REDUCE", 1, 7)]
    a = hang.analyse(page_read(lines), None, 60)
    assert sorted((c["rank"], c["on"]) for c in a.in_flight) == [(1, "host"), (2, "gpu"), (3, "gpu")]


def test_every_rank_inside_and_not_completing():
    from exporter.offline.analysis import hang

    lines = [info(C, r, 2, 100 + r) for r in range(2)] + [inflight(C, "ALL_REDUCE", r, 70) for r in range(2)]
    a = hang.analyse(page_read(lines), None, 60)
    assert a.verdict.endswith("every rank entered it and it does not complete: a peer stuck inside NCCL or "
                              "a broken link (retransmits, resets)"), a.verdict


def test_below_threshold_and_nothing_in_flight():
    from exporter.offline.analysis import hang

    a = hang.analyse(page_read([inflight(C, "ALL_REDUCE", 0, 0.25)]), None, 60)
    assert not a.hung and a.verdict.startswith("not hung: the oldest NCCL call in flight is 0.250 s old")
    a = hang.analyse(page_read([info(C, 0, 2, 100)]), None, 60)
    assert not a.hung and "no NCCL call in flight" in a.verdict


def test_threads_state_from_two_reads():
    """The missing rank's caller thread was off-CPU the whole second: asleep outside NCCL."""
    from exporter.offline.analysis import hang

    base = [info(C, r, 2, 100 + r) for r in range(2)] + [inflight(C, "ALL_REDUCE", 1, 75)]
    base += [last_seq(C, "ALL_REDUCE", r, 4) for r in range(2)]

    def sched(off):
        return [f'nccl_offcpu_seconds_total{{node="n",rank="0",thread="caller"}} {off}',
                'nccl_runqueue_delay_seconds_sum{node="n",rank="0",thread="caller"} 0.5']

    a = hang.analyse(page_read(base + sched(10.0), at=1000.0), page_read(base + sched(11.0), at=1001.0), 60)
    assert "rank 0 on n never entered it: its last AllReduce #4" in a.verdict, a.verdict
    assert any("off-CPU 1.00 s of the last 1.0 s and waited 0 ms for a CPU" in e and "asleep" in e
               for e in a.evidence), a.evidence


def test_a_communicator_made_before_the_agent_says_what_cannot_be_told():
    from exporter.offline.analysis import hang

    a = hang.analyse(page_read([inflight("local-4711-1", "ALL_REDUCE", 1, 80)]), None, 60)
    assert a.hung and a.verdict.startswith("comm local-4711-1 (size unknown): rank 1 waiting in AllReduce "
                                           "for 80.0 s; which rank did not join cannot be told"), a.verdict


def test_a_rank_stopped_in_a_call_its_peer_returned_from_is_stopped():
    """(The fault benchmark's run r095.) Rank 1 of C (pid 101) is stopped inside AllReduce on its
    pair communicator P, as P's rank 0; its pair peer (pid 103) got its data, returned, and waits
    with ranks 0 and 2 in C's AllReduce #9, which pid 101 never joins. It is named stopped
    inside, on P; a pause of every rank (all stopped) names no one."""
    from exporter.offline.analysis import hang

    pair = "77aa00000000beef"
    stop = 'nccl_inflight_stopped_seconds{node="n",op="ALL_REDUCE",comm="%s",rank="%d"} %s'
    lines = [info(C, r, 4, 100 + r) for r in range(4)] + [info(pair, 0, 2, 101), info(pair, 1, 2, 103)]
    lines += [inflight(C, "ALL_REDUCE", r, 66) for r in (0, 2, 3)] + [inflight(pair, "ALL_REDUCE", 0, 67)]
    lines += [last_seq(C, "ALL_REDUCE", r, 8) for r in range(4)]
    lines += [last_seq(pair, "ALL_REDUCE", 0, 4), last_seq(pair, "ALL_REDUCE", 1, 5)]
    a = hang.analyse(page_read(lines + [stop % (pair, 0, 67)]), None, 60)
    named = {(h["comm"], s["rank"]) for h in a.as_dict()["hangs"] for s in h["stopped"]}
    assert named == {(pair, 0)}, a.verdict
    paused = lines + [stop % (pair, 0, 67)] + [stop % (C, r, 66) for r in (0, 2, 3)]
    assert not any(h["stopped"] for h in hang.analyse(page_read(paused), None, 60).as_dict()["hangs"])


def test_missing_rank_in_a_call_on_another_communicator():
    """The issue's 2:47 AM line: rank 0 never entered AllReduce #812; it is in Broadcast #96 elsewhere."""
    from exporter.offline.analysis import hang

    other = "9c1e00000000beef"
    lines = [info(C, r, 4, 100 + r) for r in range(4)] + [info(other, 0, 2, 100)]
    lines += [inflight(C, "ALL_REDUCE", r, 75.4) for r in (1, 2, 3)] + [inflight(other, "BROADCAST", 0, 70)]
    lines += [last_seq(C, "ALL_REDUCE", r, 811) for r in range(4)] + [last_seq(other, "BROADCAST", 0, 95)]
    lines.append(f'nccl_collective_last_return_timestamp_seconds{{node="n",op="ALL_REDUCE",comm="{C}",rank="0"}} '
                 f'{1000 - 15.6}')
    a = hang.analyse(page_read(lines, at=1000.0), None, 60)
    assert a.verdict == ("comm 4a3f0000… (4 ranks): ranks 1–3 waiting in AllReduce #812 for 75.4 s; rank 0 on n "
                         "never entered it: its last AllReduce #811 returned 15.6 s ago, it is now in Broadcast #96 "
                         "on comm 9c1e0000… (as rank 0, for 70.0 s)"), a.verdict
    assert 3 <= len(a.evidence) <= 5
    assert any(e.startswith("1 other communicator(s) with a call in flight >= 60 s: 9c1e0000…") for e in a.evidence)


def test_a_missing_rank_whose_process_exited():
    """Rank 0's calls were counted on node n, but n's agent lists no live communicator of it."""
    from exporter.offline.analysis import hang

    lines = [info(C, r, 2, 100 + r) for r in (1,)] + [inflight(C, "ALL_REDUCE", 1, 90)]
    lines += [last_seq(C, "ALL_REDUCE", r, 4) for r in range(2)]
    a = hang.analyse(page_read(lines), None, 60)
    assert "rank 0 on n never entered it: its last AllReduce #4 returned at an unknown time, its process is " \
           "gone" in a.verdict, a.verdict
    assert a.as_dict()["hangs"][0]["missing"][0]["alive"] is False

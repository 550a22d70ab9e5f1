"""A rank that dies and a rank stopped inside a collective, named.

- nccl_rank_exit_timestamp_seconds: the kernel records a traced process's
  exit and its code (bpf/nccl.c process_exits); the agent matches it to the
  communicators the process still held (exporter/sources/nccl/exits.py).
- nccl_inflight_stopped_seconds: the agent reads the state of the threads of
  calls in flight over 1 s (/proc/TID/stat T or t), and `hang` names the
  stopped rank rather than every rank in flight.

The e2e test runs a simulated job of 4 ranks with the real agent: rank 1 is
SIGSTOPped inside a collective (the benchmark's own injection,
bench/faults/faults.py), then rank 2 is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ExporterProcess, run_cli
from exporter.records import metrics
from exporter.sources.nccl.exits import ExitLog, signal_name
from exporter.sources.processes import thread_stopped
from tests.test_hang import C, info, inflight, page_read


# --- no root ---------------------------------------------------------------------------

def test_thread_stopped_reads_a_real_stopped_process():
    p = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.1)
        assert not thread_stopped(p.pid)
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not thread_stopped(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread_stopped(p.pid)
        os.kill(p.pid, signal.SIGCONT)
        time.sleep(0.1)
        assert not thread_stopped(p.pid)
    finally:
        p.kill()
        p.wait()
    assert not thread_stopped(p.pid)  # gone


def test_signal_names():
    assert (signal_name(9), signal_name(11), signal_name(0), signal_name(34)) == ("SIGKILL", "SIGSEGV", "",
                                                                                   "SIGRTMIN")


class _Table(dict):
    """A BCC hash table's surface: keys with .value."""


def test_exit_log_matches_communicators_and_expires():
    from collections import namedtuple

    key = namedtuple("Key", "value")
    table = _Table({key(77): SimpleNamespace(ktime_ns=5_000_000_000, code=9)})
    comms = [SimpleNamespace(pid=77, comm=0xAB, rank=2, nranks=4), SimpleNamespace(pid=78, comm=0xAB, rank=3,
                                                                                    nranks=4)]
    log = ExitLog()
    clock = SimpleNamespace(to_realtime=lambda ns: ns + 1_000_000_000_000_000_000)
    assert log.collect(table, comms, clock, now=10.0) == 1
    assert not table  # read and emptied
    (e,) = log.exits()
    assert (e.pid, e.comm, e.rank, e.signal, e.time_s) == (77, 0xAB, 2, "SIGKILL", 1_000_000_005.0)
    log.expire(300, now=309.0)
    assert log.exits()
    log.expire(300, now=310.0)
    assert not log.exits()


def stopped(comm, op, rank, age, node="n"):
    return f'nccl_inflight_stopped_seconds{{node="{node}",op="{op}",comm="{comm}",rank="{rank}"}} {age}'


def test_hang_names_the_rank_stopped_inside():
    from exporter.offline.analysis import hang

    lines = [info(C, r, 4, 100 + r) for r in range(4)] + [inflight(C, "ALL_REDUCE", r, 90) for r in range(4)]
    a = hang.analyse(page_read(lines + [stopped(C, "ALL_REDUCE", 2, 90)]), None, 60)
    assert a.hung
    assert "rank 2 (n) stopped inside it" in a.verdict, a.verdict
    assert a.as_dict()["hangs"][0]["stopped"] == [{"rank": 2, "node": "n", "age_s": 90.0}]
    # every rank stopped at once (a pause): no culprit among them
    every = lines + [stopped(C, "ALL_REDUCE", r, 90) for r in range(4)]
    assert hang.analyse(page_read(every), None, 60).as_dict()["hangs"][0]["stopped"] == []


# --- the real agent on a simulated job ---------------------------------------------------

@pytest.mark.usefixtures("bpf", "netns")
def test_a_stopped_and_a_killed_rank_are_named_on_metrics():
    from bench.faults.faults import Stopped
    from exporter.simulator.build import build_library
    from exporter.simulator.cluster import Cluster, cleanup_stale, start_job

    work = Path(tempfile.mkdtemp(prefix="nccl-rank-faults-"))
    cleanup_stale()
    lib = build_library(work / "lib")
    try:
        with ExporterProcess(nccl_libs=[lib], node="node-a", startup_timeout=180) as agent, Cluster(4) as cluster:
            job = start_job(cluster, {r: lib for r in range(4)}, "train", iterations=10_000_000,
                            rendezvous_dir=work / "rdv", truth_dir=work / "truth", count=16384,
                            compute_delay_ms={r: 20 for r in range(4)}, extra_env={"NCCL_SIM_DURATION_S": "600"})
            fault = Stopped(inside=True)
            try:
                world = None
                deadline = time.monotonic() + 90
                while world is None and time.monotonic() < deadline:
                    families = agent.scrape()
                    counted = {s.labels["comm"] for s in agent.samples(families, metrics.COLLECTIVE_LAST_SEQ)}
                    world = next((i.labels["comm"] for i in agent.samples(families, metrics.COMMUNICATOR_INFO)
                                  if i.labels["nranks"] == "4" and i.labels["comm"] in counted), None)
                    time.sleep(0.5)
                assert world, agent.output()[-3000:]
                # (comm, rank) -> pid: a split communicator's ranks are not the job's
                pid_of = {(i.labels["comm"], i.labels["rank"]): int(i.labels["pid"])
                          for i in agent.samples(agent.scrape(), metrics.COMMUNICATOR_INFO)}

                # rank 1 stopped inside a collective: only it is named stopped
                fault.inject(SimpleNamespace(pids=job.pids), 1)
                deadline = time.monotonic() + 30
                named = []
                while time.monotonic() < deadline:
                    named = [s for s in agent.samples(agent.scrape(), metrics.INFLIGHT_STOPPED) if s.value > 3]
                    if named:
                        break
                    time.sleep(0.5)
                assert named and {pid_of.get((s.labels["comm"], s.labels["rank"])) for s in named} == {job.pids[1]}, \
                    (named, pid_of, job.pids)
                r = run_cli("hang", "--threshold", "3s", "--metrics", agent.url, "--format", "json")
                assert r.returncode == 1, r.stdout + r.stderr
                hangs = json.loads(r.stdout)["hangs"]
                culprits = {pid_of.get((h["comm"], str(m["rank"]))) for h in hangs for m in h["stopped"]}
                assert culprits == {job.pids[1]}, hangs

                # rank 2 killed: its exits, by SIGKILL, are the first of its communicators'
                os.kill(job.pids[2], signal.SIGKILL)
                mine = {cr for cr, pid in pid_of.items() if pid == job.pids[2]}
                deadline = time.monotonic() + 20
                exits = []
                while time.monotonic() < deadline:
                    exits = agent.samples(agent.scrape(), metrics.RANK_EXIT)
                    if {(s.labels["comm"], s.labels["rank"]) for s in exits} >= mine:
                        break
                    time.sleep(0.5)
                killed = [s for s in exits if (s.labels["comm"], s.labels["rank"]) in mine]
                assert len(killed) == len(mine) and {s.labels["signal"] for s in killed} == {"SIGKILL"}, exits
                assert abs(killed[0].value - time.time()) < 30
                others = [s for s in exits if (s.labels["comm"], s.labels["rank"]) not in mine]
                assert all(s.value >= killed[0].value and s.labels["signal"] != "SIGKILL" for s in others), exits
            finally:
                fault.clear(SimpleNamespace(pids=job.pids))
                job.kill()
    finally:
        shutil.rmtree(work, ignore_errors=True)

#!/usr/bin/env python3
"""Fault-injection benchmark: how fast, and how rightly, the product names the
culprit of a fault (docs/benchmark.md).

The product as users run it: the agent (`nccl-exporter run --db
--query-listen`, real uprobes) on a simulated job of ranks in network
namespaces (exporter/simulator/cluster.py); a real Prometheus scraping it
every 5 s and evaluating the shipped alerts/nccl.yml every 5 s. Each run
starts a job, waits a random time, writes the ground truth (fault, culprit,
onset) to truth.jsonl, injects the fault, and watches three detectors for up
to the fault's stated wait: Prometheus's firing alerts (its API), `nccl-exporter
hang` on the agent's /metrics, `nccl-exporter explain --nodes` on its query
endpoint. Every answer that names a culprit goes to detections.jsonl;
bench/faults/score.py scores the two files. alerts.jsonl keeps each run's
alert timeline (pending and firing spans, from the onset) to tell why a
culprit came late, and figures.jsonl the culprit alerts' recorded series
over the run (FIGURES, every 5 s from the job's start) to tell why by how
much, after Prometheus is gone.

As root, from the repository root, under the heavy lock:

    flock /tmp/nccl-heavy.lock .venv/bin/python -m bench.faults.run --set quick
    make bench-faults                      # --set full, ~5.4 h

Sets: quick (each fault and healthy control once), full (each 10 times, and
the checkpoint in the GPU-like mode: 50 healthy runs and 150 warm-ups, over
2 h healthy), or --faults a,b --repeat N. Ctrl-C stops
cleanly: every rank, namespace, nft table, the agent and Prometheus go.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.faults import score as scoring  # noqa: E402
from bench.faults.faults import FAULTS  # noqa: E402
from bench.faults.procs import _unix, free_port, get, log, stop_proc, wait_for  # noqa: E402

PROMETHEUS = "/usr/bin/prometheus"
NRANKS = 4
COMPUTE_MS = 20       # each rank's compute between collectives
COUNT = 16384         # elements per collective
EVERY = ["straggler", "lossy_link", "stopped_between", "stopped_inside", "killed", "cpu_starvation",
         "desync", "desync_count", "gpu_straggler", "gpu_slow_link", "gpu_stopped_between",
         "healthy_jitter", "healthy_checkpoint", "healthy_agent_restart", "healthy_long_collective"]
SETS = {
    "quick": (EVERY, 1),
    # and the checkpoint in the GPU-like mode, whose steps stopped mid-way end with the pause in
    # their waits (left out of the quick set, which stays under 30 minutes)
    "full": (EVERY + ["healthy_gpu_checkpoint"], 10),
    # the suite's (tests/test_bench_faults.py): the harness and the scoring, not the
    # timings, so with short warm-ups and waits (SUITE_TIMING)
    "suite": (["straggler", "stopped_between"], 1),
}
# Random onset after the job's start: the culprit alerts' 15 s rates, and the medians over the
# job's ranks, have two windows of calls by 30 s.
WARMUP_S = (30, 40)
# Between runs, at most this long for the previous run's alerts to resolve (Prometheus.cool_down);
# the slowest, NcclLinkRetransmits, needs its 30 s window and an evaluation or two
COOL_DOWN_S = 90
SUITE_TIMING = {"warmup": (5, 10), "wait": 30}
# The recorded series behind the culprit-naming alerts (alerts/nccl.yml), kept per run in
# figures.jsonl: each rank's time in call and its communicator's median (NcclRankLate), the
# links that may be lossy (NcclLinkRetransmits, NcclRankLate), run-queue delay
# (NcclRankCpuStarved) and the sends' wait for their GPU (NcclRankGpuSlow).
FIGURES = ("nccl:collective_time_seconds:median3_mean5s", "nccl:collective_time_seconds:comm_median3_mean5s",
           "nccl:tcp_retransmits:lossy_candidate_increase30s", "nccl:runqueue_delay_seconds:rate15s",
           "nccl:network_send_gpu_wait_seconds:rate15s")


def another_jobs(labels: dict, comms: set[str]) -> bool:
    """A series of a communicator not among this job's (comms: full ids; labels carry a prefix)."""
    return "comm" in labels and not any(c.startswith(labels["comm"]) for c in comms)


class Agent:
    """`nccl-exporter run` with --db and --query-listen, restartable."""

    def __init__(self, work: Path, lib: Path):
        self.work, self.lib = work, lib
        self.port, self.qport = free_port(), free_port()
        self.token = work / "token"
        self.token.write_text(secrets.token_hex(16) + "\n")
        self.token.chmod(0o600)
        self.metrics = f"http://127.0.0.1:{self.port}/metrics"
        self.query = f"http://127.0.0.1:{self.qport}"
        self.proc = None
        self.starts = 0
        self.pids: list[int] = []

    def start(self) -> None:
        self.starts += 1
        logfile = self.work / f"agent{self.starts}.log"
        argv = [sys.executable, "-m", "exporter", "run", "--listen", f"127.0.0.1:{self.port}", "--node", "bench",
                "--nccl-lib", str(self.lib), "--db", str(self.work / f"agent{self.starts}.db"),
                "--query-listen", f"127.0.0.1:{self.qport}", "--query-token-file", str(self.token)]
        self.proc = subprocess.Popen(argv, stdout=open(logfile, "wb"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True)
        self.pids.append(self.proc.pid)
        wait_for("the agent", lambda: b"nccl_exporter_build_info" in get(self.metrics), self.proc, logfile, 240)

    def stop(self) -> None:
        stop_proc(self.proc, signal.SIGINT, 60)


class Prometheus:
    """Scrapes the agent every 5 s and evaluates the shipped alerts/nccl.yml every 5 s."""

    def __init__(self, work: Path, target: str):
        self.port = free_port()
        cfg = work / "prometheus.yml"
        cfg.write_text(json.dumps({
            "global": {"scrape_interval": "5s", "evaluation_interval": "5s", "scrape_timeout": "4s"},
            "rule_files": [str(REPO / "alerts" / "nccl.yml")],
            "scrape_configs": [{"job_name": "nccl-exporter", "static_configs": [{"targets": [target]}]}]}))
        logfile = work / "prometheus.log"
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=open(logfile, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.api = f"http://127.0.0.1:{self.port}/api/v1"
        wait_for("prometheus", lambda: get(f"http://127.0.0.1:{self.port}/-/ready") is not None,
                 self.proc, logfile, 60)

    def firing(self, since: float = 0.0) -> list[dict]:
        """Alerts firing that became active at or after `since` (Unix s): not a previous job's, whose
        alert resolves only some evaluations after it ended (a link's addresses repeat between runs)."""
        data = json.loads(get(f"{self.api}/alerts"))["data"]["alerts"]
        return [a["labels"] for a in data if a.get("state") == "firing" and _unix(a["activeAt"]) >= since]

    def carried_over(self) -> list[dict]:
        """Alerts firing or pending that the next job would be named by: a link (its hosts'
        addresses are the same every run) or a process's rank (the launcher's RANK, the same
        every run). Those with a communicator name the previous job's: its id is new each job."""
        data = json.loads(get(f"{self.api}/alerts"))["data"]["alerts"]
        return [a["labels"] for a in data if a.get("state") in ("firing", "pending")
                and ("saddr" in a["labels"] or ("rank" in a["labels"] and "comm" not in a["labels"]))]

    def cool_down(self, limit_s: float = COOL_DOWN_S) -> float:
        """Wait until no alert would carry over to the next job (at most limit_s): the previous
        run's resolve a window after its fault ended. Returns the wait."""
        t0 = quiet = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            if self.carried_over():
                quiet = time.monotonic()
            elif time.monotonic() - quiet >= 6:  # quiet for an evaluation (5 s): not a flicker
                break
            time.sleep(1)
        return time.monotonic() - t0

    def timeline(self, t0: float, t1: float, onset: float, comms: set[str]) -> list[dict]:
        """Each alert's pending and firing spans between t0 and t1 (Unix s), in seconds from
        the onset, from the ALERTS series (one sample per evaluation): why a culprit was named
        late or not at all (pending too late, or pending that reset). As for the detectors, a span
        already active at t0 (the job's start), or on a communicator not in comms (this job's), is
        an earlier job's and left out."""
        got = json.loads(get(f"{self.api}/query_range?query=ALERTS&start={t0:.3f}&end={t1:.3f}&step=1"))
        spans = []
        for s in got["data"]["result"]:
            labels = {k: v for k, v in s["metric"].items() if k not in ("__name__", "alertname", "alertstate")}
            if another_jobs(labels, comms):
                continue
            ts = [float(t) for t, _ in s["values"]]
            begin = ts[0]
            for prev, t in zip(ts, ts[1:] + [None]):
                if t is None or t - prev > 1.5:   # a gap: the alert resolved (or reset) in between
                    if begin > t0 + 0.5:
                        spans.append({"alert": s["metric"]["alertname"], "state": s["metric"]["alertstate"],
                                      "from_s": round(begin - onset, 1), "to_s": round(prev - onset, 1),
                                      "labels": labels})
                    begin = t
        return sorted(spans, key=lambda x: (x["from_s"], x["alert"]))

    def figures(self, t0: float, t1: float, onset: float, comms: set[str]) -> list[dict]:
        """FIGURES between t0 and t1 (Unix s), one sample per evaluation, times in seconds from
        the onset; a series of another job's communicator is left out."""
        out = []
        for name in FIGURES:
            q = urllib.parse.urlencode({"query": name, "start": f"{t0:.3f}", "end": f"{t1:.3f}", "step": 5})
            for s in json.loads(get(f"{self.api}/query_range?{q}"))["data"]["result"]:
                labels = {k: v for k, v in s["metric"].items() if k != "__name__"}
                if another_jobs(labels, comms):
                    continue
                out.append({"series": name, "labels": labels,
                            "t_s": [round(float(t) - onset, 1) for t, _ in s["values"]],
                            "v": [float(v) for _, v in s["values"]]})
        return out

    def close(self) -> None:
        stop_proc(self.proc, signal.SIGTERM)


class Detectors:
    """Polls the three detectors in threads while a run lasts; every answer
    naming a culprit of this job becomes a detection line."""

    def __init__(self, out, agent: Agent, prom: Prometheus, ranks_of: dict, addr_rank: dict, run_id: str,
                 started: float = 0.0):
        self.out, self.agent, self.prom, self.started = out, agent, prom, started  # started: the job's (Unix s)
        self.ranks_of = ranks_of     # (comm, rank label) -> the job's global rank
        self.addr_rank = addr_rank   # host address -> global rank
        self.rank_addr = {r: a for a, r in addr_rank.items()}
        # the launcher's RANK of each rank (exporter/simulator/cluster.py sets RANK to the job's rank)
        self.launcher_ranks = {str(r) for r in set(ranks_of.values())}
        self.run_id = run_id
        self.seen: set = set()
        self.explain_errors: set = set()  # explain's failures, each logged once
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(f, p), daemon=True)
                        for f, p in ((self._prometheus, 1), (self._hang, 5), (self._explain, 10))]

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def stop(self):
        self.done.set()
        for t in self.threads:
            t.join()

    def _loop(self, fn, period):
        while not self.done.is_set():
            t0 = time.monotonic()
            try:
                fn()
            except (OSError, ValueError, KeyError, subprocess.TimeoutExpired):
                pass  # an agent restarting, Prometheus busy: the next poll
            self.done.wait(max(0.0, period - (time.monotonic() - t0)))

    def _emit(self, detector: str, culprit: dict, cause: str | None, what: str) -> None:
        key = (detector, json.dumps(culprit, sort_keys=True), cause)  # a culprit named again with its cause
        with self.lock:
            if key in self.seen:
                return
            self.seen.add(key)
            line = {"run": self.run_id, "detector": detector, "t": round(time.time(), 3), "culprit": culprit,
                    "cause": cause, "what": what}
            self.out.write(json.dumps(line) + "\n")
            self.out.flush()
        log(f"  {detector}: {culprit} ({what})")

    def _prometheus(self):
        for a in self.prom.firing(self.started):
            if "saddr" in a and "daddr" in a:
                if a["saddr"] in self.addr_rank or a["daddr"] in self.addr_rank:
                    self._emit("prometheus", {"link": [a["saddr"], a["daddr"]]}, a.get("cause", "lossy_link"),
                               a["alertname"])
            elif "peer" in a and "rank" in a and self._link(a.get("comm"), a["peer"], a["rank"]):
                # a link of a communicator (NcclLinkSlow, NcclPeerNetworkWaitHigh): peer sends, rank receives
                self._emit("prometheus", {"link": self._link(a["comm"], a["peer"], a["rank"])},
                           a.get("cause", "slow_link"), a["alertname"])
            elif "rank" in a and (a.get("comm"), a["rank"]) in self.ranks_of:
                cause = a.get("cause") or {"NcclStragglerRank": "late_arrival",
                                           "NcclRankMissing": "not_joined",
                                           "NcclRankDesync": "desync"}.get(a["alertname"])
                self._emit("prometheus", {"rank": self.ranks_of[(a["comm"], a["rank"])]}, cause, a["alertname"])
            elif "rank" in a and "comm" not in a and a["rank"] in self.launcher_ranks:
                # a process's series (the scheduler's): its rank is the launcher's RANK, the job's rank
                self._emit("prometheus", {"rank": int(a["rank"])}, a.get("cause"), a["alertname"])

    def _global(self, rank: str, comm: str | None) -> int | None:
        """The job's rank of `rank` in the communicator whose id starts with `comm` (None: any): None
        unless that names one rank."""
        ranks = {g for (c, r), g in self.ranks_of.items() if r == rank and (comm is None or c.startswith(comm))}
        return ranks.pop() if len(ranks) == 1 else None

    def _link(self, comm, sender: str, receiver: str) -> list | None:
        """[sender's address, receiver's] of two ranks of a communicator; None if not this job's."""
        ends = [self.rank_addr.get(self._global(r, comm)) for r in (sender, receiver)] if comm else [None]
        return ends if all(ends) else None

    def _cli(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "exporter", *args], capture_output=True, text=True,
                              cwd=REPO, timeout=60)

    def _hang(self):
        p = self._cli("hang", "--metrics", self.agent.metrics, "--format", "json")
        if p.returncode != 1:
            return
        for h in json.loads(p.stdout).get("hangs", []):
            for m in h.get("stopped", []):
                if (r := self.ranks_of.get((h["comm"], str(m["rank"])))) is not None:
                    self._emit("hang", {"rank": r}, "stopped_inside", "stopped inside")
            for m in h.get("desync", []):  # in another op, seq or count than the ranks waiting
                if (r := self.ranks_of.get((h["comm"], str(m["rank"])))) is not None:
                    seq = "" if m["seq"] is None else f" #{m['seq']}"
                    self._emit("hang", {"rank": r}, "desync", f"desync in {m['op']}{seq}")
            for m in h.get("missing", []):
                if m.get("elsewhere"):
                    continue  # in a collective of another communicator: waiting there, a victim
                r = self.ranks_of.get((h["comm"], str(m["rank"])))
                if r is not None:
                    self._emit("hang", {"rank": r}, "not_joined", "missing rank")

    def _explain(self):
        age = int(time.time() - self.started)  # the window starts after this job's start: not the last job's
        if age < 5:
            return
        p = self._cli("explain", "--nodes", self.agent.query, "--token-file", str(self.agent.token),
                      "--since", f"{min(30, age)}s", "--format", "json")
        if p.returncode != 0:  # said once per message: an explain that keeps failing is not a silent miss
            why = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
            if why not in self.explain_errors:
                self.explain_errors.add(why)
                log(f"  explain failed: {why}")
            return
        verdict = json.loads(p.stdout).get("verdict", "")
        link = re.search(r"(198\.18\.\d+\.\d+)\u2192(198\.18\.\d+\.\d+)", verdict)
        the_link = re.search(r"the link of (198\.18\.\d+\.\d+)", verdict)
        rank = re.search(r"\brank (\d+)\b", verdict)
        comm = re.search(r"\bcomm ([0-9a-f]{8})", verdict)
        gpu = re.match(r"GPU straggler: rank (\d+)", verdict)
        slow = re.match(r"slow link: rank (\d+) \u2190 rank (\d+)", verdict)
        if gpu and comm and (r := self._global(gpu.group(1), comm.group(1))) is not None:
            self._emit("explain", {"rank": r}, "gpu_straggler", verdict[:120])
        elif slow and comm and (ends := self._link(comm.group(1), slow.group(2), slow.group(1))):
            self._emit("explain", {"link": ends}, "slow_link", verdict[:120])
        elif verdict.startswith("network") and (link or the_link):
            ends = list(link.groups()) if link else [the_link.group(1)]
            self._emit("explain", {"link": ends}, "lossy_link", verdict[:120])
        elif rank and verdict.startswith(("straggler", "CPU starvation")):
            # "rank N on NODE" is the process's rank (Recording.process_ranks: the launcher's RANK, which
            # the simulated cluster sets to the job's rank); else N in the communicator the verdict names
            cause = "cpu_starvation" if "CPU" in verdict[:60] else "late_arrival"
            on = re.search(r"\brank (\d+) on ", verdict)
            if on and on.group(1) in self.launcher_ranks:
                self._emit("explain", {"rank": int(on.group(1))}, cause, verdict[:120])
            elif (r := self._global(rank.group(1), comm.group(1) if comm else None)) is not None:
                self._emit("explain", {"rank": r}, cause, verdict[:120])


class Ctx:
    def __init__(self, cluster, pids, agent):
        self.cluster, self.pids, self.agent = cluster, pids, agent

    def restart_agent(self):
        self.agent.stop()
        self.agent.start()


def job_map(agent: Agent, pids: list[int]) -> dict:
    """(comm, rank label) -> global rank, from the agent's nccl_communicator_info (pid -> rank)."""
    from prometheus_client.parser import text_string_to_metric_families
    rank_of_pid = {str(p): r for r, p in enumerate(pids)}
    out = {}
    for fam in text_string_to_metric_families(get(agent.metrics).decode()):
        for s in fam.samples:
            if s.name == "nccl_communicator_info" and s.labels.get("pid") in rank_of_pid:
                out[(s.labels["comm"], s.labels["rank"])] = rank_of_pid[s.labels["pid"]]
    return out


def one_run(run_id, name, lib, work, agent, prom, truth_out, det_out, rng, warmup=WARMUP_S,
            wait_s: float | None = None, commit: str = "", alerts_out=None, figures_out=None) -> None:
    from exporter.simulator.cluster import Cluster, start_job

    fault = FAULTS[name]()
    if wait_s is not None:
        fault.wait_s = wait_s
    with Cluster(NRANKS, name=f"bf{run_id}") as cluster:
        job = start_job(cluster, lib, "train", iterations=10_000_000, rendezvous_dir=work / f"rdv{run_id}",
                        truth_dir=work / f"sim{run_id}", count=COUNT,
                        compute_delay_ms={r: COMPUTE_MS for r in range(NRANKS)},
                        extra_env={"NCCL_SIM_DURATION_S": "3600", **fault.job_env(work / f"sim{run_id}")})
        ctx = Ctx(cluster, job.pids, agent)
        start = time.time()
        try:
            deadline = time.monotonic() + 60
            ranks_of = {}
            while len(set(ranks_of.values())) < NRANKS:
                if time.monotonic() > deadline or any(rc is not None for rc in job.poll()):
                    raise RuntimeError("the job did not start:\n" + job.result().summary())
                time.sleep(1)
                ranks_of = job_map(agent, job.pids)
            addr_rank = {h.addr: h.index for h in cluster.hosts}
            det = Detectors(det_out, agent, prom, ranks_of, addr_rank, run_id, started=start).start()
            try:
                time.sleep(rng.uniform(*warmup))
                culprit_rank = rng.randrange(NRANKS)
                truth = {"run": run_id, "fault": name, "healthy": fault.healthy, "cause": fault.cause,
                         "start": round(start, 3), "onset": round(time.time(), 3), "wait_s": fault.wait_s,
                         "culprit": None, "commit": commit}
                if fault.culprit == "rank":
                    truth["culprit"] = {"rank": culprit_rank}
                elif fault.culprit == "link":
                    truth["culprit"] = {"link": {"to": cluster.hosts[culprit_rank].addr}}
                    if hasattr(fault, "sender"):  # a directed link: both its ends must be named
                        truth["culprit"]["link"]["from"] = cluster.hosts[fault.sender(culprit_rank, NRANKS)].addr
                truth_out.write(json.dumps(truth) + "\n")  # before the fault: ground truth first
                truth_out.flush()
                log(f"{run_id} {name}: culprit {truth['culprit']}")
                extra = fault.inject(ctx, culprit_rank)
                log(f"{run_id}   injected: {extra}")
                time.sleep(fault.wait_s)
                comms = {c for c, _ in ranks_of}
                for out, what, rows in ((alerts_out, "alert timeline", prom.timeline),
                                        (figures_out, "figures", prom.figures)):
                    if out is None:
                        continue
                    try:
                        for row in rows(start, time.time(), truth["onset"], comms):
                            out.write(json.dumps({"run": run_id, **row}) + "\n")
                        out.flush()
                    except (OSError, ValueError, KeyError) as e:
                        log(f"{run_id}   {what} not written: {e}")
            finally:
                det.stop()
                fault.clear(ctx)
        finally:
            job.kill()


def plan_part(names: list[str], repeat: int, seed: int, part: int = 1, parts: int = 1) -> tuple[int, list[str]]:
    """The runs of the whole plan (every name `repeat` times, shuffled by `seed`) in the
    part-th of `parts` slices, and how many runs come before it: a part's runs keep their
    place (and run ids) in the whole plan, so the parts add up to it."""
    plan = [n for _ in range(repeat) for n in names]
    random.Random(seed).shuffle(plan)
    first = (part - 1) * len(plan) // parts
    return first, plan[first:part * len(plan) // parts]


def source_commit() -> str:
    """The commit the detectors ran from, "+dirty" when the tree had changes:
    parts of one set scored together must come from the same code."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", choices=sorted(SETS), default="quick")
    p.add_argument("--faults", help="comma-separated fault names instead of the set's: " + ", ".join(FAULTS))
    p.add_argument("--repeat", type=int, help="runs per fault (default: the set's)")
    p.add_argument("--out", type=Path, default=REPO / "build" / "bench-faults",
                   help="where truth.jsonl, detections.jsonl and result.json go (default build/bench-faults)")
    p.add_argument("--seed", type=int, default=None, help="random onsets and culprits (default: from the clock)")
    p.add_argument("--part", default="1/1", metavar="K/N",
                   help="run only the K-th of N equal slices of the set's shuffled plan (the full set takes "
                        "~5.4 h: in sittings, --seed S --part 1/2 then --part 2/2, each to its own --out); "
                        "score the parts together with python -m bench.faults.score T1 D1 T2 D2")
    a = p.parse_args(argv)
    try:
        part, parts = (int(x) for x in a.part.split("/"))
        if not 1 <= part <= parts:
            raise ValueError
    except ValueError:
        print(f"bench-faults: --part K/N with 1 <= K <= N, not {a.part!r}", file=sys.stderr)
        return 2
    names, repeat = SETS[a.set]
    if a.faults:
        names = [n.strip() for n in a.faults.split(",") if n.strip()]
        unknown = [n for n in names if n not in FAULTS]
        if unknown:
            print(f"bench-faults: unknown fault {', '.join(unknown)} (known: {', '.join(FAULTS)})", file=sys.stderr)
            return 2
    repeat = a.repeat or repeat
    if os.geteuid() != 0:
        print("bench-faults: needs root (BPF, network namespaces)", file=sys.stderr)
        return 2
    if not os.access(PROMETHEUS, os.X_OK):
        print(f"bench-faults: {PROMETHEUS} missing (make deps)", file=sys.stderr)
        return 2
    def interrupted(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupted)  # as Ctrl-C: the finally below cleans up
    seed = a.seed if a.seed is not None else int(time.time())
    first, plan = plan_part(names, repeat, seed, part, parts)
    rng = random.Random(seed * 1000 + part)     # onsets and culprits
    a.out.mkdir(parents=True, exist_ok=True)
    truth_path, det_path = a.out / "truth.jsonl", a.out / "detections.jsonl"
    from exporter.simulator.build import build_library
    from exporter.simulator.cluster import cleanup_stale

    work = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    lib = build_library(work / "lib")   # a private copy: only this bench's ranks are traced
    cleanup_stale()
    agent = prom = None
    timing = SUITE_TIMING if a.set == "suite" and not a.faults else {}
    warmup = timing.get("warmup", WARMUP_S)

    def expected_s(names: list[str]) -> float:
        """A run: its mean warm-up, its wait, ~8 s to start the job and clean up, ~6 s of cool-down."""
        return sum(sum(warmup) / 2 + timing.get("wait", FAULTS[n]().wait_s) + 14 for n in names)

    commit = source_commit()
    log(f"bench-faults: {len(plan)} runs ({a.set if not a.faults else 'custom'}, seed {seed}, part {a.part}, "
        f"commit {commit}), about {expected_s(plan) / 60 + 0.5:.0f} min; results in {a.out}")
    try:
        agent = Agent(work, lib)
        agent.start()
        prom = Prometheus(work, f"127.0.0.1:{agent.port}")
        with open(truth_path, "w") as truth_out, open(det_path, "w") as det_out, \
                open(a.out / "alerts.jsonl", "w") as alerts_out, open(a.out / "figures.jsonl", "w") as figures_out:
            for i, name in enumerate(plan, 1):
                if i > 1:
                    waited = prom.cool_down()
                    if waited >= 8:
                        log(f"cool-down: {waited:.0f} s until the previous run's alerts resolved")
                log(f"run {i} of {len(plan)}: {name} (about {expected_s(plan[i - 1:]) / 60 + 0.5:.0f} min left)")
                one_run(f"r{first + i:03d}", name, lib, work, agent, prom, truth_out, det_out, rng,
                        warmup=warmup, wait_s=timing.get("wait"), commit=commit, alerts_out=alerts_out,
                        figures_out=figures_out)
    except KeyboardInterrupt:
        log("interrupted: cleaning up (the runs so far are scored)")
    finally:
        if prom:
            prom.close()
        if agent:
            agent.stop()
        shutil.rmtree(work, ignore_errors=True)
    result = scoring.score(scoring.read_jsonl(truth_path), scoring.read_jsonl(det_path),
                           ["prometheus", "hang", "explain"])
    result["seed"], result["runs"], result["part"], result["commit"] = seed, len(plan), a.part, commit
    result["processes"] = (agent.pids if agent else []) + ([prom.proc.pid] if prom else [])
    (a.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(scoring.table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

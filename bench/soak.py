#!/usr/bin/env python3
"""Soak: one agent (`nccl-exporter run`) while many short simulator jobs run
back to back, each with a new communicator (bench/README.md, "Soak").

Every job is checked: its ALL_REDUCE calls on /metrics (its own series plus
what the overflow series gained during it) must equal the simulator's own
truth. Every --every jobs it prints the agent's RSS, the entries of each BPF
map (nccl_exporter_map_entries), the /metrics size and scrape time, and
whether the latest job was exact. Goal: flat RSS, bounded map entries and
scrape size, every job exact. At the end it waits --series-ttl (+ the
loop's prune) and prints the per-owner maps of ended jobs (tcp_links,
tcp_srtt, sched_stats; sock_owner): tcp_srtt and sched_stats must be empty
again (every traced process ended), else exit 1.

As root, under the heavy-test lock:

    flock /tmp/nccl-heavy.lock .venv/bin/python bench/soak.py --jobs 1000
    flock /tmp/nccl-heavy.lock .venv/bin/python bench/soak.py --jobs 200 --series-capacity 64 --series-ttl 5s

Exits 1 if a job was not exact or the exporter died.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from exporter.records import contract, metrics  # noqa: E402
from exporter.records.events import format_comm  # noqa: E402
from exporter.simulator.build import build_library  # noqa: E402
from exporter.simulator.cluster import Cluster, run_job  # noqa: E402
from exporter.simulator.truth import calls, lifecycle  # noqa: E402
from exporter.sources.nccl import hashing  # noqa: E402

OVERFLOW = format_comm(contract.SERIES_OVERFLOW_COMM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Scrape:
    def __init__(self, url: str):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as r:
            body = r.read()
        self.ms = (time.perf_counter() - t0) * 1e3
        self.bytes = len(body)
        self.calls: Counter = Counter()  # comm -> ALL_REDUCE calls
        self.entries: dict[str, int] = {}
        self.full: dict[str, int] = {}
        for fam in text_string_to_metric_families(body.decode()):
            for s in fam.samples:
                if s.name == metrics.COLLECTIVE_DURATION + "_count" and s.labels.get("op") == "ALL_REDUCE":
                    self.calls[s.labels["comm"]] += int(s.value)
                elif s.name == metrics.EXPORTER_MAP_ENTRIES:
                    self.entries[s.labels["map"]] = int(s.value)
                elif s.name == metrics.EXPORTER_MAP_FULL and s.value:
                    self.full[s.labels["map"]] = int(s.value)


def job_comm(records) -> str:
    (h,) = {hashing.nccl_comm_hash(bytes.fromhex(r["uid"]))
            for r in lifecycle(records) if r["op"] == "COMM_INIT_RANK" and r["result"] == 0}
    return hashing.format_hash(h)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--series-capacity", type=int, default=None)
    p.add_argument("--series-ttl", default="10s")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("soak: needs root (BPF)", file=sys.stderr)
        return 2
    lib = build_library()
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    argv_run = [sys.executable, "-m", "exporter", "run", "--listen", f"127.0.0.1:{port}", "--node", "soak",
                "--nccl-lib", str(lib), "--series-ttl", args.series_ttl]
    if args.series_capacity:
        argv_run += ["--series-capacity", str(args.series_capacity)]
    log = tempfile.NamedTemporaryFile(prefix="soak-exporter-", suffix=".log", delete=False)
    agent = subprocess.Popen(argv_run, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    bad = 0
    try:
        deadline = time.monotonic() + 120
        while True:
            if agent.poll() is not None:
                print(Path(log.name).read_text(), file=sys.stderr)
                return 1
            try:
                if b"nccl_exporter_build_info" in urllib.request.urlopen(url, timeout=2).read():
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                print("soak: the exporter did not start", file=sys.stderr)
                return 1
            time.sleep(0.2)
        print(f"agent pid {agent.pid}: {' '.join(argv_run[2:])}")
        print(f"{'jobs':>5} {'s':>6} {'RSS MB':>7} {'metrics KB':>10} {'scrape ms':>9} {'exact':>5} "
              f"{'overflow':>8}  map entries (full)")
        t0 = time.monotonic()
        before = Scrape(url)
        with Cluster(args.ranks) as cluster:
            for i in range(1, args.jobs + 1):
                res = run_job(cluster, lib, "allreduce", iterations=args.iterations,
                              rendezvous_dir=work / f"rdv{i}", truth_dir=work / f"truth{i}", timeout=60)
                if not res.ok:
                    print(f"job {i} failed: {res.summary()}", file=sys.stderr)
                    return 1
                after = Scrape(url)
                want = len(calls(res.truth, op="ALL_REDUCE"))
                got = after.calls[job_comm(res.truth)] + after.calls[OVERFLOW] - before.calls[OVERFLOW]
                exact = got == want
                bad += not exact
                if not exact:
                    print(f"job {i}: /metrics {got} calls, truth {want}")
                for d in (work / f"rdv{i}", work / f"truth{i}"):
                    subprocess.run(["rm", "-rf", str(d)], check=False)
                if i % args.every == 0 or i == args.jobs:
                    entries = " ".join(f"{m}={n}" + (f"({after.full[m]})" if m in after.full else "")
                                       for m, n in sorted(after.entries.items()))
                    print(f"{i:5d} {time.monotonic() - t0:6.0f} {rss_kb(agent.pid) / 1024:7.1f} "
                          f"{after.bytes / 1e3:10.1f} {after.ms:9.1f} {'yes' if exact else 'NO':>5} "
                          f"{after.calls[OVERFLOW]:8d}  {entries}", flush=True)
                before = after
                if agent.poll() is not None:
                    print("soak: the exporter died", file=sys.stderr)
                    return 1
        print(f"{args.jobs - bad}/{args.jobs} jobs exact")
        # Every job ended: after the TTL their per-owner entries leave the maps.
        from exporter.cli.common.options import parse_duration

        owner_maps = ("tcp_links", "tcp_srtt", "sched_stats", "sock_owner")
        deadline = time.monotonic() + parse_duration(args.series_ttl) + 15
        while True:
            end = Scrape(url)
            left = {m: end.entries.get(m, 0) for m in owner_maps}
            if (left["tcp_srtt"] == 0 and left["sched_stats"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(1)
        print(f"after --series-ttl {args.series_ttl}: " + " ".join(f"{m}={n}" for m, n in left.items())
              + f"; /metrics {end.bytes / 1e3:.1f} KB, RSS {rss_kb(agent.pid) / 1024:.1f} MB")
        if left["tcp_srtt"] or left["sched_stats"]:
            print("soak: entries of ended jobs still in tcp_srtt/sched_stats", file=sys.stderr)
            return 1
        return 0 if bad == 0 else 1
    finally:
        if agent.poll() is None:
            agent.terminate()
            try:
                agent.wait(60)
            except subprocess.TimeoutExpired:
                agent.kill()
        log.close()
        os.unlink(log.name)
        subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    sys.exit(main())

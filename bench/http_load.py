"""Hostile load on a real agent's two listeners, on loopback: does it hold up, and what
does it cost in threads and memory? (docs/architecture.md, "Serving HTTP")

    .venv/bin/python bench/http_load.py [--rows 300000] [--idle 1000] [--scrapes 100] [--queries 50]

Starts `nccl-exporter run --db REC --query-listen 127.0.0.1:Q` on a recording
made beforehand (REC holds --rows NCCL calls: the heavy queries have rows to
sort), waits for /-/ready, then three phases, each bounded in time:

1. idle + scrapes: --idle connections to /metrics that never send a byte,
   then --scrapes concurrent GET /metrics. Every scrape must get 200 and its
   whole body; p50/p99 latency. The idle connections must be closed by the
   server's idle timeout (or made way for scrapes), never answered.
2. heavy queries + scrapes: --queries concurrent POST /api/v1/query, a mix of
   zeroblob(200000000), printf('%.*c', 200000000, 'x'), an unbounded recursive
   CTE, and ORDER BY over nccl_events (every row, read to the end), while
   --scrapes scrapes run. Status codes per kind; the scrapes again.
3. the agent's peak RSS (VmHWM) and its thread count, sampled throughout.

Goals (docs): every scrape 200 with a full body, p99 < 1 s; peak RSS < 300 MB.
Root (the agent loads BPF): run it under flock /tmp/nccl-heavy.lock.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import pathlib
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CLI = [str(REPO / ".venv" / "bin" / "nccl-exporter")]

from bench.agent_ready import wait_ready  # noqa: E402
TOKEN = "bench-token"

HEAVY = {
    "zeroblob": "SELECT zeroblob(200000000)",
    "printf": "SELECT printf('%.*c', 200000000, 'x')",
    "recursive": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c",
    "order_by": "SELECT * FROM nccl_events ORDER BY duration_ns DESC, timestamp_ns",
}


def make_recording(path: str, n: int) -> None:
    from exporter.records.events import CallEvent
    from exporter.sinks.recording.writer import Recorder

    r = Recorder(path, node="bench", identify_processes=False, queue_max=n + 10)
    t0 = time.time_ns()
    for i in range(n):
        r(CallEvent(kind=1, op="ALL_REDUCE", pid=100, tid=100 + i % 8, start_ns=i * 1000,
                    end_ns=i * 1000 + 500_000 + (i * 7919) % 100_000, start_real_ns=t0 + i * 1_000_000,
                    comm_ptr=1, comm=0xAB, nccl_comm_hash=0xCD, seq=i, rank=i % 8, nranks=8, count=4,
                    bytes=16, datatype=7, red_op=0, root=-1, peer=-1, stream=0x10, result=0, color=-1))
    r.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sampler(threading.Thread):
    """The agent's VmHWM (peak RSS) and most threads, every 50 ms."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.stop, self.threads, self.hwm_kb = pid, threading.Event(), 0, 0

    def run(self):
        while not self.stop.is_set():
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            self.hwm_kb = int(line.split()[1])
                        elif line.startswith("Threads:"):
                            self.threads = max(self.threads, int(line.split()[1]))
            except OSError:
                return
            time.sleep(0.05)


def scrape(port: int) -> tuple[int, float, bool]:
    t0 = time.monotonic()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/metrics")
        r = c.getresponse()
        body = r.read()
        whole = r.getheader("Content-Length") is not None and len(body) == int(r.getheader("Content-Length"))
        c.close()
        return r.status, time.monotonic() - t0, whole
    except OSError:
        return -1, time.monotonic() - t0, False


def scrapes(port: int, n: int) -> list:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: scrape(port), range(n)))


def report_scrapes(label: str, got: list) -> bool:
    codes = collections.Counter(s for s, _, _ in got)
    lat = sorted(t for _, t, _ in got)
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    whole = sum(w for _, _, w in got)
    ok = codes.get(200, 0) == len(got) and whole == len(got) and p99 < 1.0
    print(f"  {label}: {dict(codes)}, whole bodies {whole}/{len(got)}, p50 {statistics.median(lat) * 1000:.0f} ms, "
          f"p99 {p99 * 1000:.0f} ms, max {lat[-1] * 1000:.0f} ms  [{'met' if ok else 'MISSED'}]", flush=True)
    return ok


def query(port: int, sql: str) -> tuple[int, int, str]:
    """(status, bytes read, trailer's truncated or error)"""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request("POST", "/api/v1/query", json.dumps({"sql": sql}),
                  {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        r = c.getresponse()
        n, last = 0, b""
        while chunk := r.read(1 << 20):
            n += len(chunk)
            last = (last + chunk)[-4096:]
        c.close()
        tail = last.rstrip(b"\n").rsplit(b"\n", 1)[-1]
        try:
            obj = json.loads(tail)
            why = obj.get("truncated") or obj.get("error") or "" if isinstance(obj, dict) else ""
        except ValueError:
            why = ""
        return r.status, n, str(why)[:60]
    except OSError as e:
        return -1, 0, type(e).__name__


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--scrapes", type=int, default=100)
    ap.add_argument("--queries", type=int, default=50)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tmp = tempfile.mkdtemp(prefix="http-load-")
    rec, tok = os.path.join(tmp, "rec.db"), os.path.join(tmp, "token")
    with open(tok, "w") as f:
        f.write(TOKEN)
    t0 = time.monotonic()
    make_recording(rec, args.rows)
    print(f"recording of {args.rows} calls ({os.path.getsize(rec) >> 20} MiB) in {time.monotonic() - t0:.1f} s",
          flush=True)
    mport, qport = free_port(), free_port()
    agent = subprocess.Popen([*CLI, "run", "--db", rec, "--listen", f"127.0.0.1:{mport}",
                              "--query-listen", f"127.0.0.1:{qport}", "--query-token-file", tok],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ok = True
    idle: list[socket.socket] = []
    try:
        why = wait_ready(mport, agent, 90)
        if why:
            raise SystemExit(why)
        sampler = Sampler(agent.pid)
        sampler.start()
        time.sleep(0.5)
        print(f"agent ready: RSS peak {sampler.hwm_kb / 1024:.0f} MB, {sampler.threads} threads", flush=True)

        print(f"1. {args.idle} idle connections to /metrics, then {args.scrapes} concurrent scrapes", flush=True)
        for _ in range(args.idle):
            try:
                idle.append(socket.create_connection(("127.0.0.1", mport), timeout=5))
            except OSError as e:
                print(f"  connect failed after {len(idle)}: {e}")
                break
        time.sleep(0.5)
        ok &= report_scrapes("scrapes", scrapes(mport, args.scrapes))
        t_idle = time.monotonic()
        closed = answered = 0
        for s in idle:
            s.settimeout(max(0.1, 15 - (time.monotonic() - t_idle)))
            try:
                data = s.recv(1)
                closed += 1
                answered += bool(data)
            except (TimeoutError, OSError):
                pass
        print(f"  idle connections closed by the server within 15 s: {closed} of {len(idle)}, "
              f"answered with bytes: {answered}", flush=True)
        ok &= closed == len(idle) and answered == 0
        for s in idle:
            s.close()
        idle = []

        print(f"2. {args.queries} concurrent heavy queries with {args.scrapes} scrapes", flush=True)
        kinds = [list(HEAVY)[i % len(HEAVY)] for i in range(args.queries)]
        with ThreadPoolExecutor(args.queries) as qpool:
            futures = [qpool.submit(query, qport, HEAVY[k]) for k in kinds]
            time.sleep(0.2)
            ok &= report_scrapes("scrapes meanwhile", scrapes(mport, args.scrapes))
            results = [f.result() for f in futures]
        by_kind: dict = collections.defaultdict(collections.Counter)
        for k, (status, _n, why) in zip(kinds, results):
            by_kind[k][f"{status}" + (f" ({why})" if why else "")] += 1
        for k, c in by_kind.items():
            print(f"  {k}: {dict(c)}", flush=True)
        time.sleep(0.3)
        sampler.stop.set()
        sampler.join()
        rss = sampler.hwm_kb / 1024
        print(f"3. agent: peak RSS {rss:.0f} MB (goal < 300), most threads {sampler.threads}", flush=True)
        ok &= rss < 300
    finally:
        for s in idle:
            s.close()
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)
    print("all goals met" if ok else "a goal was MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""How long from `run` or `trace` starting to the first NCCL call counted.

    .venv/bin/python bench/start_latency.py [--reps 5] [--pause 3]

A job is already running (the DaemonSet rollout, or `trace` started on a
busy node): one process on the simulator's libnccl.so.2 with a 1-rank
communicator, an AllReduce every millisecond. Then, R times each, the
agent started from nothing (a new process: Python, BCC's compile, discovery):

- `trace`: from just before its exec to the wall-clock time of the first call
  it prints (the call's own timestamp: when the kernel counted it);
- `run --listen`: from just before its exec to the first /metrics (polled
  every 25 ms) whose nccl_collective_duration_seconds_count is above 0; also
  when /-/ready first answered 200, and what it said then ("ready; loading
  tcp, sched" while the kernel-side sources still compile).

The goal (bench/README.md): the first call counted within 3 s, the median of
the runs. Each run waits --pause s after the previous agent's exit (its
detaching child). As root; loopback only; everything it starts is stopped.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime

REPO = pathlib.Path(__file__).resolve().parent.parent
CLI = [str(REPO / ".venv" / "bin" / "nccl-exporter")]
sys.path.insert(0, str(REPO))

from bench.stop_latency import free_port  # noqa: E402

# A 1-rank communicator on the simulator, an AllReduce every millisecond.
JOB = r"""
import ctypes, sys, time
from ctypes import c_int, c_size_t, c_void_p, byref
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
L = ctypes.CDLL(sys.argv[1])
uid = UniqueId()
assert L.ncclGetUniqueId(byref(uid)) == 0
comm = c_void_p()
L.ncclCommInitRank.argtypes = [ctypes.POINTER(c_void_p), c_int, UniqueId, c_int]
assert L.ncclCommInitRank(byref(comm), 1, uid, 0) == 0
buf = (ctypes.c_float * 16)()
L.ncclAllReduce.argtypes = [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
print("ready", flush=True)
while True:
    assert L.ncclAllReduce(buf, buf, 16, 7, 0, comm, None) == 0
    time.sleep(0.001)
"""

CALL_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) pid=\d+ .* ALL_REDUCE ")
COUNT = re.compile(r"^nccl_collective_duration_seconds_count\{[^}]*\} ([0-9.e+]+)$", re.M)


def trace_once() -> tuple[float, str]:
    """Seconds from exec to the first call trace prints (its kernel timestamp), and trace's start-up line."""
    t0 = time.time()
    proc = subprocess.Popen([*CLI, "trace"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            m = CALL_LINE.match(line)
            if m:
                h, mi, s = int(m[1]), int(m[2]), float(m[3])
                day = datetime.fromtimestamp(t0).replace(hour=h, minute=mi, second=0, microsecond=0)
                counted = day.timestamp() + s
                if counted < t0 - 3600:  # the call came after midnight
                    counted += 86400
                break
        else:
            raise SystemExit(f"trace printed no call: {proc.stderr.read().strip()[-300:]}")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    said = next((ln for ln in err.splitlines() if "start-up took" in ln), "")
    return counted - t0, said


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def run_once() -> tuple[float, float, str]:
    """Seconds from exec to the first /metrics with a call counted, to /-/ready 200, and /-/ready's first 200 body."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen([*CLI, "run", "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ready_at, ready_said = None, ""
    try:
        while True:
            now = time.monotonic()
            if proc.poll() is not None:
                raise SystemExit(f"run exited (rc={proc.returncode})")
            if now - t0 > 60:
                raise SystemExit("run counted no call in 60 s")
            if ready_at is None:
                code, body = get(base + "/-/ready")
                if code == 200:
                    ready_at, ready_said = now - t0, body.strip()
            code, body = get(base + "/metrics")
            if code == 200 and any(float(v) > 0 for v in COUNT.findall(body)):
                return time.monotonic() - t0, ready_at if ready_at is not None else float("nan"), ready_said
            time.sleep(0.025)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Run as root from the repository root.")
    ap.add_argument("--reps", type=int, default=5, help="runs of each command (default 5)")
    ap.add_argument("--pause", type=float, default=3.0,
                    help="seconds between runs: the previous agent's probes let go (default 3)")
    args = ap.parse_args()
    from exporter.simulator.build import build_library

    lib = str(build_library())
    with tempfile.TemporaryDirectory(prefix="start-latency-"):
        job = subprocess.Popen([sys.executable, "-c", JOB, lib], stdout=subprocess.PIPE, text=True)
        try:
            if job.stdout.readline().strip() != "ready":
                raise SystemExit("the job did not start")
            print(f"a job calling the simulator's libnccl every ms; {args.reps} runs each", flush=True)
            traces, runs, readies = [], [], []
            for _ in range(args.reps):
                time.sleep(args.pause)
                took, said = trace_once()
                traces.append(took)
                print(f"  trace: first call counted {took:.2f} s after exec ({said.strip()})", flush=True)
                time.sleep(args.pause)
                took, ready, body = run_once()
                runs.append(took)
                readies.append(ready)
                print(f"  run:   first call on /metrics {took:.2f} s after exec; /-/ready 200 at {ready:.2f} s "
                      f"({body!r})", flush=True)
            print(f"trace: exec -> first call counted, median {statistics.median(traces):.2f} s "
                  f"({min(traces):.2f}..{max(traces):.2f}) (goal: 3 s)")
            print(f"run:   exec -> first call on /metrics, median {statistics.median(runs):.2f} s "
                  f"({min(runs):.2f}..{max(runs):.2f}); /-/ready 200 median {statistics.median(readies):.2f} s "
                  "(goal: 3 s)")
        finally:
            job.kill()
            job.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

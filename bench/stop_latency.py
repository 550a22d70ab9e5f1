"""How long `trace --duration` and `run` take to stop, once a library is attached.

    .venv/bin/python bench/stop_latency.py [--reps 5] [--duration 5] [--lib PATH]

A caller process maps the library (the real NCCL 2.32 wheel's libnccl.so.2
when installed) and calls ncclAllReduce every millisecond, so each agent
attaches its probes to it and records its calls. Then, R times each:

- `nccl-exporter trace --duration D --db F`: the time from its "tracing NCCL
  calls for D s" line (where its clock starts, after compiling and attaching)
  to its exit, minus D (the goal: within 1 s of the duration);
- `nccl-exporter run --db F --listen 127.0.0.1:P`: once /-/ready answers 200,
  SIGTERM; the time from the signal to the exit (the goal: 2 s), and, 2 s
  after the signal, what an uninstrumented call of the library costs
  (bench/driver.c, ncclAllReduce on a NULL communicator in a tight loop)
  against the same measured before any agent ran (the goal: within 10 %:
  the probes are gone).

Each recording is checked: meta's events_recorded equals its rows (nothing
recorded is lost on the way out). Prints the medians and every sample.
As root; loopback only; everything it starts is stopped when it ends.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
CLI = [str(REPO / ".venv" / "bin" / "nccl-exporter")]
sys.path.insert(0, str(REPO))

from bench.agent_ready import wait_ready  # noqa: E402


def default_lib() -> str:
    real = next((REPO / ".venv" / "lib").glob("python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"), None)
    if real is not None:
        return str(real)
    from exporter.simulator.build import build_library

    return str(build_library())


# Maps the library and calls ncclAllReduce every millisecond (on the real NCCL: a NULL
# communicator, ncclInvalidArgument at once) so that the recordings have rows to lose.
CALLER = r"""
import ctypes, sys, time
lib = ctypes.CDLL(sys.argv[1])
lib.ncclAllReduce.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                                      ctypes.c_void_p, ctypes.c_void_p]
end = time.monotonic() + 3600
while time.monotonic() < end:
    lib.ncclAllReduce(None, None, 1, 7, 0, None, None)
    time.sleep(0.001)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_recording(path: str) -> str:
    conn = sqlite3.connect(path)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        rows = sum(conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                   for t in ("nccl_events", "tcp_events", "sched_events", "gpu_intervals"))
    finally:
        conn.close()
    ok = int(meta.get("events_recorded", -1)) == rows and "end_ns" in meta
    return f"{rows} rows, meta {meta.get('events_recorded')}, {'ok' if ok else 'LOST'}"


def trace_once(tmp: str, lib: str, duration: float, i: int) -> tuple[float, str]:
    """Seconds from trace's "tracing NCCL calls for D s" line (its clock starts there) to its
    exit, minus D."""
    out = os.path.join(tmp, f"trace-{i}.db")
    proc = subprocess.Popen([*CLI, "trace", "--duration", f"{duration:g}s", "--db", out, "--nccl-lib", lib],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = None
        for line in proc.stderr:
            if t0 is None and line.startswith("tracing NCCL calls"):
                t0 = time.monotonic()
        proc.wait(120)
        end = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if t0 is None or proc.returncode != 0:
        raise SystemExit(f"trace failed (exit {proc.returncode})")
    return end - t0 - duration, check_recording(out)


DRIVER_CALLS = 2_000_000


def call_ns(driver, lib: str) -> float:
    """ns per call of the library, uninstrumented or not: the median of 3 runs."""
    from bench.probe_overhead import run_driver

    return statistics.median(run_driver(driver, pathlib.Path(lib), DRIVER_CALLS, "null")["ns"] for _ in range(3))


def run_once(tmp: str, lib: str, i: int, driver=None) -> tuple[float, str, float | None]:
    """Seconds from SIGTERM to exit, the recording's check, and (with a
    driver) ns per call of the library 2 s after the SIGTERM."""
    out = os.path.join(tmp, f"run-{i}.db")
    port = free_port()
    proc = subprocess.Popen([*CLI, "run", "--db", out, "--listen", f"127.0.0.1:{port}", "--nccl-lib", lib],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        why = wait_ready(port, proc, 60)
        if why:
            raise SystemExit(f"run: {why}")
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        took = time.monotonic() - t0
        after = None
        if driver is not None:
            time.sleep(max(0.0, t0 + 2.0 - time.monotonic()))
            after = call_ns(driver, lib)
        return took, check_recording(out), after
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--lib", default=None)
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds between runs (the previous run's detaching child ends meanwhile)")
    args = ap.parse_args()
    lib = args.lib or default_lib()
    from bench.probe_overhead import build_driver

    with tempfile.TemporaryDirectory(prefix="stop-latency-driver-") as d:
        driver = build_driver(pathlib.Path(d))
        return measure(args, lib, driver)


def measure(args, lib: str, driver) -> int:
    holder = subprocess.Popen([sys.executable, "-c", CALLER, lib])
    try:
        time.sleep(1.0)
        before = call_ns(driver, lib)  # as after: the caller running beside it
        with tempfile.TemporaryDirectory(prefix="stop-latency-") as tmp:
            print(f"library: {lib}; {args.reps} reps; trace --duration {args.duration:g}s", flush=True)
            traces, runs, afters = [], [], []
            print(f"an uninstrumented call before any agent: {before:.0f} ns", flush=True)
            for i in range(args.reps):
                time.sleep(args.pause)
                late, rec = trace_once(tmp, lib, args.duration, i)
                traces.append(late)
                print(f"  trace: ended {late:+.2f} s after its duration ({rec})", flush=True)
                time.sleep(args.pause)
                took, rec, after = run_once(tmp, lib, i, driver)
                runs.append(took)
                afters.append(after)
                print(f"  run:   exited {took:.2f} s after SIGTERM ({rec}); a call 2 s after SIGTERM "
                      f"{after:.0f} ns ({after / before:.2f}x before)", flush=True)
            print(f"trace --duration: median {statistics.median(traces):+.2f} s past the duration "
                  f"(goal: within 1 s)")
            print(f"run, SIGTERM -> exit: median {statistics.median(runs):.2f} s (goal: 2 s)")
            worst = max(afters) / before
            print(f"a call 2 s after SIGTERM: median {statistics.median(afters):.0f} ns, worst {worst:.2f}x "
                  f"the {before:.0f} ns before any agent (goal: within 10 %)")
    finally:
        holder.kill()
        holder.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

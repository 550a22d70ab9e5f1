"""Stopping loses nothing: `trace --duration` and `run` (SIGTERM) while a process
calls the real NCCL library, with the kernel's detaching left to a child process
(sources/teardown.py). Every event the recording counts is a row, the
recording ended cleanly, and the port `run` listened on is free at once (the
child holds no socket). How fast they stop is measured in bench/stop_latency.py.

Root, BPF and the real NCCL wheel: run it under flock /tmp/nccl-heavy.lock.
"""

from __future__ import annotations

import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import CLI, REPO, free_port, require_real_nccl

# A process that calls ncclAllReduce on a NULL communicator (ncclInvalidArgument at once,
# no GPU) every millisecond until its stdin closes.
CALLER = r"""
import ctypes, sys, threading, time
lib = ctypes.CDLL(sys.argv[1])
lib.ncclAllReduce.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                                      ctypes.c_void_p, ctypes.c_void_p]
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("ready", flush=True)
while not stop.is_set():
    lib.ncclAllReduce(None, None, 1, 7, 0, None, None)
    time.sleep(0.001)
"""


@pytest.fixture()
def caller(bpf):  # bpf: the marker, root and the heavy lock (tests/conftest.py)
    lib = require_real_nccl()
    proc = subprocess.Popen([sys.executable, "-c", CALLER, lib], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield lib
    finally:
        proc.stdin.close()
        proc.wait(10)


def check_nothing_lost(path) -> int:
    conn = sqlite3.connect(path)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        rows = conn.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0]
        others = sum(conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                     for t in ("tcp_events", "sched_events", "sched_intervals", "gpu_intervals"))
    finally:
        conn.close()
    assert "end_ns" in meta, "the recording did not end cleanly"
    assert int(meta["nccl_events_recorded"]) == rows > 0
    assert int(meta["events_recorded"]) == rows + others
    assert meta["lost_total"] == "0", meta
    return rows


def test_trace_duration_records_every_call(caller, tmp_path):
    out = tmp_path / "trace.db"
    r = subprocess.run([*CLI, "trace", "--duration", "3s", "--db", out, "--nccl-lib", caller],
                       capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    check_nothing_lost(out)


def test_run_sigterm_records_every_call_and_frees_its_port(caller, tmp_path):
    out = tmp_path / "run.db"
    port = free_port()
    proc = subprocess.Popen([*CLI, "run", "--db", out, "--listen", f"127.0.0.1:{port}", "--nccl-lib", caller],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "run did not get ready"
            time.sleep(0.1)
        # stop once calls are being counted (up to 30 s): what is checked is
        # that nothing counted is lost at the stop, not how soon counting starts
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                page = resp.read().decode()
            if any(line.startswith("nccl_call_errors_total{") and float(line.rsplit(" ", 1)[1]) > 0
                   for line in page.splitlines()):
                break
            time.sleep(0.2)
        time.sleep(1.5)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    assert "stopped" in output
    check_nothing_lost(out)
    with socket.socket() as s:  # a restarted agent can listen at once (as it does: SO_REUSEADDR)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()

"""The fault benchmark's small helpers: its log, ports, HTTP reads, child
processes, and Prometheus's time stamps (bench/faults/run.py)."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S ") + msg, flush=True)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def wait_for(what: str, check, proc: subprocess.Popen, logfile: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {logfile.read_text()[-2000:]}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} not ready in {timeout:.0f} s: {logfile.read_text()[-2000:]}")


def stop_proc(p: subprocess.Popen | None, sig=signal.SIGINT, timeout: float = 30) -> None:
    if p is None or p.poll() is not None:
        return
    p.send_signal(sig)
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _unix(rfc3339: str) -> float:  # Prometheus's activeAt: "2026-11-27T10:00:00.123456789Z"
    head, _, frac = rfc3339.rstrip("Z").partition(".")
    return datetime.fromisoformat(head).replace(tzinfo=timezone.utc).timestamp() + float("0." + (frac or "0"))

"""Waiting for an agent a bench started: `nccl-exporter run` answers /-/ready with
200 once its probes are loaded and attached (docs/deploy.md)."""

from __future__ import annotations

import subprocess
import time
import urllib.request


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> str | None:
    """None once http://127.0.0.1:PORT/-/ready answers 200; else why not (the
    process exited, or `timeout` seconds passed)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return None
        except OSError:
            pass
        if proc.poll() is not None:
            return f"the agent exited (rc={proc.returncode})"
        if time.monotonic() > deadline:
            return f"the agent did not get ready in {timeout:g} s"
        time.sleep(0.2)

"""Shared test helpers. Small, stable API -- tests/test_e2e_*.py import it too:

    from tests.helpers import running_exporter, sample_value   # pythonpath = ["."]

Paths
    REPO            the repository root
    CLI             argv prefix that runs the real `nccl-exporter` CLI of this venv
    REAL_NCCL_LIB   the NCCL wheel's libnccl.so.2 (`make nccl-wheel`), or None

Guards (call at the top of a test; they pytest.skip with a reason)
    require_root()
    require_real_nccl() -> str        path of the wheel's libnccl.so.2

Processes
    free_port(host="127.0.0.1") -> int
    run_cli(*args, prefix=(), timeout=60, env=None) -> subprocess.CompletedProcess
        runs `nccl-exporter ARGS` (optionally behind `prefix`, e.g. setpriv ...),
        text mode, stdout/stderr captured.
    running_exporter(*args, port=None, start_timeout=60, stop_timeout=120, env=None)
        context manager: `nccl-exporter run --listen 127.0.0.1:PORT ARGS` in the
        background; returns once GET /metrics answers with the collector's metrics
        (nccl_exporter_build_info: probes loaded, libraries attached). Yields an Exporter:
            .port .url .proc   .scrape() -> str   .samples() -> list[Sample]
            .output() -> str   (stdout + stderr so far; all of it after the `with`)
        On exit: SIGTERM, wait (detaching uprobes can take ~0.1-0.3 s per probe on
        some kernels, so stop_timeout is generous), SIGKILL if still alive.

Prometheus text
    parse_metrics(text) -> list[Sample]   (prometheus_client Samples: .name .labels .value)
    sample_values(samples_or_text, name, **labels) -> list[float]
        every sample called `name` (full sample name, e.g. "nccl_call_errors_total",
        "nccl_collective_duration_seconds_bucket") whose labels include `labels`
    sample_value(samples_or_text, name, **labels) -> float | None
        the one such sample's value; None when there is none; AssertionError if several
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = [
    "REPO", "CLI", "REAL_NCCL_LIB",
    "require_root", "require_real_nccl",
    "free_port", "run_cli", "running_exporter", "Exporter",
    "parse_metrics", "sample_values", "sample_value",
]

REPO = Path(__file__).resolve().parent.parent
READY_METRIC = "nccl_exporter_build_info"  # exported once the agent is attached


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "nccl-exporter"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "exporter"]


CLI: list[str] = _cli()


def _find_real_nccl() -> str | None:
    roots = [p for p in sys.path if p.endswith("site-packages")]
    roots += glob.glob(str(REPO / ".venv/lib/python3*/site-packages"))
    for root in roots:
        path = os.path.join(root, "nvidia", "nccl", "lib", "libnccl.so.2")
        if os.path.isfile(path):
            return path
    return None


REAL_NCCL_LIB: str | None = _find_real_nccl()


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (loads BPF programs / changes users or mounts)")


def require_real_nccl() -> str:
    if REAL_NCCL_LIB is None:
        pytest.skip("the NCCL wheel's libnccl.so.2 is not installed in this venv (make nccl-wheel)")
    return REAL_NCCL_LIB


# --- processes -------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_cli(*args: str, prefix=(), timeout: float = 60, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    """Run `nccl-exporter ARGS` to completion; stdout and stderr captured as text."""
    return subprocess.run(
        [*prefix, *CLI, *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO),
    )


@dataclass
class Exporter:
    port: int
    url: str
    proc: subprocess.Popen
    log_path: str
    _final_output: str | None = None

    def scrape(self, timeout: float = 10) -> str:
        with urllib.request.urlopen(self.url, timeout=timeout) as r:
            return r.read().decode()

    def samples(self) -> list[Sample]:
        return parse_metrics(self.scrape())

    def output(self) -> str:
        if self._final_output is not None:  # the process is gone, its log read
            return self._final_output
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def running_exporter(*args: str, port: int | None = None, start_timeout: float = 60,
                     stop_timeout: float = 120, env: dict | None = None):
    """`nccl-exporter run --listen 127.0.0.1:PORT ARGS`, ready to scrape."""
    port = port or free_port()
    log = tempfile.NamedTemporaryFile(prefix="nccl-exporter-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [*CLI, "run", "--listen", f"127.0.0.1:{port}", *map(str, args)],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
    )
    log.close()
    exporter = Exporter(port=port, url=f"http://127.0.0.1:{port}/metrics", proc=proc,
                        log_path=log.name)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"nccl-exporter exited with {proc.returncode} before "
                                     f"serving /metrics:\n{exporter.output()}")
            try:
                # The HTTP server starts before the probes are loaded: an empty
                # page is not ready yet; the collector's build_info is.
                if READY_METRIC in exporter.scrape(timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"/metrics did not answer within {start_timeout} s:\n"
                                     f"{exporter.output()}")
            time.sleep(0.1)
        yield exporter
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(OSError):
            exporter._final_output = exporter.output()
            os.unlink(log.name)


# --- Prometheus text ----------------------------------------------------------------

def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def sample_values(samples, name: str, **labels: str) -> list[float]:
    if isinstance(samples, str):
        samples = parse_metrics(samples)
    want = {k: str(v) for k, v in labels.items()}
    return [s.value for s in samples
            if s.name == name and all(s.labels.get(k) == v for k, v in want.items())]


def sample_value(samples, name: str, **labels: str) -> float | None:
    values = sample_values(samples, name, **labels)
    assert len(values) <= 1, f"{len(values)} samples of {name} match {labels}: {values}"
    return values[0] if values else None

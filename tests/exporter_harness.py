"""Run the real `nccl-exporter run` in the background and read its /metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from exporter import histogram


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ExporterProcess:
    """`with ExporterProcess(nccl_libs=[...]) as e: e.scrape()`; [] means discovery."""

    def __init__(self, nccl_libs=(), extra_args=(), node="test-node", startup_timeout=60):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.argv = [sys.executable, "-m", "exporter", "run", "--listen", f"127.0.0.1:{self.port}",
                     "--node", node, "--log-level", "info", *extra_args]
        for lib in nccl_libs:
            self.argv += ["--nccl-lib", str(lib)]
        self.startup_timeout = startup_timeout
        self.proc = None
        self.log = tempfile.NamedTemporaryFile(prefix="exporter-", suffix=".log", delete=False)

    def __enter__(self):
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exporter exited {self.proc.returncode}:\n{self.output()}")
            if "metrics at http" in self.output():
                try:
                    self.scrape()
                    return self
                except OSError:
                    pass
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"exporter did not start within {self.startup_timeout} s:\n{self.output()}")

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if exc[0] is not None:
            sys.stderr.write(f"--- exporter log ---\n{self.output()}\n")
        os.unlink(self.log.name)

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def text(self) -> str:
        with urllib.request.urlopen(self.url, timeout=10) as r:
            return r.read().decode()

    def scrape(self) -> list:
        return list(text_string_to_metric_families(self.text()))

    @staticmethod
    def samples(families, name: str) -> list:
        """Samples of a gauge or counter family, by its full metric name."""
        return [s for fam in families for s in fam.samples if s.name == name]


def series_by_labels(families, name: str) -> list[tuple[dict, list[int]]]:
    """A histogram family -> [(labels without le, per-bucket counts in kernel order)]."""
    cumulative: dict[tuple, list[tuple[float, float]]] = {}
    for fam in families:
        if fam.name != name:
            continue
        for s in fam.samples:
            if not s.name.endswith("_bucket"):
                continue
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            cumulative.setdefault(labels, []).append((float(s.labels["le"]), s.value))
    out = []
    for labels, pairs in cumulative.items():
        pairs.sort()
        assert len(pairs) == histogram.SLOTS, f"{name}{dict(labels)}: {len(pairs)} buckets"
        counts, prev = [], 0.0
        for _le, c in pairs:
            counts.append(int(c - prev))
            prev = c
        out.append((dict(labels), counts))
    return out

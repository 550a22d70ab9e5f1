"""Everything the tests share, in one place: paths, guards, running the real
CLI and exporter, reading Prometheus text, and tiny shared libraries compiled
with the system gcc (fixtures). Tests import the helpers by name:

    from conftest import running_exporter, sample_value

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
    running_exporter(*args, ...)  context manager: `nccl-exporter run` in the
        background, ready to scrape; yields an Exporter (.scrape() -> text,
        .samples(), .output()); SIGTERM on exit.
    ExporterProcess(nccl_libs=..., extra_args=...)  the same as a class whose
        .scrape() returns parsed families (the e2e tests' form);
        series_by_labels(families, name) -> per-bucket counts of a histogram.

Prometheus text
    parse_metrics(text), sample_values(samples, name, **labels), sample_value(...)

Contracts
    check_promql(expr, where) -> metric names an expression reads; asserts
        every nccl_* name and label in it exists in exporter/records/metrics.py
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from exporter.records import histogram, metrics

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


# --- the exporter as a class (families) -----------------------------------------

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


# --- a static page over HTTP ------------------------------------------------------

def serve_text(text: str, content_type: str = "text/plain; version=0.0.4"):
    """A loopback HTTP server that answers every GET with `text` (a fake
    /metrics page), serving from a thread; returns the server (.server_address,
    .shutdown())."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = text.encode()

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# --- the kernel side, for tests that load the sources themselves ----------------

def pin(pid: int, cpu: int) -> None:
    """Pin every thread of a process to one CPU (those it has now)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {cpu})
        except OSError:
            pass


@pytest.fixture(scope="module")
def tcp(probes):
    """bpf/tcp.c loaded after the module's own `probes` (the NCCL source, its owner)."""
    from exporter.sources.tcp import TcpSource

    source = TcpSource()
    yield source
    source.close()


@pytest.fixture(scope="module")
def sched(probes):
    """bpf/sched.c loaded after the module's own `probes` (the NCCL source, its owner)."""
    from exporter.sources.sched import SchedSource

    source = SchedSource()
    yield source
    source.close()


# --- contracts: PromQL against exporter/records/metrics.py --------------------------

# Labels Prometheus adds itself, and the histogram bucket label.
PROMETHEUS_LABELS = {"job", "instance", "le", "__name__"}
_EXPOSED = metrics.exposed_names()


def check_promql(expr: str, where: str) -> set[str]:
    """The nccl_* metrics an expression reads (declared names). Asserts that
    each is in the contract, that label matchers right after a name use that
    metric's labels, and that by/without/on/ignoring/group_* clauses name
    labels of some metric the expression reads."""
    read = set()
    for sample in set(re.findall(r"\b(nccl_[a-z_]+)\b", expr)):
        assert sample in _EXPOSED, f"{where}: unknown metric {sample}"
        read.add(_EXPOSED[sample])
    for sample, body in re.findall(r"\b(nccl_[a-z_]+)\s*\{([^}]*)\}", expr):
        allowed = set(_EXPOSED[sample].labels) | PROMETHEUS_LABELS
        for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", body):
            assert name in allowed, f"{where}: {sample} has no label {name!r}"
    known = set().union(*(m.labels for m in read)) | PROMETHEUS_LABELS if read else set()
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        for name in filter(None, (n.strip() for n in clause.split(","))):
            assert not read or name in known, f"{where}: label {name!r} is on none of {sorted(m.name for m in read)}"
    return {m.name for m in read}


# --- tiny shared libraries ----------------------------------------------------------

FAKE_NCCL_C = r"""
typedef int ncclResult_t;
ncclResult_t pncclAllReduce(const void *s, void *r, unsigned long n, int t, int op,
                            void *comm, void *stream) { return (int)n; }
ncclResult_t ncclAllReduce(const void *s, void *r, unsigned long n, int t, int op,
                           void *comm, void *stream)
    __attribute__((weak, alias("pncclAllReduce")));
ncclResult_t pncclGroupStart(void) { return 0; }
ncclResult_t ncclGroupStart(void) __attribute__((weak, alias("pncclGroupStart")));
int nccl_internal_counter = 3;                       /* an object, not a function */
static int helper(int x) { return x + nccl_internal_counter; }
int uses_helper(int x) { return helper(x); }
__attribute__((visibility("hidden"))) int hidden_fn(void) { return 1; }
extern int getppid(void);                            /* undefined here, from libc */
int calls_external(void) { return getppid(); }
"""

PLAIN_C = r"""
int foo_plain(int x) { return x * 2; }
"""


def _compile(src: str, out: Path) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed (make deps)")
    c = out.with_suffix(".c")
    c.write_text(src)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1",
         "-o", str(out), str(c)],
        check=True,
    )
    return out


@pytest.fixture(scope="session")
def fake_nccl_lib(tmp_path_factory) -> Path:
    """A tiny libnccl.so.2: pncclAllReduce + weak alias ncclAllReduce, etc."""
    d = tmp_path_factory.mktemp("fake-nccl")
    return _compile(FAKE_NCCL_C, d / "libnccl.so.2")


@pytest.fixture(scope="session")
def static_nccl_lib(tmp_path_factory) -> Path:
    """NCCL 'statically linked' into a library whose name is not libnccl*."""
    d = tmp_path_factory.mktemp("static-nccl")
    return _compile(FAKE_NCCL_C, d / "libtrainer_core.so")


@pytest.fixture(scope="session")
def plain_lib(tmp_path_factory) -> Path:
    """A shared library with no NCCL symbols at all."""
    d = tmp_path_factory.mktemp("plain")
    return _compile(PLAIN_C, d / "libplain.so")

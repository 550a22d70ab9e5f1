"""Everything the tests share, in one place: paths, guards, running the real
CLI and exporter, reading Prometheus text, and tiny shared libraries compiled
with the system gcc (fixtures). Tests import the helpers by name:

    from conftest import running_exporter, sample_value

Paths
    REPO            the repository root
    CLI             argv prefix that runs the real `nccl-exporter` CLI of this venv
    REAL_NCCL_LIB   the NCCL wheel's libnccl.so.2 (`make nccl-wheel`), or None

Markers, applied here from the fixtures a test uses (nobody adds them by hand)
    bpf          the test loads BPF programs: fixture `bpf` (and `probes`,
                 `tcp`, `sched`, `launch_exporter`, which use it)
    netns        it builds network namespaces: fixture `netns`
    real_nccl    it maps the NCCL wheel's libnccl: fixture `real_nccl`
    prometheus   it runs Prometheus/Alertmanager/promtool: fixture `prometheus`
    slow         minutes of work (soak, wheel install), or timing that test-quick's
                 parallel workers break: `pytest.mark.slow`
    require_root bpf and netns imply it; skips the test when not root
  A test marked by hand (pytest.mark.bpf etc.) gets the fixture, so it is the
  same thing either way. `make test-quick` runs what has none of these.

The heavy lock
    bpf, netns, real_nccl and prometheus tests take /tmp/nccl-heavy.lock (one
    module at a time) so that developers sharing a machine do not load each
    other's agents and CPUs; see `heavy_lock` for running the suite under
    `flock /tmp/nccl-heavy.lock` yourself (no deadlock) and NCCL_HEAVY_LOCK.

Guards (call at the top of a test or fixture; they pytest.skip with a reason)
    require_root()
    require_real_nccl() -> str        path of the wheel's libnccl.so.2

Fixtures
    simulator_lib    the simulator's libnccl.so.2, built once per session
    launch_exporter  running_exporter, for a test (marks it bpf)

Processes
    free_port(host="127.0.0.1") -> int
    run_cli(*args, prefix=(), timeout=60, env=None) -> subprocess.CompletedProcess
    running_exporter(*args, ...)  the one exporter launcher: `nccl-exporter run`
        in the background, ready to scrape (or as `ready(exporter)` says);
        yields an Exporter (.scrape() -> text, .samples(), .families(),
        .output()); SIGTERM on exit.
    ExporterProcess(nccl_libs=..., extra_args=...)  the same launcher with
        the e2e tests' options (--node, --log-level info) and form
        (.scrape() -> parsed families, .text());
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


ROOT_REASON = "needs root (loads BPF programs, builds network namespaces or changes users)"


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip(ROOT_REASON)


def require_real_nccl() -> str:
    if REAL_NCCL_LIB is None:
        pytest.skip("the NCCL wheel's libnccl.so.2 is not installed in this venv (make nccl-wheel)")
    return REAL_NCCL_LIB


# --- markers, from the fixtures a test uses ------------------------------------------

# What each kind of test needs, by the fixture that provides it (and that a
# test, or a fixture it uses, asks for). bpf and netns need root.
KINDS = {
    "bpf": "loads BPF programs into the running kernel (root; takes the heavy lock)",
    "netns": "builds network namespaces (root; takes the heavy lock)",
    "real_nccl": "maps the NCCL wheel's libnccl.so.2 (make nccl-wheel; takes the heavy lock)",
    "prometheus": "runs Prometheus, Alertmanager or promtool (Debian packages; takes the heavy lock)",
}
NEEDS_ROOT = {"bpf", "netns"}


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/fixtures/metrics.txt from the fake sources (test_sink_http.py)")


def pytest_configure(config):
    for name, what in KINDS.items():
        config.addinivalue_line("markers", f"{name}: {what}; applied from the fixture `{name}`")
    config.addinivalue_line("markers", "slow: minutes of work (soak, wheel install), or timing that a loaded "
                                       "machine breaks; not in make test-quick")
    config.addinivalue_line("markers", "require_root: skipped unless root (bpf and netns imply it)")


def pytest_collection_modifyitems(config, items):
    """Each test's markers from the fixtures it uses, directly or through other
    fixtures; a kind marked by hand gets its fixture, so the two are one."""
    for item in items:
        names = getattr(item, "fixturenames", None)
        if names is None:
            continue
        for kind in KINDS:
            if kind in names and item.get_closest_marker(kind) is None:
                item.add_marker(kind)
            elif item.get_closest_marker(kind) is not None and kind not in names:
                names.insert(0, kind)  # the fixture: its lock, its skip
        if any(item.get_closest_marker(k) for k in NEEDS_ROOT) and not item.get_closest_marker("require_root"):
            item.add_marker("require_root")


def pytest_runtest_setup(item):
    if item.get_closest_marker("require_root") is not None:
        require_root()


HEAVY_LOCK = "/tmp/nccl-heavy.lock"


def _lock_holders(path: str) -> set[int]:
    """Pids holding a flock(2) lock on `path` (/proc/locks; waiters left out)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders = set()
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want:
            holders.add(int(fields[4]))
    return holders


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


@pytest.fixture(scope="module")
def heavy_lock():
    """/tmp/nccl-heavy.lock, exclusively, for the rest of the module: developers
    sharing a machine run one heavy module at a time (BPF agents are node-wide
    and see each other's jobs; two CPUs do not time two jobs well).

    No deadlock when the suite itself runs under `flock /tmp/nccl-heavy.lock
    make test` (or any ancestor holds it, as .ci/run may): a lock held by a
    process this one descends from is ours already, and is not taken again
    (flock(2) from a new open() would wait for it forever). NCCL_HEAVY_LOCK=held
    says the same explicitly; NCCL_HEAVY_LOCK=off takes no lock."""
    mode = os.environ.get("NCCL_HEAVY_LOCK", "")
    if mode in ("held", "off") or _lock_holders(HEAVY_LOCK) & _ancestors():
        yield
        return
    import fcntl

    fd = os.open(HEAVY_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.stderr.write(f"\n[waiting for {HEAVY_LOCK}, held by pid "
                             f"{','.join(map(str, sorted(_lock_holders(HEAVY_LOCK)))) or '?'}]\n")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases it


@pytest.fixture(scope="module")
def bpf(heavy_lock):
    """This module loads BPF programs: root, and the heavy lock."""
    require_root()


@pytest.fixture(scope="module")
def netns(heavy_lock):
    """This module builds network namespaces (exporter/simulator/cluster.py): root, the heavy lock."""
    require_root()


@pytest.fixture(scope="module")
def real_nccl(heavy_lock) -> str:
    """The NCCL wheel's libnccl.so.2 (a process that maps it is traced by every agent)."""
    return require_real_nccl()


@pytest.fixture(scope="module")
def prometheus(heavy_lock):
    """Prometheus and friends run here: the heavy lock (they are skipped where not installed)."""


@pytest.fixture(scope="session")
def simulator_lib() -> Path:
    """The simulator's libnccl.so.2 (exporter/simulator/build.py), built once a session."""
    from exporter.simulator.build import build_library

    return build_library()


@pytest.fixture
def launch_exporter(bpf):
    """running_exporter, for a test: `with launch_exporter("--node", "t") as e: ...`."""
    return running_exporter


# --- processes -------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_detaching(timeout: float = 60) -> None:
    """Until no stopped agent's child is still detaching its probes (sources/bpf.py
    Teardown). A new agent need not wait, but while one detaches its ~90 uprobes
    (serialised in the kernel) the new agent's attaching is slowed by seconds: a
    test that times attaching against a job's first call waits first."""
    from exporter.sources.bpf import Teardown

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = False
        for comm in Path("/proc").glob("[0-9]*/comm"):
            try:
                busy = comm.read_text().strip() == Teardown.NAME
            except OSError:
                continue
            if busy:
                break
        if not busy:
            return
        time.sleep(0.2)


def run_cli(*args: str, prefix=(), timeout: float = 60, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    """Run `nccl-exporter ARGS` to completion; stdout and stderr captured as text."""
    return subprocess.run(
        [*prefix, *CLI, *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO),
    )


class Exporter:
    """`nccl-exporter run --listen 127.0.0.1:PORT ARGS` in the background: the
    one way the tests launch the exporter (running_exporter, ExporterProcess,
    test_http's served page). Entering waits until it is ready: `ready(self)`
    returns true, by default when /metrics shows the collector's build_info
    (the HTTP server starts before the probes are loaded: an empty page is not
    ready yet). Leaving sends `stop_signal` and keeps the log for .output()."""

    def __init__(self, *args: str, port: int | None = None, env: dict | None = None,
                 start_timeout: float = 60, stop_timeout: float = 120, ready=None,
                 stop_signal: int = signal.SIGTERM):
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/metrics"
        self.argv = [*CLI, "run", "--listen", f"127.0.0.1:{self.port}", *map(str, args)]
        self.env, self.start_timeout, self.stop_timeout = env, start_timeout, stop_timeout
        self.ready = ready or (lambda e: READY_METRIC in Exporter.scrape(e, timeout=2))
        self.stop_signal = stop_signal
        self.proc: subprocess.Popen | None = None
        self.log_path = ""
        self._final_output: str | None = None

    def __enter__(self):
        log = tempfile.NamedTemporaryFile(prefix="nccl-exporter-", suffix=".log", delete=False)
        self.log_path = log.name
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env, cwd=str(REPO))
        log.close()
        try:
            deadline = time.monotonic() + self.start_timeout
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"nccl-exporter exited with {self.proc.returncode} before "
                                         f"it was ready:\n{self.output()}")
                try:
                    if self.ready(self):
                        return self
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"nccl-exporter was not ready within {self.start_timeout} s:\n"
                                         f"{self.output()}")
                time.sleep(0.05)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._final_output is None and self.log_path:
            with contextlib.suppress(OSError):
                self._final_output = self.output()
                os.unlink(self.log_path)
        if exc and exc[0] is not None and self._final_output is not None:
            sys.stderr.write(f"--- exporter log ---\n{self._final_output}\n")

    def scrape(self, timeout: float = 10) -> str:
        with urllib.request.urlopen(self.url, timeout=timeout) as r:
            return r.read().decode()

    def samples(self) -> list[Sample]:
        return parse_metrics(self.scrape())

    def families(self) -> list:
        return list(text_string_to_metric_families(Exporter.scrape(self)))

    def output(self) -> str:
        if self._final_output is not None:  # the process is gone, its log read
            return self._final_output
        with open(self.log_path, errors="replace") as f:
            return f.read()


def running_exporter(*args: str, **options) -> Exporter:
    """`with running_exporter("--node", "t") as e: e.scrape()`: see Exporter."""
    return Exporter(*args, **options)


class ExporterProcess(Exporter):
    """`with ExporterProcess(nccl_libs=[...]) as e: e.scrape()`; [] means
    discovery. The e2e tests' form: --node and --log-level info, .scrape()
    returns parsed families and .text() the page; stopped with SIGINT."""

    def __init__(self, nccl_libs=(), extra_args=(), node="test-node", startup_timeout=60):
        args = ["--node", node, "--log-level", "info", *extra_args]
        for lib in nccl_libs:
            args += ["--nccl-lib", str(lib)]
        super().__init__(*args, start_timeout=startup_timeout, stop_signal=signal.SIGINT)

    def text(self) -> str:
        return Exporter.scrape(self)

    def scrape(self) -> list:
        return self.families()

    @staticmethod
    def samples(families, name: str) -> list:
        """Samples of a gauge or counter family, by its full metric name."""
        return [s for fam in families for s in fam.samples if s.name == name]


# --- Prometheus text ----------------------------------------------------------------

def exposition(families) -> str:
    """The text exposition of metric families (a collector's output), as a scrape gets it."""
    from prometheus_client import CollectorRegistry, generate_latest

    class Families:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    return generate_latest(registry).decode()


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


CLASSIC = histogram.CLASSIC[histogram.DEFAULT_CLASSIC]


def classic_bucket(duration_ns: int) -> int:
    """The default classic bucket (text scrapes) a duration is counted in."""
    return CLASSIC.bucket_of_slot(histogram.DURATION, histogram.bucket_of(duration_ns))


def series_by_labels(families, name: str) -> list[tuple[dict, list[int]]]:
    """A histogram family of a text scrape -> [(labels without le, per-bucket counts
    of its classic buckets)] (records/histogram.py CLASSIC; `classic_bucket` maps a
    duration there)."""
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
        want = len(CLASSIC.bounds(histogram.DURATION)) + 1
        assert len(pairs) == want, f"{name}{dict(labels)}: {len(pairs)} buckets"
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
# Other exporters' metrics the dashboards join to ours (docs/network.md):
# node_exporter's infiniband collector, per device and port.
COMPANION_LABELS = {f"node_infiniband_{m}": ("device", "port") for m in (
    "port_transmit_wait_total", "port_errors_received_total", "link_downed_total",
    "port_data_received_bytes_total", "port_data_transmitted_bytes_total")}
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
    for sample in set(re.findall(r"\b(node_[a-z_]+)\b", expr)):
        assert sample in COMPANION_LABELS, f"{where}: unknown companion metric {sample}"
        known |= set(COMPANION_LABELS[sample])
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

"""The agent's HTTP endpoints: /metrics (gzip when asked), /-/ready (503 until
the probes count, then 200), /-/healthy, 404 elsewhere, and sd_notify READY=1
to $NOTIFY_SOCKET. One real exporter serves the module (BPF: root, the heavy
lock). The same serving without root or BPF, on a fake reader:
tests/test_sink_http.py."""

from __future__ import annotations

import gzip
import os
import socket
import time
import urllib.error
import urllib.request

import pytest

from conftest import READY_METRIC, Exporter, parse_metrics
from exporter.sinks.http import notify_systemd


def get(url: str, headers: dict | None = None, timeout: float = 5) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# --- sd_notify, without an exporter --------------------------------------------------

def _datagram_socket(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(5)
    return s


def test_notify_systemd_path_socket(tmp_path):
    path = str(tmp_path / "notify")
    with _datagram_socket(path) as s:
        assert notify_systemd("READY=1", {"NOTIFY_SOCKET": path})
        assert s.recv(4096) == b"READY=1"


def test_notify_systemd_abstract_socket():
    name = f"nccl-exporter-test-{os.getpid()}-{time.monotonic_ns()}"
    with _datagram_socket("\0" + name) as s:
        assert notify_systemd("READY=1", {"NOTIFY_SOCKET": "@" + name})
        assert s.recv(4096) == b"READY=1"


def test_notify_systemd_unset_or_unreachable(tmp_path):
    assert notify_systemd("READY=1", {}) is False
    assert notify_systemd("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "nobody")}) is False


# --- /-/healthy follows the agent loop's heartbeat, without an agent --------------------

def test_healthy_is_503_while_starting_and_when_the_loop_stalls():
    from prometheus_client import CollectorRegistry

    from exporter.sinks.http import STALL_S, HttpServer

    server = HttpServer("127.0.0.1", 0, CollectorRegistry(auto_describe=False))
    base = f"http://127.0.0.1:{server.port}/-/healthy"
    try:
        assert get(base)[0] == 200  # no agent watched: the server alone
        beat: list = [None]
        server.watch(lambda: beat[0])
        code, _, body = get(base)
        assert code == 503 and body.startswith(b"starting:"), body
        beat[0] = time.monotonic()
        assert get(base)[0] == 200
        beat[0] = time.monotonic() - STALL_S - 5  # the loop has not turned for longer than STALL_S
        code, _, body = get(base)
        assert code == 503 and b"has not turned for" in body, body
    finally:
        server.shutdown()


# --- one real exporter ------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(fake_nccl_lib, tmp_path_factory, bpf):
    """`run --nccl-lib LIB` with NOTIFY_SOCKET set; /-/ready polled from the first moment."""
    notify_path = str(tmp_path_factory.mktemp("notify") / "sock")
    notify = _datagram_socket(notify_path)
    statuses: list[int] = []  # /-/ready answers, in order (deduplicated)
    healthy: list[int] = []  # /-/healthy answers, in order (deduplicated)
    metrics_before_ready: list[str] = []

    def ready(exporter) -> bool:
        code, _, body = get(exporter.base + "/-/ready", timeout=2)
        if not statuses or statuses[-1] != code:
            statuses.append(code)
        alive = get(exporter.base + "/-/healthy", timeout=2)[0]
        if not healthy or healthy[-1] != alive:
            healthy.append(alive)
        if code != 200 and not metrics_before_ready:
            metrics_before_ready.append(get(exporter.url)[2].decode())
        return body == b"ready\n"  # 200, and the kernel-side sources loaded too (they load after counting)

    env = dict(os.environ, NOTIFY_SOCKET=notify_path)
    try:
        with Exporter("--log-level", "info", "--nccl-lib", fake_nccl_lib, env=env, ready=ready,
                      stop_timeout=60) as exporter:
            yield {"base": exporter.base, "statuses": statuses, "notify": notify, "log": exporter.log_path,
                   "metrics_before_ready": metrics_before_ready, "healthy": healthy}
    finally:
        notify.close()


def test_ready_goes_from_503_to_200(served):
    assert served["statuses"] == [503, 200]
    # /metrics answered before readiness too (without the agent's families yet)
    assert served["metrics_before_ready"] and READY_METRIC not in served["metrics_before_ready"][0]
    code, _, body = get(served["base"] + "/-/ready")
    assert code == 200 and body == b"ready\n"
    # once ready, the collector is registered
    assert READY_METRIC in get(served["base"] + "/metrics")[2].decode()


def test_ready_is_logged_once_and_notified(served):
    served["notify"].settimeout(10)
    message = served["notify"].recv(4096).decode()
    assert message.splitlines()[0] == "READY=1"
    with open(served["log"]) as f:
        lines = [line for line in f if " ready" in line.lower() or line.lower().startswith("ready")]
    assert len(lines) == 1, lines
    assert "attached" in open(served["log"]).read()


def test_healthy_only_once_the_agent_loop_turns(served):
    """503 while compiling and attaching (what a startupProbe waits for), then 200."""
    assert served["healthy"][0] == 503 and served["healthy"][-1] in (200, 503), served["healthy"]
    deadline = time.monotonic() + 10
    while (code := get(served["base"] + "/-/healthy")[0]) != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    code, headers, body = get(served["base"] + "/-/healthy")
    assert code == 200 and body == b"healthy\n"


@pytest.mark.parametrize("path", ["/", "/metricsx", "/-/readyz", "/favicon.ico", "/metrics/x"])
def test_other_paths_are_404(served, path):
    code, _, body = get(served["base"] + path)
    assert code == 404, (path, body)
    assert READY_METRIC.encode() not in body


def test_metrics_gzip_when_asked(served):
    code, plain_headers, plain = get(served["base"] + "/metrics")
    assert code == 200 and "Content-Encoding" not in plain_headers
    code, headers, body = get(served["base"] + "/metrics", {"Accept-Encoding": "gzip"})
    assert code == 200 and headers["Content-Encoding"] == "gzip"
    unzipped = gzip.decompress(body).decode()
    # the same families (values move between scrapes; families may come, as a
    # process is learnt meanwhile, but none goes)
    def names(text):
        return {s.name for s in parse_metrics(text)}
    assert names(plain.decode()) <= names(unzipped)
    assert READY_METRIC in unzipped
    assert len(body) < len(plain)


def test_not_ready_while_a_library_failed_to_attach():
    from types import SimpleNamespace

    from exporter.agent.pipeline import attach_problems

    ok = SimpleNamespace(path="/a/libnccl.so.2", attached={"ncclAllReduce": "ALL_REDUCE"},
                         failed={}, missing=["ncclGather"])
    bad = SimpleNamespace(path="/b/libnccl.so.2", attached={"ncclAllReduce": "ALL_REDUCE"},
                          failed={"ncclBroadcast": "Failed to attach BPF to uprobe"}, missing=[])
    assert attach_problems([ok]) == []
    (line,) = attach_problems([ok, bad])
    assert "1 of 2 NCCL functions in /b/libnccl.so.2" in line and "uprobe" in line

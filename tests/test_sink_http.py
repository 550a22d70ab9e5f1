"""The Prometheus sink without root or BPF: /metrics served on an ephemeral
port from a registry fed by fake sources (tests/fake_sources.py), wired by
the same Pipeline `run` uses.

- The exposition of every family is diffed against the checked-in
  tests/fixtures/metrics.txt. After a deliberate change to what /metrics
  shows, regenerate it with

      .venv/bin/python -m pytest tests/test_sink_http.py --update-golden

  and review the diff like code.
- Serving: gzip when asked, OpenMetrics when asked, HEAD, /-/ready (503, then
  200), /-/healthy, 404 elsewhere.
- Wiring a new source (one row of SOURCES) onto /metrics: tests/test_source_plugin.py.
"""

from __future__ import annotations

import gzip
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import fake_sources
from exporter import __version__
from conftest import REPO, parse_metrics
from exporter.records import metrics
from exporter.sinks.prometheus import collector as prometheus_collector
from exporter.sinks.http import HttpServer
from exporter.agent.pipeline import Pipeline

GOLDEN = REPO / "tests" / "fixtures" / "metrics.txt"
NODE = "node-a"


@pytest.fixture
def frozen_clock(monkeypatch):
    """The sink's clocks at fixed values (ages and the scrape duration are
    exact), and the fake sources' processes alive."""
    import time as real_time
    from types import SimpleNamespace

    fake_time = SimpleNamespace(clock_gettime_ns=lambda clock: fake_sources.NOW_NS,
                                CLOCK_MONOTONIC=real_time.CLOCK_MONOTONIC,
                                perf_counter=lambda: 1.0, time=lambda: 1.7e9)
    monkeypatch.setattr(prometheus_collector, "time", fake_time)
    # the fake sources' pid counts as a living process
    monkeypatch.setattr(prometheus_collector, "alive_checker", lambda: lambda pid: True)


def registry_of(agent, **sinks) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    Pipeline(agent, NODE).serve_metrics(registry, **sinks)
    return registry


@pytest.fixture
def served(frozen_clock):
    """HttpServer on 127.0.0.1:0 over the fake sources; yields (server, base URL)."""
    server = HttpServer("127.0.0.1", 0, registry_of(fake_sources.FakeAgent(), spans=fake_sources.FakeSpans(),
                                                    recorder=fake_sources.FakeRecorder()))
    try:
        yield server, f"http://127.0.0.1:{server.port}"
    finally:
        server.shutdown()


def get(url: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# --- the golden exposition ------------------------------------------------------------

def exposition() -> str:
    """The fake sources' /metrics page; the version is a placeholder there (it
    is written once, in exporter/__init__.py: test_wheel.py)."""
    agent = fake_sources.FakeAgent()
    text = generate_latest(registry_of(agent, spans=fake_sources.FakeSpans(),
                                       recorder=fake_sources.FakeRecorder())).decode()
    return text.replace(f'version="{__version__}"', 'version="VERSION"')


def test_exposition_matches_the_golden_file(frozen_clock, request):
    text = exposition()
    if request.config.getoption("--update-golden"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert GOLDEN.is_file(), f"{GOLDEN} missing: run pytest {__file__} --update-golden"
    want = GOLDEN.read_text()
    if text != want:
        import difflib

        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            str(GOLDEN), "now", n=1))
        pytest.fail(f"/metrics differs from {GOLDEN.relative_to(REPO)} (regenerate with --update-golden "
                    f"if the change is meant):\n{diff[:6000]}")


def test_the_golden_file_has_every_declared_family():
    """Each family of records/metrics.py has a sample there: the diff covers them all."""
    names = {s.name for s in parse_metrics(GOLDEN.read_text())}
    missing = []
    for m in metrics.ALL:
        shown = {m.name, f"{m.name}_total", f"{m.name}_bucket", f"{m.name}_count", f"{m.name}_sum"}
        if not names & shown:
            missing.append(m.name)
    assert not missing, f"no sample in {GOLDEN.name}: {missing} (tests/fake_sources.py gives none)"


# --- serving ----------------------------------------------------------------------------

def test_metrics_plain_and_gzip(served):
    _, base = served
    code, headers, plain = get(base + "/metrics")
    assert code == 200 and "Content-Encoding" not in headers
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert plain.decode() == exposition_of(served)
    code, headers, body = get(base + "/metrics", {"Accept-Encoding": "gzip"})
    assert code == 200 and headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(body) == plain and len(body) < len(plain)


def exposition_of(served) -> str:
    server, _ = served
    return generate_latest(server._server.registry).decode()


def test_openmetrics_when_asked(served):
    _, base = served
    code, headers, body = get(base + "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert code == 200 and headers["Content-Type"].startswith("application/openmetrics-text")
    text = body.decode()
    assert text.rstrip().endswith("# EOF")
    # the span sink's exemplar, on the bucket of its duration
    assert '# {trace_id="4bf92f3577b34da6a3ce929d0e0e4736"} 0.187' in text


def test_name_filter_selects_families(served):
    """`/metrics?name[]=...` gives just the named families (the collector
    describes its families; without that the page was empty)."""
    _, base = served
    code, _, body = get(base + "/metrics?name[]=nccl_collective_bytes_total"
                        "&name[]=nccl_collective_duration_seconds_count")
    names = {s.name for s in parse_metrics(body.decode())}
    assert code == 200 and names == {"nccl_collective_bytes_total", "nccl_collective_duration_seconds_count"}


def test_head_has_headers_and_no_body(served):
    _, base = served
    code, headers, body = get(base + "/metrics", method="HEAD")
    assert code == 200 and body == b"" and int(headers["Content-Length"]) > 1000


def test_ready_healthy_and_404(served):
    server, base = served
    assert get(base + "/-/ready")[0] == 503
    server.set_ready()
    assert get(base + "/-/ready")[:3:2] == (200, b"ready\n")
    assert get(base + "/-/healthy")[:3:2] == (200, b"healthy\n")
    for path in ("/", "/metricsx", "/-/readyz", "/metrics/x"):
        code, _, body = get(base + path)
        assert code == 404 and b"nccl_" not in body, path

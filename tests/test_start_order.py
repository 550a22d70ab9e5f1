"""The agent counts NCCL calls before its kernel-side sources are compiled
(agent/sources.py SourceRow.after_counting; docs/architecture.md, "Start-up
and attach order"): real BPF, a real job on the simulator's libnccl, the
real HTTP server."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry

from exporter.agent.pipeline import Pipeline, when_ready
from exporter.sinks.http import HttpServer
from tests.test_loader import JOB

NODE = "node-start"


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def calls_counted(body: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith("nccl_collective_duration_seconds_count{"))


def test_calls_are_counted_while_tcp_and_sched_still_load(simulator_lib, bpf):
    from exporter.agent.loop import Agent, AgentConfig

    agent = Agent(AgentConfig(node=NODE, nccl_libs=[str(simulator_lib)], sched_waits=True))
    server = job = None
    try:
        # Made, not loaded: no compile of bpf/tcp.c or bpf/sched.c before counting.
        assert agent.tcp is None and agent.sched is None
        assert [row.name for row in agent.loading] == ["tcp", "sched"]
        assert agent.reader.waits_from_ns is None  # calls' waits unmeasured until bpf/sched.c loads
        pipeline = Pipeline(agent, NODE)
        registry = CollectorRegistry(auto_describe=False)
        pipeline.serve_metrics(registry)
        agent.on_loaded.append(pipeline.source_loaded)
        server = HttpServer("127.0.0.1", 0, registry)
        base = f"http://127.0.0.1:{server.port}"
        assert get(base + "/-/ready")[0] == 503

        agent.start_discovery()
        when_ready(agent, server, NODE)
        assert get(base + "/-/ready") == (200, "ready; loading tcp, sched\n")

        # A job's calls are counted now, with the kernel side not loaded yet.
        job = subprocess.run([sys.executable, "-c", JOB, str(simulator_lib), "0", "20"],
                             capture_output=True, text=True, timeout=60)
        assert job.returncode == 0, job.stderr
        body = get(base + "/metrics")[1]
        assert calls_counted(body) == 20, body[-2000:]
        assert 'nccl_exporter_node_tracepoints_attached{node="node-start",source="tcp"}' not in body

        # The loop's next turns load them, one a turn, and /metrics shows them.
        agent.step(timeout_ms=0)
        assert agent.tcp is not None and agent.sched is None
        assert get(base + "/-/ready") == (200, "ready; loading sched\n")
        before = time.monotonic_ns()
        agent.step(timeout_ms=0)
        assert agent.sched is not None and not agent.loading
        assert before <= agent.reader.waits_from_ns <= time.monotonic_ns()  # calls begun from then on
        assert get(base + "/-/ready") == (200, "ready\n")
        body = get(base + "/metrics")[1]
        for source in ("tcp", "sched"):
            assert f'nccl_exporter_node_tracepoints_attached{{node="node-start",source="{source}"}} 1.0' in body
        assert [row.name for row in agent.loaded][-2:] == ["tcp", "sched"]
        assert agent.tcp in agent.programs and agent.sched in agent.programs
    finally:
        if server is not None:
            server.shutdown()
        agent.close()


def test_a_kernel_side_source_that_cannot_load_stops_the_agent_in_one_line(simulator_lib, bpf, monkeypatch):
    """A required after_counting source that fails: a SetupError (the CLI's one
    line, exit 2), not a traceback from the loop; what loaded is closed."""
    import pytest

    from exporter.agent import sources as agent_sources
    from exporter.agent.config import SetupError
    from exporter.agent.loop import Agent, AgentConfig

    def broken(_agent):
        raise OSError("tracepoint tcp/tcp_probe: no such event")

    rows = [agent_sources.SourceRow(r.name, broken, events=r.events, collector=r.collector, after_counting=True)
            if r.name == "tcp" else r for r in agent_sources.SOURCES]
    monkeypatch.setattr(agent_sources, "SOURCES", rows)
    agent = Agent(AgentConfig(node=NODE, nccl_libs=[str(simulator_lib)]))
    try:
        agent.start_discovery()
        started = time.monotonic()
        with pytest.raises(SetupError, match=r"^the tcp source did not load: tracepoint tcp/tcp_probe"):
            agent.step(timeout_ms=0)
        assert time.monotonic() - started < 30
        assert agent.tcp is None and [row.name for row in agent.loading] == ["sched"]
    finally:
        agent.close()

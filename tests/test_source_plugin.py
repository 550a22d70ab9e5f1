"""A new source is one file and one row of SOURCES (docs/architecture.md,
"Where a new thing goes").

The first half of this file is that one file: a made-up thermometer source
with its record, its hooks for the agent's loop (sources/base.py), its part
of /metrics (a sinks/prometheus SourceCollector) and its recording table
(sinks/recording/tables.py). The tests add its row to agent/sources.py's
SOURCES and change nothing else: the real Agent loads it beside the real
sources, its readings show on a real /metrics scrape, the agent's loop
prunes the reading of a process that ended, its records land in a real
SQLite recording, its losses in the recording's meta, and it is closed with
the others.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

import fake_sources
from conftest import parse_metrics
from exporter.agent import sources as agent_sources
from exporter.agent.pipeline import Pipeline
from exporter.agent.sources import SourceRow
from exporter.sinks.http import HttpServer
from exporter.sinks.prometheus import SourceCollector
from exporter.sinks.recording.tables import RecordTable
from exporter.sinks.recording.writer import Recorder
from exporter.sources.base import Source
from exporter.sources.processes import alive_checker

NODE = "node-a"
FAMILY = "nccl_test_thermometer_celsius"


# --- the new source: one file -------------------------------------------------------------

@dataclass(frozen=True)
class Reading:
    """The source's record: one process's temperature."""

    pid: int
    celsius: float


class Thermometer(Source):
    """Reads a made-up temperature of each watched process on every tick and
    delivers it as a Reading; forgets the processes that are gone."""

    def __init__(self):
        self.watched: dict[int, float] = {}  # pid -> its latest reading
        self.deliver = None
        self.closed = False

    def watch(self, pid: int) -> None:
        with self.lock:
            self.watched[pid] = 0.0

    def on_event(self, callback) -> None:
        self.deliver = callback

    def tick(self, now: float) -> None:
        with self.lock:  # a scrape reads `watched`
            for pid in self.watched:
                self.watched[pid] = 36.5 + pid % 10 / 10
        for pid, celsius in list(self.watched.items()):
            self.deliver(Reading(pid, celsius))

    def prune(self, ttl: float, rank_label) -> None:
        alive = alive_checker()
        self.watched = {pid: c for pid, c in self.watched.items() if alive(pid)}

    def losses(self) -> dict[str, int]:
        return {"kernel_thermometer_events": 0}

    def close(self) -> None:
        self.closed = True


class ThermometerCollector(SourceCollector):
    def families(self, scrape):
        if self.source is None:  # not loaded
            return
        f = GaugeMetricFamily(FAMILY, "A made-up source's reading", labels=["node", "pid"])
        for pid, celsius in sorted(self.source.watched.items()):
            f.add_metric([scrape.node, str(pid)], celsius)
        yield f

    def describe(self):
        yield Metric(FAMILY, "A made-up source's reading", "gauge")


READINGS = RecordTable("thermometer_readings", ("pid INTEGER NOT NULL", "celsius REAL", "node TEXT"), Reading,
                       lambda r, node: (r.pid, r.celsius, node))

ROW = SourceRow("thermometer", lambda agent: Thermometer(), events="_dispatch_kernel",
                collector=ThermometerCollector, tables=(READINGS,))


# --- the tests --------------------------------------------------------------------------------

def scrape(server, query: str = "") -> dict:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics{query}", timeout=10) as r:
        samples = parse_metrics(r.read().decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}


def readings(samples: dict) -> dict[int, float]:
    return {int(dict(labels)["pid"]): v for (name, labels), v in samples.items() if name == FAMILY}


def test_the_row_alone_wires_the_source_into_the_real_agent(monkeypatch, tmp_path, bpf):
    from exporter.agent.loop import Agent, AgentConfig

    monkeypatch.setattr(agent_sources, "SOURCES", [*agent_sources.SOURCES, ROW])
    agent = Agent(AgentConfig(node=NODE, prune_interval=0.05))
    server = recorder = None
    child = subprocess.Popen(["sleep", "60"])
    try:
        thermometer = agent.thermometer
        assert isinstance(thermometer, Thermometer) and ROW in agent.loaded
        pipeline = Pipeline(agent, NODE)
        registry = CollectorRegistry(auto_describe=False)
        pipeline.serve_metrics(registry)
        server = HttpServer("127.0.0.1", 0, registry)
        recorder = Recorder(str(tmp_path / "rec.db"), node=NODE, identify_processes=False)
        pipeline.listen(recorder)

        thermometer.watch(os.getpid())
        thermometer.watch(child.pid)
        agent.step(timeout_ms=0)  # a tick: readings delivered and kept
        seen = readings(scrape(server))
        assert set(seen) == {os.getpid(), child.pid}, seen
        assert seen[child.pid] == pytest.approx(36.5 + child.pid % 10 / 10)
        samples = scrape(server)
        assert any(name == "nccl_collective_duration_seconds_count" or name.startswith("nccl_exporter_build")
                   for name, _ in samples), "the real sources' families beside it"
        # /metrics?name[]= knows the family (the collector describes it)
        assert set(readings(scrape(server, f"?name[]={FAMILY}"))) == {os.getpid(), child.pid}

        child.kill()
        child.wait()
        deadline = time.monotonic() + 10
        while child.pid in thermometer.watched:  # the loop's prune, every 0.05 s here
            assert time.monotonic() < deadline, "the agent's loop never pruned the ended process"
            agent.step(timeout_ms=20)
        assert set(readings(scrape(server))) == {os.getpid()}

        assert agent.kernel_losses()["kernel_thermometer_events"] == 0
        recorder.set_kernel_lost(**agent.kernel_losses())
        recorder.close()
        with sqlite3.connect(tmp_path / "rec.db") as db:
            rows = db.execute("SELECT pid, celsius, node FROM thermometer_readings").fetchall()
            meta = dict(db.execute("SELECT key, value FROM meta"))
        assert {pid for pid, _, _ in rows} == {os.getpid(), child.pid}, rows
        assert all(node == NODE for _, _, node in rows) and len(rows) >= 3, rows
        assert meta["lost_kernel_thermometer_events"] == "0"
        assert int(meta["events_recorded"]) >= len(rows)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if server is not None:
            server.shutdown()
        if recorder is not None:
            recorder.close()
        agent.close()
    assert thermometer.closed and agent.loaded == []


def test_the_row_alone_shows_the_source_on_metrics(monkeypatch):
    """No root: the same row beside the fake sources (tests/fake_sources.py),
    served by the Pipeline `run` uses."""
    monkeypatch.setattr(agent_sources, "SOURCES", [*agent_sources.SOURCES, ROW])
    thermometer = Thermometer()
    thermometer.watched = {4242: 41.5}
    registry = CollectorRegistry(auto_describe=False)
    Pipeline(fake_sources.FakeAgent(thermometer=thermometer), NODE).serve_metrics(registry)
    server = HttpServer("127.0.0.1", 0, registry)
    try:
        samples = scrape(server)
    finally:
        server.shutdown()
    assert readings(samples) == {4242: 41.5}
    assert any(name == "nccl_exporter_build_info" for name, _ in samples), "beside the collector's families"


def test_a_recorder_writes_a_source_table_it_is_given(tmp_path):
    """The recorder alone: a table added while it runs is created by its
    writer thread and filled, with the built-in tables untouched."""
    path = tmp_path / "r.db"
    recorder = Recorder(str(path), node=NODE, identify_processes=False)
    try:
        recorder.add_tables([READINGS])
        for i in range(3):
            recorder(Reading(pid=100 + i, celsius=37.0 + i))
    finally:
        recorder.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT pid, celsius, node FROM thermometer_readings ORDER BY pid").fetchall() == [
            (100, 37.0, NODE), (101, 38.0, NODE), (102, 39.0, NODE)]
        assert db.execute("SELECT count(*) FROM nccl_events").fetchone() == (0,)
    assert recorder.recorded["thermometer_readings"] == 3

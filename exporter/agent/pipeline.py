"""The sinks of an agent, attached in one place: what `run` and `trace` publish.

    pipeline = Pipeline(agent, node)
    pipeline.serve_metrics(registry, spans=..., recorder=...)  # /metrics (run)
    pipeline.listen(recorder)                                    # every record (trace --out, run --db)

Sources are wired in by their row in agent/sources.py's SOURCES: each row's
`collector` is its part of /metrics (sinks/prometheus/), its `tables` are
its own in recordings, and every source's records reach the listeners
attached here. So a new source is one row there, and a new sink is one
method here (docs/architecture.md).
"""

from __future__ import annotations

from exporter.agent import sources as agent_sources
from exporter.agent.loop import Agent
from exporter.records import histogram
from exporter.sinks.prometheus import Collector
from exporter.sinks.recording.writer import Recorder


class Pipeline:
    def __init__(self, agent: Agent, node: str):
        self.agent = agent
        self.node = node

    def collectors(self) -> list:
        """The sources' parts of /metrics, in SOURCES order (an optional source
        that did not load gets its part all the same, with None)."""
        return [row.collector(getattr(self.agent, row.name, None))
                for row in agent_sources.SOURCES if row.collector is not None]

    def serve_metrics(self, registry, spans=None, recorder=None) -> None:
        """Register what /metrics shows: every source's part, and the
        exporter's own families; spans and recorder add their counters."""
        registry.register(Collector(self.node, self.agent.processes, self.collectors(), spans=spans,
                                    lock=self.agent.lock, recorder=recorder,
                                    classic=histogram.CLASSIC[self.agent.config.histogram_resolution]))

    def listen(self, sink) -> None:
        """`sink(record)` for every record the sources deliver (recorder, span
        sink, the trace printer), called from the agent's loop. A recorder
        also gets the loaded sources' own tables."""
        if isinstance(sink, Recorder):
            sink.add_tables([t for row in self.agent.loaded for t in row.tables])
        self.agent.listeners.append(sink)

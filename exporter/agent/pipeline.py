"""The sinks of an agent, attached in one place: what `run` and `trace` publish.

    pipeline = Pipeline(agent, node)
    pipeline.serve_metrics(registry, spans=..., recorder=...)  # /metrics (run)
    pipeline.listen(recorder)                                    # every record (trace --out, run --db)

Sources are wired in by their row in agent/loop.py's SOURCES: the rows with a
`collector` keyword are handed to the Prometheus collector (sinks/prometheus.py),
the rows with `metrics` add families of their own, and every source's records
reach the listeners attached here. So a new source is one row there, and a
new sink is one method here (docs/architecture.md).
"""

from __future__ import annotations

from exporter.records import histogram
from exporter.sinks.prometheus import NcclCollector
from exporter.agent import loop as agent_module
from exporter.agent.loop import Agent


class SourceMetrics:
    """The families sources give themselves (a SOURCES row's `metrics`), read
    under the agent's lock at scrape time like the collector's own."""

    def __init__(self, agent: Agent, node: str):
        self.agent = agent
        self.node = node

    def collect(self):
        with self.agent.lock:
            families = [f for row in self.agent.loaded if row.metrics is not None
                        for f in row.metrics(getattr(self.agent, row.name), self.node)]
        yield from families


class Pipeline:
    def __init__(self, agent: Agent, node: str):
        self.agent = agent
        self.node = node

    def collector_sources(self) -> dict:
        """The NcclCollector's source keywords, from SOURCES (None: not loaded)."""
        return {row.collector: getattr(self.agent, row.name)
                for row in agent_module.SOURCES if row.collector}

    def serve_metrics(self, registry, spans=None, recorder=None) -> None:
        """Register what /metrics shows: the collector over the sources, and
        the sources' own families; spans and recorder add their counters."""
        registry.register(NcclCollector(self.node, processes=self.agent.processes, spans=spans,
                                        lock=self.agent.lock, recorder=recorder,
                                        classic=histogram.CLASSIC[self.agent.config.histogram_resolution],
                                        **self.collector_sources()))
        registry.register(SourceMetrics(self.agent, self.node))

    def listen(self, sink) -> None:
        """`sink(record)` for every record the sources deliver (recorder, span
        sink, the trace printer), called from the agent's loop."""
        self.agent.listeners.append(sink)

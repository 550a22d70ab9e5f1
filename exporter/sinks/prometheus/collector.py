"""/metrics: every source's part (one SourceCollector per SOURCES row, in
its order), then the exporter's own families, read when Prometheus scrapes.

Nothing is cached between scrapes except the per-process launcher identity
and the plugin part's sticky peer names; every number comes from the
kernel's maps when Prometheus asks. A scrape only reads: pruning dead
processes' entries is the agent loop's job.
"""

from __future__ import annotations

import threading
import time

from prometheus_client.core import Metric

from exporter.records import histogram, metrics
from exporter.sinks.prometheus.families import family_of
from exporter.sinks.prometheus.self_metrics import exporter_families
from exporter.sinks.prometheus.source import Scrape, SourceCollector
from exporter.sources.processes import alive_checker


class Collector:
    """The one collector `run` registers. parts: the sources' collectors;
    processes: the ProcessTable (ranks and launcher identity); spans: the span
    sink, when traces are exported (exemplars, span counts); recorder: run
    --db's Recorder (its drops); lock: the agent's, held while reading (BCC
    objects are shared with its loop); classic: text scrapes' buckets (run
    --histogram-resolution)."""

    def __init__(self, node: str, processes, parts: list[SourceCollector], spans=None, lock=None,
                 recorder=None, classic=None):
        self.lock = lock or threading.Lock()
        self.node = node
        self.processes = processes
        self.parts = list(parts)
        self.spans = spans
        self.recorder = recorder
        self.classic = classic or histogram.CLASSIC[histogram.DEFAULT_CLASSIC]

    def describe(self):
        """The declared families, without reading any source: the registry
        learns the names from it, which `/metrics?name[]=...` filtering needs
        (the registry does not collect to learn them: run's auto_describe=False)."""
        for m in metrics.ALL:
            yield Metric(m.name, m.help, m.kind)
        for part in self.parts:
            yield from part.describe()

    def collect(self):
        started = time.perf_counter()
        with self.lock:
            # /proc is asked once per pid and scrape whether a process lives
            scrape = Scrape(self.node, self.processes, alive_checker(),
                            time.clock_gettime_ns(time.CLOCK_MONOTONIC), self.classic, self.spans)
            for part in self.parts:
                part.prepare(scrape)
            families = [f for part in self.parts for f in part.families(scrape)]
            families += exporter_families(scrape, self.parts, self.recorder)
        yield from families
        yield family_of(metrics.EXPORTER_SCRAPE_DURATION, {(self.node,): time.perf_counter() - started})

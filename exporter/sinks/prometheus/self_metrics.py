"""The exporter's own families (nccl_exporter_*): its version, its programs'
map fill and misses, its node-wide tracepoints, and what each part, the span
sink and the recorder add of their own."""

from __future__ import annotations

from exporter import __version__
from exporter.records import metrics
from exporter.sinks.prometheus.families import family_of
from exporter.sinks.prometheus.source import Scrape


def exporter_families(scrape: Scrape, parts, recorder=None) -> list:
    """parts: the sources' collectors (source.py), in SOURCES order; recorder:
    run --db's Recorder (its drops, by reason)."""
    node = scrape.node
    out = [family_of(metrics.EXPORTER_BUILD_INFO, {(node, __version__): 1})]
    entries, capacity, misses, hot, full = {}, {}, {}, {}, {}
    for part in parts:
        for program, caps in part.programs():
            for name, cap in caps.items():
                entries[(node, name)] = program.entries(name)
                capacity[(node, name)] = cap
            for fn, n in program.recursion_misses().items():
                misses[(node, fn)] = n
        hot.update({(node, name): int(on) for name, on in part.tracepoints().items()})
        full.update({(node, name): n for name, n in part.map_full(scrape).items()})
    out += [family_of(metrics.EXPORTER_NODE_TRACEPOINTS, hot),
            family_of(metrics.EXPORTER_MAP_ENTRIES, entries),
            family_of(metrics.EXPORTER_MAP_CAPACITY, capacity),
            family_of(metrics.EXPORTER_MAP_FULL, full),
            family_of(metrics.EXPORTER_BPF_MISSES, misses)]
    for part in parts:
        out += part.exporter_families(scrape)
    if scrape.spans is not None:
        out.append(family_of(metrics.EXPORTER_SPANS, {(node, o): n for o, n in scrape.spans.counts().items()}))
    if recorder is not None:
        out.append(family_of(metrics.EXPORTER_RECORDING_DROPPED,
                             {(node, reason): n for reason, n in recorder.drops().items()}))
    return out

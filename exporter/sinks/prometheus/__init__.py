"""The Prometheus sink: reads the sources at scrape time and builds the
metric families of exporter/records/metrics.py.

One file per source's collector, like node_exporter's collector/ directory:
nccl.py (the NCCL call surface), tcp.py, sched.py, plugin.py (GPU time and
network waits); source.py is the shape every one of them has and what one
scrape shares; collector.py calls them all and self_metrics.py adds the
exporter's own families; histograms.py is the one histogram family builder
(also used by OTLP metrics) and families.py the label rules. A source's
collector is named by its row of SOURCES (agent/sources.py).
"""

from exporter.sinks.prometheus.collector import Collector
from exporter.sinks.prometheus.families import empty_family, family_of, pod_labels, rank_label
from exporter.sinks.prometheus.histograms import ExponentialHistogramFamily, Histograms
from exporter.sinks.prometheus.nccl import NcclCollector
from exporter.sinks.prometheus.plugin import (PluginCollector, gpu_families, network_families, plugin_labels,
                                              with_announced)
from exporter.sinks.prometheus.sched import SchedCollector, sched_families
from exporter.sinks.prometheus.source import Scrape, SourceCollector
from exporter.sinks.prometheus.tcp import TcpCollector, tcp_families

__all__ = ["Collector", "ExponentialHistogramFamily", "Histograms", "NcclCollector", "PluginCollector",
           "SchedCollector", "Scrape", "SourceCollector", "TcpCollector", "empty_family", "family_of",
           "gpu_families", "network_families", "plugin_labels", "pod_labels", "rank_label", "sched_families",
           "tcp_families", "with_announced"]

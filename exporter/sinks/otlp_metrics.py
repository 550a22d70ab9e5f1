"""OTLP metrics: every family of the collector, pushed every interval.

`run --otlp-metrics-endpoint URL` reads the same collector a scrape reads
(exporter/sinks/prometheus/) and turns what it yields into OTLP data:

- counters: cumulative monotonic sums (named without Prometheus's _total);
- gauges: gauges;
- histograms: exponential histograms at scale 3 with the kernel's own
  buckets (records/histogram.py). OTLP's bucket i is (b^i, b^(i+1)] where
  Prometheus's (and the kernel's) bucket j is (b^(j-1), b^j], so the OTLP
  index of a kernel bucket is j - 1; zero count and threshold as in the
  native histogram; a histogram without buckets (SchedTotals) is an explicit
  histogram with its +Inf bucket only.

Nothing is aggregated here and no SDK instrument is fed: the data points are
built from the kernel's maps, as a scrape is, and handed to the OTLP
exporter of opentelemetry-exporter-otlp (gRPC or HTTP/protobuf, with the
standard OTEL_EXPORTER_OTLP_METRICS_* / OTEL_EXPORTER_OTLP_* variables).

Start times: a series' start_time_unix_nano is when this process first saw
it, and is moved to the export's time when its count went down (a series
that expired and came back, a counter reset), so a backend reads each
cumulative series correctly.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Buckets,
    ExponentialHistogram,
    ExponentialHistogramDataPoint,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from exporter import __version__
from exporter.records import histogram
from exporter.sinks.spans import make_otlp_exporter

log = logging.getLogger("nccl_exporter")
CUMULATIVE = AggregationTemporality.CUMULATIVE
DEFAULT_INTERVAL_S = 60.0


def default_interval_s(environ=None) -> float:
    """$OTEL_METRIC_EXPORT_INTERVAL (milliseconds, the SDK's variable), else 60 s."""
    value = (environ if environ is not None else os.environ).get("OTEL_METRIC_EXPORT_INTERVAL")
    try:
        return float(value) / 1000 if value else DEFAULT_INTERVAL_S
    except ValueError:
        return DEFAULT_INTERVAL_S


def otel_buckets(counts, layout: histogram.Layout) -> tuple[int, int, list[int]]:
    """(zero count, OTLP offset, dense bucket counts) of a series' slots: the
    OTLP offset is the first populated kernel bucket's index minus 1."""
    populated = [s for s in range(1, min(len(counts), layout.slots)) if counts[s]]
    if not populated:
        return counts[0] if counts else 0, 0, []
    first, last = populated[0], populated[-1]
    return counts[0], layout.index_of_slot(first) - 1, list(counts[first:last + 1])


def _unit(name: str) -> str:
    if name.endswith("_seconds") or "_seconds_" in name:
        return "s"
    if "bytes" in name:
        return "By"
    return ""


class StartTimes:
    """Per (metric, attributes): the start of its cumulative series."""

    def __init__(self, now_ns: int):
        self.started = now_ns
        self.seen: dict[tuple, tuple[int, float]] = {}  # key -> (start ns, last value)

    def of(self, key: tuple, value: float, now_ns: int) -> int:
        start, last = self.seen.get(key, (self.started, 0.0))
        if value < last:  # reset: the series counts from zero again
            start = now_ns
        self.seen[key] = (start, value)
        return start


def metrics_data(families, resource: Resource, starts: StartTimes, now_ns: int) -> MetricsData:
    """The OTLP data of one collection (families from a collector's collect())."""
    from exporter.sinks.prometheus import ExponentialHistogramFamily

    out = []
    for f in families:
        if isinstance(f, ExponentialHistogramFamily):
            if f.layout is None:
                points = []
                for labels, counts, total_s, _ in f.series:
                    attrs = dict(zip(f.label_names, labels))
                    n = sum(counts)
                    points.append(HistogramDataPoint(
                        attributes=attrs, start_time_unix_nano=starts.of((f.name, labels), n, now_ns),
                        time_unix_nano=now_ns, count=n, sum=total_s, bucket_counts=[n], explicit_bounds=[],
                        min=None, max=None))
                data = Histogram(data_points=points, aggregation_temporality=CUMULATIVE)
            else:
                points = []
                for labels, counts, total_s, _ in f.series:
                    attrs = dict(zip(f.label_names, labels))
                    n = sum(counts)
                    zero, offset, dense = otel_buckets(counts, f.layout)
                    points.append(ExponentialHistogramDataPoint(
                        attributes=attrs, start_time_unix_nano=starts.of((f.name, labels), n, now_ns),
                        time_unix_nano=now_ns, count=n, sum=total_s, scale=histogram.SCHEMA,
                        zero_count=zero, positive=Buckets(offset=offset, bucket_counts=dense),
                        negative=Buckets(offset=0, bucket_counts=[]), flags=0, min=None, max=None))
                data = ExponentialHistogram(data_points=points, aggregation_temporality=CUMULATIVE)
        elif f.type == "counter":
            points = []
            for s in f.samples:
                if s.name != f.name + "_total":
                    continue
                key = (f.name, tuple(sorted(s.labels.items())))
                points.append(NumberDataPoint(attributes=dict(s.labels),
                                              start_time_unix_nano=starts.of(key, s.value, now_ns),
                                              time_unix_nano=now_ns, value=s.value))
            data = Sum(data_points=points, aggregation_temporality=CUMULATIVE, is_monotonic=True)
        elif f.type in ("gauge", "info", "untyped", "unknown", "stateset"):
            data = Gauge(data_points=[NumberDataPoint(attributes=dict(s.labels), start_time_unix_nano=0,
                                                      time_unix_nano=now_ns, value=s.value)
                                      for s in f.samples])
        else:
            continue  # a summary or a classic histogram: the collector has none
        if data.data_points:
            out.append(Metric(name=f.name, description=f.documentation, unit=_unit(f.name), data=data))
    scope = ScopeMetrics(scope=InstrumentationScope("nccl-exporter", __version__), metrics=out, schema_url="")
    return MetricsData(resource_metrics=[ResourceMetrics(resource=resource, scope_metrics=[scope], schema_url="")])


def node_resource(node: str) -> Resource:
    """The resource of the agent's metrics: as for its spans, less the traced process."""
    attrs = {"service.version": __version__, "host.name": socket.gethostname(), "node": node}
    if not (os.environ.get("OTEL_SERVICE_NAME")
            or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")):
        attrs["service.name"] = "nccl-exporter"
    return Resource.create(attrs)  # + OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME


def make_metric_exporter(protocol: str, endpoint: str | None, timeout_s: float = 10.0):
    """OTLP metrics over gRPC or HTTP/protobuf (the span sink's exporter maker)."""
    return make_otlp_exporter(protocol, endpoint, timeout_s, signal="metrics")


class OtlpMetricsPusher:
    """Collects `registry` every `interval_s` and exports it; `shutdown()`
    exports once more (nothing counted is lost at exit) and stops."""

    def __init__(self, registry, exporter, node: str, interval_s: float):
        self.registry, self.exporter, self.interval_s = registry, exporter, interval_s
        self.resource = node_resource(node)
        self.starts = StartTimes(time.time_ns())
        self.exports = {"exported": 0, "failed": 0}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="nccl-exporter-otlp-metrics", daemon=True)
        self._thread.start()

    def export_now(self) -> bool:
        with self._lock:
            data = metrics_data(self.registry.collect(), self.resource, self.starts, time.time_ns())
            try:
                ok = self.exporter.export(data) == MetricExportResult.SUCCESS
            except Exception as e:  # noqa: BLE001 - the backend is down or refuses: say so, keep counting
                log.warning("OTLP metrics export failed: %s", e)
                ok = False
            self.exports["exported" if ok else "failed"] += 1
            return ok

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.export_now()

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join()
        self.export_now()
        self.exporter.shutdown()

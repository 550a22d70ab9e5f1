"""The one histogram family builder of /metrics (and of OTLP metrics,
sinks/otlp_metrics.py): a source's series land on label sets, their schema-3
slot counts are summed (records/histogram.py), and the family is read as
classic buckets by text scrapes and as native histograms by protobuf scrapes
(sinks/protobuf.py)."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.core import Exemplar, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from exporter.records import histogram, metrics


class ExponentialHistogramFamily(Metric):
    """A histogram family holding each series' schema-3 slots (records/histogram.py).

    Text scrapes read `samples`: classic buckets derived from the slots at the
    bounds of `classic` (built on first access, so a protobuf scrape never
    builds them). The protobuf encoder (sinks/protobuf.py) reads `series` and
    `layout` and writes native histograms. layout None: the source has no
    buckets (SchedTotals), only a count and a sum: +Inf alone."""

    def __init__(self, name: str, documentation: str, labels: list[str], layout, classic):
        super().__init__(name, documentation, "histogram")
        self.label_names = labels
        self.layout = layout
        self.classic = classic
        # (label values, slot counts, sum in seconds, exemplar or None), sorted by labels
        self.series: list[tuple[tuple, list[int], float, tuple | None]] = []
        self._samples: list | None = None

    @property
    def samples(self):
        if self._samples is None:
            self._samples = self._classic_samples()
        return self._samples

    @samples.setter
    def samples(self, value):  # Metric.__init__ and restricted copies set it
        self._samples = value if value else None

    def _classic_samples(self) -> list:
        f = HistogramMetricFamily(self.name, self.documentation, labels=self.label_names)
        layout, classic = self.layout, self.classic
        les = [floatToGoString(b) for b in classic.le_seconds(layout)] if layout else []
        for labels, counts, total_s, ex in self.series:
            cumulative = classic.cumulative(layout, counts) if layout else [sum(counts)]
            buckets = [*zip(les, cumulative), ("+Inf", cumulative[-1])]
            if ex and layout:
                trace_id, duration_ns, ts = ex
                i = classic.bucket_of_slot(layout, layout.slot_of(duration_ns))
                le, count = buckets[i]
                buckets[i] = (le, count, Exemplar({"trace_id": trace_id}, duration_ns / 1e9, ts))
            f.add_metric(list(labels), buckets, total_s)
        return f.samples


class Histograms:
    """The one histogram builder: sums the slot counts of series that land on
    the same label set (a layout's slots: records/histogram.py), and gives a
    family that text scrapes read as classic buckets (`classic`: coarse or
    fine) and protobuf scrapes as native histograms.

    The sums are added as integers in the layout's unit (ns, or us for srtt;
    ns without a layout) and turned into seconds once, in family():
    a float sum over processes would depend on their order, which changes as
    processes expire, and a counter one ulp lower is a reset to rate()
    (docs/architecture.md, "Counters are summed in integers")."""

    def __init__(self, name: str, layout, classic=None):
        self.spec = metrics.spec(name)
        self.layout = layout
        self.classic = classic or histogram.CLASSIC[histogram.DEFAULT_CLASSIC]
        self.per_second = layout.per_second if layout else 10**9
        self.buckets: dict[tuple, list[int]] = {}
        self.sums: dict[tuple, int] = defaultdict(int)

    def add(self, labels: tuple, counts, total: int) -> None:
        """counts: the series' slot counts; total: its sum in the layout's unit (int)."""
        size = self.layout.slots if self.layout else 1
        acc = self.buckets.setdefault(labels, [0] * size)
        for i, n in enumerate(counts[:size]):
            acc[i] += n
        acc[-1] += sum(counts[size:])  # anything past the layout is overflow
        self.sums[labels] += total

    def family(self, exemplars: dict | None = None) -> ExponentialHistogramFamily:
        """exemplars: labels -> (trace id, duration ns, unix time): the latest slow
        call's trace, shown on its classic bucket (OpenMetrics exposition only)."""
        f = ExponentialHistogramFamily(self.spec.name, self.spec.help, list(self.spec.labels),
                                       self.layout, self.classic)
        for labels in sorted(self.buckets):
            f.series.append((labels, self.buckets[labels], self.sums[labels] / self.per_second,
                             (exemplars or {}).get(labels)))
        return f

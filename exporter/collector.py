"""Prometheus collector: reads the BPF maps at scrape time.

Nothing is cached between scrapes except the per-process launcher identity;
every number comes from the kernel's maps when Prometheus asks.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from prometheus_client.core import (
    CounterMetricFamily,
    Exemplar,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from . import __version__, contract, histogram
from .maps import MapReader, format_comm
from .probes import COUNTERS


def label(value: int) -> str:
    """rank / nranks label: the number, or 'unknown' (-1)."""
    return str(value) if value >= 0 else "unknown"


class NcclCollector:
    def __init__(self, reader: MapReader, node: str, probes, processes, lock=None,
                 spans=None, sections=()):
        self.lock = lock or threading.Lock()  # held while reading: BCC objects are shared
        self.reader = reader
        self.node = node
        self.probes = probes
        self.processes = processes  # exporter.processes.ProcessTable
        self.spans = spans  # exporter.spans.SpanSink, when traces are exported
        # Other readers' families (TCP, scheduler): callables (node, rank_of) -> families.
        self.sections = list(sections)

    def collect(self):
        started = time.perf_counter()
        with self.lock:
            families = [
                *self._collectives(),
                *self._errors(),
                *self._inflight(),
                *self._communicators(),
                *self._self_metrics(),
            ]
            if self.sections:
                comms = self.reader.communicators()

                def rank_of(pid):
                    return self.processes.rank_of(pid, comms)

                for section in self.sections:
                    families.extend(section(self.node, rank_of))
        yield from families
        scrape = GaugeMetricFamily(
            contract.EXPORTER_SCRAPE_DURATION,
            "Time this scrape spent reading the BPF maps.",
            labels=["node"],
        )
        scrape.add_metric([self.node], time.perf_counter() - started)
        yield scrape

    def _collectives(self):
        node = self.node
        durations = _Histograms()
        lifecycle = _Histograms()
        nbytes: dict[tuple, int] = defaultdict(int)
        for s in self.reader.series():
            if s.op in contract.COLLECTIVE_OPS.values():
                comm = format_comm(s.comm_hash)
                durations.add((node, s.op, comm, label(s.rank), label(s.nranks)), s)
                nbytes[(node, s.op, comm, label(s.rank))] += s.bytes
            else:
                lifecycle.add((node, s.op), s)

        exemplars = {}
        if self.spans is not None:
            for (op, comm, rank, nranks), ex in list(self.spans.exemplars.items()):
                exemplars[(node, op, comm, label(rank), label(nranks))] = ex
        yield durations.family(
            contract.COLLECTIVE_DURATION,
            "Duration of NCCL collective and point-to-point API calls, from entry to "
            "return of the library function (on a GPU this is host-side time: enqueue, "
            "or the wait when the call blocks).",
            ["node", "op", "comm", "rank", "nranks"],
            exemplars,
        )
        b = CounterMetricFamily(
            contract.COLLECTIVE_BYTES,
            "Bytes named by NCCL calls: the count argument times the datatype size "
            "(per-rank send count for ALL_GATHER/GATHER, per-rank receive count for "
            "REDUCE_SCATTER/SCATTER, per-peer count for ALL_TO_ALL).",
            labels=["node", "op", "comm", "rank"],
        )
        for labels, value in sorted(nbytes.items()):
            b.add_metric(list(labels), value)
        yield b
        yield lifecycle.family(
            contract.LIFECYCLE_DURATION,
            "Duration of NCCL lifecycle calls (communicator init/split/destroy, group end, ...).",
            ["node", "op"],
        )

    def _errors(self):
        f = CounterMetricFamily(
            contract.CALL_ERRORS,
            "NCCL API calls that returned something other than ncclSuccess, by op and ncclResult_t.",
            labels=["node", "op", "result"],
        )
        for (op, result), n in sorted(self.reader.errors().items()):
            f.add_metric([self.node, op, result], n)
        yield f

    def _inflight(self):
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        oldest: dict[tuple, int] = {}
        for call in self.reader.inflight():
            key = (self.node, call.op, format_comm(call.comm_hash), label(call.rank))
            age = max(0, now - call.start_ns)
            oldest[key] = max(oldest.get(key, 0), age)
        f = GaugeMetricFamily(
            contract.INFLIGHT_OLDEST,
            "Age of the oldest NCCL call still inside the library, per op, communicator "
            "and rank. A value that keeps growing is a hang.",
            labels=["node", "op", "comm", "rank"],
        )
        for key, age in sorted(oldest.items()):
            f.add_metric(list(key), age / 1e9)
        yield f

    def _communicators(self):
        f = GaugeMetricFamily(
            contract.COMMUNICATOR_INFO,
            "One per live communicator of a traced process (value 1).",
            labels=[
                "node", "comm", "nccl_comm_hash", "rank", "nranks", "pid",
                "launcher", "launcher_rank", "world_size",
            ],
        )
        self.reader.forget_dead_processes()
        for c in sorted(self.reader.communicators(), key=lambda c: (c.pid, c.comm_hash)):
            who = self.processes.identity(c.pid)
            f.add_metric(
                [
                    self.node,
                    format_comm(c.comm_hash),
                    f"{c.nccl_hash:016x}" if c.nccl_hash else "",
                    label(c.rank),
                    label(c.nranks),
                    str(c.pid),
                    who.get("launcher") or "",
                    _opt(who.get("rank")),
                    _opt(who.get("world_size")),
                ],
                1,
            )
        yield f

    def _self_metrics(self):
        info = GaugeMetricFamily(
            contract.EXPORTER_BUILD_INFO, "nccl-exporter version (value 1).",
            labels=["node", "version"],
        )
        info.add_metric([self.node, __version__], 1)
        yield info

        attached = GaugeMetricFamily(
            contract.EXPORTER_PROBE_ATTACHED,
            "1 when the function of that library is probed, 0 when it is missing "
            "from the library or could not be attached. Aliases probed through "
            "their twin at the same address are not listed.",
            labels=["node", "library", "function"],
        )
        for report in self.probes.reports:
            for fn in report.attached:
                attached.add_metric([self.node, report.path, fn], 1)
            for fn in [*report.missing, *report.failed]:
                attached.add_metric([self.node, report.path, fn], 0)
        yield attached

        entries = GaugeMetricFamily(
            contract.EXPORTER_MAP_ENTRIES, "Entries in each BPF map.", labels=["node", "map"]
        )
        capacity = GaugeMetricFamily(
            contract.EXPORTER_MAP_CAPACITY, "Capacity of each BPF map.", labels=["node", "map"]
        )
        for name, (n, cap) in sorted(self.reader.fill().items()):
            entries.add_metric([self.node, name], n)
            capacity.add_metric([self.node, name], cap)
        yield entries
        yield capacity

        counters = self.reader.counters()
        full = CounterMetricFamily(
            contract.EXPORTER_MAP_FULL,
            "Updates dropped because a BPF map was full (those calls are not counted).",
            labels=["node", "map"],
        )
        for name, map_name in (
            ("STATS_FULL", "series_index"),
            ("COMMS_FULL", "communicators"),
            ("INFLIGHT_FULL", "inflight"),
            ("ERRORS_FULL", "call_errors"),
            ("SOCKETS_FULL", "sock_owner"),
            ("LINKS_FULL", "tcp_links"),
            ("SCHED_FULL", "thread_sched"),
        ):
            full.add_metric([self.node, map_name], counters[name])
        yield full
        lost = CounterMetricFamily(
            contract.EXPORTER_EVENTS_LOST,
            "Events dropped because the ring buffer to user space was full.",
            labels=["node"],
        )
        lost.add_metric([self.node], counters["EVENTS_LOST"] + counters["TCP_EVENTS_LOST"])
        yield lost
        misses = CounterMetricFamily(
            contract.EXPORTER_BPF_MISSES,
            "Tracepoint/uprobe hits the kernel did not run a program for, because another "
            "BPF program was already running on that CPU (e.g. a retransmit in a softirq "
            "that interrupted a scheduler probe). Those hits are missing from every count.",
            labels=["node", "program"],
        )
        for program, n in sorted(self.probes.recursion_misses().items()):
            misses.add_metric([self.node, program], n)
        yield misses
        if self.spans is not None:
            spans = CounterMetricFamily(
                contract.EXPORTER_SPANS,
                "Spans of slow calls by outcome: exported to the OTLP backend, failed to "
                "export (backend down or refusing), or dropped before export because the "
                "backend was behind (the probe path never waits for it).",
                labels=["node", "outcome"],
            )
            for outcome, n in self.spans.counts().items():
                spans.add_metric([self.node, outcome], n)
            yield spans


assert set(COUNTERS) >= {"STATS_FULL", "COMMS_FULL", "INFLIGHT_FULL", "ERRORS_FULL", "EVENTS_LOST"}


class _Histograms:
    """Sums kernel series that land on the same label set, then exposes them."""

    def __init__(self):
        self.buckets: dict[tuple, list[int]] = {}
        self.sums: dict[tuple, int] = defaultdict(int)

    def add(self, labels: tuple, s) -> None:
        acc = self.buckets.setdefault(labels, [0] * histogram.SLOTS)
        for i, n in enumerate(s.buckets):
            acc[i] += n
        self.sums[labels] += s.sum_ns

    def family(self, name: str, doc: str, label_names: list[str],
               exemplars: dict | None = None) -> HistogramMetricFamily:
        """exemplars: labels -> (trace id, duration ns, unix time): the latest slow
        call's trace, shown on its bucket (OpenMetrics exposition only)."""
        f = HistogramMetricFamily(name, doc, labels=label_names)
        for labels in sorted(self.buckets):
            buckets = histogram.cumulative_buckets(self.buckets[labels])
            ex = (exemplars or {}).get(labels)
            if ex:
                trace_id, duration_ns, ts = ex
                i = min(histogram.bucket_of(duration_ns), len(buckets) - 1)
                le, count = buckets[i]
                buckets[i] = (le, count, Exemplar({"trace_id": trace_id}, duration_ns / 1e9, ts))
            f.add_metric(list(labels), buckets, self.sums[labels] / 1e9)
        return f


def _opt(v) -> str:
    return "" if v is None else str(v)

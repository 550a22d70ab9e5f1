"""The scheduler's families on /metrics, read from a SchedTable: a
SchedSource (bpf/sched.c) or SchedTotals (/proc, no program)."""

from __future__ import annotations

from collections import defaultdict

from exporter.records import metrics
from exporter.sinks.prometheus.families import family_of, owner_rank_label
from exporter.sinks.prometheus.histograms import Histograms
from exporter.sinks.prometheus.source import Scrape, SourceCollector
from exporter.sources import sched as sched_source


class SchedCollector(SourceCollector):
    """source: a SchedSource or SchedTotals, None when not loaded."""

    def families(self, scrape: Scrape):
        if self.source is None:
            return []
        return sched_families(scrape.node, self.source, scrape.rank_of, scrape.classic)

    def programs(self):
        if isinstance(self.source, sched_source.SchedSource):  # not SchedTotals: no maps
            yield self.source, sched_source.MAP_CAPACITY

    def tracepoints(self) -> dict[str, bool]:
        return {self.source.name: self.source.hot} if self.source is not None else {}


def sched_families(node: str, sched, rank_of, classic=None) -> list:
    """nccl_runqueue_delay_seconds and nccl_offcpu_seconds_total of a SchedSource
    or SchedTotals (whose histogram has its +Inf bucket only), labelled {node,
    rank, thread}; processes with the same rank and kind are summed (with the
    retired totals of expired processes: `labelled`)."""
    runq = Histograms(metrics.RUNQUEUE_DELAY, sched.layout, classic)
    offcpu: dict[tuple, int] = defaultdict(int)   # ns, exact: the sum must not depend on the order
    for lset, s in sched.labelled(lambda pid: owner_rank_label(rank_of, pid)):
        labels = (node, *lset)
        runq.add(labels, s.buckets, s.sum_ns)
        offcpu[labels] += s.offcpu_ns
    return [runq.family(), family_of(metrics.OFFCPU, offcpu, per_second=10**9)]

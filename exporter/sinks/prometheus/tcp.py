"""The TCP families on /metrics, read from a TcpSource (sources/tcp.py):
retransmits, failures, resets and smoothed RTT per link and owner rank."""

from __future__ import annotations

from collections import defaultdict

from exporter.records import histogram, metrics
from exporter.sinks.prometheus.families import family_of, owner_rank_label
from exporter.sinks.prometheus.histograms import Histograms
from exporter.sinks.prometheus.source import Scrape, SourceCollector
from exporter.sources import tcp as tcp_source


class TcpCollector(SourceCollector):
    """source: a TcpSource, None when not loaded (then nothing is shown)."""

    def families(self, scrape: Scrape):
        if self.source is None:
            return []
        return tcp_families(scrape.node, self.source, scrape.rank_of, scrape.classic)

    def programs(self):
        return [(self.source, tcp_source.MAP_CAPACITY)] if self.source is not None else []

    def tracepoints(self) -> dict[str, bool]:
        return {self.source.name: self.source.hot} if self.source is not None else {}

    def exporter_families(self, scrape: Scrape):
        if self.source is not None:
            yield family_of(metrics.EXPORTER_RETRANSMITS_MISSED,
                            {(scrape.node,): tcp_source.retransmits_missed(scrape.counters)})


def tcp_families(node: str, tcp, rank_of, classic=None) -> list:
    """The TCP families of a TcpSource; rank_of(pid) -> rank or None labels each owner.
    Links of owners with the same rank are summed; an owner that is gone keeps
    the rank it had, and the retired totals of expired owners are included
    (TcpSource.labelled, OwnerExpiry): a label set never goes backwards."""
    retrans: dict[tuple, int] = defaultdict(int)
    failures: dict[tuple, int] = defaultdict(int)
    resets: dict[tuple, int] = defaultdict(int)
    links, srtt_recs = tcp.labelled(lambda pid: owner_rank_label(rank_of, pid))
    for lset, link in links:
        labels = (node, *lset)
        if link.retransmits:
            retrans[labels] += link.retransmits
        if link.failures:
            failures[labels] += link.failures
        if link.resets_sent:
            resets[(node, "sent", *lset)] += link.resets_sent
        if link.resets_received:
            resets[(node, "received", *lset)] += link.resets_received
    srtt = Histograms(metrics.TCP_SRTT, histogram.SRTT, classic)
    for lset, s in srtt_recs:
        srtt.add((node, *lset), s.buckets, s.sum_us)
    return [family_of(metrics.TCP_RETRANSMITS, retrans), family_of(metrics.TCP_RETRANSMIT_FAILURES, failures),
            family_of(metrics.TCP_RESETS, resets), srtt.family()]

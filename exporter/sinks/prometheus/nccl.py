"""The NCCL call surface on /metrics, read from an NcclReader (sources/nccl/):
collective durations and bytes, lifecycle calls, errors, in-flight calls,
communicators and their async errors; the counters every program shares."""

from __future__ import annotations

from collections import defaultdict

from exporter.records import contract, histogram, metrics
from exporter.records.events import format_comm
from exporter.sinks.prometheus.families import (empty_family, family_of, optional_label, pod_labels,
                                                 rank_label)
from exporter.sinks.prometheus.histograms import Histograms
from exporter.sinks.prometheus.source import Scrape, SourceCollector
from exporter.sources.nccl import probes as nccl_probes


class NcclCollector(SourceCollector):
    """source: an NcclReader. It names the communicators the other parts
    label by (Scrape.comms) and reads the counters map they share."""

    def prepare(self, scrape: Scrape) -> None:
        reader = self.source
        # Communicators of processes that are gone are not shown; the
        # agent's loop deletes their entries (a scrape only reads).
        scrape.comms = [c for c in reader.communicators() if scrape.alive(c.pid)]
        try:
            scrape.traced = {k.value for k in reader.probes["traced_processes"].keys()}
        except Exception:  # noqa: BLE001 - map unreadable: no process counts as traced, the scrape goes on
            pass
        scrape.counters = reader.counters()

    def families(self, scrape: Scrape):
        yield from self._collectives(scrape)
        yield self._errors(scrape)
        yield from self._inflight(scrape)
        yield self._communicators(scrape)
        yield self._exits(scrape)
        yield from self._async_errors(scrape)

    def _collectives(self, scrape: Scrape):
        node, reader = scrape.node, self.source
        durations = Histograms(metrics.COLLECTIVE_DURATION, histogram.DURATION, scrape.classic)
        lifecycle = Histograms(metrics.LIFECYCLE_DURATION, histogram.DURATION, scrape.classic)
        nbytes: dict[tuple, int] = defaultdict(int)
        last_seq: dict[tuple, int] = {}
        last_return: dict[tuple, float] = {}
        for s in reader.series():
            if s.op in contract.COLLECTIVE_OPS.values():
                scrape.made_collectives.add((s.comm, s.rank))
                key = (node, s.op, format_comm(s.comm), rank_label(s.rank))
                durations.add(key, s.buckets, s.sum_ns)
                nbytes[key] += s.bytes
                if s.calls and s.comm != contract.SERIES_OVERFLOW_COMM:
                    last_seq[key] = max(last_seq.get(key, -1), s.last_seq)
                    if s.last_ns:
                        t = reader.clock.to_realtime(s.last_ns) / 1e9
                        last_return[key] = max(last_return.get(key, 0.0), t)
            else:
                lifecycle.add((node, s.op), s.buckets, s.sum_ns)
        exemplars = {}
        if scrape.spans is not None:
            for (op, comm, rank), ex in list(scrape.spans.exemplars.items()):
                exemplars[(node, op, comm, rank_label(rank))] = ex
        yield durations.family(exemplars)
        yield family_of(metrics.COLLECTIVE_BYTES, nbytes)
        yield family_of(metrics.COLLECTIVE_LAST_SEQ, last_seq)
        yield family_of(metrics.COLLECTIVE_LAST_RETURN, last_return)
        yield lifecycle.family()

    def _errors(self, scrape: Scrape):
        return family_of(metrics.CALL_ERRORS, {(scrape.node, op, result): n
                                               for (op, result), n in self.source.errors().items()})

    def _inflight(self, scrape: Scrape):
        """The oldest call in flight per series, and the oldest of those whose
        caller is stopped (a rank stopped inside a collective: its peers wait
        in flight too, but running), and the oldest call's size (a rank
        waiting with another count than its peers is desynchronized)."""
        oldest: dict[tuple, float] = {}
        stopped: dict[tuple, float] = {}
        size: dict[tuple, int] = {}
        for call in self.source.inflight():
            key = (scrape.node, call.op, format_comm(call.comm), rank_label(call.rank))
            age = max(0, scrape.now_ns - call.start_ns) / 1e9
            if key not in oldest or age >= oldest[key]:
                oldest[key] = age
                size[key] = call.nbytes
            if call.stopped:
                stopped[key] = max(stopped.get(key, 0), age)
        yield family_of(metrics.INFLIGHT_OLDEST, oldest)
        yield family_of(metrics.INFLIGHT_STOPPED, stopped)
        yield family_of(metrics.INFLIGHT_BYTES, size)

    def _exits(self, scrape: Scrape):
        return family_of(metrics.RANK_EXIT, {(scrape.node, format_comm(e.comm), rank_label(e.rank), e.signal): e.time_s
                                             for e in self.source.exits()})

    def _communicators(self, scrape: Scrape):
        f = empty_family(metrics.COMMUNICATOR_INFO)
        for c in sorted(scrape.comms, key=lambda c: (c.pid, c.comm)):
            who = scrape.processes.identity(c.pid)
            f.add_metric(
                [
                    scrape.node,
                    format_comm(c.comm),
                    f"{c.nccl_comm_hash:016x}" if c.nccl_comm_hash else "",
                    rank_label(c.rank),
                    rank_label(c.nranks),
                    str(c.pid),
                    who.get("launcher") or "",
                    optional_label(who.get("rank")),
                    optional_label(who.get("world_size")),
                    *pod_labels(who),
                ],
                1,
            )
        return f

    def _async_errors(self, scrape: Scrape):
        """nccl_communicator_async_error{node, comm, rank, result} = 1 for the last
        result of each communicator's ncclCommGetAsyncError, and its polls."""
        state: dict[tuple, int] = {}
        polls: dict[tuple, int] = defaultdict(int)
        for a in self.source.async_errors():
            if not scrape.alive(a.pid):
                continue
            comm, rank = format_comm(a.comm), rank_label(a.rank)
            state[(scrape.node, comm, rank, a.result)] = 1
            polls[(scrape.node, comm, rank)] += a.polls
        yield family_of(metrics.COMMUNICATOR_ASYNC_ERROR, state)
        yield family_of(metrics.COMMUNICATOR_ASYNC_POLLS, polls)

    # --- the exporter's own families --------------------------------------------------

    def programs(self):
        yield self.source.probes, nccl_probes.MAP_CAPACITY

    def map_full(self, scrape: Scrape) -> dict[str, int]:
        return {m: scrape.counters[c] for c, m in contract.MAP_FULL_COUNTERS}

    def exporter_families(self, scrape: Scrape):
        node, counters = scrape.node, scrape.counters
        attached = empty_family(metrics.EXPORTER_PROBE_ATTACHED)
        for report in self.source.probes.reports:
            for fn in report.attached:
                attached.add_metric([node, report.path, fn], 1)
            for fn in [*report.missing, *report.failed]:
                attached.add_metric([node, report.path, fn], 0)
        yield attached
        # every program's ring-buffer losses are counted in the shared counters map
        yield family_of(metrics.EXPORTER_EVENTS_LOST,
                        {(node, source): counters[c] for c, source in contract.EVENTS_LOST_COUNTERS})
        yield family_of(metrics.EXPORTER_RETURNS_MISSED, {(node,): counters.get("RETURNS_MISSED", 0)})

"""The Prometheus sink: reads the sources at scrape time and builds the
metric families of exporter/records/metrics.py.

Nothing is cached between scrapes except the per-process launcher identity;
every number comes from the kernel's maps when Prometheus asks. A scrape
only reads: pruning dead processes' entries is the agent loop's job.
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
    Metric,
)
from prometheus_client.utils import floatToGoString

from exporter import __version__
from exporter.records import contract, histogram, metrics
from exporter.records.events import Communicator, format_comm
from exporter.sources import sched as sched_source
from exporter.sources.processes import alive_checker
from exporter.sources import tcp as tcp_source
from exporter.sources.nccl import probes as nccl_probes
from exporter.sources.plugin import source as plugin_source



def rank_label(value: int) -> str:
    """rank / nranks label: the number, or 'unknown' (-1)."""
    return str(value) if value >= 0 else "unknown"


def empty_family(name: str):
    """An empty counter or gauge family of a metric of the contract (exporter/records/metrics.py)."""
    m = metrics.spec(name)
    make = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}[m.kind]
    return make(m.name, m.help, labels=list(m.labels))


def family_of(name: str, values: dict[tuple, float]):
    """A counter or gauge family with one sample per label tuple, in sorted order."""
    f = empty_family(name)
    for label_values, v in sorted(values.items()):
        f.add_metric(list(label_values), v)
    return f


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
    fine) and protobuf scrapes as native histograms."""

    def __init__(self, name: str, layout, classic=None):
        self.spec = metrics.spec(name)
        self.layout = layout
        self.classic = classic or histogram.CLASSIC[histogram.DEFAULT_CLASSIC]
        self.buckets: dict[tuple, list[int]] = {}
        self.sums: dict[tuple, float] = defaultdict(float)

    def add(self, labels: tuple, counts, sum_seconds: float) -> None:
        size = self.layout.slots if self.layout else 1
        acc = self.buckets.setdefault(labels, [0] * size)
        for i, n in enumerate(counts[:size]):
            acc[i] += n
        acc[-1] += sum(counts[size:])  # anything past the layout is overflow
        self.sums[labels] += sum_seconds

    def family(self, exemplars: dict | None = None) -> ExponentialHistogramFamily:
        """exemplars: labels -> (trace id, duration ns, unix time): the latest slow
        call's trace, shown on its classic bucket (OpenMetrics exposition only)."""
        f = ExponentialHistogramFamily(self.spec.name, self.spec.help, list(self.spec.labels),
                                       self.layout, self.classic)
        for labels in sorted(self.buckets):
            f.series.append((labels, self.buckets[labels], self.sums[labels], (exemplars or {}).get(labels)))
        return f


class NcclCollector:
    """Every family, read from the sources when Prometheus scrapes.

    nccl: an NcclReader; tcp, sched: the kernel-side sources (None when off);
    processes: the ProcessTable (ranks and launcher identity); spans: the span
    sink, when traces are exported (exemplars, span counts).
    """

    def __init__(self, node: str, nccl, processes, tcp=None, sched=None, spans=None, lock=None,
                 plugin=None, recorder=None, classic=None):
        self.lock = lock or threading.Lock()  # held while reading: BCC objects are shared
        self.node = node
        self.nccl = nccl
        self.processes = processes
        self.tcp = tcp
        self.sched = sched
        self.spans = spans
        self.plugin = plugin  # exporter.sources.plugin.source.PluginSource, None when not loaded
        self.named_peers: dict = {}  # network_families' sticky peer names per (commHash, rank)
        self.recorder = recorder  # run --db's Recorder: its drops, by reason
        # which classic buckets text scrapes get (run --histogram-resolution)
        self.classic = classic or histogram.CLASSIC[histogram.DEFAULT_CLASSIC]

    def describe(self):
        """The declared families, without reading any source: the registry
        learns the names from it, which `/metrics?name[]=...` filtering needs
        (the registry does not collect to learn them: run's auto_describe=False)."""
        for m in metrics.ALL:
            yield Metric(m.name, m.help, m.kind)

    def collect(self):
        started = time.perf_counter()
        with self.lock:
            # Communicators of processes that are gone are not shown; the
            # agent's loop deletes their entries (a scrape only reads).
            alive = alive_checker()
            comms = with_announced([c for c in self.nccl.communicators() if alive(c.pid)],
                                   self.plugin.comms() if self.plugin is not None else (), alive)
            families = [
                *self._collectives(),
                *self._errors(),
                *self._inflight(),
                *self._communicators(comms),
                *self._async_errors(alive),
                *self._tcp(comms),
                *self._sched(comms),
                *self._gpu(comms, alive),
                *self._self_metrics(),
            ]
        yield from families
        yield family_of(metrics.EXPORTER_SCRAPE_DURATION, {(self.node,): time.perf_counter() - started})

    # --- the NCCL call surface ------------------------------------------------------

    def _collectives(self):
        node = self.node
        durations = Histograms(metrics.COLLECTIVE_DURATION, histogram.DURATION, self.classic)
        lifecycle = Histograms(metrics.LIFECYCLE_DURATION, histogram.DURATION, self.classic)
        nbytes: dict[tuple, int] = defaultdict(int)
        made: set[tuple[int, int]] = set()  # (comm, rank) with collectives: whose process made one
        last_seq: dict[tuple, int] = {}
        last_return: dict[tuple, float] = {}
        for s in self.nccl.series():
            if s.op in contract.COLLECTIVE_OPS.values():
                made.add((s.comm_hash, s.rank))
                comm = format_comm(s.comm_hash)
                key = (node, s.op, comm, rank_label(s.rank))
                durations.add(key, s.buckets, s.sum_ns / 1e9)
                nbytes[key] += s.bytes
                if s.calls and s.comm_hash != contract.SERIES_OVERFLOW_COMM:
                    last_seq[key] = max(last_seq.get(key, -1), s.last_seq)
                    if s.last_ns:
                        t = self.nccl.clock.to_realtime(s.last_ns) / 1e9
                        last_return[key] = max(last_return.get(key, 0.0), t)
            else:
                lifecycle.add((node, s.op), s.buckets, s.sum_ns / 1e9)
        self._made_collectives = made
        exemplars = {}
        if self.spans is not None:
            for (op, comm, rank), ex in list(self.spans.exemplars.items()):
                exemplars[(node, op, comm, rank_label(rank))] = ex
        yield durations.family(exemplars)
        yield family_of(metrics.COLLECTIVE_BYTES, nbytes)
        yield family_of(metrics.COLLECTIVE_LAST_SEQ, last_seq)
        yield family_of(metrics.COLLECTIVE_LAST_RETURN, last_return)
        yield lifecycle.family()

    def _errors(self):
        yield family_of(metrics.CALL_ERRORS, {(self.node, op, result): n
                                           for (op, result), n in self.nccl.errors().items()})

    def _inflight(self):
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        oldest: dict[tuple, float] = {}
        for call in self.nccl.inflight():
            key = (self.node, call.op, format_comm(call.comm_hash), rank_label(call.rank))
            oldest[key] = max(oldest.get(key, 0), max(0, now - call.start_ns) / 1e9)
        yield family_of(metrics.INFLIGHT_OLDEST, oldest)

    def _communicators(self, comms):
        f = empty_family(metrics.COMMUNICATOR_INFO)
        for c in sorted(comms, key=lambda c: (c.pid, c.comm_hash)):
            who = self.processes.identity(c.pid)
            f.add_metric(
                [
                    self.node,
                    format_comm(c.comm_hash),
                    f"{c.nccl_hash:016x}" if c.nccl_hash else "",
                    rank_label(c.rank),
                    rank_label(c.nranks),
                    str(c.pid),
                    who.get("launcher") or "",
                    _opt(who.get("rank")),
                    _opt(who.get("world_size")),
                    *pod_labels(who),
                ],
                1,
            )
        yield f

    def _async_errors(self, alive):
        """nccl_communicator_async_error{node, comm, rank, result} = 1 for the last
        result of each communicator's ncclCommGetAsyncError, and its polls."""
        state: dict[tuple, int] = {}
        polls: dict[tuple, int] = defaultdict(int)
        for a in self.nccl.async_errors():
            if not alive(a.pid):
                continue
            comm, rank = format_comm(a.comm_hash), rank_label(a.rank)
            state[(self.node, comm, rank, a.result)] = 1
            polls[(self.node, comm, rank)] += a.polls
        yield family_of(metrics.COMMUNICATOR_ASYNC_ERROR, state)
        yield family_of(metrics.COMMUNICATOR_ASYNC_POLLS, polls)

    # --- the kernel side ---------------------------------------------------------------

    def _tcp(self, comms):
        if self.tcp is not None:
            yield from tcp_families(self.node, self.tcp, lambda pid: self.processes.rank_of(pid, comms),
                                    self.classic)

    def _sched(self, comms):
        if self.sched is not None:
            yield from sched_families(self.node, self.sched, lambda pid: self.processes.rank_of(pid, comms),
                                      self.classic)

    def _gpu(self, comms, alive):
        traced = set()
        try:
            traced = {k.value for k in self.nccl.probes["traced_processes"].keys()}
        except Exception:  # noqa: BLE001 - map unreadable: no process counts as traced, the scrape goes on
            pass
        self.processes.mark_collectives(comms, getattr(self, "_made_collectives", ()))
        yield from gpu_families(self.node, self.plugin, comms, traced | {c.pid for c in comms}, alive,
                                self.processes.identity, self.classic, self.named_peers)

    # --- the exporter itself -------------------------------------------------------------

    def _sources(self):
        """(program, capacities) of every loaded source."""
        yield self.nccl.probes, nccl_probes.MAP_CAPACITY
        if self.tcp is not None:
            yield self.tcp, tcp_source.MAP_CAPACITY
        if isinstance(self.sched, sched_source.SchedSource):  # not SchedTotals: no maps
            yield self.sched, sched_source.MAP_CAPACITY
        if self.plugin is not None:
            yield self.plugin, plugin_source.MAP_CAPACITY

    def _self_metrics(self):
        node = self.node
        yield family_of(metrics.EXPORTER_BUILD_INFO, {(node, __version__): 1})
        attached = empty_family(metrics.EXPORTER_PROBE_ATTACHED)
        for report in self.nccl.probes.reports:
            for fn in report.attached:
                attached.add_metric([node, report.path, fn], 1)
            for fn in [*report.missing, *report.failed]:
                attached.add_metric([node, report.path, fn], 0)
        yield attached
        entries, capacity, misses = {}, {}, {}
        for program, caps in self._sources():
            for name, cap in caps.items():
                entries[(node, name)] = program.entries(name)
                capacity[(node, name)] = cap
            for fn, n in program.recursion_misses().items():
                misses[(node, fn)] = n
        yield family_of(metrics.EXPORTER_NODE_TRACEPOINTS,
                     {(node, p.name): int(p.hot) for p in (self.tcp, self.sched) if p is not None})
        yield family_of(metrics.EXPORTER_MAP_ENTRIES, entries)
        yield family_of(metrics.EXPORTER_MAP_CAPACITY, capacity)
        counters = self.nccl.counters()
        full = {(node, m): counters[c] for c, m in contract.MAP_FULL_COUNTERS}
        if self.plugin is not None:
            drops = self.plugin.drops()
            full.update({(node, m): drops[d] for d, m in plugin_source.MAP_FULL})
        yield family_of(metrics.EXPORTER_MAP_FULL, full)
        if self.plugin is not None:
            yield family_of(metrics.EXPORTER_GPU_INTERVALS_REJECTED,
                         {(node, reason): n for reason, n in self.plugin.rejected().items()})
            yield family_of(metrics.EXPORTER_GPU_INTERVALS_SHARED, {(node,): self.plugin.shared()})
            yield family_of(metrics.EXPORTER_GPU_OPERATIONS_UNTIMED, {(node,): self.plugin.untimed()})
        yield family_of(metrics.EXPORTER_EVENTS_LOST,
                     {(node, source): counters[c] for c, source in contract.EVENTS_LOST_COUNTERS})
        yield family_of(metrics.EXPORTER_BPF_MISSES, misses)
        yield family_of(metrics.EXPORTER_RETURNS_MISSED, {(node,): counters.get("RETURNS_MISSED", 0)})
        if self.tcp is not None:
            yield family_of(metrics.EXPORTER_RETRANSMITS_MISSED, {(node,): tcp_source.retransmits_missed(counters)})
        if self.spans is not None:
            yield family_of(metrics.EXPORTER_SPANS, {(node, o): n for o, n in self.spans.counts().items()})
        if self.recorder is not None:
            yield family_of(metrics.EXPORTER_RECORDING_DROPPED,
                         {(node, reason): n for reason, n in self.recorder.drops().items()})


def _owner_rank_label(rank_of, pid: int) -> str:
    """A kernel-side series' rank label: the owner's rank, '' when unknown."""
    if not pid:
        return ""
    r = rank_of(pid)
    return "" if r is None or r == -1 else str(r)


def tcp_families(node: str, tcp, rank_of, classic=None) -> list:
    """The TCP families of a TcpSource; rank_of(pid) -> rank or None labels each owner.
    Links of owners with the same rank are summed; an owner that is gone keeps
    the rank it had, and the retired totals of expired owners are included
    (TcpSource.labelled, OwnerExpiry): a label set never goes backwards."""
    retrans: dict[tuple, int] = defaultdict(int)
    failures: dict[tuple, int] = defaultdict(int)
    resets: dict[tuple, int] = defaultdict(int)
    links, srtt_recs = tcp.labelled(lambda pid: _owner_rank_label(rank_of, pid))
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
        srtt.add((node, *lset), s.buckets, s.sum_us * 1e-6)
    return [family_of(metrics.TCP_RETRANSMITS, retrans), family_of(metrics.TCP_RETRANSMIT_FAILURES, failures),
            family_of(metrics.TCP_RESETS, resets), srtt.family()]


def sched_families(node: str, sched, rank_of, classic=None) -> list:
    """nccl_runqueue_delay_seconds and nccl_offcpu_seconds_total of a SchedSource
    or SchedTotals (whose histogram has its +Inf bucket only), labelled {node,
    rank, thread}; processes with the same rank and kind are summed (with the
    retired totals of expired processes: `labelled`)."""
    runq = Histograms(metrics.RUNQUEUE_DELAY, sched.layout, classic)
    offcpu: dict[tuple, float] = defaultdict(float)
    for lset, s in sched.labelled(lambda pid: _owner_rank_label(rank_of, pid)):
        labels = (node, *lset)
        runq.add(labels, s.buckets, s.sum_ns / 1e9)
        offcpu[labels] += s.offcpu_ns / 1e9
    return [runq.family(), family_of(metrics.OFFCPU, offcpu)]


def with_announced(comms, announced, alive) -> list[Communicator]:
    """The kernel's communicators and those the profiler plugin announced that
    no call has named yet (an agent that attached mid-job: idle or hung ones,
    docs/communicators.md), as Communicator records with handle 0."""
    named = {(c.pid, c.comm_hash) for c in comms}
    extra = [Communicator(pid=a.pid, handle=0, comm_hash=a.nccl_hash, nccl_hash=a.nccl_hash, rank=a.rank,
                          nranks=a.nranks)
             for a in announced if (a.pid, a.nccl_hash) not in named and alive(a.pid)]
    return list(comms) + sorted(extra, key=lambda c: (c.pid, c.comm_hash))


def plugin_labels(who: dict) -> tuple[str, ...]:
    """nccl_profiler_plugin_active's labels after node and pid, from a
    ProcessTable identity: the pod, the libnccl version, whether it made a
    collective (the plugin alert's conditions, docs/alerts.md)."""
    return (*pod_labels(who), who.get("libnccl_version") or "", "yes" if who.get("collectives") else "no")


def pod_labels(who: dict) -> tuple[str, ...]:
    """The metrics.POD labels of a ProcessTable identity ("" where unknown)."""
    return tuple(who.get(k) or "" for k in metrics.POD)


def gpu_families(node: str, plugin, comms, traced_pids, is_alive=None, identity=None,
                 classic=None, named_peers: dict | None = None) -> list:
    """The profiler plugin's families: GPU duration histograms, the oldest GPU
    in-flight ages and nccl_profiler_plugin_active. comm label: NCCL's
    commHash in 16 hex digits, the host series' label of the same
    communicator (docs/communicators.md). plugin None (not loaded): every
    traced process is 0. `identity`: pid -> the ProcessTable's dict (pod,
    libnccl_version, collectives labels; None: all empty)."""
    is_alive = is_alive or alive_checker()

    durations = Histograms(metrics.GPU_DURATION, histogram.DURATION, classic)
    oldest: dict[tuple, float] = {}
    with_plugin: set[int] = set()
    if plugin is not None:
        for s in plugin.series():
            durations.add((node, s.op, format_comm(s.nccl_hash), rank_label(s.rank)),
                          s.buckets, s.sum_ns / 1e9)
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        for f in plugin.inflight():
            if not is_alive(f.pid):
                continue  # the agent's loop forgets it
            key = (node, f.op, format_comm(f.nccl_hash), rank_label(f.rank), f.state)
            oldest[key] = max(oldest.get(key, 0.0), max(0, now - f.since_ns) / 1e9)
        with_plugin = {p.pid for p in plugin.processes() if is_alive(p.pid)}
    def key(pid: int) -> tuple:
        return (node, str(pid), *plugin_labels(identity(pid) if identity else {}))

    active = {key(pid): 1 for pid in with_plugin}
    for pid in traced_pids:
        if pid not in with_plugin and is_alive(pid):
            active[key(pid)] = 0
    return [durations.family(), family_of(metrics.GPU_INFLIGHT_OLDEST, oldest),
            family_of(metrics.PROFILER_PLUGIN_ACTIVE, active),
            *network_families(node, plugin, format_comm, is_alive, named_peers)]


def network_families(node: str, plugin, comm_of, is_alive, named_peers: dict | None = None) -> list:
    """nccl_network_{wait,step_wait}_seconds_total, nccl_network_wire_bytes_total and
    nccl_network_foreign_proxy_ops_total from the plugin's network series.

    Cardinality: per (comm, rank) at most contract.NET_TOP_K peers by name,
    the rest "other". `named_peers` ((NCCL commHash, rank) -> the peers named
    so far; the collector keeps it across scrapes) makes the choice sticky: a
    peer once named stays named, new ones are named while there is room (the
    most waited first), so no counter moves between series."""
    named = named_peers if named_peers is not None else {}
    wait: dict[tuple, float] = defaultdict(float)
    steps: dict[tuple, float] = defaultdict(float)
    nbytes: dict[tuple, float] = defaultdict(float)
    foreign: dict[tuple, float] = {}
    if plugin is not None:
        series = plugin.network()
        by_owner: dict[tuple, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for s in series:
            if s.peer >= 0:
                by_owner[(s.nccl_hash, s.rank)][s.peer] += sum(s.wall_ns)
        for owner in [o for o in named if o not in by_owner]:
            del named[owner]  # expired with its communicator
        for owner, peers in by_owner.items():
            have = named.setdefault(owner, set())
            for peer in sorted(peers, key=lambda p: (-peers[p], p)):
                if len(have) >= contract.NET_TOP_K:
                    break
                have.add(peer)
        for s in series:
            have = named.get((s.nccl_hash, s.rank), ())
            peer = str(s.peer) if s.peer in have else "other"
            base = (node, comm_of(s.nccl_hash), rank_label(s.rank), peer, s.direction)
            nbytes[base] += s.bytes
            for phase, w, st in zip(contract.NETWORK_PHASES[s.direction], s.wall_ns, s.step_ns):
                wait[(*base, phase)] += w / 1e9
                steps[(*base, phase)] += st / 1e9
        foreign = {(node, str(pid)): n for pid, n in plugin.foreign_proxy_ops().items() if is_alive(pid)}
    return [family_of(metrics.NETWORK_WAIT, wait), family_of(metrics.NETWORK_STEP_WAIT, steps),
            family_of(metrics.NETWORK_BYTES, nbytes), family_of(metrics.NETWORK_FOREIGN_OPS, foreign)]


def _opt(v) -> str:
    return "" if v is None else str(v)

"""The profiler plugin's families on /metrics, read from a PluginSource
(sources/plugin/): GPU durations and in-flight ages, network waits per peer,
whether each traced process has the plugin, and the communicators it
announced that no call has named yet."""

from __future__ import annotations

import time
from collections import defaultdict

from exporter.records import contract, histogram, metrics
from exporter.records.events import Communicator, format_comm
from exporter.sinks.prometheus.families import family_of, pod_labels, rank_label
from exporter.sinks.prometheus.histograms import Histograms
from exporter.sinks.prometheus.source import Scrape, SourceCollector
from exporter.sources.plugin import source as plugin_source
from exporter.sources.processes import alive_checker


class PluginCollector(SourceCollector):
    """source: a PluginSource, None when it did not load: every traced process
    then shows nccl_profiler_plugin_active 0."""

    def __init__(self, source):
        super().__init__(source)
        self.named_peers: dict = {}  # network_families' sticky peer names per (commHash, rank)

    def prepare(self, scrape: Scrape) -> None:
        if self.source is not None:
            scrape.comms = with_announced(scrape.comms, self.source.comms(), scrape.alive)

    def families(self, scrape: Scrape):
        scrape.processes.mark_collectives(scrape.comms, scrape.made_collectives)
        return gpu_families(scrape.node, self.source, scrape.comms, scrape.traced | {c.pid for c in scrape.comms},
                            scrape.alive, scrape.processes.identity, scrape.classic, self.named_peers,
                            now_ns=scrape.now_ns)

    def programs(self):
        return [(self.source, plugin_source.MAP_CAPACITY)] if self.source is not None else []

    def map_full(self, scrape: Scrape) -> dict[str, int]:
        if self.source is None:
            return {}
        drops = self.source.drops()
        return {m: drops[d] for d, m in plugin_source.MAP_FULL}

    def exporter_families(self, scrape: Scrape):
        if self.source is None:
            return
        node, plugin = scrape.node, self.source
        yield family_of(metrics.EXPORTER_GPU_INTERVALS_REJECTED,
                        {(node, reason): n for reason, n in plugin.rejected().items()})
        yield family_of(metrics.EXPORTER_GPU_INTERVALS_SHARED, {(node,): plugin.shared()})
        yield family_of(metrics.EXPORTER_GPU_OPERATIONS_UNTIMED, {(node,): plugin.untimed()})


def with_announced(comms, announced, alive) -> list[Communicator]:
    """The kernel's communicators and those the profiler plugin announced that
    no call has named yet (an agent that attached mid-job: idle or hung ones,
    docs/communicators.md), as Communicator records with handle 0."""
    named = {(c.pid, c.comm) for c in comms}
    extra = [Communicator(pid=a.pid, comm_ptr=0, comm=a.comm, nccl_comm_hash=a.comm, rank=a.rank,
                          nranks=a.nranks)
             for a in announced if (a.pid, a.comm) not in named and alive(a.pid)]
    return list(comms) + sorted(extra, key=lambda c: (c.pid, c.comm))


def plugin_labels(who: dict) -> tuple[str, ...]:
    """nccl_profiler_plugin_active's labels after node and pid, from a
    ProcessTable identity: the pod, the libnccl version, whether it made a
    collective (the plugin alert's conditions, docs/alerts.md)."""
    return (*pod_labels(who), who.get("libnccl_version") or "", "yes" if who.get("collectives") else "no")


def gpu_families(node: str, plugin, comms, traced_pids, is_alive=None, identity=None,
                 classic=None, named_peers: dict | None = None, now_ns: int | None = None) -> list:
    """The profiler plugin's families: GPU duration histograms, the oldest GPU
    in-flight ages and nccl_profiler_plugin_active. comm label: NCCL's
    commHash in 16 hex digits, the host series' label of the same
    communicator (docs/communicators.md). plugin None (not loaded): every
    traced process is 0. `identity`: pid -> the ProcessTable's dict (pod,
    libnccl_version, collectives labels; None: all empty). now_ns: CLOCK_MONOTONIC
    now (None: read here)."""
    is_alive = is_alive or alive_checker()

    durations = Histograms(metrics.GPU_DURATION, histogram.DURATION, classic)
    oldest: dict[tuple, float] = {}
    with_plugin: set[int] = set()
    if plugin is not None:
        for s in plugin.series():
            durations.add((node, s.op, format_comm(s.comm), rank_label(s.rank)),
                          s.buckets, s.sum_ns)
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC) if now_ns is None else now_ns
        for f in plugin.inflight():
            if not is_alive(f.pid):
                continue  # the agent's loop forgets it
            key = (node, f.op, format_comm(f.comm), rank_label(f.rank), f.state)
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
    wait: dict[tuple, int] = defaultdict(int)    # ns, exact (Histograms says why)
    steps: dict[tuple, int] = defaultdict(int)
    nbytes: dict[tuple, int] = defaultdict(int)
    foreign: dict[tuple, float] = {}
    if plugin is not None:
        series = plugin.network()
        by_owner: dict[tuple, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for s in series:
            if s.peer >= 0:
                by_owner[(s.comm, s.rank)][s.peer] += sum(s.wall_ns)
        for owner in [o for o in named if o not in by_owner]:
            del named[owner]  # expired with its communicator
        for owner, peers in by_owner.items():
            have = named.setdefault(owner, set())
            for peer in sorted(peers, key=lambda p: (-peers[p], p)):
                if len(have) >= contract.NET_TOP_K:
                    break
                have.add(peer)
        for s in series:
            have = named.get((s.comm, s.rank), ())
            peer = str(s.peer) if s.peer in have else "other"
            base = (node, comm_of(s.comm), rank_label(s.rank), peer, s.direction)
            nbytes[base] += s.bytes
            for phase, w, st in zip(contract.NETWORK_PHASES[s.direction], s.wall_ns, s.step_ns):
                wait[(*base, phase)] += w
                steps[(*base, phase)] += st
        foreign = {(node, str(pid)): n for pid, n in plugin.foreign_proxy_ops().items() if is_alive(pid)}
    return [family_of(metrics.NETWORK_WAIT, wait, per_second=10**9),
            family_of(metrics.NETWORK_STEP_WAIT, steps, per_second=10**9),
            family_of(metrics.NETWORK_BYTES, nbytes), family_of(metrics.NETWORK_FOREIGN_OPS, foreign)]

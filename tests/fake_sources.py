"""Sources without a kernel: the records the real sources decode from BPF
maps, as fixed lists, behind the same methods the sinks call. For tests of
the sinks that need no root: /metrics serving and the golden exposition
(tests/test_sink_http.py).

    agent = FakeAgent()                    # what agent/pipeline.py wires
    Pipeline(agent, "node-a").serve_metrics(registry)

Every family of records/metrics.py gets at least one sample from these
records (the golden file is checked for it), so a change to a family's
rendering shows in tests/fixtures/metrics.txt.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from types import SimpleNamespace

from exporter.records import contract, histogram
from exporter.records.events import (Communicator, GpuInflight, GpuSeries, InflightCall, NetworkSeries,
                                     PluginComm, PluginProcess, SchedStats, Series, TcpLink, TcpSrtt)
from exporter.sources.nccl.exits import RankExit
from exporter.sources.nccl.maps import AsyncState
from exporter.sources.nccl.probes import MAP_CAPACITY as NCCL_MAPS
from exporter.sources.plugin.source import DROPS, MAP_CAPACITY as PLUGIN_MAPS
from exporter.sources.tcp import MAP_CAPACITY as TCP_MAPS

# The fake job's pid (test_sink_http.py makes the sink see it alive: it shows
# only communicators and in-flight work of living processes).
PID = 4242
NOW_NS = 10_000_000_000_000  # the fixed CLOCK_MONOTONIC of a golden scrape
NCCL_HASH = 0x1234_5678_9ABC_DEF0  # NCCL's commHash of the fake job's communicator
COMM = NCCL_HASH  # its `comm` label (docs/communicators.md)
IDLE_HASH = 0xFEED_0000_0000_0001  # a communicator only the profiler plugin announced


def _buckets(n: int, *hits: tuple[int, int]) -> tuple[int, ...]:
    out = [0] * n
    for i, count in hits:
        out[i] += count
    return tuple(out)


class FakeProgram:
    """What the sinks read of a BPF program besides its records: map fill and misses."""

    def __init__(self, name: str, capacities: dict, hot: bool = True):
        self.name = name
        self.capacities = capacities
        self.hot = hot
        self.reports = []

    def entries(self, map_name: str) -> int:
        return min(3, self.capacities[map_name])

    def recursion_misses(self) -> dict[str, int]:
        return {f"{self.name}_fn": 0}


class FakeProbes(FakeProgram):
    def __init__(self):
        super().__init__("nccl", NCCL_MAPS)
        self.reports = [SimpleNamespace(path="/opt/nccl/lib/libnccl.so.2",
                                        attached={"ncclAllReduce": "ALL_REDUCE", "ncclSend": "SEND"},
                                        missing=["ncclGather"], failed={})]

    def __getitem__(self, name: str):
        if name == "traced_processes":
            return {SimpleNamespace(value=PID): 1}
        raise KeyError(name)


LAST_RETURN_NS = 5_000_000_000        # CLOCK_MONOTONIC of the ALL_REDUCE series' latest return
WALL_OFFSET_NS = 1_700_000_000_000_000_000


class FakeNcclReader:
    """NcclReader's surface: series, errors, in-flight calls, communicators."""

    def __init__(self):
        self.probes = FakeProbes()
        # CLOCK_MONOTONIC -> wall clock at a fixed offset: the last-return gauge is reproducible
        self.clock = SimpleNamespace(to_realtime=lambda ns: ns + WALL_OFFSET_NS)
        slots = histogram.DURATION.slots
        at = histogram.bucket_of  # the slot of a duration in ns
        self._series = [
            Series("ALL_REDUCE", COMM, 0, 2, calls=5, bytes=5 << 20, sum_ns=15_000_000,
                   buckets=_buckets(slots, (at(3_000_000), 4), (at(8_000_000), 1)), last_ns=LAST_RETURN_NS),
            Series("SEND", COMM, 0, 2, calls=2, bytes=4096, sum_ns=40_000, buckets=_buckets(slots, (at(20_000), 2))),
            Series("COMM_INIT_RANK", 0, 0, 2, calls=1, bytes=0, sum_ns=2_000_000,
                   buckets=_buckets(slots, (at(2_000_000), 1))),
        ]

    def series(self):
        return list(self._series)

    def errors(self):
        return {("ALL_REDUCE", "ncclInvalidArgument"): 1}

    def inflight(self):
        return [InflightCall(tid=PID, op="ALL_REDUCE", comm=COMM, rank=0, nranks=2,
                             start_ns=NOW_NS - 250_000_000)] + [
            # a thread of the process stopped inside an ALL_REDUCE of the second communicator for 12 s
            InflightCall(tid=PID + 7, op="ALL_REDUCE", comm=IDLE_HASH, rank=1, nranks=4,
                         start_ns=NOW_NS - 12_000_000_000, stopped=True)]

    def communicators(self):
        return [Communicator(pid=PID, comm_ptr=0x5000, comm=COMM, nccl_comm_hash=NCCL_HASH, rank=0, nranks=2)]

    def exits(self):  # rank 1 of the job, killed (its process held the communicator)
        return [RankExit(pid=PID + 1, comm=COMM, rank=1, nranks=2, time_s=1_700_000_100.5, signal="SIGKILL")]

    def async_errors(self):
        return [AsyncState(pid=PID, comm_ptr=0x5000, comm=COMM, nccl_comm_hash=NCCL_HASH, rank=0, nranks=2,
                           result="ncclRemoteError", polls=7, changes=1, changed_ns=NOW_NS - 1, last_ns=NOW_NS)]

    def counters(self):
        counts = defaultdict(int, {name: 0 for name in contract.COUNTERS})
        counts.update(EVENTS_LOST=1, RETRANSMIT_HITS=5, RETRANSMIT_SEEN=4)
        return counts


class FakeProcesses:
    """ProcessTable's surface: a rank, the launcher's and the pod's identity,
    the libnccl version per pid, and which made a collective."""

    def __init__(self):
        self._known: dict[int, dict] = {}

    def identity(self, pid):
        return self._known.setdefault(pid, {
            "launcher": "torchrun", "rank": 0, "world_size": 2,
            "namespace": "ml", "pod": "trainer-0", "container": "pytorch",
            "pod_uid": "5f1d8c2a-3b4e-4f60-9a7b-0c1d2e3f4a5b",
            "container_id": "containerd://" + "ab" * 32, "libnccl_version": "2.32.3",
            "collectives": False})

    def rank_of(self, pid, comms=()):
        return 0

    def mark_collectives(self, communicators, series_keys):
        for c in communicators:
            if (c.comm, c.rank) in series_keys:
                self.identity(c.pid)["collectives"] = True


class FakeTcp(FakeProgram):
    def __init__(self):
        super().__init__("tcp", TCP_MAPS)

    def labelled(self, rank_label):
        link = TcpLink(family=2, saddr="198.18.0.6", daddr="198.18.0.7", port=40000, owner=PID,
                       retransmits=3, failures=1, resets_sent=1, resets_received=2)
        srtt = TcpSrtt(family=2, saddr="198.18.0.6", daddr="198.18.0.7", port=40000, owner=PID, count=4,
                       sum_us=800, buckets=_buckets(histogram.SRTT.slots, (histogram.SRTT.slot_of(200), 4)))
        lset = (link.saddr, link.daddr, str(link.port), rank_label(PID))
        return [(lset, link)], [(lset, srtt)]


class FakeSched(FakeProgram):
    """A SchedTotals-like table (its histogram has its +Inf bucket only)."""

    layout = None

    def __init__(self):
        super().__init__("sched", {}, hot=False)

    def labelled(self, rank_label):
        return [((rank_label(PID), "caller"),
                 SchedStats(pid=PID, thread="caller", count=3, sum_ns=3_000_000, offcpu_ns=9_000_000,
                            buckets=(3,)))]


class FakePlugin(FakeProgram):
    def __init__(self):
        super().__init__("plugin", PLUGIN_MAPS)

    def series(self):
        return [GpuSeries("ALL_REDUCE", NCCL_HASH, 0, 2, calls=5, bytes=5 << 20, sum_ns=12_000_000,
                          buckets=_buckets(histogram.DURATION.slots, (histogram.bucket_of(2_400_000), 5)))]

    def inflight(self):
        return [GpuInflight(pid=PID, id=1, op="ALL_REDUCE", comm=NCCL_HASH, rank=0, nranks=2, seq=5,
                            state="running", since_ns=NOW_NS - 100_000_000)]

    def processes(self):
        return [PluginProcess(pid=PID, first_seen_ns=1, last_seen_ns=2, comms=1, dropped=0, iface_version=7)]

    def comms(self):
        # the kernel's communicator (named by a call: shown once), and one no
        # call has named (idle since before the agent): shown from the announcement
        return [PluginComm(pid=PID, comm=NCCL_HASH, rank=0, nranks=2, nnodes=1, last_ns=NOW_NS),
                PluginComm(pid=PID, comm=IDLE_HASH, rank=1, nranks=4, nnodes=2, last_ns=NOW_NS)]

    def network(self):
        """Rank 0 of a 8-rank AllToAll-like job: 6 peers with figures, 4 named
        (the most waited: 5, then 1, 2, 3), the rest (6, 7) and the plugin's
        own "other" in peer="other"."""
        out = []
        for peer, wait_ms in ((5, 40), (1, 9), (2, 8), (3, 7), (6, 2), (7, 1), (-1, 1)):
            ms = 1_000_000
            out.append(NetworkSeries(NCCL_HASH, 0, peer, "recv", ops=5, bytes=5 << 20,
                                     wall_ns=(wait_ms * ms, 1 * ms, 2 * ms),
                                     step_ns=(4 * wait_ms * ms, 4 * ms, 8 * ms)))
            out.append(NetworkSeries(NCCL_HASH, 0, peer, "send", ops=5, bytes=5 << 20,
                                     wall_ns=(1 * ms, 0, 3 * ms), step_ns=(2 * ms, 0, 6 * ms)))
        return out

    def foreign_proxy_ops(self):
        return {PID: 3}

    def drops(self):
        return {name: 0 for name in DROPS}

    def rejected(self):
        return {"longer_than_host": 2, "start_before_enqueue": 0, "stop_before_start": 0, "channel_lost": 0}

    def shared(self):
        return 3

    def untimed(self):
        return 4


class FakeSpans:
    """SpanSink's surface: exemplars and span counts."""

    exemplars = {("ALL_REDUCE", f"{COMM:016x}", 0): ("4bf92f3577b34da6a3ce929d0e0e4736", 187_000_000, 1.7e9)}

    def counts(self):
        return {"exported": 2, "dropped": 0}


class FakeRecorder:
    def drops(self):
        return {"queue_full": 0, "write_failed": 1}


class FakeAgent:
    """What agent/pipeline.py reads of an Agent: the SOURCES rows' attributes,
    the process table, the lock and the config."""

    def __init__(self, **extra):
        from exporter.agent.loop import AgentConfig
        from exporter.agent.sources import SOURCES

        self.config = AgentConfig(node="n1")
        self.lock = threading.Lock()
        self.listeners: list = []
        self.processes = FakeProcesses()
        self.reader = FakeNcclReader()
        self.probes = self.reader.probes
        self.tcp = FakeTcp()
        self.sched = FakeSched()
        self.plugin = FakePlugin()
        self.loader = None
        for name, source in extra.items():
            setattr(self, name, source)
        self.loaded = [row for row in SOURCES if getattr(self, row.name, None) is not None]

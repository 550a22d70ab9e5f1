"""SOURCES: every source the agent loads, one row each, in load order (rows
marked after_counting load after all the others), which is /metrics' order.

A row is the one place that wires a source in (docs/architecture.md, "Where
a new thing goes"): how it loads (its BPF text is its Program's, bpf/<name>.c;
`load` gives it the agent's options), where its records go, its collector
on /metrics (sinks/prometheus/, one file per source) and its own recording
tables (sinks/recording/tables.py). What the loaded source does on the
agent's loop (tick, prune, heat, losses, close) it answers itself: the
Source hooks of sources/base.py. The NCCL source comes first: it owns the
maps the others share (bpf/traced.h). Rows marked after_counting load on
the agent's loop once the NCCL probes count (the start-up order:
docs/architecture.md). Closed in the reverse order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from exporter.agent.preflight import check_schedstat
from exporter.records import contract
from exporter.sinks.prometheus import NcclCollector, PluginCollector, SchedCollector, TcpCollector
from exporter.sinks.recording.tables import RecordTable
from exporter.sources.loader import LoaderSource
from exporter.sources.nccl.maps import NcclReader
from exporter.sources.nccl.probes import NcclProbes
from exporter.sources.plugin.source import PluginSource
from exporter.sources.sched import SchedSource
from exporter.sources.schedstat import SchedTotals
from exporter.sources.tcp import TcpSource

Agent = Any  # exporter.agent.loop.Agent, which imports this module
log = logging.getLogger("nccl_exporter")


@dataclass(frozen=True)
class SourceRow:
    """One row of SOURCES."""

    name: str  # the agent's attribute: agent.<name>
    # the loaded source (a sources/base.py Source; a later row may use an earlier one)
    load: Callable[[Agent], Any]
    # A load failure is a warning with this explanation and the source is None;
    # without one, it stops the agent.
    optional: Callable[[Agent], str] | None = None
    # The agent method its records go to (source.on_event), where it has on_event.
    events: str | None = None
    # Its part of /metrics: collector(source) -> a sinks/prometheus SourceCollector,
    # made for an optional source that did not load too (source None).
    collector: Callable[[Any], Any] | None = None
    # Tables of its own in recordings (run --db, trace --db): the recorder
    # creates them and writes each record of their type there.
    tables: tuple[RecordTable, ...] = ()
    # Loaded by the agent's loop once NCCL calls are counted (the NCCL probes
    # and the plugin's hooks attached), not before: its compile (BCC, ~0.3-0.5 s
    # a program) does not delay counting. /-/ready names it while it loads.
    after_counting: bool = False


def _probes(agent: Agent) -> NcclProbes:
    probes = NcclProbes(series_capacity=agent.config.series_capacity)
    if agent.config.record_all:  # a ring-buffer event for every call, not only slow ones
        probes.set_record_all(True)
    return probes


def _reader(agent: Agent) -> NcclReader:
    reader = NcclReader(agent.probes, agent.clock)
    reader.waits_from_ns = None  # until bpf/sched.c is loaded (_sched, after counting starts): not measured
    return reader


def _tcp(agent: Agent) -> TcpSource:
    return TcpSource(agent.clock, srtt_sampling=agent.config.srtt_sampling, owner_window=agent.config.owner_window)


def _sched(agent: Agent):
    """--sched waits: bpf/sched.c; otherwise the kernel's per-thread totals from /proc."""
    if agent.config.sched_waits:
        sched = SchedSource(agent.clock)
        if agent.config.runq_event_min_ns:
            sched.set_runq_event_min(agent.config.runq_event_min_ns)
        # Measured for the calls that begin from now on: those in flight
        # meanwhile had waits before its tracepoints were attached.
        agent.reader.waits_from_ns = time.monotonic_ns()
        return sched
    schedstat = check_schedstat()
    if not schedstat.ok:
        log.warning("%s", schedstat.detail)
    return SchedTotals(agent.reader.traced_pids, agent.reader.call_threads)


def _plugin(agent: Agent) -> PluginSource:
    """GPU time from the profiler plugin; its network series expire with
    their communicator (docs/network.md)."""
    plugin = PluginSource(agent.clock, live_comms=lambda: {c.nccl_comm_hash for c in agent.reader.communicators()
                                                             if c.nccl_comm_hash})
    if agent.config.record_all:  # every GPU operation too (recordings' gpu_intervals)
        for op in contract.COLLECTIVE_OPS.values():
            plugin.set_slow_threshold(op, 1)
    return plugin


SOURCES: list[SourceRow] = [
    SourceRow("probes", _probes),
    SourceRow("reader", _reader, events="_dispatch", collector=NcclCollector),
    # The kernel's side: loaded once NCCL calls are counted.
    SourceRow("tcp", _tcp, events="_dispatch_kernel", collector=TcpCollector, after_counting=True),
    SourceRow("sched", _sched, events="_dispatch_kernel", collector=SchedCollector, after_counting=True),
    # GPU time from the profiler plugin (bpf/plugin.c): optional, never fatal.
    # Before counting starts: its hooks are attached before NCCL's functions
    # (agent/discovery.py).
    SourceRow("plugin", _plugin, events="_dispatch_kernel", collector=PluginCollector,
           optional=lambda a: "GPU time off: the profiler plugin source did not load"),
    # Library discovery as a reaction to mapping (bpf/loader.c); without it
    # a /proc rescan timer (LibraryWatcher) is the fallback.
    SourceRow("loader", lambda a: LoaderSource(), events="_loader_event",
           optional=lambda a: f"library discovery falls back to a {a.config.rescan_interval:.1f} s /proc "
                              "rescan: the loader source did not load"),
]

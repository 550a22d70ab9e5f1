"""The agent: the sources, library discovery and the listeners, driven by one loop.

Data flows one way: kernel maps and ring buffers -> the sources' records ->
sinks (the Prometheus collector at scrape time; listeners such as the span
sink, the recorder or the `trace` printer, called from the loop).
agent/sources.py's SOURCES is the one list of sources: how each loads,
where its records go, its collector and its recording tables;
agent/pipeline.py attaches the sinks. The loop names no source: it calls
the hooks every source has (sources/base.py: tick, prune, heat, losses,
close). It is also the only place that writes kernel state after start-up:
pruning dead processes' entries, relative slow thresholds.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field

from exporter.agent import sources as agent_sources
from exporter.agent.config import SetupError
from exporter.agent.logs import announce
from exporter.agent.discovery import AgentError, Discovery
from exporter.agent.sources import SourceRow
from exporter.records import contract, histogram
from exporter.records.events import format_comm
from exporter.sources.base import Source
from exporter.sources.bpf import ClockOffset, Program, RingWaiter
from exporter.sources.processes import ProcessTable

log = logging.getLogger("nccl_exporter")

__all__ = ["Agent", "AgentConfig", "AgentError"]


@dataclass
class AgentConfig:
    node: str
    nccl_libs: list[str] = field(default_factory=list)  # empty: discover
    record_all: bool = False  # a ring-buffer event for every NCCL call, not only slow ones
    runq_event_min_ns: int = 0  # run-queue waits at least this long become events; 0: none
    rescan_interval: float = 0.5  # /proc rescans, only when the loader source cannot load
    clock_interval: float = 60.0  # re-sample CLOCK_REALTIME - CLOCK_MONOTONIC this often
    prune_interval: float = 2.0  # forget dead processes' map entries this often
    series_ttl: float = contract.DEFAULT_SERIES_TTL  # s an ended communicator's series stay
    series_capacity: int = contract.MAX_SERIES  # series the kernel holds; more: comm="overflow"
    # classic buckets of text scrapes: coarse | fine (records/histogram.py CLASSIC;
    # the kernel's schema-3 buckets do not change)
    histogram_resolution: str = histogram.DEFAULT_CLASSIC
    # s without a traced process after which the tracepoints that fire for
    # every task and packet of the node are detached (until one is traced
    # again); None: always attached
    idle_detach: float | None = None
    # The scheduler: False (`run`'s default) reads the kernel's per-thread
    # totals from /proc (SchedTotals, no program at any context switch); True
    # loads bpf/sched.c, which runs at every switch and wakeup of the node
    # (histogram buckets, each call's waits, wait events). docs/sched.md.
    sched_waits: bool = False
    # tcp_probe (srtt samples) attached for (window, period) s of each period
    # while hot; None: the whole time (docs/tcp.md, "srtt")
    srtt_sampling: tuple[float, float] | None = None
    # the send/recv tracepoints that learn socket owners attached only for
    # this many s after a socket may have an unknown owner, while hot; None:
    # the whole time (docs/tcp.md, "Owner windows")
    owner_window: float | None = None


class Agent(Discovery):
    def __init__(self, config: AgentConfig):
        self.config = config
        self.lock = threading.Lock()  # BCC objects: attach and prune vs. scrape
        self.clock = ClockOffset()
        self.listeners: list = []  # callables taking a CallEvent, TcpEvent, SchedEvent or GpuCall
        self._slow = None
        self._init_discovery()
        self.loaded: list[SourceRow] = []  # the rows of SOURCES loaded, in order
        # Rows the loop loads once NCCL calls are counted (SourceRow.after_counting)
        self.loading: list[SourceRow] = [row for row in agent_sources.SOURCES if row.after_counting]
        # callables (row, source), told of each source loaded after the start (the pipeline's sinks)
        self.on_loaded: list = []
        try:
            for row in agent_sources.SOURCES:
                if row.after_counting:
                    setattr(self, row.name, None)
                else:
                    self._load(row)
        except BaseException:
            self._close_sources()
            raise
        # The NCCL source is the core: the process table reads its maps, and
        # its communicators are the ranks' rule (ProcessTable.rank_of).
        self.processes = ProcessTable(self.probes)
        self.reader.identity = self.processes.identity  # launcher rank of a mid-job communicator
        if self.plugin is not None:  # ... or NCCL's identity, where the plugin announced only one
            self.reader.announced = self.plugin.comms
        self._communicators = self.reader.communicators
        # Set once the NCCL probes and the plugin's hooks are loaded and every
        # library found at start is attached: counting has started (`run`
        # answers /-/ready with 200; the `loading` rows come after).
        self.ready = threading.Event()
        self.counting_since: float | None = None  # CLOCK_MONOTONIC s `ready` was set (discovery)
        self._next_prune = 0.0
        self._last_traced = time.monotonic()
        self._next_clock = time.monotonic() + config.clock_interval
        self.events_seen = 0
        # CLOCK_MONOTONIC s of the loop's latest turn (None before the first):
        # /-/healthy's liveness (sinks/http.py STALL_S)
        self.heartbeat: float | None = None
        self.waiter = RingWaiter()  # one wait over every program's ring buffers ...
        for program in self.programs:
            if program is not self.loader:  # ... but the loader's: the attach thread's
                self.waiter.add(program)

    def _load(self, row: SourceRow) -> None:
        try:
            source = row.load(self)
        except Exception as e:
            if row.optional is None:
                raise
            log.warning("%s: %s", row.optional(self), str(e).splitlines()[0])
            source = None
        setattr(self, row.name, source)
        if source is None:
            return
        if not isinstance(source, Source):
            raise TypeError(f"SOURCES row {row.name!r} loaded a {type(source).__name__}, "
                            "not a Source (sources/base.py)")
        source.lock = self.lock
        self.loaded.append(row)
        if row.events is not None and hasattr(source, "on_event"):
            source.on_event(getattr(self, row.events))

    def load_next(self) -> None:
        """Load the next row of `loading` (the loop does, one a turn, once
        counting has started: the ring buffers keep what comes meanwhile)."""
        row = self.loading[0]
        try:
            self._load(row)
        except Exception as e:  # noqa: BLE001 - a required source that cannot load stops the agent, in one line
            raise SetupError(f"the {row.name} source did not load: {str(e).splitlines()[0]}") from None
        finally:
            self.loading.pop(0)
        source = getattr(self, row.name)
        if source is not None:
            if isinstance(source, Program):
                self.waiter.add(source)
            for tell in self.on_loaded:
                tell(row, source)
        if not self.loading:  # on stderr: trace's stdout is its calls
            names = ", ".join(r.name for r in agent_sources.SOURCES if r.after_counting and getattr(self, r.name))
            announce(f"also loaded: {names} ({time.monotonic() - self.counting_since:.1f} s after NCCL "
                     "calls were first counted)", stream=sys.stderr)

    def _loaded(self) -> list[Source]:
        return [getattr(self, row.name) for row in self.loaded]

    @property
    def programs(self) -> list:
        """The loaded BPF programs (the NCCL reader and SchedTotals are none)."""
        return [s for s in self._loaded() if isinstance(s, Program)]

    @property
    def slow(self):
        """The slow-call policy (agent/slow.py), set by whoever wants slow-call
        events: refreshed by the loop, told of the series slots prune frees."""
        return self._slow

    @slow.setter
    def slow(self, policy) -> None:
        self._slow = policy
        self.reader.on_series_freed = policy.forget if policy is not None else None

    # --- events ------------------------------------------------------------

    def _dispatch(self, event) -> None:
        self.events_seen += 1
        if event.kind == contract.EVENT_LIFECYCLE:
            self.processes.identity(event.pid)  # learns (and traces) a new process once
            log.info(
                "%s pid=%d comm=%s nccl_comm_hash=%016x rank=%d nranks=%d result=%d %.1f ms",
                event.op, event.pid, format_comm(event.comm), event.nccl_comm_hash,
                event.rank, event.nranks, event.result, event.duration_ns / 1e6,
            )
        for listener in self.listeners:
            listener(event)

    def _dispatch_kernel(self, event) -> None:
        self.events_seen += 1
        for listener in self.listeners:
            listener(event)

    # --- the loop ----------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> None:
        """Deliver what every ring buffer holds, waiting up to timeout_ms for the first record."""
        self.waiter.wait(timeout_ms)

    def step(self, timeout_ms: int = 100) -> None:
        """One turn: deliver events, attach newly found libraries, each
        source's tick, prune when due."""
        self.heartbeat = time.monotonic()
        if self.loading and self.ready.is_set():
            self.load_next()
            timeout_ms = 0
        self.poll(timeout_ms)
        if self._slow is not None:
            with self.lock:
                self._slow.refresh()
        now = time.monotonic()
        self.discover_step(now)
        if self.config.idle_detach is not None:
            self._heat(now)
        for source in self._loaded():  # without the lock: each holds it where a scrape reads
            source.tick(now)
        if now >= self._next_clock:
            # Wall-clock time of the kernel's monotonic stamps: sampled again
            # now and then, so an NTP step moves later timestamps with it
            # (recordings store each sample in clock_samples).
            self._next_clock = now + self.config.clock_interval
            self.clock.refresh()
        if now >= self._next_prune:
            self._next_prune = now + self.config.prune_interval
            self.prune()

    def _heat(self, now: float) -> None:
        """Attach the node-wide tracepoints (sources with `node_wide`: the
        scheduler's, the sockets') while a process is traced (a libnccl user,
        kernel-side from its first NCCL call or user-side from its mapping),
        and detach them idle_detach s after the last one: a node between
        jobs pays nothing for them."""
        sources = self._loaded()
        node_wide = [s for s in sources if s.node_wide]
        with self.lock:
            if any(s.tracing() for s in sources):
                self._last_traced = now
            want = now - self._last_traced < self.config.idle_detach
            if all(s.hot == want for s in node_wide):
                return
            for source in node_wide:
                source.set_hot(want)
        what = " and ".join(sorted(s.node_wide for s in node_wide))
        log.info("%s", f"a traced process: {what} tracepoints attached" if want else
                 f"no traced process for {self.config.idle_detach:g} s: {what} tracepoints detached")

    def prune(self) -> None:
        """Forget the map entries and Python state of processes that are gone."""
        with self.lock:
            # Dependents first (reverse load order): per-owner TCP and sched
            # entries and the plugin's go while the communicators and the
            # process table still know a just-ended process's rank (frozen
            # then). Entries of an ended process leave after the TTL; their
            # counts stay in a retired total while a living process shares the
            # label set (OwnerExpiry): no counter goes backwards.
            comms = self._communicators()

            def rank_label(pid: int) -> str:  # as the Prometheus sink's owner_rank_label
                r = self.processes.rank_of(pid, comms) if pid else None
                return "" if r is None or r == -1 else str(r)

            for source in reversed(self._loaded()):
                source.prune(self.config.series_ttl, rank_label)
        self.processes.forget_dead()

    def run_until(self, stop: threading.Event, deadline: float | None = None) -> None:
        while not stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            self.step()
        self.poll(0)  # what is already in the ring buffers is not lost

    def kernel_losses(self) -> dict:
        """Events the kernel could not hand over, by source (for recordings' meta)."""
        losses: dict[str, int] = {}
        for source in self._loaded():
            losses.update(source.losses())
        return losses

    def close(self, detach_in_background: bool = False) -> None:
        """Detach and unload everything. detach_in_background (a process about to end):
        the kernel's part of detaching is left to a child process (sources/bpf.py
        Teardown), so this returns in milliseconds instead of ~0.13 s per probe."""
        from exporter.sources.bpf import Teardown

        teardown = Teardown() if detach_in_background else None
        try:
            self._close()
        finally:
            if teardown is not None:
                teardown.release()

    def _close(self) -> None:
        self.stop_discovery()
        self.waiter.close()
        with self.lock:
            self._close_sources()

    def _close_sources(self) -> None:
        """Dependents first: they hold references to the NCCL program's maps."""
        for source in reversed(self._loaded()):
            source.close()
        self.loaded = []

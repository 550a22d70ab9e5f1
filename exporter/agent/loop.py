"""The agent: the sources, library discovery and the listeners, driven by one loop.

Data flows one way: kernel maps and ring buffers -> the sources' records ->
sinks (the Prometheus collector at scrape time; listeners such as the span
sink, the recorder or the `trace` printer, called from the loop). SOURCES
below is the one list of sources: how each loads, where its records go and
what /metrics reads of it; agent/pipeline.py attaches the sinks. The loop is
also the only place that writes kernel state after start-up: pruning dead
processes' entries, relative slow thresholds.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from exporter.records import contract, histogram
from exporter.records.events import format_comm
from exporter.sources.bpf import ClockOffset, Program, RingWaiter
from exporter.sources.loader import LoaderSource
from exporter.sources.nccl import libfind
from exporter.sources.nccl.probes import NcclProbes
from exporter.sources.nccl.maps import NcclReader
from exporter.sources.plugin import source as plugin_source
from exporter.sources.plugin.source import PluginSource
from exporter.sources.processes import ProcessTable, alive_checker
from exporter.sources.sched import SchedSource
from exporter.sources.schedstat import POLL_INTERVAL_S, SchedTotals
from exporter.sources.tcp import TcpSource, retransmits_missed
from exporter.agent.preflight import check_schedstat

log = logging.getLogger("nccl_exporter")


class AgentError(RuntimeError):
    """A condition that stops the agent, with a one-line explanation."""


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


@dataclass(frozen=True)
class Source:
    """One row of SOURCES: how the agent loads a source and where its records go."""

    name: str  # the agent's attribute: agent.<name>
    load: Callable[["Agent"], Any]  # the loaded source (a later row may use an earlier one)
    # A load failure is a warning with this explanation and the source is None;
    # without one, it stops the agent.
    optional: Callable[["Agent"], str] | None = None
    # The agent method its records go to (source.on_event), where it has on_event.
    events: str | None = None
    # The NcclCollector keyword it is passed as (sinks/prometheus.py reads it at scrape time).
    collector: str | None = None
    # Families of its own for /metrics: metrics(source, node) -> prometheus_client metrics.
    metrics: Callable[[Any, str], Iterable] | None = None


def _sched(agent: "Agent"):
    """--sched waits: bpf/sched.c; otherwise the kernel's per-thread totals from /proc."""
    if agent.config.sched_waits:
        return SchedSource(agent.clock)
    agent.reader.sched_waits = False
    schedstat = check_schedstat()
    if not schedstat.ok:
        log.warning("%s", schedstat.detail)
    return SchedTotals(agent.reader.traced_pids, agent.reader.call_threads)


# Every source the agent loads, in load order, and where its records go: the
# one place that wires a source in (docs/architecture.md, "Where a new thing
# goes"). The NCCL source comes first: it owns the maps the others share
# (bpf/traced.h). Closed in the reverse order.
SOURCES: list[Source] = [
    Source("probes", lambda a: NcclProbes(series_capacity=a.config.series_capacity)),
    Source("reader", lambda a: NcclReader(a.probes, a.clock), events="_dispatch", collector="nccl"),
    Source("tcp", lambda a: TcpSource(a.clock), events="_dispatch_kernel", collector="tcp"),
    Source("sched", _sched, events="_dispatch_kernel", collector="sched"),
    # GPU time from the profiler plugin (bpf/plugin.c): optional, never fatal.
    Source("plugin", lambda a: PluginSource(a.clock), events="_dispatch_kernel", collector="plugin",
           optional=lambda a: "GPU time off: the profiler plugin source did not load"),
    # Library discovery as a reaction to mapping (bpf/loader.c); without it
    # a /proc rescan timer (LibraryWatcher) is the fallback.
    Source("loader", lambda a: LoaderSource(), events="_loader_event",
           optional=lambda a: f"library discovery falls back to a {a.config.rescan_interval:.1f} s /proc "
                              "rescan: the loader source did not load"),
]


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.lock = threading.Lock()  # BCC objects: attach and prune vs. scrape
        self.clock = ClockOffset()
        self.listeners: list = []  # callables taking a CallEvent, TcpEvent, SchedEvent or GpuCall
        self.slow = None  # exporter.agent.slow.SlowCallPolicy, set by whoever wants slow-call events
        self._next_poll = 0.0
        self._next_plugin_scan = 0.0
        self._mapped: set[int] = set()  # pids that mapped or exec'd since the last step
        self._exec: set[int] = set()
        self._scanner = libfind.ProcessScanner()
        self.loaded: list[Source] = []  # the rows of SOURCES loaded, in order
        try:
            for row in SOURCES:
                self._load(row)
        except BaseException:
            self._close_sources()
            raise
        self.processes = ProcessTable(self.probes)
        self.reader.identity = self.processes.identity  # launcher rank of a mid-job communicator
        if self.plugin is not None:  # ... or NCCL's identity, where the plugin announced only one
            self.reader.announced = self.plugin.comms
        self._found: queue.Queue = queue.Queue()
        self._learn: queue.Queue = queue.Queue()  # (pid, library) for processes.saw, from _attach
        # Set once the kernel side is loaded and every library found at start
        # is attached: counting has started (`run` answers /-/ready with 200).
        self.ready = threading.Event()
        self._watcher = None
        self._next_prune = 0.0
        self._last_traced = time.monotonic()
        self._next_clock = time.monotonic() + config.clock_interval
        self.events_seen = 0
        # CLOCK_MONOTONIC s of the loop's latest turn (None before the first):
        # /-/healthy's liveness (sinks/http.py STALL_S)
        self.heartbeat: float | None = None
        self.waiter = RingWaiter()  # one wait over every program's ring buffers ...
        for program in self.sources:
            if program is not self.loader:  # ... but the loader's: the attach thread's
                self.waiter.add(program)
        self._attacher: threading.Thread | None = None
        self._stop_attacher = threading.Event()
        if config.record_all:
            self.probes.set_record_all(True)
            if self.plugin is not None:  # every GPU operation too (recordings' gpu_intervals)
                for op in contract.COLLECTIVE_OPS.values():
                    self.plugin.set_slow_threshold(op, 1)
        if config.runq_event_min_ns and config.sched_waits:
            self.sched.set_runq_event_min(config.runq_event_min_ns)

    def _load(self, row: Source) -> None:
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
        self.loaded.append(row)
        if row.events is not None and hasattr(source, "on_event"):
            source.on_event(getattr(self, row.events))

    @property
    def sources(self) -> list:
        """The loaded BPF programs (the NCCL reader and SchedTotals are none)."""
        return [getattr(self, row.name) for row in self.loaded if isinstance(getattr(self, row.name), Program)]

    # --- libraries ---------------------------------------------------------

    def start_discovery(self) -> None:
        """Attach to the given libraries, or to every libnccl in use, and keep watching."""
        given = self.config.nccl_libs
        if given:
            try:
                libraries = libfind.find_libraries(given)
            except libfind.LibraryError as e:
                raise AgentError(str(e)) from None
        if self.loader is not None:
            # First the loader probes, then the scan: a library (or, with
            # given libraries, a profiler plugin) mapped in between is
            # reported by an event, not lost.
            self.loader.attach_loaders()
        # The plugin's hooks before NCCL's functions: in a running job, a
        # call the function probes see is then named by the plugin's record
        # of it (bpf/plugin.c bind_call), never counted under comm="unknown"
        # for want of the hooks.
        self._attach_plugins(plugin_source.plugin_paths(), scan=True)
        # Every process's maps, through the scanner the loader events use: its
        # verdicts on the files mapped now (the interpreter, its libraries)
        # are then cached, so a new process's first look costs a maps read,
        # not an ELF parse of each of its libraries (that made a job started
        # right after the agent miss its first calls).
        for lib in libraries if given else self._scanner.scan():
            self._attach(lib)
        if not given and self.loader is None:
            self._watcher = libfind.LibraryWatcher(self._found.put, interval=self.config.rescan_interval)
            self._watcher.start()
        if self.loader is not None:
            self._attacher = threading.Thread(target=self._attach_loop, name="nccl-exporter-attach",
                                              daemon=True)
            self._attacher.start()
        self.ready.set()

    def _attach_loop(self) -> None:
        """The loader's events, on a thread of their own: a library mapped now
        is attached within milliseconds, whatever the loop is doing (its duty
        cycles detach tracepoints, each a wait for the kernel of ~0.1 s), so
        a job calling it 100 ms later is counted from its first call."""
        waiter = RingWaiter()
        waiter.add(self.loader)
        try:
            while not self._stop_attacher.is_set():
                waiter.wait(100)
                if self._mapped:
                    self._attach_mapped()
        finally:
            waiter.close()

    def _attach(self, lib) -> None:
        # uprobe_multi links touch no BCC state that a scrape reads: no wait
        # for the agent's lock (the loop may hold it through a grace period)
        try:
            with contextlib.nullcontext() if self.probes.uses_links else self.lock:
                report = self.probes.attach(lib.path)
        except FileNotFoundError:
            # Its process exited (/proc/PID/root/... is gone) or the file was
            # removed between the scan and now: nothing left to attach to.
            log.debug("%s is gone before it could be attached", lib.path)
            return
        for pid in getattr(lib, "pids", ()) or ():
            # learned (environment, pod, version; traced in the kernel) on the
            # loop's next turn: tracing waits for a tracepoint's detach, which
            # the attach thread must not, with the next library to attach
            self._learn.put((pid, lib.path))
        if report is None:
            return
        log.info(
            "attached %d NCCL functions in %s%s%s",
            len(report.attached),
            report.path,
            f"; not exported: {', '.join(report.missing)}" if report.missing else "",
            f"; failed: {report.failed}" if report.failed else "",
        )

    def _attach_plugins(self, paths=(), scan: bool = False) -> None:
        """Uprobes on the profiler plugin's hooks: `paths`, and the plugin files
        mapped by all processes (scan) or by the traced ones."""
        if self.plugin is None:
            return
        for path in paths:
            try:
                with self.lock:
                    if self.plugin.attach(path):
                        log.info("attached the profiler plugin's hooks in %s", path)
            except Exception as e:  # noqa: BLE001 - one process's plugin failing to attach is a warning, the agent goes on
                log.warning("%s", str(e).splitlines()[0])
        self._discover_plugins(None if scan else [k.value for k in self.probes["traced_processes"].keys()])

    def _discover_plugins(self, pids) -> None:
        """Attach to the plugin files these processes (None: all) have mapped."""
        try:
            if pids is not None and not plugin_source.mapped_plugins(pids):
                return  # the common case, without waiting for the lock
            with self.lock:
                found = self.plugin.discover(pids)
            for path in found:
                log.info("attached the profiler plugin's hooks in %s", path)
        except Exception as e:  # noqa: BLE001 - a failed scan is a warning, the agent goes on
            log.warning("profiler plugin scan: %s", str(e).splitlines()[0])

    # --- events ------------------------------------------------------------

    def _dispatch(self, event) -> None:
        self.events_seen += 1
        if event.kind == contract.EVENT_LIFECYCLE:
            self.processes.identity(event.pid)  # learns (and traces) a new process once
            log.info(
                "%s pid=%d comm=%s nccl_comm_hash=%016x rank=%d nranks=%d result=%d %.1f ms",
                event.op, event.pid, format_comm(event.comm_hash), event.nccl_hash,
                event.rank, event.nranks, event.result, event.duration_ns / 1e6,
            )
        for listener in self.listeners:
            listener(event)

    def _loader_event(self, event) -> None:
        self._mapped.add(event.pid)
        if event.kind == "EXEC":
            self._exec.add(event.pid)

    def _attach_mapped(self) -> None:
        """React to the loader's events: look at the maps of the processes
        that mapped a library (or exec'd) since the last turn, once each."""
        pids, self._mapped = self._mapped, set()
        execs, self._exec = self._exec, set()
        if execs:
            for path in self.loader.attach_loaders(execs):  # a container's own ld.so
                log.info("probing the dynamic loader %s", path)
        if not self.config.nccl_libs:
            for lib in self._scanner.scan(pids):
                self._attach(lib)
        if self.plugin is not None:  # after: a new process's first calls come before
            self._discover_plugins(pids)  # NCCL loads its plugin, and must not wait for a scan

    def _dispatch_kernel(self, event) -> None:
        self.events_seen += 1
        for listener in self.listeners:
            listener(event)

    # --- the loop ----------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> None:
        """Deliver what every ring buffer holds, waiting up to timeout_ms for the first record."""
        self.waiter.wait(timeout_ms)

    def step(self, timeout_ms: int = 100) -> None:
        """One turn: deliver events, attach newly found libraries, prune when due."""
        self.heartbeat = time.monotonic()
        self.poll(timeout_ms)
        if self.slow is not None:
            with self.lock:
                self.slow.refresh()
        while True:
            try:
                lib = self._found.get_nowait()
            except queue.Empty:
                break
            self._attach(lib)
        while True:
            try:
                pid, path = self._learn.get_nowait()
            except queue.Empty:
                break
            self.processes.saw(pid, path)
        now = time.monotonic()
        if self.config.idle_detach is not None:
            self._heat(now)
        # The duty cycles attach and detach tracepoints without the lock: a
        # detach waits ~70 ms for the kernel (RCU), which a scrape need not
        # share; scrapes never attach or detach, and this thread's _heat is
        # the only other caller.
        if self.config.srtt_sampling is not None:
            self.tcp.srtt_duty(now, *self.config.srtt_sampling)
        if now >= self._next_poll:
            self._next_poll = now + POLL_INTERVAL_S
            with self.lock:  # communicators of a job that began before the agent
                self.reader.name_unknown_comms()
            if self.config.owner_window is not None:
                self.tcp.owner_duty(now, self.config.owner_window, self.reader.counter("OWNERS_WANTED"),
                                    self.reader.traced_pids())
            if not self.config.sched_waits:
                with self.lock:  # a scrape polls it too
                    self.sched.poll()
        if now >= self._next_clock:
            # Wall-clock time of the kernel's monotonic stamps: sampled again
            # now and then, so an NTP step moves later timestamps with it
            # (recordings store each sample in clock_samples).
            self._next_clock = now + self.config.clock_interval
            self.clock.refresh()
        if self.loader is None and self.plugin is not None and now >= self._next_plugin_scan:
            self._next_plugin_scan = now + 5.0  # no loader events: look again now and then
            self._attach_plugins()
        if now >= self._next_prune:
            self._next_prune = now + self.config.prune_interval
            self.prune()

    def _heat(self, now: float) -> None:
        """Attach the node-wide scheduler and socket tracepoints while a
        process is traced (a libnccl user, kernel-side from its first NCCL
        call or user-side from its mapping), and detach them idle_detach s
        after the last one: a node between jobs pays nothing for them."""
        with self.lock:
            if next(iter(self.probes["traced_processes"].keys()), None) is not None:
                self._last_traced = now
            want = now - self._last_traced < self.config.idle_detach
            if want == self.tcp.hot:
                return
            for source in (self.sched, self.tcp):
                source.set_hot(want)
        what = "scheduler and socket" if self.config.sched_waits else "socket"
        log.info("%s", f"a traced process: {what} tracepoints attached" if want else
                 f"no traced process for {self.config.idle_detach:g} s: {what} tracepoints detached")

    def prune(self) -> None:
        """Forget the map entries and Python state of processes that are gone."""
        with self.lock:
            # Per-owner TCP and sched entries first, while the communicators and
            # the process table still know a just-ended process's rank (frozen
            # then). Entries of an ended process leave after the TTL; their
            # counts stay in a retired total while a living process shares the
            # label set (OwnerExpiry): no counter goes backwards.
            comms = self.reader.communicators()

            def rank_label(pid: int) -> str:  # as the Prometheus sink's _rank_label
                r = self.processes.rank_of(pid, comms) if pid else None
                return "" if r is None or r == -1 else str(r)

            self.tcp.expire_owners(self.config.series_ttl, rank_label)
            self.sched.expire_owners(self.config.series_ttl, rank_label)
            self.reader.forget_dead_processes()
            self.reader.forget_local_names(alive_checker())
            freed = self.reader.expire_series(self.config.series_ttl)
            if freed and self.slow is not None:
                self.slow.forget(freed)
            if self.plugin is not None:
                self.plugin.forget_dead_processes()
                # network series expire with their communicator (docs/network.md)
                self.plugin.expire_network({c.nccl_hash for c in comms if c.nccl_hash},
                                           self.config.series_ttl)
        self.processes.forget_dead()

    def run_until(self, stop: threading.Event, deadline: float | None = None) -> None:
        while not stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            self.step()
        self.poll(0)  # what is already in the ring buffers is not lost

    def kernel_losses(self) -> dict:
        """Events the kernel could not hand over, by source (for recordings' meta)."""
        counters = self.reader.counters()
        return {"kernel_nccl_events": counters.get("EVENTS_LOST", 0),
                "kernel_tcp_events": counters.get("TCP_EVENTS_LOST", 0),
                "kernel_sched_events": counters.get("SCHED_EVENTS_LOST", 0),
                # retransmits bpf/tcp.c did not run for (e.g. another BPF program was running on that CPU)
                "kernel_skipped_retransmits": retransmits_missed(counters)}

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
        if self._watcher is not None:
            self._watcher.stop()
        self._stop_attacher.set()
        if self._attacher is not None:
            self._attacher.join()
        self.waiter.close()
        with self.lock:
            self._close_sources()

    def _close_sources(self) -> None:
        """Dependents first: they hold references to the NCCL program's maps."""
        for row in reversed(self.loaded):
            close = getattr(getattr(self, row.name), "close", None)
            if close is not None:
                close()
        self.loaded = []

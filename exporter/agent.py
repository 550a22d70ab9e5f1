"""The agent: probes + library discovery + sinks, driven by one loop.

Data flows one way: kernel maps and the ring buffer -> MapReader records ->
sinks (the Prometheus collector at scrape time; event callbacks such as the
`trace` printer).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from . import libfind
from .maps import EVENT_LIFECYCLE, CallEvent, MapReader, format_comm
from .probes import NcclProbes
from .processes import ProcessTable
from .sched import SchedReader
from .tcp import TcpReader

log = logging.getLogger("nccl_exporter")


class AgentError(RuntimeError):
    """A condition that stops the agent, with a one-line explanation."""


@dataclass
class AgentConfig:
    node: str
    nccl_libs: list[str] = field(default_factory=list)  # empty: discover
    record_all: bool = False  # a ring-buffer event for every NCCL call, not only slow ones
    runq_event_min_ns: int = 0  # run-queue waits at least this long become events; 0: none
    rescan_interval: float = 0.5


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.lock = threading.Lock()  # BCC objects: attach vs. scrape
        self.probes = NcclProbes()
        self.reader = MapReader(self.probes.bpf)
        self.processes = ProcessTable(self.probes)
        self.listeners: list = []  # callables taking a CallEvent, TcpEvent or SchedEvent
        self.slow = None  # exporter.slow.SlowCallPolicy, set by whoever wants slow-call events
        self._found: queue.Queue = queue.Queue()
        self._watcher = None
        self.events_seen = 0
        self.reader.on_event(self._dispatch)
        # The kernel side: TCP links and the scheduler, read at scrape time,
        # and TCP events (retransmits, resets of traced sockets) as they come.
        self.tcp = TcpReader(self.probes.bpf, self.reader.clock)
        self.tcp.on_event(self._dispatch_kernel)
        self.sched = SchedReader(self.probes.bpf, self.reader.clock)
        self.sched.on_event(self._dispatch_kernel)
        self.sections: list = [self.tcp.families, self.sched.families]
        if config.record_all:
            self.probes.set_record_all(True)
        if config.runq_event_min_ns:
            self.probes.set_runq_event_min(config.runq_event_min_ns)

    # --- libraries ---------------------------------------------------------

    def start_discovery(self) -> None:
        """Attach to the given libraries, or to every libnccl in use, and keep watching."""
        if self.config.nccl_libs:
            try:
                libraries = libfind.find_libraries(self.config.nccl_libs)
            except libfind.LibraryError as e:
                raise AgentError(str(e)) from None
            for lib in libraries:
                self._attach(lib)
            return
        for lib in libfind.mapped_nccl_libraries():
            self._attach(lib)
        self._watcher = libfind.LibraryWatcher(self._found.put, interval=self.config.rescan_interval)
        self._watcher.start()

    def _attach(self, lib) -> None:
        with self.lock:
            report = self.probes.attach(lib.path)
        for pid in getattr(lib, "pids", ()) or ():
            self.processes.saw(pid)
        if report is None:
            return
        log.info(
            "attached %d NCCL functions in %s%s%s",
            len(report.attached),
            report.path,
            f"; not exported: {', '.join(report.missing)}" if report.missing else "",
            f"; failed: {report.failed}" if report.failed else "",
        )

    # --- events ------------------------------------------------------------

    def _dispatch(self, event: CallEvent) -> None:
        self.events_seen += 1
        if event.kind == EVENT_LIFECYCLE:
            self.processes.identity(event.pid)  # learns (and traces) a new process once
            log.info(
                "%s pid=%d comm=%s nccl_comm_hash=%016x rank=%d nranks=%d result=%d %.1f ms",
                event.op, event.pid, format_comm(event.comm_hash), event.nccl_hash,
                event.rank, event.nranks, event.result, event.duration_ns / 1e6,
            )
        for listener in self.listeners:
            listener(event)

    def _dispatch_kernel(self, event) -> None:
        self.events_seen += 1
        for listener in self.listeners:
            listener(event)

    # --- the loop ----------------------------------------------------------

    def step(self, timeout_ms: int = 200) -> None:
        """One turn: deliver events, attach newly found libraries."""
        self.reader.poll(timeout_ms)
        if self.slow is not None:
            with self.lock:
                self.slow.refresh()
        while True:
            try:
                lib = self._found.get_nowait()
            except queue.Empty:
                break
            self._attach(lib)

    def run_until(self, stop: threading.Event, deadline: float | None = None) -> None:
        while not stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            self.step()
        self.reader.poll(0)  # what is already in the ring buffer is not lost

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        with self.lock:
            self.probes.close()

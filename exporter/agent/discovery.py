"""Library discovery: which processes use libnccl and the profiler plugin,
and attaching the NCCL and plugin probes to them as they appear (a mixin of
the Agent, agent/loop.py: it reads the agent's probes, plugin and loader
sources and its lock)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

from exporter.sources.bpf import RingWaiter
from exporter.sources.nccl import libfind
from exporter.sources.plugin import source as plugin_source

log = logging.getLogger("nccl_exporter")

class AgentError(RuntimeError):
    """A condition that stops the agent, with a one-line explanation."""


PLUGIN_RESCAN_S = 5.0  # without loader events, plugin files are looked for this often


class Discovery:
    """Attaching to libraries: at start, on the loader's events (a thread of
    its own) and, without the loader source, by a /proc rescan timer."""

    def _init_discovery(self) -> None:
        self._mapped: set[int] = set()  # pids that mapped or exec'd since the last step
        self._exec: set[int] = set()
        self._scanner = libfind.ProcessScanner()
        self._found: queue.Queue = queue.Queue()
        self._learn: queue.Queue = queue.Queue()  # (pid, library) for processes.saw, from _attach
        self._watcher = None
        self._attacher: threading.Thread | None = None
        self._stop_attacher = threading.Event()
        self._next_plugin_scan = 0.0

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
        self.counting_since = time.monotonic()
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

    def discover_step(self, now: float) -> None:
        """The loop's part of discovery: attach what the rescan timer found,
        learn the processes of attached libraries, look for plugin files."""
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
        if self.loader is None and self.plugin is not None and now >= self._next_plugin_scan:
            self._next_plugin_scan = now + PLUGIN_RESCAN_S  # no loader events: look again now and then
            self._attach_plugins()

    def stop_discovery(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        self._stop_attacher.set()
        if self._attacher is not None:
            self._attacher.join()

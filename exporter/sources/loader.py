"""The loader source: bpf/loader.c, which says which process has just mapped
a library, so new NCCL libraries are attached as a reaction to being mapped
instead of by rescanning /proc on a timer.

A uprobe on the dynamic loader's `_dl_debug_state` fires in a process every
time its list of loaded objects changes (after start-up's DT_NEEDED
libraries, and around every dlopen/dlclose), and sched_process_exec when a
process starts a new program. Each event is a pid; the agent then reads that
one process's /proc/<pid>/maps. Loader files (`ld-linux-x86-64.so.2`, a
container's own copy, musl's `ld-musl-*.so.1`) are probed once per file:
those mapped at start, and any new one seen in an exec'd process's maps;
never another architecture's (qemu-user maps its guest's loader: the
uprobe's x86 int3 in that file would break every emulated program, as
for NCCL libraries and plugins, elf.runs_here). This program shares no
map with the others and loads on its own.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

from exporter.records import contract
from exporter.sources.base import Source
from exporter.sources.bpf import Program
from exporter.sources.nccl import elf

LOADER_PATTERNS = ("ld-linux*.so*", "ld-*.so*", "ld-musl-*.so*")
LOADER_FUNCTION = "_dl_debug_state"


@dataclass(frozen=True)
class LoaderEvent:
    pid: int
    kind: str  # LINK_MAP | EXEC (contract.LOADER_EVENTS)
    ts_ns: int  # CLOCK_MONOTONIC


def is_loader(path: str) -> bool:
    name = os.path.basename(path)
    return any(fnmatch.fnmatchcase(name, p) for p in LOADER_PATTERNS)


def mapped_loaders(pids=None, proc: str = "/proc") -> dict[tuple[int, int], str]:
    """(st_dev, st_ino) -> an openable path of each dynamic loader mapped by
    the given processes (default: all)."""
    if pids is None:
        try:
            pids = [int(n) for n in os.listdir(proc) if n.isdigit()]
        except OSError:
            pids = []
    out: dict[tuple[int, int], str] = {}
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/maps", "rb") as f:
                data = f.read()
        except OSError:
            continue
        for line in data.splitlines():
            if b"ld-" not in line:
                continue
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith(b"/"):
                continue
            path = parts[5].decode("utf-8", "surrogateescape")
            if path.endswith(" (deleted)") or not is_loader(path):
                continue
            inode = int(parts[4])
            # The plain path when it is the same file (same mount namespace),
            # else the file as that process sees it (a container's loader).
            for candidate in (path, f"{proc}/{pid}/root{path}"):
                try:
                    st = os.stat(candidate)
                except OSError:
                    continue
                if st.st_ino == inode:
                    out.setdefault((st.st_dev, st.st_ino), candidate)
                    break
    return out


class LoaderSource(Program, Source):
    """bpf/loader.c and the loader files it is attached to."""

    def __init__(self):
        super().__init__("loader")
        self.probed: dict[tuple[int, int], str] = {}
        self.failed: dict[str, str] = {}

    def attach_loaders(self, pids=None) -> list[str]:
        """Probe every loader file mapped by these processes (default: all)
        that is not probed yet; returns the new paths."""
        new = []
        for key, path in mapped_loaders(pids).items():
            if key in self.probed or path in self.failed:
                continue
            if not elf.runs_here(path):
                self.failed[path] = "another architecture's loader (an emulated process's): never probed"
                continue
            try:
                self.bpf.attach_uprobe(name=path, sym=LOADER_FUNCTION, fn_name="on_link_map_change")
            except Exception as e:  # noqa: BLE001 - a loader without the symbol (static binaries have none)
                self.failed[path] = str(e).splitlines()[0] if str(e) else type(e).__name__
                continue
            self.probed[key] = path
            new.append(path)
        return new

    def decode_event(self, data) -> LoaderEvent:
        e = self["loader_events"].event(data)
        return LoaderEvent(pid=e.pid, kind=contract.LOADER_EVENTS.get(e.kind, str(e.kind)), ts_ns=e.ts_ns)

    def on_event(self, callback) -> None:
        """Call `callback(LoaderEvent)` for each event, from poll()/consume()."""
        self.open_ring("loader_events", self.decode_event, callback)

    def lost(self) -> int:
        table = self["loader_lost"]
        return table[table.Key(0)].value

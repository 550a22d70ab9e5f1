"""Traced processes: who they are to the launcher (torchrun, Slurm, MPI) and
to Kubernetes (pod, namespace, container: sources/pods.py).

The launcher rank is metadata on nccl_communicator_info, and the kernel's
fallback rank for calls on a communicator the agent never saw created (an
agent started mid-job): it is written into the `traced_processes` BPF map,
which also tells the kernel-side probes which processes and threads to watch.
"""

from __future__ import annotations

import os
import threading

from exporter.sources.identity import launcher_identity, process_command
from exporter.sources.nccl import libfind
from exporter.sources.pods import POD_FIELDS, PodResolver


def alive_checker(proc: str = "/proc"):
    """is_alive(pid) -> bool, asking /proc once per pid: for one scrape or one
    prune, where many records name the same few processes."""
    seen: dict[int, bool] = {}

    def is_alive(pid: int) -> bool:
        alive = seen.get(pid)
        if alive is None:
            alive = seen[pid] = os.path.exists(f"{proc}/{pid}")
        return alive

    return is_alive


def thread_stopped(tid: int, proc: str = "/proc") -> bool:
    """Whether a thread is stopped: state T (a stop signal: SIGSTOP, SIGTSTP)
    or t (a debugger's tracing stop) in /proc/TID/stat. False when gone."""
    try:
        with open(f"{proc}/{tid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] in (b"T", b"t")  # the state follows "(comm) "


class ProcessTable:
    def __init__(self, probes=None, proc: str = "/proc", pods: PodResolver | None = None):
        self.probes = probes
        self.proc = proc
        self.pods = pods or PodResolver(proc=proc)
        self._scanner = libfind.ProcessScanner(proc)
        self._known: dict[int, dict] = {}
        self._lock = threading.Lock()

    def identity(self, pid: int) -> dict:
        """Launcher identity of a process (cached while it lives)."""
        with self._lock:
            who = self._known.get(pid)
        if who is None:
            who = self.saw(pid)
        return who

    def describe(self, pid: int) -> dict:
        """What identity() says, without learning: for threads other than the
        agent's (the recorder's), which must not touch the kernel maps."""
        with self._lock:
            who = self._known.get(pid)
        return dict(who) if who is not None else self._read(pid)

    def saw(self, pid: int, library: str | None = None) -> dict:
        """Learn a process: read its environment, its pod and its libnccl's
        version (of `library`, else of the libnccl its maps show), tell the
        kernel its rank."""
        who = self._read(pid, library)
        with self._lock:
            self._known[pid] = who
        # A process already gone (a short job's events read after it exited) is
        # not traced again: its kernel entries were deleted at its exit.
        if self.probes is not None and os.path.exists(f"{self.proc}/{pid}"):
            try:
                self.probes.trace_process(pid, who.get("rank"), proc=self.proc)
            except Exception:  # noqa: BLE001 - map full: counted by the kernel side; rank stays unknown
                pass
        return who

    def _read(self, pid: int, library: str | None = None) -> dict:
        who = dict(launcher_identity(pid, proc=self.proc))
        who["command"] = process_command(pid)
        pod = self.pods.identify(pid)
        who.update(zip(POD_FIELDS, pod.fields()))
        if library is None:
            try:
                library = next((lib.path for lib in self._scanner.scan([pid])), None)
            except Exception:  # noqa: BLE001 - gone, or maps unreadable: version unknown
                library = None
        who["libnccl_version"] = libfind.nccl_version(library) if library else ""
        who["collectives"] = False  # set by mark_collectives once a collective of it is counted
        return who

    def mark_collectives(self, communicators, series_keys) -> None:
        """Remember which processes made a collective: a process whose
        (communicator, rank) has a collective series (series_keys: a set of
        (comm, rank)). Sticky while the process lives, also after its
        communicators are destroyed."""
        for c in communicators:
            if (c.comm, c.rank) in series_keys:
                who = self.identity(c.pid)
                who["collectives"] = True

    def forget_dead(self) -> None:
        with self._lock:
            for pid in [p for p in self._known if not os.path.exists(f"{self.proc}/{p}")]:
                del self._known[pid]

    def rank_of(self, pid: int, communicators=()) -> int | None:
        """A process's rank: its launcher rank, else its rank in the largest
        communicator it belongs to (the world), else None."""
        who = self.identity(pid)
        if who.get("rank") is not None:
            return int(who["rank"])
        if who.get("comm_rank") is not None:  # learnt earlier: stays after the comms go
            return who["comm_rank"]
        mine = [c for c in communicators if c.pid == pid and c.rank >= 0]
        if mine:
            who["comm_rank"] = max(mine, key=lambda c: c.nranks).rank
            return who["comm_rank"]
        return None

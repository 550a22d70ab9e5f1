"""What each record becomes in a recording: the rows of each table, written one batch
per transaction, and what the writer knows per process to label them (the processes
seen, their communicators and ranks), forgotten when the process is gone.

Recorder (writer.py) is a RecordRows: it calls _write(batch) from its writer thread.
"""

from __future__ import annotations

import os
import sqlite3
import time

from exporter.records import contract
from exporter.records.events import CallEvent, GpuCall
from exporter.records.render import Renderer, table_of
from exporter.sinks.recording.schema import INSERT
from exporter.sinks.recording.scope import pid_netns


class RecordRows:
    """Records to rows, and the per-process state that labels them. Expects of its
    subclass: node, scope, conn, recorded, identify, identify_processes, dead_grace_s."""

    def _init_rows(self) -> None:
        self._rows = Renderer(self.node)
        self._seen_pids: set[int] = set()
        self._seen_comms: set[tuple[int, int]] = set()
        self._unranked_comms: set[tuple[int, int]] = set()  # seen with rank -1 (a split child, so far)
        self._comm_rows: list = []
        self._world: dict[int, tuple[int, int]] = {}  # pid -> (nranks, rank) of its largest comm
        self._launcher_rank: dict[int, int] = {}
        self._dead_since: dict[int, float] = {}

    def forget_dead_processes(self, now: float | None = None) -> list[int]:
        """Forget what the writer remembers per process (seen, comms, ranks) for
        processes gone at least dead_grace_s; returns the pids forgotten. A pid
        used again later is a new process and is identified again."""
        now = time.monotonic() if now is None else now
        proc = self.scope.proc
        pids = set(self._seen_pids) | set(self._world) | set(self._launcher_rank) \
            | {p for p, _c in self._seen_comms} | set(self.scope._verdict)
        gone = []
        for pid in pids:
            if os.path.exists(f"{proc}/{pid}"):
                self._dead_since.pop(pid, None)
            elif now - self._dead_since.setdefault(pid, now) >= self.dead_grace_s:
                gone.append(pid)
        if gone:
            dead = set(gone)
            self._seen_pids -= dead
            for pid in gone:
                self._world.pop(pid, None)
                self._launcher_rank.pop(pid, None)
                self._dead_since.pop(pid, None)
                self.scope._verdict.pop(pid, None)
            self._seen_comms = {k for k in self._seen_comms if k[0] not in dead}
            unranked = getattr(self, "_unranked_comms", None)
            if unranked is not None:
                self._unranked_comms = {k for k in unranked if k[0] not in dead}
        # pids that vanished from every structure
        for pid in [p for p in self._dead_since if p not in pids]:
            del self._dead_since[pid]
        return gone

    def _write(self, batch: list) -> None:
        rows = self._rows
        nccl, tcp, sched, gpu, waits, intervals = [], [], [], [], [], []
        procs = []
        own: dict = {}  # sources' own tables' rows (Recorder.add_tables)
        seen = self._seen_pids
        for event in batch:
            table = self._tables.get(type(event))
            if table is not None:
                own.setdefault(table, []).append(table.row(event, self.node))
                continue
            if type(event) is GpuCall:
                gpu.append((event.pid, rows.comm(event.comm), event.op, event.seq, event.kind, event.rank,
                            event.peer if event.peer >= 0 else None, event.enqueue_real_ns or None,
                            event.start_real_ns, event.duration_ns, self.node, event.bytes))
                if event.peer_waits:
                    waits += peer_wait_rows(event, gpu[-1][1], self.node)
                continue
            if type(event) is CallEvent:
                what, pid = "nccl", event.pid
                if event.comm and ((pid, event.comm) not in self._seen_comms or (
                        event.rank >= 0 and (pid, event.comm) in self._unranked_comms)):
                    self._learn_comm(event)
            else:
                what = table_of(event)
                if not what:
                    continue
                pid = event.get("pid") if isinstance(event, dict) else event.pid
            if pid and pid not in seen:  # first: its launcher rank labels this very row
                seen.add(pid)
                if self.identify_processes:
                    procs.append(self._process_row(pid))
            if what == "nccl":
                nccl.append(rows.call(event))
            elif what == "tcp":
                tcp.append(rows.tcp(event, self._rank_of(pid)))
            elif what == "sched_interval":
                intervals.append(rows.sched_interval(event, self._rank_of(pid)))
            else:
                sched.append(rows.sched(event, self._rank_of(pid)))
        comms, self._comm_rows = self._comm_rows, []
        batches = {"nccl": nccl, "tcp": tcp, "sched": sched, "sched_interval": intervals, "gpu": gpu,
                   "peer_waits": waits, "processes": procs}
        c = self.conn
        c.execute("BEGIN")
        try:
            for kind, kind_rows in batches.items():
                if kind_rows:
                    c.executemany(INSERT[kind], kind_rows)
            for table, table_rows in own.items():
                c.executemany(table.insert, table_rows)
            if comms:
                # A split child's rank is learnt after its first event: fill it in then.
                c.executemany("INSERT INTO communicators VALUES (?, ?, ?, ?, ?, ?, ?) "
                              "ON CONFLICT (node, pid, comm_id_hash) DO UPDATE SET rank = excluded.rank, "
                              "nranks = excluded.nranks WHERE communicators.rank < 0 AND excluded.rank >= 0",
                              comms)
            c.execute("COMMIT")
        except BaseException:
            try:
                c.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # SQLite already rolled back (e.g. disk full): keep the first error
            raise
        for kind in ("nccl", "tcp", "sched", "sched_interval", "gpu"):
            self.recorded[kind] += len(batches[kind])
        for table, table_rows in own.items():
            self.recorded[table.name] += len(table_rows)

    def _learn_comm(self, e) -> None:
        self._seen_comms.add((e.pid, e.comm))
        (self._unranked_comms.add if e.rank < 0 else self._unranked_comms.discard)((e.pid, e.comm))
        self._comm_rows.append((self.node, e.pid, self._rows.comm(e.comm),
                                self._rows.comm(e.nccl_comm_hash), e.rank, e.nranks, e.start_real_ns))
        # A process's rank, for its TCP and scheduler rows: its rank in its largest
        # communicator (ties: the lowest rank), unless the launcher said (processes
        # table); the rule of read.Recording.process_ranks, as known so far.
        best = self._world.get(e.pid)
        if e.rank >= 0 and (best is None or (e.nranks, -e.rank) > (best[0], -best[1])):
            self._world[e.pid] = (e.nranks, e.rank)

    def _rank_of(self, pid):
        r = self._launcher_rank.get(pid)
        if r is not None:
            return r
        best = self._world.get(pid)
        return best[1] if best else None

    def _process_row(self, pid: int) -> tuple:
        """A processes row (schema.PROCESS_FIELDS). The agent's ProcessTable
        (`identify`, set by run/trace: the kubelet's names where enabled)
        knows the pod and library version; without it, the pod from the
        cgroup and environment only."""
        from exporter.sources.identity import launcher_identity, process_command
        from exporter.sources.pods import PodResolver

        if self.identify is not None:
            who = self.identify(pid)
        else:
            who = dict(launcher_identity(pid))
            who.update(zip(("namespace", "pod", "container", "pod_uid", "container_id"),
                           PodResolver().identify(pid).fields()))
        if who.get("rank") is not None:
            self._launcher_rank[pid] = who["rank"]
        return (pid, self.node, who.get("launcher") or "", who.get("rank"), who.get("world_size"),
                who.get("command") or process_command(pid), pid_netns(pid), time.time_ns(),
                *(who.get(k) or "" for k in ("namespace", "pod", "container", "pod_uid", "container_id",
                                              "libnccl_version")))


def peer_wait_rows(event: GpuCall, comm: str, node: str) -> list[tuple]:
    """nccl_peer_waits rows (schema.PEER_WAIT_FIELDS) of one GPU operation's
    network figures: one per (peer, direction, phase); peer NULL for "other";
    bytes on the phase NCCL gave transSize with (send_wait, recv_flush_wait)."""
    out = []
    for w in event.peer_waits:
        phases = contract.NETWORK_PHASES[w.direction]
        carries = phases[2] if w.direction == "send" else phases[1]
        for phase, wall, step in zip(phases, w.wall_ns, w.step_ns):
            out.append((event.pid, comm, event.op, event.seq, event.kind, event.rank,
                        w.peer if w.peer >= 0 else None, w.direction, phase, wall, step,
                        w.bytes if phase == carries else 0, node))
    return out

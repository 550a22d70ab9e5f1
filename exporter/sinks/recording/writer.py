"""Record what the agent sees to SQLite: one file per recording, queried with SQL.

    recorder = Recorder("nccl.db", node="gpu-017", scope=Scope(pids={1234}))
    agent.listeners.append(recorder)     # called from the ring-buffer poll
    ...
    recorder.close()                     # flushes everything, writes the summary to meta

The listener never blocks: it filters by scope and appends the event object
to a bounded queue (a counted drop when full). One writer thread turns the
events into rows (exporter/records/render.py) and commits them in batches
(every BATCH_ROWS rows or BATCH_SECONDS, whichever comes first) to a WAL
database, so a killed recorder leaves a valid file holding every committed
batch.
"""

from __future__ import annotations

import collections
import os
import socket
import sqlite3
import threading
import time

from exporter import __version__
from exporter.sinks.recording.rows import RecordRows
from exporter.sinks.recording.gpu_join import fold_gpu_intervals
from exporter.sinks.recording.schema import (DEFERRED_INDEXES, GPU_INTERVALS_INDEX, SCHEMA_VERSION,
                                             RecordingError, open_db)
from exporter.sinks.recording.scope import Scope
from exporter.sinks.recording.tables import RecordTable

# Batching and bounds (env overrides are for tests and benchmarks).
BATCH_ROWS = 5000
BATCH_SECONDS = 0.2
QUEUE_MAX = int(os.environ.get("NCCL_EXPORTER_STORE_QUEUE") or 65536)
META_EVERY_S = 1.0
PRUNE_EVERY_S = 10.0  # forget processes that are gone (bounded state over months)
DEAD_GRACE_S = 30.0  # ... once gone this long: their last events are written by then
CLOCK_SAMPLE_EVERY_S = 60.0  # clock_samples: CLOCK_REALTIME - CLOCK_MONOTONIC, re-sampled (NTP steps)


def _read_id(path: str) -> str:
    """/etc/machine-id, the boot id: the node's identity in meta ('' if unreadable)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


# Meta counters that add up over the sessions that recorded into one file (and lost_*).
COUNTED_META = ("events_offered", "events_recorded", "nccl_events_recorded", "tcp_events_recorded",
                "sched_events_recorded", "sched_intervals_recorded", "gpu_intervals_recorded", "out_of_scope")


# --- the recorder -----------------------------------------------------------------

class Recorder(RecordRows):
    """A listener that records events to SQLite from a writer thread. This file holds the
    queue, the writer thread, its batches and meta; what each record becomes in the tables
    is RecordRows' (rows.py)."""

    def __init__(self, path: str, node: str | None = None, scope: Scope | None = None,
                 queue_max: int | None = None, batch_rows: int = BATCH_ROWS,
                 batch_seconds: float = BATCH_SECONDS, clock_offset_ns: int | None = None,
                 identify_processes: bool = True):
        self.path = path
        self.node = node or socket.gethostname()
        self.scope = scope or Scope()
        # pid -> identity dict (launcher, pod, libnccl_version: the agent's
        # ProcessTable.identity); None: read here from /proc
        self.identify = None
        self.queue_max = int(queue_max or QUEUE_MAX)
        self.batch_rows = batch_rows
        self.batch_seconds = batch_seconds
        self.identify_processes = identify_processes
        self._q: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        # Called once, from the writer thread, with a one-line message when
        # writing fails (the recording stops; later events are counted in
        # dropped_failed): `trace` stops, `run` logs it.
        self.on_error = None
        self.dropped_failed = 0  # events never written because writing failed
        self.prune_every_s = PRUNE_EVERY_S
        self.dead_grace_s = DEAD_GRACE_S
        # Counters: the producer (poll thread) writes offered/dropped/out_of_scope,
        # the writer thread writes the recorded ones.
        self.offered = 0
        self.dropped = 0
        self.out_of_scope = 0
        # gpu: gpu_intervals rows, sched_interval: sched_intervals rows
        self.recorded = {"nccl": 0, "tcp": 0, "sched": 0, "sched_interval": 0, "gpu": 0}
        self.kernel_lost: dict[str, int] = {}
        self.started_ns = time.time_ns()
        self.ended_ns: int | None = None
        self._init_rows()
        self._extra_meta: dict[str, str] = {}
        self._clock_sampled = float("-inf")
        self._tables: dict[type, RecordTable] = {}  # sources' own tables (add_tables), by record type
        self._new_tables: list[RecordTable] = []  # ... to create, by the writer thread
        self.conn = open_db(path)
        # A recording added to (run --db / trace --out on an existing file) keeps its start
        # and counts on from its totals: its rows are all still there.
        try:
            before = dict(self.conn.execute("SELECT key, value FROM meta"))
        except sqlite3.Error:
            before = {}
        self._base = {k: int(v) for k, v in before.items()
                      if (k in COUNTED_META or k.startswith("lost_")) and str(v).lstrip("-").isdigit()}
        meta = {
            "node": self.node,
            "agent_version": __version__,
            "schema_version": str(SCHEMA_VERSION),
            "hostname": socket.gethostname(),
            "start_ns": before.get("start_ns") or str(self.started_ns),
            "session_start_ns": str(self.started_ns),
            "scope": self.scope.describe(),
            "clock_offset_ns": "" if clock_offset_ns is None else str(clock_offset_ns),
            "queue_max": str(self.queue_max),
            "machine_id": _read_id("/etc/machine-id"),
            "boot_id": _read_id("/proc/sys/kernel/random/boot_id"),
        }
        try:
            with self.conn:
                self.conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", meta.items())
            self._write_meta(final=False)
        except sqlite3.Error as e:  # disk full, read-only, locked: one line, no traceback
            self.conn.close()
            self._error = e
            raise RecordingError(self.error_message) from None
        self._thread = threading.Thread(target=self._writer, name="nccl-recording", daemon=True)
        self._thread.start()

    # --- producer side (the ring-buffer poll): never blocks ----------------------

    def __call__(self, event) -> None:
        self.offered += 1
        pid = getattr(event, "pid", None)
        if pid is None and isinstance(event, dict):
            pid = event.get("pid")
        if not self.scope.everything and (pid is None or pid not in self.scope):
            self.out_of_scope += 1
            return
        if self._error is not None:  # the writer failed: counted, never silent
            self.dropped_failed += 1
            return
        q = self._q
        n = len(q)
        if n >= self.queue_max:
            self.dropped += 1
            return
        q.append(event)
        if n + 1 == self.batch_rows:
            self._wake.set()

    def note(self, **meta) -> None:
        """Extra meta keys (e.g. clock_offset_ns), written with the next meta update."""
        self._extra_meta.update({k: str(v) for k, v in meta.items()})

    def set_kernel_lost(self, **counts: int) -> None:
        """Losses before the recorder (ring buffers full): written to meta."""
        self.kernel_lost.update({k: int(v) for k, v in counts.items()})

    def add_tables(self, tables) -> None:
        """Sources' own tables (RecordTable): created by the writer before it
        writes again; their records are written from then on."""
        self._new_tables.extend(tables)

    def _create_tables(self) -> None:
        while self._new_tables:
            t = self._new_tables.pop(0)
            with self.conn:
                self.conn.execute(t.create)
            self._tables[t.record] = t
            self.recorded.setdefault(t.name, 0)

    @property
    def queued(self) -> int:
        return len(self._q)

    @property
    def total_recorded(self) -> int:
        return sum(self.recorded.values())

    @property
    def total_lost(self) -> int:
        return self.dropped + self.dropped_failed + sum(self.kernel_lost.values())

    # --- writer thread ---------------------------------------------------------------

    def _writer(self) -> None:
        last_meta = last_prune = time.monotonic()
        batch: list = []
        try:
            while True:
                stopping = self._stop.is_set()
                self._create_tables()
                batch = self._drain()
                full = len(batch) >= self.batch_rows  # more may be queued: no pause
                if batch:
                    self._write(batch)
                    batch = []  # written: not lost if what follows fails
                now = time.monotonic()
                if now - last_meta >= META_EVERY_S:
                    self._write_meta(final=False)
                    last_meta = now
                if now - last_prune >= self.prune_every_s:
                    self.forget_dead_processes(now)
                    last_prune = now
                if stopping and not self._q:
                    break
                if not full:
                    self._wake.wait(self.batch_seconds)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - reported now (on_error) and by close(); drops counted
            self._fail(e, lost=len(batch))

    def _fail(self, error: BaseException, lost: int = 0) -> None:
        """Writing failed: stop recording, count what is lost, say it once."""
        self._error = error
        self.queue_max = 0
        # the batch that failed (rolled back) and whatever was still queued
        lost += len(self._q)
        self._q.clear()
        self.dropped_failed += lost
        if self.on_error is not None:
            try:
                self.on_error(self.error_message)
            except Exception:  # noqa: BLE001 - a broken callback must not hide the error from close()
                pass

    @property
    def error_message(self) -> str | None:
        """One line saying why the recording failed, None while it works."""
        if self._error is None:
            return None
        e = self._error
        text = str(e) or type(e).__name__
        hint = ""
        if isinstance(e, sqlite3.OperationalError):
            low = text.lower()
            if "readonly" in low or "read-only" in low:
                hint = " (the file or its directory is not writable)"
            elif "full" in low:
                hint = " (no space left on the file system)"
            elif "locked" in low or "busy" in low:
                hint = " (another process holds a lock on the database)"
        return f"recording to {self.path} failed: {text}{hint}"

    @property
    def failed(self) -> bool:
        return self._error is not None

    def drops(self) -> dict[str, int]:
        """Events the recorder did not write, by reason (the recording_dropped metric)."""
        return {"queue_full": self.dropped, "write_failed": self.dropped_failed}

    def _drain(self) -> list:
        q = self._q
        n = min(len(q), self.batch_rows)
        pop = q.popleft
        return [pop() for _ in range(n)]

    def _write_meta(self, final: bool) -> None:
        meta = {
            "last_commit_ns": str(time.time_ns()),
            "events_offered": str(self.offered),
            "events_recorded": str(self.total_recorded),
            "nccl_events_recorded": str(self.recorded["nccl"]),
            "tcp_events_recorded": str(self.recorded["tcp"]),
            "sched_events_recorded": str(self.recorded["sched"]),
            "sched_intervals_recorded": str(self.recorded["sched_interval"]),
            "gpu_intervals_recorded": str(self.recorded["gpu"]),
            "lost_queue_full": str(self.dropped),
            "out_of_scope": str(self.out_of_scope),
            **{f"lost_{k}": str(v) for k, v in self.kernel_lost.items()},
            "lost_total": str(self.total_lost),
            **self._extra_meta,
        }
        for k, v in self._base.items():
            if k in meta and meta[k].lstrip("-").isdigit():
                meta[k] = str(int(meta[k]) + v)
        if final:
            meta["end_ns"] = str(self.ended_ns)
        sample = final or time.monotonic() - self._clock_sampled >= CLOCK_SAMPLE_EVERY_S
        with self.conn:
            self.conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", meta.items())
            if sample:
                self._clock_sampled = time.monotonic()
                real, mono = time.clock_gettime_ns(time.CLOCK_REALTIME), time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                self.conn.execute("INSERT OR REPLACE INTO clock_samples VALUES (?, ?, ?)",
                                  (self.node, real, real - mono))

    # --- shutdown ------------------------------------------------------------------------

    def close(self) -> None:
        """Write everything queued, the final meta, and leave a single-file database."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self.ended_ns = time.time_ns()
        try:
            if self._error is None:
                self._write_meta(final=True)
            self.conn.execute(GPU_INTERVALS_INDEX)
            fold_gpu_intervals(self.conn)
            for sql in DEFERRED_INDEXES:
                self.conn.execute(sql)
            # Fold the WAL into the main file so the recording is one portable file.
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.conn.execute("PRAGMA journal_mode = DELETE")
        except sqlite3.DatabaseError:
            pass
        finally:
            self.conn.close()
        if self._error is not None:
            raise RecordingError(self.error_message)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def summary(self) -> str:
        kernel = sum(self.kernel_lost.values())
        return (f"{self.recorded['nccl']} NCCL calls, {self.recorded['tcp']} TCP events, "
                f"{self.recorded['sched']} scheduler events recorded to {self.path}; "
                f"lost {self.total_lost} (kernel ring buffer {kernel}, recorder queue full {self.dropped})")

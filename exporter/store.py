"""Record what the agent sees to SQLite: one file per recording, queried with SQL.

    recorder = Recorder("nccl.db", node="gpu-017", scope=Scope(pids={1234}))
    agent.listeners.append(recorder)     # called from the ring-buffer poll
    ...
    recorder.close()                     # flushes everything, writes the summary to meta

The listener never blocks: it filters by scope and appends the event object
to a bounded queue (a counted drop when full). One writer thread turns the
events into rows and commits them in batches (every BATCH_ROWS rows or
BATCH_SECONDS, whichever comes first) to a WAL database, so a killed
recorder leaves a valid file holding every committed batch.

The schema (docs/schema.md) is versioned with PRAGMA user_version;
MIGRATIONS[i] takes a database from version i to i + 1.
"""

from __future__ import annotations

import collections
import os
import socket
import sqlite3
import threading
import time

from . import __version__, contract
from .maps import EVENT_LIFECYCLE, CallEvent, format_comm

# --- schema ---------------------------------------------------------------------

# MIGRATIONS[i]: the SQL steps from user_version i to i + 1. Append only:
# a released step is never edited (databases in the field have run it).
MIGRATIONS: list[list[str]] = [
    # 0 -> 1: the tables
    [
        """CREATE TABLE nccl_events (
            timestamp_ns   INTEGER NOT NULL,  -- call start, wall clock ns since the epoch
            duration_ns    INTEGER NOT NULL,
            op             TEXT    NOT NULL,  -- contract.OPS: ALL_REDUCE, SEND, COMM_INIT_RANK, ...
            rank           INTEGER,           -- rank in the communicator (-1: unknown)
            nranks         INTEGER,
            comm_id_hash   TEXT,              -- 16 hex digits, or 'unknown'
            nccl_comm_hash TEXT,
            seq            INTEGER,           -- this rank's n-th call of op on the communicator
            count          INTEGER,
            bytes          INTEGER,
            datatype       TEXT,              -- ncclFloat32, ... (NULL: not applicable)
            red_op         TEXT,              -- ncclSum, ... (NULL: not applicable)
            peer           INTEGER,           -- SEND/RECV (NULL: not applicable)
            root           INTEGER,           -- rooted collectives (NULL: not applicable)
            stream         TEXT,
            result         TEXT,              -- ncclSuccess, ...
            pid            INTEGER NOT NULL,
            tid            INTEGER NOT NULL,
            node           TEXT    NOT NULL,
            kind           TEXT    NOT NULL   -- 'call' | 'lifecycle'
        )""",
        """CREATE TABLE tcp_events (
            timestamp_ns INTEGER NOT NULL,
            event        TEXT    NOT NULL,    -- tcp_retransmit_skb | tcp_retransmit_failed |
                                              -- tcp_send_reset | tcp_receive_reset
            family       TEXT,                -- ipv4 | ipv6
            saddr        TEXT,
            daddr        TEXT,
            sport        INTEGER,
            dport        INTEGER,
            state        TEXT,
            seq          INTEGER,             -- NULL when the tracepoint does not give it
            pid          INTEGER,             -- owner: the traced process of the socket
            tid          INTEGER,
            rank         INTEGER,             -- the owner's rank (launcher rank, else its rank in
                                              -- its largest communicator; NULL: unknown)
            node         TEXT    NOT NULL
        )""",
        """CREATE TABLE processes (
            pid          INTEGER NOT NULL,
            node         TEXT    NOT NULL,
            launcher     TEXT,                -- torchrun | slurm | mpi | ''
            launcher_rank INTEGER,
            world_size   INTEGER,
            command      TEXT,
            netns        INTEGER,             -- inode of /proc/<pid>/ns/net
            first_seen_ns INTEGER,
            PRIMARY KEY (node, pid)
        )""",
        """CREATE TABLE communicators (
            node           TEXT    NOT NULL,
            pid            INTEGER NOT NULL,
            comm_id_hash   TEXT    NOT NULL,
            nccl_comm_hash TEXT,
            rank           INTEGER,
            nranks         INTEGER,
            first_seen_ns  INTEGER,
            PRIMARY KEY (node, pid, comm_id_hash)
        )""",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)",
    ],
    # 1 -> 2: scheduler view, and the indexes of the documented queries
    [
        "ALTER TABLE nccl_events ADD COLUMN runq_wait_ns INTEGER",  # NULL: not measured
        """CREATE TABLE sched_events (
            timestamp_ns INTEGER NOT NULL,
            pid          INTEGER NOT NULL,
            tid          INTEGER,
            event        TEXT    NOT NULL,    -- runq_wait | offcpu
            duration_ns  INTEGER NOT NULL,
            node         TEXT    NOT NULL
        )""",
        "CREATE INDEX nccl_events_time ON nccl_events (timestamp_ns)",
        "CREATE INDEX tcp_events_event_time ON tcp_events (event, timestamp_ns)",
        "CREATE INDEX sched_events_time ON sched_events (timestamp_ns)",
    ],
    # 2 -> 3: sched_events filled (which thread, inside which call), proxy waits per call
    [
        "ALTER TABLE nccl_events ADD COLUMN proxy_runq_wait_ns INTEGER",  # NULL: not measured
        "ALTER TABLE sched_events ADD COLUMN rank INTEGER",
        "ALTER TABLE sched_events ADD COLUMN thread TEXT",   # caller | proxy | other
        "ALTER TABLE sched_events ADD COLUMN comm TEXT",     # the thread's name
        "ALTER TABLE sched_events ADD COLUMN cpu INTEGER",
        "ALTER TABLE sched_events ADD COLUMN op TEXT",       # the NCCL call it waited in; NULL: none
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)

# Indexes built when a recording ends, not kept up while recording: their
# keys arrive in random order, and keeping them up costs most of the
# writer's throughput (docs/schema.md, Performance). A recording that was
# killed lacks them; every query still answers, by scanning.
DEFERRED_INDEXES = [
    "CREATE INDEX IF NOT EXISTS nccl_events_op_duration ON nccl_events (op, duration_ns)",
    "CREATE INDEX IF NOT EXISTS nccl_events_comm_seq ON nccl_events (comm_id_hash, op, seq)",
]

NCCL_COLUMNS = ("timestamp_ns", "duration_ns", "op", "rank", "nranks", "comm_id_hash",
                "nccl_comm_hash", "seq", "count", "bytes", "datatype", "red_op", "peer", "root",
                "stream", "result", "pid", "tid", "node", "kind", "runq_wait_ns", "proxy_runq_wait_ns")
TCP_COLUMNS = ("timestamp_ns", "event", "family", "saddr", "daddr", "sport", "dport", "state",
               "seq", "pid", "tid", "rank", "node")
SCHED_COLUMNS = ("timestamp_ns", "pid", "tid", "event", "duration_ns", "node", "rank", "thread",
                 "comm", "cpu", "op")

INSERT_NCCL = f"INSERT INTO nccl_events ({', '.join(NCCL_COLUMNS)}) VALUES ({', '.join('?' * len(NCCL_COLUMNS))})"
INSERT_TCP = f"INSERT INTO tcp_events ({', '.join(TCP_COLUMNS)}) VALUES ({', '.join('?' * len(TCP_COLUMNS))})"
INSERT_SCHED = f"INSERT INTO sched_events ({', '.join(SCHED_COLUMNS)}) VALUES ({', '.join('?' * len(SCHED_COLUMNS))})"

TCP_EVENTS = ("tcp_retransmit_skb", "tcp_retransmit_failed", "tcp_send_reset", "tcp_receive_reset")

# Batching and bounds (env overrides are for tests and benchmarks).
BATCH_ROWS = 5000
BATCH_SECONDS = 0.2
QUEUE_MAX = int(os.environ.get("NCCL_EXPORTER_STORE_QUEUE") or 65536)
META_EVERY_S = 1.0


class StoreError(RuntimeError):
    """The database cannot be created or written (one line)."""


def migrate(conn: sqlite3.Connection, target: int = SCHEMA_VERSION) -> int:
    """Bring a database to `target`; returns the version it had."""
    have = conn.execute("PRAGMA user_version").fetchone()[0]
    if have > SCHEMA_VERSION:
        raise StoreError(f"database schema version {have} is newer than this nccl-exporter "
                         f"({SCHEMA_VERSION}): upgrade nccl-exporter")
    for version in range(have, target):
        with conn:  # one transaction per step: a crash leaves the previous version
            for sql in MIGRATIONS[version]:
                conn.execute(sql)
            conn.execute(f"PRAGMA user_version = {version + 1}")
    return have


def open_db(path: str) -> sqlite3.Connection:
    """Open (creating) a recording for writing, migrated to SCHEMA_VERSION."""
    try:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode = WAL")
        # A killed process loses nothing the OS has: OFF skips only the fsyncs
        # that protect against power loss (the tail of the recording).
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("PRAGMA cache_size = -65536")  # KiB: 64 MiB at most
        conn.execute("PRAGMA wal_autocheckpoint = 8192")
        migrate(conn)
    except sqlite3.DatabaseError as e:
        raise StoreError(f"cannot record to {path}: {e}") from None
    return conn


# --- scope ----------------------------------------------------------------------

def netns_inode(spec: str | int) -> int:
    """--netns PATH|INODE -> the namespace inode ('net:[4026532]' also accepted)."""
    text = str(spec).strip()
    if text.startswith("net:[") and text.endswith("]"):
        text = text[5:-1]
    if text.isdigit():
        return int(text)
    try:
        return os.stat(text).st_ino
    except OSError as e:
        raise StoreError(f"--netns {spec}: {e.strerror or e}") from None


def pid_netns(pid: int, proc: str = "/proc") -> int | None:
    try:
        return os.stat(f"{proc}/{pid}/ns/net").st_ino
    except OSError:
        return None


class Scope:
    """Which processes a recording keeps: given pids and/or one network namespace.

    Empty scope: everything. A process's namespace is read once, on its
    first event, and remembered (an event arrives while its process lives).
    """

    def __init__(self, pids=(), netns: int | None = None, proc: str = "/proc"):
        self.pids = set(int(p) for p in pids)
        self.netns = netns
        self.proc = proc
        self._verdict: dict[int, bool] = {}

    @property
    def everything(self) -> bool:
        return not self.pids and self.netns is None

    def __contains__(self, pid) -> bool:
        if self.everything:
            return True
        v = self._verdict.get(pid)
        if v is None:
            v = pid in self.pids or (self.netns is not None and pid_netns(pid, self.proc) == self.netns)
            self._verdict[pid] = v
        return v

    def describe(self) -> str:
        parts = []
        if self.pids:
            parts.append("pid " + ",".join(str(p) for p in sorted(self.pids)))
        if self.netns is not None:
            parts.append(f"netns {self.netns}")
        return " or ".join(parts) or "all processes"


# --- rows -----------------------------------------------------------------------

# nccl_events.kind: 'lifecycle' for every op of contract.LIFECYCLE_OPS (the
# kernel sends the frequent ones, ncclCommCount/UserRank, as plain calls).
_LIFECYCLE_NAMES = frozenset(contract.LIFECYCLE_OPS.values())
_DT = {code: name for code, (name, _size) in contract.NCCL_DATATYPES.items()}


class _Rows:
    """Event objects -> row tuples, with the per-value formatting memoized."""

    def __init__(self, node: str):
        self.node = node
        self._hash: dict[int, str] = {}
        self._hex: dict[int, str] = {}

    def comm(self, h: int) -> str:
        s = self._hash.get(h)
        if s is None:
            s = self._hash[h] = format_comm(h)
        return s

    def hexa(self, v: int) -> str:
        s = self._hex.get(v)
        if s is None:
            if len(self._hex) > 4096:
                self._hex.clear()
            s = self._hex[v] = hex(v)
        return s

    def call(self, e) -> tuple:
        dt, rop = e.datatype, e.red_op
        return (
            e.start_real_ns, e.end_ns - e.start_ns, e.op, e.rank, e.nranks,
            self.comm(e.comm_hash), self.comm(e.nccl_hash), e.seq, e.count, e.bytes,
            (_DT.get(dt) or contract.datatype_name(dt)) if dt >= 0 else None,
            contract.redop_name(rop) if rop >= 0 else None,
            e.peer if e.peer >= 0 else None, e.root if e.root >= 0 else None,
            self.hexa(e.stream), contract.NCCL_RESULTS.get(e.result) or contract.result_name(e.result),
            e.pid, e.tid, self.node,
            "lifecycle" if e.kind == EVENT_LIFECYCLE or e.op in _LIFECYCLE_NAMES else "call",
            getattr(e, "runq_wait_ns", None),
            getattr(e, "proxy_wait_ns", None),
        )

    def tcp(self, d: dict, rank) -> tuple:
        family = d.get("family")
        if family in (2, 10):
            family = "ipv6" if family == 10 else "ipv4"
        return (
            d["timestamp_ns"], d["event"], family, _text(d.get("saddr")), _text(d.get("daddr")),
            d.get("sport"), d.get("dport"), _text(d.get("state")), d.get("seq") or None,
            d.get("pid") or None, d.get("tid") or None, d.get("rank", rank), self.node,
        )

    def sched(self, d: dict, rank) -> tuple:
        return (d["timestamp_ns"], d["pid"], d.get("tid"), d["event"], d["duration_ns"], self.node,
                rank, d.get("thread"), d.get("comm"), d.get("cpu"), d.get("op"))


def _text(v):
    return None if v is None else str(v)


def classify(event) -> tuple[str, object]:
    """('nccl', CallEvent) | ('tcp', dict) | ('sched', dict) | ('', None) for anything else."""
    if isinstance(event, CallEvent):
        return "nccl", event
    d = event if isinstance(event, dict) else (event.as_dict() if hasattr(event, "as_dict") else None)
    if not d:
        return "", None
    name = str(d.get("event", ""))
    if name.startswith("tcp_"):
        return "tcp", d
    if "duration_ns" in d and "pid" in d and name:
        return "sched", d
    return "", None


# --- the recorder -----------------------------------------------------------------

class Recorder:
    """A listener that records events to SQLite from a writer thread."""

    def __init__(self, path: str, node: str | None = None, scope: Scope | None = None,
                 queue_max: int | None = None, batch_rows: int = BATCH_ROWS,
                 batch_seconds: float = BATCH_SECONDS, clock_offset_ns: int | None = None,
                 identify_processes: bool = True):
        self.path = path
        self.node = node or socket.gethostname()
        self.scope = scope or Scope()
        self.queue_max = int(queue_max or QUEUE_MAX)
        self.batch_rows = batch_rows
        self.batch_seconds = batch_seconds
        self.identify_processes = identify_processes
        self._q: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        # Counters: the producer (poll thread) writes offered/dropped/out_of_scope,
        # the writer thread writes the recorded ones.
        self.offered = 0
        self.dropped = 0
        self.out_of_scope = 0
        self.recorded = {"nccl": 0, "tcp": 0, "sched": 0}
        self.kernel_lost: dict[str, int] = {}
        self.started_ns = time.time_ns()
        self.ended_ns: int | None = None
        self._rows = _Rows(self.node)
        self._seen_pids: set[int] = set()
        self._seen_comms: set[tuple[int, int]] = set()
        self._comm_rows: list = []
        self._world: dict[int, tuple[int, int]] = {}  # pid -> (nranks, rank) of its largest comm
        self._launcher_rank: dict[int, int] = {}
        self._extra_meta: dict[str, str] = {}
        self.conn = open_db(path)
        meta = {
            "node": self.node,
            "agent_version": __version__,
            "schema_version": str(SCHEMA_VERSION),
            "hostname": socket.gethostname(),
            "start_ns": str(self.started_ns),
            "scope": self.scope.describe(),
            "clock_offset_ns": "" if clock_offset_ns is None else str(clock_offset_ns),
            "queue_max": str(self.queue_max),
        }
        with self.conn:
            self.conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", meta.items())
        self._write_meta(final=False)
        self._thread = threading.Thread(target=self._writer, name="nccl-store", daemon=True)
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

    @property
    def queued(self) -> int:
        return len(self._q)

    @property
    def total_recorded(self) -> int:
        return sum(self.recorded.values())

    @property
    def total_lost(self) -> int:
        return self.dropped + sum(self.kernel_lost.values())

    # --- writer thread ---------------------------------------------------------------

    def _writer(self) -> None:
        last_meta = time.monotonic()
        try:
            while True:
                stopping = self._stop.is_set()
                batch = self._drain()
                if batch:
                    self._write(batch)
                now = time.monotonic()
                if now - last_meta >= META_EVERY_S:
                    self._write_meta(final=False)
                    last_meta = now
                if stopping and not self._q:
                    break
                if len(batch) < self.batch_rows:
                    self._wake.wait(self.batch_seconds)
                    self._wake.clear()
        except BaseException as e:  # reported by close(); the producer keeps counting drops
            self._error = e
            self.queue_max = 0

    def _drain(self) -> list:
        q = self._q
        n = min(len(q), self.batch_rows)
        pop = q.popleft
        return [pop() for _ in range(n)]

    def _write(self, batch: list) -> None:
        rows = self._rows
        nccl, tcp, sched = [], [], []
        procs = []
        seen = self._seen_pids
        for event in batch:
            if type(event) is CallEvent:
                what, d, pid = "nccl", event, event.pid
                if event.comm_hash and (pid, event.comm_hash) not in self._seen_comms:
                    self._learn_comm(event)
            else:
                what, d = classify(event)
                if not what:
                    continue
                pid = d.pid if what == "nccl" else d.get("pid")
            if pid and pid not in seen:  # first: its launcher rank labels this very row
                seen.add(pid)
                if self.identify_processes:
                    procs.append(self._process_row(pid))
            if what == "nccl":
                nccl.append(rows.call(d))
            elif what == "tcp":
                tcp.append(rows.tcp(d, self._rank_of(pid)))
            else:
                sched.append(rows.sched(d, self._rank_of(pid)))
        comms, self._comm_rows = self._comm_rows, []
        c = self.conn
        c.execute("BEGIN")
        try:
            if nccl:
                c.executemany(INSERT_NCCL, nccl)
            if tcp:
                c.executemany(INSERT_TCP, tcp)
            if sched:
                c.executemany(INSERT_SCHED, sched)
            if procs:
                c.executemany("INSERT OR IGNORE INTO processes VALUES (?, ?, ?, ?, ?, ?, ?, ?)", procs)
            if comms:
                c.executemany("INSERT OR IGNORE INTO communicators VALUES (?, ?, ?, ?, ?, ?, ?)", comms)
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        self.recorded["nccl"] += len(nccl)
        self.recorded["tcp"] += len(tcp)
        self.recorded["sched"] += len(sched)

    def _learn_comm(self, e) -> None:
        self._seen_comms.add((e.pid, e.comm_hash))
        self._comm_rows.append((self.node, e.pid, self._rows.comm(e.comm_hash),
                                self._rows.comm(e.nccl_hash), e.rank, e.nranks, e.start_real_ns))
        # A process's rank, for its TCP events: its rank in its largest communicator,
        # unless the launcher said (processes table).
        best = self._world.get(e.pid)
        if e.rank >= 0 and (best is None or e.nranks > best[0]):
            self._world[e.pid] = (e.nranks, e.rank)

    def _rank_of(self, pid):
        r = self._launcher_rank.get(pid)
        if r is not None:
            return r
        best = self._world.get(pid)
        return best[1] if best else None

    def _process_row(self, pid: int) -> tuple:
        from .identity import launcher_identity, process_command

        who = launcher_identity(pid)
        if who["rank"] is not None:
            self._launcher_rank[pid] = who["rank"]
        return (pid, self.node, who["launcher"], who["rank"], who["world_size"], process_command(pid),
                pid_netns(pid), time.time_ns())

    def _write_meta(self, final: bool) -> None:
        meta = {
            "last_commit_ns": str(time.time_ns()),
            "events_offered": str(self.offered),
            "events_recorded": str(self.total_recorded),
            "nccl_events_recorded": str(self.recorded["nccl"]),
            "tcp_events_recorded": str(self.recorded["tcp"]),
            "sched_events_recorded": str(self.recorded["sched"]),
            "lost_queue_full": str(self.dropped),
            "out_of_scope": str(self.out_of_scope),
            **{f"lost_{k}": str(v) for k, v in self.kernel_lost.items()},
            "lost_total": str(self.total_lost),
            **self._extra_meta,
        }
        if final:
            meta["end_ns"] = str(self.ended_ns)
        with self.conn:
            self.conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", meta.items())

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
            raise StoreError(f"recording to {self.path} failed: {self._error}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def summary(self) -> str:
        kernel = sum(self.kernel_lost.values())
        return (f"{self.recorded['nccl']} NCCL calls, {self.recorded['tcp']} TCP events, "
                f"{self.recorded['sched']} scheduler events recorded to {self.path}; "
                f"lost {self.total_lost} (kernel ring buffer {kernel}, recorder queue full {self.dropped})")


class Progress:
    """The recording's progress on stderr: rewritten in place on a terminal
    (every second), one line every PLAIN_EVERY_S seconds otherwise."""

    PLAIN_EVERY_S = 5.0

    def __init__(self, recorder: Recorder, stream):
        self.recorder = recorder
        self.stream = stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.every = 1.0 if self.tty else self.PLAIN_EVERY_S
        self.t0 = self.last = time.monotonic()
        self.last_offered = 0

    def line(self, now: float) -> str:
        r = self.recorder
        rate = (r.offered - self.last_offered) / max(now - self.last, 1e-9)
        return (f"recording {now - self.t0:6.1f} s: {rate:8.0f} events/s, "
                f"{r.total_recorded} recorded, {r.queued} queued, {r.total_lost} lost")

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last < self.every:
            return
        text = self.line(now)
        self.last, self.last_offered = now, self.recorder.offered
        self.stream.write(("\r" + text + "\x1b[K") if self.tty else text + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

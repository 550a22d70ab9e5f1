"""The recording's schema: tables, migrations and opening a file for writing.

The schema (docs/schema.md) is versioned with PRAGMA user_version;
MIGRATIONS[i] takes a database from version i to i + 1. Column order of the
event tables is the renderer's (exporter/records/render.py), so a field has
one name everywhere.
"""

from __future__ import annotations

import sqlite3

from exporter.records.render import NCCL_FIELDS, SCHED_FIELDS, SCHED_INTERVAL_FIELDS, TCP_FIELDS

# --- schema ---------------------------------------------------------------------

# A row whose nccl_comm_hash names NCCL's commHash (migration 7 -> 8).
_KNOWN_NCCL_HASH = ("nccl_comm_hash IS NOT NULL AND nccl_comm_hash NOT IN ('', 'unknown') "
                    "AND comm_id_hash IS NOT nccl_comm_hash")

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
    # 3 -> 4: the wall-clock offset re-sampled while recording; merged recordings' nodes and skew
    [
        """CREATE TABLE clock_samples (
            node      TEXT    NOT NULL,
            sample_ns INTEGER NOT NULL,       -- CLOCK_REALTIME when sampled
            offset_ns INTEGER NOT NULL,       -- CLOCK_REALTIME - CLOCK_MONOTONIC then
            PRIMARY KEY (node, sample_ns)
        )""",
        """CREATE TABLE nodes (                -- filled by merge: one row per node and boot
            node       TEXT NOT NULL,
            machine_id TEXT NOT NULL,         -- /etc/machine-id ('' : not recorded)
            boot_id    TEXT NOT NULL,         -- /proc/sys/kernel/random/boot_id ('' : not recorded)
            hostname   TEXT,
            start_ns   INTEGER,
            end_ns     INTEGER,
            source     TEXT,                  -- the file it was merged from
            PRIMARY KEY (node, machine_id, boot_id)
        )""",
        """CREATE TABLE clock_skew (           -- filled by merge: node clock - reference clock
            node        TEXT PRIMARY KEY,
            offset_ns   INTEGER NOT NULL,
            reference   TEXT,
            collectives INTEGER,              -- collectives compared
            residual_ns INTEGER,              -- median |difference - offset|
            method      TEXT,                 -- 'host call ends[...]', 'causal bounds (...)', 'reference', 'none: ...'
            lower_ns    INTEGER,              -- causal bounds of offset_ns (NULL: unbounded)
            upper_ns    INTEGER
        )""",
    ],
    # 4 -> 5: GPU time from the profiler plugin (docs/plugin.md). The GPU start
    # is stored relative to the call's own timestamp_ns, so merge's clock
    # alignment of timestamp_ns carries it along.
    [
        "ALTER TABLE nccl_events ADD COLUMN gpu_start_offset_ns INTEGER",  # GPU start - timestamp_ns; NULL: no GPU time
        "ALTER TABLE nccl_events ADD COLUMN gpu_duration_ns INTEGER",      # NULL: no GPU time
        """CREATE TABLE gpu_intervals (        -- every GPU operation the plugin reported while recording
            pid             INTEGER NOT NULL,
            nccl_comm_hash  TEXT    NOT NULL,  -- NCCL's commHash, as nccl_events.nccl_comm_hash
            op              TEXT    NOT NULL,
            seq             INTEGER NOT NULL,  -- NCCL's seqNumber (coll); p2p: the plugin's order
            kind            TEXT    NOT NULL,  -- coll | p2p
            rank            INTEGER,
            peer            INTEGER,           -- p2p: the peer
            enqueue_ns      INTEGER,           -- CLOCK_REALTIME: the host enqueue
            gpu_start_ns    INTEGER NOT NULL,  -- CLOCK_REALTIME
            gpu_duration_ns INTEGER NOT NULL,
            node            TEXT
        )""",
    ],
    # 5 -> 6: where each process ran in Kubernetes (the labels of
    # nccl_communicator_info, sources/pods.py) and its libnccl's version
    [
        "ALTER TABLE processes ADD COLUMN namespace TEXT",     # '' : not in a pod, or unknown
        "ALTER TABLE processes ADD COLUMN pod TEXT",
        "ALTER TABLE processes ADD COLUMN container TEXT",     # the container's name (kubelet only)
        "ALTER TABLE processes ADD COLUMN pod_uid TEXT",       # metadata.uid, from the cgroup path
        "ALTER TABLE processes ADD COLUMN container_id TEXT",  # 'containerd://<64 hex>', from the cgroup path
        "ALTER TABLE processes ADD COLUMN libnccl_version TEXT",  # '2.32.3'; '' : unknown
    ],
    # 6 -> 7: what each GPU operation's network transfers waited for, per peer
    # and direction (the profiler plugin's ProxyOp/ProxyStep figures; docs/network.md)
    [
        """CREATE TABLE nccl_peer_waits (      -- one row per (operation, peer, direction, phase)
            pid             INTEGER NOT NULL,  -- the operation: as gpu_intervals (pid, nccl_comm_hash, op, seq, kind)
            nccl_comm_hash  TEXT    NOT NULL,
            op              TEXT    NOT NULL,
            seq             INTEGER NOT NULL,
            kind            TEXT    NOT NULL,  -- coll | p2p
            rank            INTEGER,
            peer            INTEGER,           -- the peer rank; NULL: the peers beyond the top K, summed
            direction       TEXT    NOT NULL,  -- send | recv
            phase           TEXT    NOT NULL,  -- contract.NETWORK_PHASES: send_gpu_wait, ..., recv_gpu_wait
            wall_ns         INTEGER NOT NULL,  -- time with at least one step in this phase
            step_ns         INTEGER NOT NULL,  -- summed over steps (they overlap)
            bytes           INTEGER NOT NULL,  -- transSize counted in this phase (send_wait, recv_flush_wait); else 0
            node            TEXT
        )""",
    ],
    # 7 -> 8: comm_id_hash is the `comm` label, NCCL's commHash where known
    # (docs/communicators.md): every agent names a communicator alike, whether
    # it saw it made or learnt it from the profiler plugin. Rows written before
    # held the agent's own id there; they take NCCL's, so one recording (or a
    # merge of old and new ones) has one id per communicator.
    [
        f"""UPDATE nccl_events SET comm_id_hash = nccl_comm_hash WHERE {_KNOWN_NCCL_HASH}""",
        f"""UPDATE OR IGNORE communicators SET comm_id_hash = nccl_comm_hash WHERE {_KNOWN_NCCL_HASH}""",
    ],
    # 8 -> 9: a GPU operation's bytes, so a call is joined to its own interval where NCCL's
    # seqNumber is not the call count (exporter/sinks/recording/gpu_join.py)
    [
        "ALTER TABLE gpu_intervals ADD COLUMN bytes INTEGER",  # NULL: recorded before this version
    ],
    # 9 -> 10: `--sched totals` (run's default) in recordings: what each process's threads
    # of one kind waited for a CPU between two reads of /proc (sources/schedstat.py)
    [
        """CREATE TABLE sched_intervals (      -- one row per (process, thread kind, read) with a wait
            timestamp_ns INTEGER NOT NULL,     -- CLOCK_REALTIME: the interval's start (the previous read)
            interval_ns  INTEGER NOT NULL,     -- its length (~1 s)
            pid          INTEGER NOT NULL,
            thread       TEXT    NOT NULL,     -- caller | proxy | other
            runq_wait_ns INTEGER NOT NULL,     -- runnable, not running, summed over its threads (> 0)
            switch_ins   INTEGER NOT NULL,
            node         TEXT    NOT NULL,
            rank         INTEGER               -- the process's rank, as sched_events.rank
        )""",
        "CREATE INDEX sched_intervals_time ON sched_intervals (timestamp_ns)",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)

# The processes table's columns, in the order the recorder writes them.
PROCESS_FIELDS = ("pid", "node", "launcher", "launcher_rank", "world_size", "command", "netns",
                  "first_seen_ns", "namespace", "pod", "container", "pod_uid", "container_id",
                  "libnccl_version")

# When a recording ends, gpu_join.fold_gpu_intervals fills each collective call's GPU
# interval from gpu_intervals (not per row while recording: that would need an index on
# nccl_events kept up at every insert). Its lookups' index:
GPU_INTERVALS_INDEX = "CREATE INDEX IF NOT EXISTS gpu_intervals_key ON gpu_intervals (pid, op, seq)"

# Indexes built when a recording ends, not kept up while recording: their
# keys arrive in random order, and keeping them up costs most of the
# writer's throughput (docs/schema.md, Performance). A recording that was
# killed lacks them; every query still answers, by scanning.
DEFERRED_INDEXES = [
    "CREATE INDEX IF NOT EXISTS nccl_events_op_duration ON nccl_events (op, duration_ns)",
    "CREATE INDEX IF NOT EXISTS nccl_events_comm_seq ON nccl_events (comm_id_hash, op, seq)",
]

def _insert(table: str, fields: tuple[str, ...]) -> str:
    return f"INSERT INTO {table} ({', '.join(fields)}) VALUES ({', '.join('?' * len(fields))})"


GPU_FIELDS = ("pid", "nccl_comm_hash", "op", "seq", "kind", "rank", "peer", "enqueue_ns", "gpu_start_ns",
              "gpu_duration_ns", "node", "bytes")

PEER_WAIT_FIELDS = ("pid", "nccl_comm_hash", "op", "seq", "kind", "rank", "peer", "direction", "phase",
                    "wall_ns", "step_ns", "bytes", "node")

INSERT = {
    "processes": _insert("processes", PROCESS_FIELDS).replace("INSERT", "INSERT OR IGNORE", 1),
    "gpu": _insert("gpu_intervals", GPU_FIELDS),
    "peer_waits": _insert("nccl_peer_waits", PEER_WAIT_FIELDS),
    "nccl": _insert("nccl_events", NCCL_FIELDS),
    "tcp": _insert("tcp_events", TCP_FIELDS),
    "sched": _insert("sched_events", SCHED_FIELDS),
    "sched_interval": _insert("sched_intervals", SCHED_INTERVAL_FIELDS),
}


class RecordingError(RuntimeError):
    """The database cannot be created or written (one line)."""


def migrate(conn: sqlite3.Connection, target: int = SCHEMA_VERSION) -> int:
    """Bring a database to `target`; returns the version it had."""
    have = conn.execute("PRAGMA user_version").fetchone()[0]
    if have > SCHEMA_VERSION:
        raise RecordingError(f"database schema version {have} is newer than this nccl-exporter "
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
        raise RecordingError(f"cannot record to {path}: {e}") from None
    return conn

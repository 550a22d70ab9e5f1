"""Combining recordings into one file: the SQL of `merge` (exporter/offline/fleet/merge.py
decides what is merged, checks node identities and estimates the clock skew).

Row identity (docs/fleet.md): a UNIQUE index per event table, NULLs read as
-1 / '' so that they compare equal:

- nccl_events:  (node, timestamp_ns, pid, tid, op) - one thread starts one
  outermost call at a time, so start time, thread and op name a call;
- tcp_events:   (node, timestamp_ns, event, pid, saddr, sport, daddr, dport, seq);
- sched_events: (node, timestamp_ns, pid, tid, event);
- sched_intervals: (node, timestamp_ns, pid, thread);
- processes (node, pid), communicators (node, pid, comm_id_hash),
  clock_samples (node, sample_ns), nodes (node, machine_id, boot_id): their
  primary keys.
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from typing import NamedTuple

from exporter.sinks.recording.read import Recording
from exporter.sinks.recording.schema import DEFERRED_INDEXES, SCHEMA_VERSION, migrate

IDENTITY = {
    "nccl_events": "CREATE UNIQUE INDEX IF NOT EXISTS merge_identity_nccl ON nccl_events "
                   "(node, timestamp_ns, pid, tid, op)",
    "tcp_events": "CREATE UNIQUE INDEX IF NOT EXISTS merge_identity_tcp ON tcp_events "
                  "(node, timestamp_ns, event, IFNULL(pid, -1), IFNULL(saddr, ''), IFNULL(sport, -1), "
                  "IFNULL(daddr, ''), IFNULL(dport, -1), IFNULL(seq, -1))",
    "sched_events": "CREATE UNIQUE INDEX IF NOT EXISTS merge_identity_sched ON sched_events "
                    "(node, timestamp_ns, pid, IFNULL(tid, -1), event)",
    "sched_intervals": "CREATE UNIQUE INDEX IF NOT EXISTS merge_identity_sched_intervals ON sched_intervals "
                       "(node, timestamp_ns, pid, thread)",
}
TABLES = ("nccl_events", "tcp_events", "sched_events", "sched_intervals", "processes", "communicators",
          "clock_samples", "nccl_peer_waits")
# The index the skew estimate and stragglers read; merge builds the others only when asked.
SKEW_INDEX = "nccl_events_comm_seq"


class Identity(NamedTuple):
    """A node as merge records it (the nodes table, else the recording's meta)."""
    node: str
    machine_id: str
    boot_id: str
    hostname: str | None
    start_ns: int | None
    end_ns: int | None
    source: str | None


class MergeError(RuntimeError):
    """One line for 'nccl-exporter: error: ...'."""


def _uri(path: str) -> str:
    return "file:" + urllib.parse.quote(os.path.abspath(path))


def _columns(conn, schema, table) -> list[str]:
    return [r[1] for r in conn.execute(f"PRAGMA {schema}.table_info({table})")]


# --- the inputs -------------------------------------------------------------------

def open_input(path: str, tmpdir: str) -> str:
    """A path holding `path` at SCHEMA_VERSION: itself, or a migrated temporary copy in
    tmpdir (the input is never written). MergeError unless it is a readable, undamaged
    recording of a version this nccl-exporter knows."""
    if not os.path.isfile(path):
        raise MergeError(f"{path}: no such file")
    try:
        conn = sqlite3.connect(_uri(path) + "?mode=ro", uri=True)
        rec = Recording(conn, path)
        version, has_calls = rec.version, rec.has_table("nccl_events")
        conn.close()
    except sqlite3.DatabaseError as e:
        raise MergeError(f"{path}: not an nccl-exporter recording ({e})") from None
    if not version or not has_calls:
        raise MergeError(f"{path}: not an nccl-exporter recording (no schema version or no nccl_events table)")
    if version > SCHEMA_VERSION:
        raise MergeError(f"{path}: schema version {version} is newer than this nccl-exporter ({SCHEMA_VERSION})")
    try:
        conn = sqlite3.connect(_uri(path) + "?mode=ro", uri=True)
        try:
            problem = conn.execute("PRAGMA quick_check(1)").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        problem = str(e)
    if problem != "ok":
        raise MergeError(f"{path}: the file is damaged ({' '.join(str(problem).split())})")
    if version == SCHEMA_VERSION:
        _check_tables(path, path, version)
        return path
    copy = os.path.join(tmpdir, f"v{version}-{len(os.listdir(tmpdir))}.db")
    try:
        src = sqlite3.connect(_uri(path) + "?mode=ro", uri=True)
        dst = sqlite3.connect(copy)
        try:
            src.backup(dst)
            migrate(dst)
        finally:
            src.close()
            dst.close()
    except sqlite3.DatabaseError as e:
        raise MergeError(f"{path}: schema version {version} does not match its tables ({e})") from None
    _check_tables(copy, path, version)
    return copy


def _expected_columns() -> dict[str, set]:
    """The merged tables' columns at SCHEMA_VERSION."""
    conn = sqlite3.connect(":memory:")
    try:
        migrate(conn)
        return {t: set(_columns(conn, "main", t)) for t in TABLES}
    finally:
        conn.close()


def _check_tables(path: str, label: str, version: int) -> None:
    """MergeError unless `path` holds every merged table with every column of its version."""
    expected = _expected_columns()
    conn = sqlite3.connect(_uri(path) + "?mode=ro", uri=True)
    try:
        for table, cols in expected.items():
            have = set(_columns(conn, "main", table))
            missing = sorted(cols - have)
            if missing:
                what = "no table" if not have else "no column " + ", ".join(missing)
                raise MergeError(f"{label}: schema version {version} does not match its tables "
                                 f"({table}: {what})")
    finally:
        conn.close()


def identities(path: str, label: str) -> list[Identity]:
    """The nodes a checked input holds: its nodes table (a merged file), else one row per
    node named by its meta (or its calls), `label` being its source."""
    conn = sqlite3.connect(_uri(path) + "?mode=ro", uri=True)
    try:
        rec = Recording(conn, path)
        if rec.has_table("nodes"):
            ids = list(map(Identity._make, conn.execute(
                "SELECT node, machine_id, boot_id, hostname, start_ns, end_ns, source FROM nodes")))
            if ids:
                return ids
        meta = rec.meta()
        names = {meta["node"]} if meta.get("node") and meta["node"] != "(merged)" else set(rec.nodes())
    finally:
        conn.close()
    end = meta.get("end_ns") or meta.get("last_commit_ns")
    return [Identity(n, meta.get("machine_id", ""), meta.get("boot_id", ""), meta.get("hostname"),
                     int(meta["start_ns"]) if meta.get("start_ns") else None, int(end) if end else None, label)
            for n in sorted(names)]


def meta_value(path: str, key: str) -> str:
    """One meta value of a checked input ('' when it has none)."""
    conn = sqlite3.connect(_uri(path) + "?mode=ro", uri=True)
    try:
        return Recording(conn, path).meta().get(key, "")
    finally:
        conn.close()


# --- the output -------------------------------------------------------------------

def open_output(work: str, fresh: bool) -> tuple[sqlite3.Connection, list[tuple[str, str]]]:
    """The merged file, migrated, with the row-identity indexes; returns it and, for a
    fresh file, the (name, sql) of the indexes dropped until the rows are in (a sorted
    build at the end beats random inserts)."""
    conn = sqlite3.connect(_uri(work), uri=True, isolation_level=None)
    try:
        # A new file is scratch until renamed: no journal. An existing one keeps its journal.
        conn.execute(f"PRAGMA journal_mode = {'OFF' if fresh else 'WAL'}")
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("PRAGMA cache_size = -262144")  # KiB
        conn.execute("PRAGMA temp_store = MEMORY")
        conn.execute("PRAGMA threads = 4")  # sorter helper threads for the index builds
        migrate(conn)
        for sql in IDENTITY.values():
            conn.execute(sql)
        later = []
        if fresh:
            later = list(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index' "
                                      "AND sql IS NOT NULL AND name NOT LIKE 'merge_identity_%'"))
            for name, _ in later:
                conn.execute(f"DROP INDEX {name}")
    except BaseException:
        conn.close()
        raise
    return conn, later


def add_input(conn, path: str, ids: list[tuple], mapping: dict) -> tuple[dict, dict]:
    """Copy one checked input's rows into the merged file in one transaction, nodes renamed
    by `mapping`; returns ({table: rows added}, {table: rows offered})."""
    added = {t: 0 for t in TABLES}
    offered = {t: 0 for t in TABLES}
    conn.execute("ATTACH DATABASE ? AS src", (_uri(path) + "?mode=ro",))  # inputs are never written
    try:
        node_expr = "node"
        params: list = []
        if mapping:
            node_expr = "CASE node " + " ".join("WHEN ? THEN ?" for _ in mapping) + " ELSE node END"
            for old, new in mapping.items():
                params += [old, new]
        conn.execute("BEGIN")
        try:
            conn.executemany("INSERT OR IGNORE INTO nodes VALUES (?, ?, ?, ?, ?, ?, ?)", ids)
            for table in TABLES:
                cols = [c for c in _columns(conn, "main", table) if c in set(_columns(conn, "src", table))]
                sel = ", ".join(node_expr if c == "node" else c for c in cols)
                before = conn.total_changes
                conn.execute(f"INSERT OR IGNORE INTO main.{table} ({', '.join(cols)}) "
                             f"SELECT {sel} FROM src.{table}", params if "node" in cols else [])
                added[table] += conn.total_changes - before
                offered[table] += conn.execute(f"SELECT COUNT(*) FROM src.{table}").fetchone()[0]
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    finally:
        conn.execute("DETACH DATABASE src")
    return added, offered


def count_nodes(conn) -> int:
    """The nodes (and boots) of the merged file."""
    return conn.execute("SELECT COUNT(DISTINCT node) FROM nodes").fetchone()[0]


def build_indexes(conn, later: list[tuple[str, str]], query_indexes: bool) -> None:
    """The (comm_id_hash, op, seq) index always (the skew estimate and stragglers read it);
    the others, which serve time-window and slow-call queries, when asked (they answer
    without, by scanning)."""
    for _, sql in later:
        if query_indexes or SKEW_INDEX in sql:
            conn.execute(sql)
    for sql in DEFERRED_INDEXES:
        if query_indexes or SKEW_INDEX in sql:
            conn.execute(sql)


def store_skew_and_meta(conn, skew_rows: list[tuple], meta: dict[str, str]) -> None:
    """Replace clock_skew with `skew_rows` (read.CLOCK_SKEW_COLUMNS order) and set `meta`, in
    one transaction."""
    conn.execute("BEGIN")
    conn.execute("DELETE FROM clock_skew")
    if skew_rows:
        conn.executemany("INSERT INTO clock_skew VALUES (?, ?, ?, ?, ?, ?, ?, ?)", skew_rows)
    conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", list(meta.items()))
    conn.execute("COMMIT")


def close_output(conn, fresh: bool) -> None:
    """Leave the merged file as one file (no WAL) and close it."""
    if not fresh:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.close()

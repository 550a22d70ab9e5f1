"""A time window of a recording as a file of its own (`fleet fetch`, the node
query endpoint's GET /api/v1/recording): the same schema, the event rows of
the window, every other table whole.

Only the window's rows are read and written: the live recording of an agent
that has run for weeks is large, and `explain --nodes` asks for its last 30 s
every few seconds (a copy of the whole file, then deletes, grew with the
recording and outran the caller's timeout)."""

from __future__ import annotations

import os
import sqlite3
import urllib.parse

from exporter.sinks.recording import query

_WINDOW_KEY = "window_copy_gpu_key"  # a working index of the copy's GPU operations, not in the schema


def window_copy(db: str, dest: str, since_ns: int | None, until_ns: int | None) -> None:
    """Copy the recording `db` to `dest`, keeping only rows of [since, until] in every table
    with a timestamp_ns column, GPU operations (gpu_intervals) that started in it and their
    per-peer network waits (nccl_peer_waits: no time of their own, they belong to an operation);
    the other tables, e.g. processes and meta, whole."""
    src = query.open_readonly(db)  # checks it is a recording; a snapshot of it when whole
    try:
        if since_ns is None and until_ns is None:
            out = sqlite3.connect(dest)
            try:
                src.backup(out)
            finally:
                out.close()
            return
        version = src.execute("PRAGMA user_version").fetchone()[0]
        objects = src.execute("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL "
                              "AND name NOT LIKE 'sqlite_%' ORDER BY rowid").fetchall()
    finally:
        src.close()
    lo = -(1 << 63) if since_ns is None else since_ns
    hi = (1 << 63) - 1 if until_ns is None else until_ns
    conn = sqlite3.connect(dest, uri=True)
    try:
        conn.execute("ATTACH DATABASE ? AS src",
                     ("file:" + urllib.parse.quote(os.path.abspath(db)) + "?mode=ro",))
        tables = [name for kind, name, _ in objects if kind == "table"]
        with conn:  # one transaction: one consistent read of a recording being written
            for kind, _, sql in objects:
                if kind == "table":
                    conn.execute(sql)
            for t in tables:
                cols = {r[1] for r in conn.execute(f'PRAGMA main.table_info("{t}")')}
                if "timestamp_ns" in cols:
                    conn.execute(f'INSERT INTO main."{t}" SELECT * FROM src."{t}" '
                                 f'WHERE timestamp_ns >= ? AND timestamp_ns <= ?', (lo, hi))
                elif t == "gpu_intervals":
                    conn.execute('INSERT INTO main.gpu_intervals SELECT * FROM src.gpu_intervals '
                                 'WHERE gpu_start_ns >= ? AND gpu_start_ns <= ?', (lo, hi))
                elif t != "nccl_peer_waits":
                    conn.execute(f'INSERT INTO main."{t}" SELECT * FROM src."{t}"')
            if "nccl_peer_waits" in tables:
                # each peer wait row of the recording looks its operation up among the window's: by
                # an index (dropped after), not a scan of the window's operations per row, which
                # grew as (recording x window) and outran explain --nodes' 10 s on a GPU job
                conn.execute(f"CREATE INDEX main.{_WINDOW_KEY} ON gpu_intervals (pid, nccl_comm_hash, op, seq)")
                conn.execute("INSERT INTO main.nccl_peer_waits SELECT w.* FROM src.nccl_peer_waits AS w "
                             "WHERE EXISTS (SELECT 1 FROM main.gpu_intervals AS g WHERE g.pid = w.pid "
                             "AND g.nccl_comm_hash = w.nccl_comm_hash AND g.op = w.op AND g.seq = w.seq "
                             "AND g.kind = w.kind AND g.node IS w.node)")
                conn.execute(f"DROP INDEX main.{_WINDOW_KEY}")
            if "meta" in tables:
                conn.executemany("INSERT OR REPLACE INTO main.meta (key, value) VALUES (?, ?)",
                                 [("window_since_ns", "" if since_ns is None else str(since_ns)),
                                  ("window_until_ns", "" if until_ns is None else str(until_ns))])
            for kind, _, sql in objects:  # indexes, views, triggers: after the rows
                if kind != "table":
                    conn.execute(sql)
            conn.execute(f"PRAGMA main.user_version = {int(version)}")
        conn.execute("DETACH DATABASE src")
    finally:
        conn.close()

"""A time window of a recording as a file of its own (`fleet fetch`, the node
query endpoint's GET /api/v1/recording): the same schema, the event rows of
the window, every other table whole."""

from __future__ import annotations

import sqlite3

from exporter.sinks.recording import query


def window_copy(db: str, dest: str, since_ns: int | None, until_ns: int | None) -> None:
    """Copy the recording `db` to `dest`, keeping only rows of [since, until] in every table
    with a timestamp_ns column, GPU operations (gpu_intervals) that started in it and their
    per-peer network waits (nccl_peer_waits: no time of their own, they belong to an operation);
    the other tables, e.g. processes and meta, whole."""
    src = query.open_readonly(db)
    try:
        out = sqlite3.connect(dest)
        try:
            src.backup(out)
        finally:
            out.close()
    finally:
        src.close()
    if since_ns is None and until_ns is None:
        return
    conn = sqlite3.connect(dest)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        with conn:
            for t in tables:
                cols = {r[1] for r in conn.execute(f'PRAGMA table_info("{t}")')}
                if "timestamp_ns" not in cols:
                    continue
                if since_ns is not None:
                    conn.execute(f'DELETE FROM "{t}" WHERE timestamp_ns < ?', (since_ns,))
                if until_ns is not None:
                    conn.execute(f'DELETE FROM "{t}" WHERE timestamp_ns > ?', (until_ns,))
            if "gpu_intervals" in tables:
                if since_ns is not None:
                    conn.execute("DELETE FROM gpu_intervals WHERE gpu_start_ns < ?", (since_ns,))
                if until_ns is not None:
                    conn.execute("DELETE FROM gpu_intervals WHERE gpu_start_ns > ?", (until_ns,))
                if "nccl_peer_waits" in tables:
                    conn.execute("DELETE FROM nccl_peer_waits AS w WHERE NOT EXISTS (SELECT 1 FROM gpu_intervals AS g "
                                 "WHERE g.pid = w.pid AND g.nccl_comm_hash = w.nccl_comm_hash AND g.op = w.op "
                                 "AND g.seq = w.seq AND g.kind = w.kind AND g.node IS w.node)")
            if "meta" in tables:
                conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                                 [("window_since_ns", "" if since_ns is None else str(since_ns)),
                                  ("window_until_ns", "" if until_ns is None else str(until_ns))])
        conn.execute("VACUUM")
    finally:
        conn.close()

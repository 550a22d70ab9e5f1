"""Merge recordings of many nodes into one file (`nccl-exporter merge -o OUT.db IN.db...`).

Every row keeps its node. Rows are deduplicated by a row identity (below),
so merging the same recording twice, two copies of it, or overlapping
windows of one node adds nothing. Inputs of an older schema version are
migrated on a temporary copy (the input is never written). Two inputs that
give one node name to different machines (`meta.machine_id`) are refused
unless one is renamed (`--rename [FILE:]OLD=NEW`). The clock offsets
estimated from the data (exporter/tools/analysis/skew.py) are stored in
`clock_skew`; rows keep their own node's clock (readers subtract the offset;
`--no-align` leaves the table empty).

Row identity (docs/fleet.md): a UNIQUE index per event table, NULLs read as
-1 / '' so that they compare equal:

- nccl_events:  (node, timestamp_ns, pid, tid, op) - one thread starts one
  outermost call at a time, so start time, thread and op name a call;
- tcp_events:   (node, timestamp_ns, event, pid, saddr, sport, daddr, dport, seq);
- sched_events: (node, timestamp_ns, pid, tid, event);
- processes (node, pid), communicators (node, pid, comm_id_hash),
  clock_samples (node, sample_ns), nodes (node, machine_id, boot_id): their
  primary keys.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field

from exporter.sinks.recording.schema import DEFERRED_INDEXES, SCHEMA_VERSION, migrate

IDENTITY = {
    "nccl_events": "CREATE UNIQUE INDEX IF NOT EXISTS merge_identity_nccl ON nccl_events "
                   "(node, timestamp_ns, pid, tid, op)",
    "tcp_events": "CREATE UNIQUE INDEX IF NOT EXISTS merge_identity_tcp ON tcp_events "
                  "(node, timestamp_ns, event, IFNULL(pid, -1), IFNULL(saddr, ''), IFNULL(sport, -1), "
                  "IFNULL(daddr, ''), IFNULL(dport, -1), IFNULL(seq, -1))",
    "sched_events": "CREATE UNIQUE INDEX IF NOT EXISTS merge_identity_sched ON sched_events "
                    "(node, timestamp_ns, pid, IFNULL(tid, -1), event)",
}
TABLES = ("nccl_events", "tcp_events", "sched_events", "processes", "communicators", "clock_samples")


class MergeError(RuntimeError):
    """One line for 'nccl-exporter: error: ...'."""


@dataclass
class Report:
    inputs: int = 0
    added: dict = field(default_factory=lambda: {t: 0 for t in TABLES})
    offered: dict = field(default_factory=lambda: {t: 0 for t in TABLES})
    nodes: int = 0
    skew: list = field(default_factory=list)
    seconds: float = 0.0


def parse_renames(specs) -> list[tuple[str | None, str, str]]:
    """'[FILE:]OLD=NEW' -> (file or None, old, new)."""
    out = []
    for spec in specs or ():
        left, eq, new = spec.rpartition("=")
        if not eq or not left or not new:
            raise MergeError(f"--rename {spec!r}: expected OLD=NEW or FILE:OLD=NEW")
        path, colon, old = left.rpartition(":")
        out.append((path if colon else None, old, new))
    return out


def _meta(conn, schema="main") -> dict:
    try:
        return dict(conn.execute(f"SELECT key, value FROM {schema}.meta"))
    except sqlite3.DatabaseError:
        return {}


def _open_input(path: str, tmpdir: str) -> str:
    """A path holding `path` at SCHEMA_VERSION: itself, or a migrated temporary copy."""
    if not os.path.isfile(path):
        raise MergeError(f"{path}: no such file")
    try:
        conn = sqlite3.connect(_uri(path) + "?mode=ro", uri=True)
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        conn.close()
    except sqlite3.DatabaseError as e:
        raise MergeError(f"{path}: not an nccl-exporter recording ({e})") from None
    if not version or "nccl_events" not in tables:
        raise MergeError(f"{path}: not an nccl-exporter recording (no schema version or no nccl_events table)")
    if version > SCHEMA_VERSION:
        raise MergeError(f"{path}: schema version {version} is newer than this nccl-exporter ({SCHEMA_VERSION})")
    if version == SCHEMA_VERSION:
        return path
    copy = os.path.join(tmpdir, f"v{version}-{len(os.listdir(tmpdir))}.db")
    src = sqlite3.connect(_uri(path) + "?mode=ro", uri=True)
    dst = sqlite3.connect(copy)
    src.backup(dst)
    src.close()
    migrate(dst)
    dst.close()
    return copy


def _uri(path: str) -> str:
    return "file:" + urllib.parse.quote(os.path.abspath(path))


def _columns(conn, schema, table) -> list[str]:
    return [r[1] for r in conn.execute(f"PRAGMA {schema}.table_info({table})")]


def merge(out: str, inputs: list[str], renames=(), align: bool = True) -> Report:
    """Merge `inputs` into `out` (created, or added to). Built in `out`.partial and renamed at the
    end: an interrupted merge leaves `out` as it was."""
    t0 = time.monotonic()
    rep = Report()
    renames = parse_renames(renames) if renames and isinstance(next(iter(renames)), str) else list(renames)
    if not inputs:
        raise MergeError("no input recordings")
    if any(os.path.abspath(p) == os.path.abspath(out) for p in inputs):
        raise MergeError(f"{out}: the output is also an input")
    work = out + ".partial"
    tmpdir = tempfile.mkdtemp(prefix="nccl-merge-")
    conn = None
    try:
        try:
            if os.path.exists(work):
                os.unlink(work)
            if os.path.exists(out):
                shutil.copyfile(_open_input(out, tmpdir), work)
            conn = sqlite3.connect(_uri(work), uri=True, isolation_level=None)
            # A scratch file renamed at the end: no journal needed (a crash leaves only the .partial).
            conn.execute("PRAGMA journal_mode = OFF")
            conn.execute("PRAGMA synchronous = OFF")
            conn.execute("PRAGMA cache_size = -262144")  # KiB
            conn.execute("PRAGMA temp_store = MEMORY")
            migrate(conn)
            for sql in IDENTITY.values():
                conn.execute(sql)
            # The other indexes are rebuilt once at the end (sorted builds beat random inserts).
            later = list(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL "
                                      "AND name NOT LIKE 'merge_identity_%'"))
            for name, _ in later:
                conn.execute(f"DROP INDEX {name}")
        except (sqlite3.DatabaseError, OSError, RuntimeError) as e:
            raise MergeError(f"cannot write {out}: {e}") from None
        for path in inputs:
            _merge_one(conn, path, _open_input(path, tmpdir), renames, rep)
            rep.inputs += 1
        rep.nodes = conn.execute("SELECT COUNT(DISTINCT node) FROM nodes").fetchone()[0]
        for _, sql in later:
            conn.execute(sql)
        for sql in DEFERRED_INDEXES:
            conn.execute(sql)
        conn.execute("BEGIN")
        conn.execute("DELETE FROM clock_skew")
        if align:
            from exporter.tools.analysis import skew

            rep.skew = list(skew.estimate(conn).values())
            conn.executemany("INSERT INTO clock_skew VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [o.row() for o in rep.skew])
        conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [
            ("node", "(merged)"), ("schema_version", str(SCHEMA_VERSION)),
            ("merged_ns", str(time.time_ns())), ("aligned", "1" if align else "0")])
        conn.execute("COMMIT")
        conn.execute("PRAGMA journal_mode = DELETE")
        conn.close()
        conn = None
        os.replace(work, out)
    finally:
        if conn is not None:
            conn.close()
        if os.path.exists(work):
            os.unlink(work)
        shutil.rmtree(tmpdir, ignore_errors=True)
    rep.seconds = time.monotonic() - t0
    return rep


def _merge_one(conn, label: str, path: str, renames, rep: Report) -> None:
    conn.execute("ATTACH DATABASE ? AS src", (_uri(path) + "?mode=ro",))  # inputs are never written
    try:
        mapping = {old: new for f, old, new in renames
                   if f is None or os.path.abspath(f) == os.path.abspath(label)}
        meta = _meta(conn, "src")
        # This input's nodes and their identities: a merged input has a nodes table; a recording, meta.
        ids = list(conn.execute("SELECT node, machine_id, boot_id, hostname, start_ns, end_ns, source "
                                "FROM src.nodes"))
        if not ids:
            names = {meta["node"]} if meta.get("node") and meta["node"] != "(merged)" else \
                {r[0] for r in conn.execute("SELECT DISTINCT node FROM src.nccl_events")}
            names.discard("")
            names.discard("(merged)")
            end = meta.get("end_ns") or meta.get("last_commit_ns")
            ids = [(n, meta.get("machine_id", ""), meta.get("boot_id", ""), meta.get("hostname"),
                    int(meta["start_ns"]) if meta.get("start_ns") else None, int(end) if end else None, label)
                   for n in sorted(names)]
        ids = [(mapping.get(n, n), *rest) for n, *rest in ids]
        for node, machine, *_ in ids:
            if not machine:
                continue
            clash = conn.execute("SELECT machine_id, source FROM nodes WHERE node = ? AND machine_id != '' "
                                 "AND machine_id != ?", (node, machine)).fetchone()
            if clash:
                raise MergeError(f"{label}: node name {node!r} is already used by another machine (machine id "
                                 f"{clash[0][:12]}… from {clash[1]}, here {machine[:12]}…): rename one with "
                                 f"--rename {label}:{node}=NEW")
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
                rep.added[table] += conn.total_changes - before
                rep.offered[table] += conn.execute(f"SELECT COUNT(*) FROM src.{table}").fetchone()[0]
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    finally:
        conn.execute("DETACH DATABASE src")

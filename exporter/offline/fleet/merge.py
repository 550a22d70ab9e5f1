"""Merge recordings of many nodes into one file (`nccl-exporter merge -o OUT.db IN.db...`).

Every row keeps its node. Every input is checked before anything is
written. Rows are deduplicated by a row identity (below),
so merging the same recording twice, two copies of it, or overlapping
windows of one node adds nothing. Inputs of an older schema version are
migrated on a temporary copy (the input is never written). Two inputs that
give one node name to different machines (`meta.machine_id`) are refused
unless one is renamed (`--rename [FILE:]OLD=NEW`). The clock offsets
estimated from the data (exporter/offline/analysis/skew.py) are stored in
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
TABLES = ("nccl_events", "tcp_events", "sched_events", "processes", "communicators", "clock_samples",
          "nccl_peer_waits")


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
    phases: dict = field(default_factory=dict)  # seconds: check, rows, indexes, skew


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


def _uri(path: str) -> str:
    return "file:" + urllib.parse.quote(os.path.abspath(path))


def _columns(conn, schema, table) -> list[str]:
    return [r[1] for r in conn.execute(f"PRAGMA {schema}.table_info({table})")]


def _identities(path: str, label: str, mapping: dict) -> list[tuple]:
    """The nodes an input holds: (node after renaming, machine_id, boot_id, hostname, start, end, source)."""
    conn = sqlite3.connect(_uri(path) + "?mode=ro", uri=True)
    try:
        meta = _meta(conn)
        ids = []
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'nodes'").fetchone():
            ids = list(conn.execute("SELECT node, machine_id, boot_id, hostname, start_ns, end_ns, source FROM nodes"))
        if not ids:
            names = {meta["node"]} if meta.get("node") and meta["node"] != "(merged)" else \
                {r[0] for r in conn.execute("SELECT DISTINCT node FROM nccl_events")}
            end = meta.get("end_ns") or meta.get("last_commit_ns")
            ids = [(n, meta.get("machine_id", ""), meta.get("boot_id", ""), meta.get("hostname"),
                    int(meta["start_ns"]) if meta.get("start_ns") else None, int(end) if end else None, label)
                   for n in sorted(names)]
    finally:
        conn.close()
    return [(mapping.get(n, n), *rest) for n, *rest in ids]


def _mapping(renames, label: str) -> dict:
    return {old: new for f, old, new in renames if f is None or os.path.abspath(f) == os.path.abspath(label)}


def merge(out: str, inputs: list[str], renames=(), align: bool = True, query_indexes: bool = False) -> Report:
    """Merge `inputs` into `out`. Every input is checked (readable, schema, node identities) before
    anything is written, so a refused merge leaves `out` as it was. A new `out` is built in
    `out`.partial and renamed at the end; an existing one is added to in place, one transaction per
    input (an interrupted merge keeps the inputs done so far; running it again finishes it)."""
    t0 = time.monotonic()
    rep = Report()
    renames = parse_renames(renames) if renames and isinstance(next(iter(renames)), str) else list(renames)
    if not inputs:
        raise MergeError("no input recordings")
    if any(os.path.abspath(p) == os.path.abspath(out) for p in inputs):
        raise MergeError(f"{out}: the output is also an input")
    tmpdir = tempfile.mkdtemp(prefix="nccl-merge-")
    fresh = not os.path.exists(out)
    work = out + ".partial" if fresh else out
    conn = None
    try:
        # 1. Check everything first.
        seen: dict[str, tuple] = {}
        if not fresh:
            _open_input(out, tmpdir)  # a recording of a version we can read
            for node, machine, *_rest, source in _identities(out, out, {}):
                if machine:
                    seen[node] = (machine, source)
        plan = []
        for label in inputs:
            path = _open_input(label, tmpdir)
            try:
                ids = _identities(path, label, _mapping(renames, label))
            except (sqlite3.DatabaseError, ValueError) as e:
                raise MergeError(f"{label}: cannot read its nodes ({e})") from None
            for node, machine, *_rest in ids:
                if not machine:
                    continue
                other = seen.get(node)
                if other and other[0] != machine:
                    raise MergeError(f"{label}: node name {node!r} is already used by another machine (machine id "
                                     f"{other[0][:12]}… from {other[1]}, here {machine[:12]}…): rename one with "
                                     f"--rename {label}:{node}=NEW")
                seen.setdefault(node, (machine, label))
            plan.append((label, path, ids))
        rep.phases["check"] = time.monotonic() - t0
        # 2. Write.
        try:
            if fresh and os.path.exists(work):
                os.unlink(work)
            conn = sqlite3.connect(_uri(work), uri=True, isolation_level=None)
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
            if fresh:  # the other indexes are built once at the end (a sorted build beats random inserts)
                later = list(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index' "
                                          "AND sql IS NOT NULL AND name NOT LIKE 'merge_identity_%'"))
                for name, _ in later:
                    conn.execute(f"DROP INDEX {name}")
        except (sqlite3.DatabaseError, OSError, RuntimeError) as e:
            raise MergeError(f"cannot write {out}: {e}") from None
        for label, path, ids in plan:
            try:
                _merge_one(conn, label, path, ids, _mapping(renames, label), rep)
            except sqlite3.DatabaseError as e:
                raise MergeError(f"{label}: {e}") from None
            rep.inputs += 1
        rep.nodes = conn.execute("SELECT COUNT(DISTINCT node) FROM nodes").fetchone()[0]
        rep.phases["rows"] = time.monotonic() - t0 - sum(rep.phases.values())
        # The (comm_id_hash, op, seq) index serves the skew estimate and stragglers; the others
        # serve time-window and slow-call queries (they answer without, by scanning).
        for _, sql in later:
            if query_indexes or "nccl_events_comm_seq" in sql:
                conn.execute(sql)
        for sql in DEFERRED_INDEXES:
            if query_indexes or "nccl_events_comm_seq" in sql:
                conn.execute(sql)
        rep.phases["indexes"] = time.monotonic() - t0 - sum(rep.phases.values())
        conn.execute("BEGIN")
        conn.execute("DELETE FROM clock_skew")
        if align:
            from exporter.offline.analysis import skew

            rep.skew = list(skew.estimate(conn).values())
            conn.executemany("INSERT INTO clock_skew VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [o.row() for o in rep.skew])
        conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [
            ("node", "(merged)"), ("schema_version", str(SCHEMA_VERSION)),
            ("merged_ns", str(time.time_ns())), ("aligned", "1" if align else "0")])
        conn.execute("COMMIT")
        rep.phases["skew"] = time.monotonic() - t0 - sum(rep.phases.values())
        if not fresh:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode = DELETE")
        conn.close()
        conn = None
        if fresh:
            os.replace(work, out)
    finally:
        if conn is not None:
            conn.close()
        if fresh and os.path.exists(work):
            os.unlink(work)
        shutil.rmtree(tmpdir, ignore_errors=True)
    rep.seconds = time.monotonic() - t0
    return rep


def _merge_one(conn, label: str, path: str, ids, mapping: dict, rep: Report) -> None:
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
                rep.added[table] += conn.total_changes - before
                rep.offered[table] += conn.execute(f"SELECT COUNT(*) FROM src.{table}").fetchone()[0]
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    finally:
        conn.execute("DETACH DATABASE src")

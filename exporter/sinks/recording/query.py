"""Reading a recording: the one guarded read-only query (`ReadOnlyQuery`), used by
`nccl-exporter query`, the node query endpoint (sinks/recording/endpoint.py) and the
MCP server (offline/mcp_server.py).

The database is opened with a `mode=ro` URI, and an authorizer refuses
anything that writes (INSERT/UPDATE/DELETE, CREATE/DROP/ALTER, temp tables
included), ATTACH/DETACH and PRAGMAs that set a value, before the statement
runs; VACUUM (which the authorizer never sees) is refused by its first word.
`Limits` bound what one query may take: a time limit (a progress handler),
the longest string or blob (SQLITE_LIMIT_LENGTH: zeroblob(), printf('%.*c'),
group_concat() end with "string or blob too big"), the columns of a row
(SQLITE_LIMIT_COLUMN) and the page cache, which is also what a sort or a
recursive query keeps in memory before spilling to a temporary file.
Output formats are the tools' (exporter/cli/common/output.py).
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
import urllib.parse
from dataclasses import dataclass


class QueryError(RuntimeError):
    """One line for 'nccl-exporter: error: ...' (exit 2). `kind`: refused, time, sql, open."""

    def __init__(self, message: str, kind: str = "sql"):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Limits:
    """What one query may take; None: SQLite's own limit."""

    time_s: float | None = None       # wall time, checked every PROGRESS_STEPS VM steps
    value_bytes: int | None = None    # the longest string or blob (SQLITE_LIMIT_LENGTH)
    columns: int | None = None        # columns of a result row (SQLITE_LIMIT_COLUMN)
    cache_kib: int | None = None      # page cache, and a sort's memory before it spills


# `nccl-exporter query` on one's own file: SQLite's limits, no time limit.
LOCAL = Limits()
# Queries from the network and from assistants (the node endpoint, MCP): a row is at
# most COLUMNS x VALUE bytes inside SQLite (and once more as Python objects), plus
# the cache: the per-query memory the endpoint's concurrency bound multiplies.
SHARED = Limits(time_s=10.0, value_bytes=1 << 20, columns=128, cache_kib=4096)
PROGRESS_STEPS = 10_000


# PRAGMAs that only read, even with an argument.
READ_PRAGMAS = {
    "table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
    "foreign_key_list", "integrity_check", "quick_check", "collation_list", "function_list",
    "pragma_list", "database_list", "compile_options", "module_list",
}
# PRAGMAs that change something even without an argument.
WRITE_PRAGMAS_BARE = {"wal_checkpoint", "optimize", "incremental_vacuum", "shrink_memory"}

_READ_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}
_RECURSIVE = getattr(sqlite3, "SQLITE_RECURSIVE", 33)

_AUTH_ACTIONS = (
    "CREATE_INDEX", "CREATE_TABLE", "CREATE_TEMP_INDEX", "CREATE_TEMP_TABLE", "CREATE_TEMP_TRIGGER",
    "CREATE_TEMP_VIEW", "CREATE_TRIGGER", "CREATE_VIEW", "DELETE", "DROP_INDEX", "DROP_TABLE",
    "DROP_TEMP_INDEX", "DROP_TEMP_TABLE", "DROP_TEMP_TRIGGER", "DROP_TEMP_VIEW", "DROP_TRIGGER",
    "DROP_VIEW", "INSERT", "PRAGMA", "READ", "SELECT", "TRANSACTION", "UPDATE", "ATTACH", "DETACH",
    "ALTER_TABLE", "REINDEX", "ANALYZE", "CREATE_VTABLE", "DROP_VTABLE", "FUNCTION", "SAVEPOINT",
    "RECURSIVE",
)
_ACTION_NAMES = {getattr(sqlite3, "SQLITE_" + n): n.replace("_", " ")
                 for n in _AUTH_ACTIONS if hasattr(sqlite3, "SQLITE_" + n)}


class _Guard:
    """sqlite3 authorizer: allows reading only; remembers why it refused."""

    def __init__(self):
        self.refused: str | None = None
        self.selecting = False

    def __call__(self, action, arg1, arg2, _db, _trigger):
        if action in _READ_ACTIONS or action == _RECURSIVE:
            self.selecting |= action == sqlite3.SQLITE_SELECT
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_UPDATE and self.selecting and arg1 in ("sqlite_master", "sqlite_schema"):
            # A table-valued function (pragma_table_info(...)) or an eponymous virtual
            # table (dbstat) is being set up for this SELECT: SQLite asks to update
            # sqlite_master's columns for it; a SELECT cannot write, and the file is mode=ro.
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA:
            name = (arg1 or "").lower()
            if name in READ_PRAGMAS or (arg2 is None and name not in WRITE_PRAGMAS_BARE):
                return sqlite3.SQLITE_OK
            self.refused = f"PRAGMA {name}" + (f" = {arg2}" if arg2 is not None else "")
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_TRANSACTION:
            return sqlite3.SQLITE_OK
        what = _ACTION_NAMES.get(action, f"action {action}")
        self.refused = what.upper() + (f" {arg1}" if arg1 else "")
        return sqlite3.SQLITE_DENY


_COMMENTS = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)


def _first_word(sql: str) -> str:
    m = re.match(r"\s*([A-Za-z]+)", _COMMENTS.sub(" ", sql))
    return m.group(1).upper() if m else ""


def open_readonly(path: str) -> sqlite3.Connection:
    """Open a recording read-only; QueryError if it is missing or not a recording."""
    if not os.path.exists(path):
        raise QueryError(f"{path}: no such file", "open")
    if os.path.isdir(path):
        raise QueryError(f"{path}: is a directory, not a recording", "open")
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
    conn = None
    try:
        conn = sqlite3.connect(uri, uri=True)
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as e:
        if conn is not None:
            conn.close()
        raise QueryError(f"{path}: not an nccl-exporter recording ({e})", "open") from None
    if not version or "nccl_events" not in tables:
        conn.close()
        raise QueryError(f"{path}: not an nccl-exporter recording (no schema version or no nccl_events "
                         "table)", "open")
    return conn


class ReadOnlyQuery:
    """One guarded read-only statement on a recording: `names`, then the rows by iteration.

        with ReadOnlyQuery(path, sql, SHARED) as q:
            q.names; for row in q: ...

    Every failure is a QueryError with a one-line message and a kind: "open" (no
    such file, not a recording), "refused" (a write, VACUUM, ...), "time" (the
    time limit), "sql" (anything else SQLite says, "string or blob too big" among it).
    Rows are fetched one at a time, so the caller decides how many it holds."""

    def __init__(self, path: str, sql: str, limits: Limits = LOCAL):
        self.limits = limits
        self.deadline = None if limits.time_s is None else time.monotonic() + limits.time_s
        if _first_word(sql) == "VACUUM":
            raise QueryError("refused: VACUUM writes a database (queries are read-only)", "refused")
        self.conn = open_readonly(path)
        try:
            self._limit(limits)
            self.guard = _Guard()
            self.conn.set_authorizer(self.guard)
            if self.deadline is not None:
                self.conn.set_progress_handler(self._past_deadline, PROGRESS_STEPS)
            try:
                self.cur = self.conn.execute(sql)
            except Exception as e:  # noqa: BLE001 - mapped to one line
                raise self._error(e) from None
            self.names = [d[0] for d in self.cur.description or ()]
        except BaseException:
            self.conn.close()
            raise

    def _limit(self, limits: Limits) -> None:
        if limits.value_bytes is not None:
            self.conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, limits.value_bytes)
            self.conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, min(limits.value_bytes, 1 << 20))
        if limits.columns is not None:
            self.conn.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, limits.columns)
        if limits.cache_kib is not None:
            self.conn.execute(f"PRAGMA cache_size = -{int(limits.cache_kib)}")
            self.conn.execute("PRAGMA temp_store = FILE")  # sorts and recursive queries spill to disk

    def _past_deadline(self) -> int:
        return 1 if time.monotonic() > self.deadline else 0

    def timed_out(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def _error(self, e: BaseException) -> QueryError:
        if self.guard.refused:
            return QueryError(f"refused: {self.guard.refused} (queries are read-only)", "refused")
        if isinstance(e, sqlite3.OperationalError) and "interrupt" in str(e) and self.timed_out():
            return QueryError(f"time limit of {self.limits.time_s:g} s reached", "time")
        if "not authorized" in str(e):
            return QueryError("refused: not authorized (extension loading is off; queries are read-only)",
                              "refused")
        if isinstance(e, (sqlite3.Error, sqlite3.Warning, OverflowError, ValueError, MemoryError)):
            return QueryError(f"SQL error: {e}", "sql")
        raise e

    def __iter__(self):
        while True:
            try:
                row = self.cur.fetchone()
            except Exception as e:  # noqa: BLE001
                raise self._error(e) from None
            if row is None:
                return
            yield row

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "ReadOnlyQuery":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run(path: str, sql: str, limits: Limits = LOCAL) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of one read-only statement."""
    names, rows, _ = first_rows(path, sql, limits)
    return names, rows


def first_rows(path: str, sql: str, limits: Limits = LOCAL, max_rows: int | None = None
               ) -> tuple[list[str], list[tuple], bool]:
    """(column names, at most max_rows rows, cut: there were more) of one read-only statement."""
    with ReadOnlyQuery(path, sql, limits) as q:
        rows = []
        for row in q:
            if max_rows is not None and len(rows) >= max_rows:
                return q.names, rows, True
            rows.append(row)
        return q.names, rows, False


# --- questions asked of many recordings as SQL -------------------------------------
# The nodes' query endpoints answer SQL only, so the MCP server's fixed questions
# travel as SQL text: written here, beside the schema they read.

def slowest_calls_sql(limit: int, op: str | None = None) -> str:
    """The longest NCCL calls (op: a contract.OPS name, already checked), slowest first."""
    where = "kind = 'call'" + (f" AND op = '{op}'" if op else "")
    return ("SELECT op, rank, nranks, comm_id_hash, seq, duration_ns / 1e6 AS ms, timestamp_ns "
            f"FROM nccl_events WHERE {where} ORDER BY duration_ns DESC LIMIT {int(limit)}")


def retransmits_by_link_sql(limit: int) -> str:
    """TCP retransmits per link and owner, most first."""
    return ("SELECT rank, pid, saddr || ':' || sport AS local, daddr || ':' || dport AS remote, "
            "COUNT(*) AS retransmits, (MAX(timestamp_ns) - MIN(timestamp_ns)) / 1e9 AS over_s "
            "FROM tcp_events WHERE event = 'tcp_retransmit_skb' "
            f"GROUP BY rank, pid, saddr, sport, daddr, dport ORDER BY retransmits DESC LIMIT {int(limit)}")

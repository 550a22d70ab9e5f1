"""Reading a recording: read-only SQL (`nccl-exporter query DB "SQL"`).

The database is opened with a `mode=ro` URI, and an authorizer refuses
anything that writes (INSERT/UPDATE/DELETE, CREATE/DROP/ALTER, temp tables
included), ATTACH/DETACH and PRAGMAs that set a value, before the statement
runs. Output formats are the tools' (exporter/tools/output.py).
"""

from __future__ import annotations

import os
import re
import sqlite3
import urllib.parse


class QueryError(RuntimeError):
    """One line for 'nccl-exporter: error: ...' (exit 2)."""


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

    def __call__(self, action, arg1, arg2, _db, _trigger):
        if action in _READ_ACTIONS or action == _RECURSIVE:
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
        raise QueryError(f"{path}: no such file")
    if os.path.isdir(path):
        raise QueryError(f"{path}: is a directory, not a recording")
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as e:
        raise QueryError(f"{path}: not an nccl-exporter recording ({e})") from None
    if not version or "nccl_events" not in tables:
        conn.close()
        raise QueryError(f"{path}: not an nccl-exporter recording (no schema version or no nccl_events table)")
    return conn


def run(path: str, sql: str) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of one read-only statement."""
    if _first_word(sql) == "VACUUM":
        raise QueryError("refused: VACUUM writes a database; query is read-only")
    conn = open_readonly(path)
    guard = _Guard()
    conn.set_authorizer(guard)
    try:
        cur = conn.execute(sql)
        rows = cur.fetchall()
        names = [d[0] for d in cur.description or ()]
    except sqlite3.DatabaseError as e:
        if guard.refused:
            raise QueryError(f"refused: {guard.refused} (query is read-only)") from None
        raise QueryError(f"SQL error: {e}") from None
    except (sqlite3.Warning, sqlite3.ProgrammingError) as e:
        raise QueryError(f"SQL error: {e}") from None
    finally:
        conn.close()
    return names, rows

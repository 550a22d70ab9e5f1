"""The read side of a recording: every question the tools ask of one, as typed rows.

    with Recording.open("job.db") as rec:      # read-only; ReadError: one line
        ranks = rec.process_ranks()
        for call in rec.calls(): ...

The schema (schema.py, docs/schema.md) is written on one side and read here,
so a column has one spelling and each rule one place. Analysis (offline/
analysis), export, fleet and MCP read through `Recording`; the SQL a user
types goes through query.py instead. A `Recording` also wraps a connection
the caller opened (merge reads the file it is writing): `Recording(conn)`.

Older recordings lack later tables and columns: every method answers for
what the file has (an empty answer, or NULL for a missing column), and
`has_table` / `columns` say what is there.
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from typing import Iterable, Iterator, NamedTuple

from exporter.sinks.recording import query


class ReadError(RuntimeError):
    """A recording cannot be opened: one line (no such file, not a recording)."""


def is_local_comm(comm: str | None) -> bool:
    """A communicator without a job-wide id: made before the agent attached
    (`local-<pid>-<n>`) or not yet named (`unknown`; docs/communicators.md)."""
    return not comm or comm == "unknown" or comm.startswith("local-")


# --- typed rows -------------------------------------------------------------------

class Call(NamedTuple):
    """One nccl_events row (the columns the tools read)."""
    timestamp_ns: int
    duration_ns: int
    op: str
    rank: int | None
    nranks: int | None
    comm: str | None          # comm_id_hash: the `comm` label
    seq: int | None
    count: int | None
    bytes: int | None
    node: str
    pid: int
    tid: int
    kind: str                 # call | lifecycle
    runq_wait_ns: int | None  # None: not measured (or a recording older than the column)
    previous_end_ns: int | None = None  # calls(previous_end=True): the thread's previous call's end


class CallCounts(NamedTuple):
    """What the calls of a recording were on (explain's 'no collectives')."""
    calls: int
    nodes: int
    local: int       # calls on communicators without a job-wide id (is_local_comm)
    comms: int       # communicators with a job-wide id


class SeqCalls(NamedTuple):
    """Calls of one sequence number of a communicator's op (the skew estimate)."""
    seq: int
    node: str
    start_ns: int
    end_ns: int


class TcpEvent(NamedTuple):
    timestamp_ns: int
    event: str
    node: str
    pid: int | None
    saddr: str | None
    sport: int | None
    daddr: str | None
    dport: int | None
    state: str | None


class WaitInterval(NamedTuple):
    """One sched_intervals row (`--sched totals`): what a process's threads of one kind
    waited runnable in [timestamp_ns, timestamp_ns + interval_ns]."""
    timestamp_ns: int
    interval_ns: int
    node: str
    pid: int
    thread: str
    runq_wait_ns: int


class Wait(NamedTuple):
    """One sched_events row: a thread runnable but not running."""
    timestamp_ns: int
    duration_ns: int
    node: str
    pid: int
    tid: int | None
    thread: str | None   # caller | proxy | other; None: a recording older than the column
    name: str | None     # the thread's name (sched_events.comm)


class PeerWaits(NamedTuple):
    """nccl_peer_waits summed per (communicator, rank, peer, direction, phase)."""
    nccl_comm_hash: str
    rank: int | None
    peer: int
    direction: str       # send | recv
    phase: str
    wall_ns: int
    bytes: int
    operations: int      # distinct operations (op, seq, kind)
    node: str | None
    pid: int
    worst_wall_ns: int   # the largest one operation's wall_ns


# --- the reader -------------------------------------------------------------------

class Recording:
    """A recording opened for reading (or a connection to one)."""

    def __init__(self, conn: sqlite3.Connection, path: str | None = None):
        self.conn = conn
        self.path = path
        self._tables: set[str] | None = None
        self._ranks: dict[tuple, int] | None = None

    @classmethod
    def open(cls, path: str) -> "Recording":
        """Read-only (a `mode=ro` URI); ReadError, one line, when it is missing or not a recording."""
        try:
            return cls(query.open_readonly(path), path)
        except query.QueryError as e:
            raise ReadError(str(e)) from None

    @classmethod
    def open_copy(cls, path: str) -> "Recording":
        """A file nothing writes (a downloaded copy, whatever its journal mode): opened
        immutable, so no -wal or -shm appears beside it; no checks (sqlite3 errors)."""
        return cls(sqlite3.connect(f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro&immutable=1",
                                   uri=True), path)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Recording":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- what the file has ------------------------------------------------------

    def has_table(self, name: str) -> bool:
        if self._tables is None:
            self._tables = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return name in self._tables

    def columns(self, table: str) -> set[str]:
        return {r[1] for r in self.conn.execute(f"PRAGMA table_info({table})")}

    @property
    def version(self) -> int:
        return self.conn.execute("PRAGMA user_version").fetchone()[0]

    def meta(self) -> dict[str, str]:
        """The meta table (node, start_ns, machine_id, ...); {} without one."""
        if not self.has_table("meta"):
            return {}
        return dict(self.conn.execute("SELECT key, value FROM meta"))

    def nodes(self, table: str = "nccl_events") -> list[str]:
        """The nodes with rows in `table`, in name order; [] without the table."""
        if not self.has_table(table):
            return []
        return [r[0] for r in self.conn.execute(f"SELECT DISTINCT node FROM {table} ORDER BY node")]

    def first_times(self, table: str) -> dict[str, int]:
        """node -> its earliest timestamp_ns in `table`; {} without the table."""
        if not self.has_table(table):
            return {}
        return {n: t for n, t in self.conn.execute(f"SELECT node, MIN(timestamp_ns) FROM {table} GROUP BY node")
                if t is not None}

    # --- processes: the one rank rule -------------------------------------------------

    def launcher_ranks(self) -> dict[tuple[str, int], int]:
        """(node, pid) -> the rank its launcher gave it (torchrun, Slurm, MPI), where it did."""
        if not self.has_table("processes"):
            return {}
        return {(n, p): r for n, p, r in self.conn.execute(
            "SELECT node, pid, launcher_rank FROM processes WHERE launcher_rank IS NOT NULL")}

    def process_ranks(self) -> dict[tuple[str, int], int]:
        """(node, pid) -> the process's rank, by the one rule every tool uses (docs/schema.md;
        the recorder writes tcp_events.rank and sched_events.rank by it, rows.py): the
        launcher's rank, else its rank in the largest communicator it made calls on
        (ties: the lowest rank).

        Unknown: a process with neither is absent (`rank_of` answers None), and every
        tool shows it as `?` ("rank ?"), never a rank guessed from elsewhere."""
        if self._ranks is None:
            best: dict[tuple, tuple] = {}
            for node, pid, rank, nranks in self.conn.execute(
                    "SELECT node, pid, rank, MAX(nranks) FROM nccl_events WHERE rank >= 0 GROUP BY node, pid, rank"):
                if (node, pid) not in best or (nranks or 0) > best[(node, pid)][0]:
                    best[(node, pid)] = (nranks or 0, rank)
            self._ranks = {k: v[1] for k, v in best.items()}
            self._ranks.update(self.launcher_ranks())
        return self._ranks

    def rank_of(self, node: str, pid: int) -> int | None:
        """The process's rank (process_ranks), None when unknown."""
        return self.process_ranks().get((node, pid))

    # --- calls -------------------------------------------------------------------

    def calls(self, kind: str | None = None, previous_end: bool = False,
              order: str = "node, pid, timestamp_ns") -> Iterator[Call]:
        """nccl_events rows (kind: 'call' or 'lifecycle'; None: both) in `order` (the
        timeline's: node, pid, time; "" for storage order). previous_end: each row also
        carries the end of its thread's previous call (None for its first)."""
        runq = "runq_wait_ns" if "runq_wait_ns" in self.columns("nccl_events") else "NULL"
        prev = ("LAG(timestamp_ns + duration_ns) OVER (PARTITION BY node, pid, tid ORDER BY timestamp_ns)"
                if previous_end else "NULL")
        sql = (f"SELECT timestamp_ns, duration_ns, op, rank, nranks, comm_id_hash, seq, count, bytes, node, pid, "
               f"tid, kind, {runq}, {prev} FROM nccl_events" + (" WHERE kind = ?" if kind else "")
               + (f" ORDER BY {order}" if order else ""))
        return map(Call._make, self.conn.execute(sql, (kind,) if kind else ()))

    def call_counts(self) -> CallCounts:
        """The calls (kind 'call'), their nodes, those on local communicators, the job-wide ones."""
        row = self.conn.execute(
            "SELECT COUNT(*), COUNT(DISTINCT node), "
            "SUM(comm_id_hash IS NULL OR comm_id_hash = 'unknown' OR comm_id_hash LIKE 'local-%'), "
            "COUNT(DISTINCT CASE WHEN comm_id_hash NOT LIKE 'local-%' AND comm_id_hash != 'unknown' "
            "THEN comm_id_hash END) FROM nccl_events WHERE kind = 'call'").fetchone()
        return CallCounts(*(v or 0 for v in row))

    def count_calls(self) -> int:
        """Every nccl_events row."""
        return self.conn.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0]

    def calls_by_comm(self, ops: Iterable[str]) -> list[tuple[str, str | None, int]]:
        """(op, comm, calls) of the calls of `ops`, the most calls first."""
        ops = sorted(ops)
        return self.conn.execute(
            f"SELECT op, comm_id_hash, COUNT(*) FROM nccl_events WHERE kind = 'call' "
            f"AND op IN ({','.join('?' * len(ops))}) GROUP BY op, comm_id_hash ORDER BY COUNT(*) DESC",
            ops).fetchall()

    def comm_ops(self) -> list[tuple[str, str]]:
        """The distinct (comm, op) of the calls: one seek each on the (comm_id_hash, op, seq)
        index where there is one."""
        out = []
        row = self.conn.execute("SELECT comm_id_hash, op FROM nccl_events WHERE comm_id_hash IS NOT NULL "
                                "ORDER BY comm_id_hash, op LIMIT 1").fetchone()
        while row is not None:
            out.append(row)
            row = self.conn.execute("SELECT comm_id_hash, op FROM nccl_events WHERE (comm_id_hash, op) > (?, ?) "
                                    "ORDER BY comm_id_hash, op LIMIT 1", row).fetchone()
        return out

    def seq_range(self, comm: str, op: str) -> tuple[int, int] | None:
        """The lowest and highest sequence number of a communicator's op; None: none."""
        lo = self.conn.execute("SELECT seq FROM nccl_events WHERE comm_id_hash = ? AND op = ? AND seq IS NOT NULL "
                               "ORDER BY seq LIMIT 1", (comm, op)).fetchone()
        hi = self.conn.execute("SELECT seq FROM nccl_events WHERE comm_id_hash = ? AND op = ? AND seq IS NOT NULL "
                               "ORDER BY seq DESC LIMIT 1", (comm, op)).fetchone()
        return None if lo is None else (lo[0], hi[0])

    def calls_at(self, comm: str, op: str, seqs: list[int]) -> Iterator[SeqCalls]:
        """The calls (kind 'call') of these sequence numbers of a communicator's op."""
        for i in range(0, len(seqs), 500):
            chunk = seqs[i:i + 500]
            yield from map(SeqCalls._make, self.conn.execute(
                f"SELECT seq, node, timestamp_ns, timestamp_ns + duration_ns FROM nccl_events "
                f"WHERE comm_id_hash = ? AND op = ? AND seq IN ({','.join('?' * len(chunk))}) AND kind = 'call'",
                (comm, op, *chunk)))

    def span(self, node: str, pid: int) -> int:
        """A process's time in the recording: its last call's end - its first call's start (0: none)."""
        row = self.conn.execute("SELECT MAX(timestamp_ns + duration_ns) - MIN(timestamp_ns) FROM nccl_events "
                                "WHERE node = ? AND pid = ?", (node, pid)).fetchone()
        return (row[0] or 0) if row else 0

    # --- communicators ------------------------------------------------------------------

    def comm_labels(self) -> dict[str, str]:
        """NCCL's commHash -> the `comm` label (comm_id_hash) where the recording knows one."""
        if not self.has_table("communicators"):
            return {}
        return dict(self.conn.execute(
            "SELECT nccl_comm_hash, MIN(comm_id_hash) FROM communicators WHERE nccl_comm_hash IS NOT NULL "
            "AND comm_id_hash NOT LIKE 'local-%' AND comm_id_hash != 'unknown' GROUP BY nccl_comm_hash"))

    # --- the kernel's view: sockets and scheduler ---------------------------------------

    def tcp_events(self, event: str | None = None, order: str = "node, timestamp_ns") -> Iterator[TcpEvent]:
        """tcp_events of sockets with a known owner (pid), optionally of one event, in `order`."""
        sql = ("SELECT timestamp_ns, event, node, pid, saddr, sport, daddr, dport, state FROM tcp_events "
               "WHERE pid IS NOT NULL" + (" AND event = ?" if event else "") + (f" ORDER BY {order}" if order else ""))
        return map(TcpEvent._make, self.conn.execute(sql, (event,) if event else ()))

    def local_addresses(self) -> set[tuple[str, str, int]]:
        """(local address, node, pid) of every owned socket seen."""
        return set(self.conn.execute("SELECT DISTINCT saddr, node, pid FROM tcp_events "
                                     "WHERE saddr IS NOT NULL AND pid IS NOT NULL"))

    def waits(self, threads: tuple[str, ...] | None = None,
              order: str = "node, pid, timestamp_ns") -> Iterator[Wait]:
        """sched_events (runnable, not running), in `order`; threads: only these kinds of
        thread (caller, proxy, other) where the recording tells them apart. [] without the table."""
        if not self.has_table("sched_events"):
            return iter(())
        cols = self.columns("sched_events")
        thread = "thread" if "thread" in cols else "NULL"
        name = "comm" if "comm" in cols else "NULL"
        where, params = "", ()
        if threads and "thread" in cols:
            where, params = f" WHERE thread IN ({','.join('?' * len(threads))})", threads
        return map(Wait._make, self.conn.execute(
            f"SELECT timestamp_ns, duration_ns, node, pid, tid, {thread}, {name} FROM sched_events{where}"
            + (f" ORDER BY {order}" if order else ""), params))

    def wait_intervals(self, threads: tuple[str, ...] | None = None,
                       order: str = "node, pid, timestamp_ns") -> Iterator[WaitInterval]:
        """sched_intervals (`--sched totals`), in `order`; threads: only these kinds of
        thread. [] without the table (schema 9 and older)."""
        if not self.has_table("sched_intervals"):
            return iter(())
        where, params = "", ()
        if threads:
            where, params = f" WHERE thread IN ({','.join('?' * len(threads))})", threads
        return map(WaitInterval._make, self.conn.execute(
            "SELECT timestamp_ns, interval_ns, node, pid, thread, runq_wait_ns FROM sched_intervals"
            + where + (f" ORDER BY {order}" if order else ""), params))

    # --- the profiler plugin's view: GPU intervals and peer waits -------------------------

    def peer_waits(self, op: str | None = None) -> Iterator[PeerWaits]:
        """nccl_peer_waits of known peers, summed per (communicator, rank, peer, direction,
        phase); [] without the table (schema 6 and older)."""
        if not self.has_table("nccl_peer_waits"):
            return iter(())
        where, params = "peer IS NOT NULL" + (" AND op = ?" if op else ""), (op,) if op else ()
        return map(PeerWaits._make, self.conn.execute(
            "SELECT nccl_comm_hash, rank, peer, direction, phase, SUM(wall_ns), SUM(bytes), "
            "COUNT(DISTINCT op || ':' || seq || ':' || kind), MIN(node), MIN(pid), MAX(wall_ns) FROM nccl_peer_waits "
            f"WHERE {where} GROUP BY nccl_comm_hash, rank, peer, direction, phase", params))

    def gpu_time_of_peer_waits(self, op: str | None = None) -> dict[tuple[str, int], int]:
        """(nccl_comm_hash, rank) -> the GPU time (gpu_intervals) of the operations that have
        peer waits; {} without either table."""
        if not (self.has_table("gpu_intervals") and self.has_table("nccl_peer_waits")):
            return {}
        opf = "WHERE op = ?" if op else ""
        return {(c, r): t for c, r, t in self.conn.execute(
            "SELECT w.nccl_comm_hash, w.rank, SUM(g.gpu_duration_ns) FROM (SELECT DISTINCT pid, node, "
            f"nccl_comm_hash, op, seq, kind, rank FROM nccl_peer_waits {opf}) AS w JOIN gpu_intervals AS g "
            "ON g.pid = w.pid AND g.nccl_comm_hash = w.nccl_comm_hash AND g.op = w.op AND g.seq = w.seq "
            "AND g.kind = w.kind AND (g.node IS w.node OR g.node IS NULL OR w.node IS NULL) "
            # one process driving several GPUs holds several ranks of one communicator
            "AND (g.rank IS w.rank OR g.rank IS NULL OR w.rank IS NULL) "
            "GROUP BY w.nccl_comm_hash, w.rank", (op,) if op else ())}

    # --- clocks (merge) ---------------------------------------------------------

    def clock_skew(self) -> list[tuple]:
        """The clock_skew rows merge stored, in CLOCK_SKEW_COLUMNS order; [] without the table."""
        if not self.has_table("clock_skew"):
            return []
        return list(self.conn.execute(f"SELECT {', '.join(CLOCK_SKEW_COLUMNS)} FROM clock_skew"))


CLOCK_SKEW_COLUMNS = ("node", "offset_ns", "reference", "collectives", "residual_ns", "method", "lower_ns",
                      "upper_ns")


def node_name(path: str, default: str) -> str:
    """The node a recording was made on (meta `node`), else `default`."""
    try:
        with Recording.open(path) as rec:
            return rec.meta().get("node") or default
    except (ReadError, sqlite3.DatabaseError):
        return default

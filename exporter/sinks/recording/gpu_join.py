"""When a recording ends: each collective call's GPU interval, from gpu_intervals into its
nccl_events row (docs/plugin.md, "Which call a GPU interval belongs to").

NCCL's seqNumber is not the call count ("NCCL habits": seqNumber): a count-0
collective, a copy-engine one, one run as a symmetric kernel and (2.29+) a
Broadcast on the AllGatherV path are calls with no Coll record and no number, and
graph replays are records with no call. So a call is not joined on its seq alone:

- the plugin makes a collective's Coll record on the thread inside the NCCL call that
  launches it: the call itself, or the ncclGroupEnd that closes the thread's outermost
  group (`hostStreamPlanTask` runs before that call returns, v2.28.9-1
  src/enqueue.cc:1307-1320, :1667-1671). The records whose host enqueue lies inside
  that call are the launch's; its calls are the call, or the group's collective calls;
- within one launch, records and calls are paired per (communicator, rank, op, bytes,
  root):
  calls in call order, records in seqNumber order (NCCL sorts a group's tasks by size
  and type, src/enqueue.cc:348-375, so only equal keys are ambiguous, and those are
  operations of one size in one group). A count-0 call is never paired (NCCL
  discards it, src/enqueue.cc:2554-2555); a call left unpaired has no GPU interval;
- a joined call takes the record's seq, NCCL's own number;
- what no launch claimed (the host-callback path, where NCCL makes the records after
  the call returned: src/enqueue.cc:1519-1531) is joined as before, on the uprobes'
  seq (pid, communicator, op, seq), with equal bytes, one record per call.

Pure SQL plus one pass over the collective and group rows of the processes that have
records: run once, when the recording ends (Recorder.close).
"""

from __future__ import annotations

import bisect
import sqlite3
from collections import defaultdict

from exporter.records import contract

# Calls that may have a Coll record (AlltoAll, Gather and Scatter have none where NCCL runs
# them as P2P tasks, src/enqueue.cc:2585-2610: they then stay unpaired).
_COLL_OPS = tuple(contract.COLLECTIVE_OPS[code] for code in range(1, 11) if code not in (6, 7))
_ROOTED = ("BROADCAST", "REDUCE")

_SEQ_FALLBACK = """
UPDATE nccl_events SET gpu_start_offset_ns = g.gpu_start_ns - nccl_events.timestamp_ns,
                       gpu_duration_ns = g.gpu_duration_ns
  FROM gpu_intervals AS g
 WHERE g.kind = 'coll' AND g.pid = nccl_events.pid AND g.op = nccl_events.op
   AND g.seq = nccl_events.seq AND g.nccl_comm_hash = nccl_events.nccl_comm_hash
   AND g.node IS nccl_events.node AND g.rank IS nccl_events.rank
   AND (g.bytes IS NULL OR g.bytes = nccl_events.bytes) AND nccl_events.count > 0
   AND nccl_events.kind = 'call' AND nccl_events.gpu_duration_ns IS NULL
   AND nccl_events.rowid NOT IN (SELECT call FROM temp.gpu_joined)
   AND g.rowid NOT IN (SELECT interval FROM temp.gpu_joined)"""


def _key(comm, rank, op, nbytes, root):
    return (comm, rank, op, nbytes, root if op in _ROOTED else None)


def launches(rows):
    """Yields (start, end, calls) of every launch: an ungrouped collective call, or the
    ncclGroupEnd closing a thread's outermost group with the calls made inside it.
    `rows`: (rowid, tid, timestamp_ns, duration_ns, op, nccl_comm_hash, count, bytes,
    root, rank) of one process, ordered by tid and time (an iterable: a cursor)."""
    tid, depth, members = None, 0, []
    for row in rows:
        if row[1] != tid:
            tid, depth, members = row[1], 0, []
        op = row[4]
        if op == "GROUP_START":
            depth += 1
        elif op == "GROUP_END":
            if depth == 1 and members:
                yield row[2], row[2] + row[3], members
            if depth <= 1:
                members = []
            depth = max(0, depth - 1)
        elif depth:
            members.append(row)
        else:
            yield row[2], row[2] + row[3], [row]


def pair(calls, records) -> list[tuple[int, int, int]]:
    """(call rowid, record index, seq): the calls of one launch paired with its records.
    records: (rowid, nccl_comm_hash, op, seq, bytes, peer, enqueue_ns, rank)."""
    free = defaultdict(list)
    for rec in sorted(records, key=lambda r: r[3]):
        free[_key(rec[1], rec[7], rec[2], rec[4], rec[5])].append(rec)
    out = []
    for call in calls:
        if not call[6]:  # count 0: NCCL discards it
            continue
        waiting = free.get(_key(call[5], call[9], call[4], call[7], call[8]))
        if waiting:
            rec = waiting.pop(0)
            out.append((call[0], rec[0], rec[3]))
    return out


def _write(conn: sqlite3.Connection, pairs: list) -> None:
    conn.executemany("INSERT INTO temp.gpu_joined VALUES (?, ?)", [(c, r) for c, r, _s in pairs])
    conn.executemany(
        "UPDATE nccl_events SET seq = ?, gpu_start_offset_ns = g.gpu_start_ns - nccl_events.timestamp_ns, "
        "gpu_duration_ns = g.gpu_duration_ns FROM gpu_intervals AS g WHERE nccl_events.rowid = ? AND g.rowid = ?",
        [(s, c, r) for c, r, s in pairs])


def fold_gpu_intervals(conn: sqlite3.Connection) -> int:
    """Fill nccl_events' GPU columns (and NCCL's seq) from gpu_intervals, in one
    transaction; returns the calls joined by launch."""
    own = not conn.in_transaction
    if own:
        conn.execute("BEGIN")
    try:
        joined = _fold(conn)
    except BaseException:
        if own:
            conn.execute("ROLLBACK")
        raise
    if own:
        conn.execute("COMMIT")
    return joined


def _fold(conn: sqlite3.Connection) -> int:
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS gpu_joined (call INTEGER PRIMARY KEY, interval INTEGER)")
    conn.execute("DELETE FROM temp.gpu_joined")
    ops = ", ".join(f"'{op}'" for op in (*_COLL_OPS, "GROUP_START", "GROUP_END"))
    joined = 0
    procs = conn.execute("SELECT DISTINCT node, pid FROM gpu_intervals WHERE kind = 'coll'").fetchall()
    for node, pid in procs:
        recs = conn.execute(
            "SELECT rowid, nccl_comm_hash, op, seq, bytes, peer, enqueue_ns, rank FROM gpu_intervals "
            "WHERE kind = 'coll' AND pid = ? AND node IS ? AND enqueue_ns IS NOT NULL ORDER BY enqueue_ns",
            (pid, node)).fetchall()
        times = [r[6] for r in recs]
        # the rows are read whole first (the updates below change the table a cursor would walk)
        rows = conn.execute(
            "SELECT rowid, tid, timestamp_ns, duration_ns, op, nccl_comm_hash, count, bytes, root, rank "
            "FROM nccl_events "
            f"WHERE pid = ? AND node IS ? AND op IN ({ops}) ORDER BY tid, timestamp_ns", (pid, node)).fetchall()
        used: set[int] = set()
        pairs = []
        for start, end, calls in launches(rows):
            lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
            inside = [recs[i] for i in range(lo, hi) if recs[i][0] not in used]
            for call, rec_id, seq in pair(calls, inside):
                used.add(rec_id)
                pairs.append((call, rec_id, seq))
        del rows
        _write(conn, pairs)
        joined += len(pairs)
    conn.execute(_SEQ_FALLBACK)
    conn.execute("DROP TABLE temp.gpu_joined")
    return joined

"""Fleet benchmarks: merge 100 nodes x 100k events (goal < 60 s), export 1M events to Perfetto (< 30 s).

    .venv/bin/python bench/fleet_bench.py [--nodes 100] [--events 100000] [--dir /tmp/fleet-bench]

Synthetic recordings with the real schema (exporter/sinks/recording/schema.py:
migrations and INSERTs): a job of 8 ranks per node in one world
communicator; each node has ~90 % NCCL calls (ALL_REDUCE, collective ends
together, node clocks shifted by up to +-50 ms), 5 % retransmits, 5 %
run-queue waits. One node's file is written row by row, the others are
copies of it with the node name, pids and clock changed (INSERT ... SELECT),
which is not timed. Timed: `merge` of every file into a new one (dedup
indexes, deferred indexes, skew estimate), then merging them all again
(everything a duplicate), and `export perfetto` of a 1M-event merge.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import sqlite3
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from exporter.records.render import NCCL_FIELDS, SCHED_FIELDS, TCP_FIELDS
from exporter.sinks.recording import schema
from exporter.sinks.recording.read import Recording

RANKS_PER_NODE = 8
T0 = 1_700_000_000_000_000_000


def template(path: pathlib.Path, nodes: int, events: int) -> None:
    """Node 0's recording: `events` rows."""
    conn = sqlite3.connect(path)
    schema.migrate(conn)
    n_calls = int(events * 0.9)
    per_rank = n_calls // RANKS_PER_NODE
    nranks = nodes * RANKS_PER_NODE
    rnd = random.Random(0)
    nccl, tcp, sched = [], [], []
    for seq in range(1, per_rank + 1):
        base = T0 + seq * 5_000_000
        end = base + 3_000_000
        for lr in range(RANKS_PER_NODE):
            arrive = base + rnd.randrange(0, 1_000_000)
            pid = 1000 + lr
            nccl.append((arrive, end + rnd.randrange(0, 50_000) - arrive, "ALL_REDUCE", lr, nranks,
                         "3f00aa00bb00cc00", "3f00aa00bb00cc00", seq, 1 << 20, 4 << 20, "ncclFloat32", "ncclSum",
                         None, None, "0x7f00", "ncclSuccess", pid, pid, "node000", "call", 0, 0))
    k = (events - len(nccl)) // 2
    for i in range(k):
        ts = T0 + rnd.randrange(0, per_rank * 5_000_000)
        lr = i % RANKS_PER_NODE
        tcp.append((ts, "tcp_retransmit_skb", "ipv4", "10.0.0.1", "10.0.0.2", 40000 + lr, 5000, "ESTABLISHED",
                    i, 1000 + lr, 0, lr, "node000"))
        sched.append((ts + 17, 1000 + lr, 1000 + lr, "runq_wait", 150_000, "node000", lr, "caller", "python", 0,
                      None))
    assert len(nccl[0]) == len(NCCL_FIELDS) and len(tcp[0]) == len(TCP_FIELDS) and len(sched[0]) == len(SCHED_FIELDS)
    with conn:
        conn.executemany(schema.INSERT["nccl"], nccl)
        conn.executemany(schema.INSERT["tcp"], tcp)
        conn.executemany(schema.INSERT["sched"], sched)
        conn.executemany("INSERT INTO meta VALUES (?, ?)", [("node", "node000"), ("machine_id", "m000"),
                                                            ("boot_id", "b000"), ("start_ns", str(T0))])
    conn.close()


def shift_of(index: int) -> int:
    """Node `index`'s clock shift (node 0, the template: none)."""
    return (index * 7919 * 1009) % 100_000_001 - 50_000_000 if index else 0


def derive(tpl: pathlib.Path, path: pathlib.Path, index: int) -> None:
    """Node `index`: the template with its node name, ranks, pids and clock (shift up to +-50 ms) changed."""
    node = f"node{index:03d}"
    shift = shift_of(index)
    conn = sqlite3.connect(path)
    schema.migrate(conn)
    conn.execute("ATTACH DATABASE ? AS t", (str(tpl),))
    base = index * RANKS_PER_NODE
    with conn:
        cols = ", ".join(NCCL_FIELDS)
        sel = ", ".join({"timestamp_ns": f"timestamp_ns + {shift}", "node": "?", "rank": f"rank + {base}"}
                        .get(c, c) for c in NCCL_FIELDS)
        conn.execute(f"INSERT INTO nccl_events ({cols}) SELECT {sel} FROM t.nccl_events", (node,))
        for table, fields in (("tcp_events", TCP_FIELDS), ("sched_events", SCHED_FIELDS)):
            sel = ", ".join({"timestamp_ns": f"timestamp_ns + {shift}", "node": "?"}.get(c, c) for c in fields)
            conn.execute(f"INSERT INTO {table} ({', '.join(fields)}) SELECT {sel} FROM t.{table}", (node,))
        conn.executemany("INSERT INTO meta VALUES (?, ?)", [("node", node), ("machine_id", f"m{index:03d}"),
                                                            ("boot_id", f"b{index:03d}"), ("start_ns", str(T0))])
    conn.execute("DETACH DATABASE t")
    conn.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--dir", default="/tmp/fleet-bench")
    ap.add_argument("--export-events", type=int, default=1_000_000)
    ap.add_argument("--reuse", action="store_true", help="keep the recordings made by a previous run")
    ap.add_argument("--query-indexes", action="store_true", help="merge --query-indexes")
    a = ap.parse_args()
    from exporter.offline.export import perfetto
    from exporter.offline.fleet import merge

    d = pathlib.Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    files = [d / f"node{i:03d}.db" for i in range(a.nodes)]
    t = time.monotonic()
    if not (a.reuse and all(f.exists() for f in files)):
        for f in d.glob("*"):
            f.unlink()
        template(files[0], a.nodes, a.events)
        for i in range(1, a.nodes):
            derive(files[0], files[i], i)
    for f in (d / "merged.db", d / "export.db"):
        if f.exists():
            f.unlink()
    total = sum(sqlite3.connect(f).execute(
        "SELECT (SELECT COUNT(*) FROM nccl_events) + (SELECT COUNT(*) FROM tcp_events) + "
        "(SELECT COUNT(*) FROM sched_events)").fetchone()[0] for f in files)
    print(f"made {a.nodes} recordings, {total} events in all, in {time.monotonic() - t:.1f} s (not timed)",
          flush=True)

    out = d / "merged.db"
    t = time.monotonic()
    rep = merge.merge(str(out), [str(f) for f in files], query_indexes=a.query_indexes)
    merge_s = time.monotonic() - t
    ref = shift_of(int(rep.skew[0].reference[4:]))
    worst = max(abs(o.offset_ns - (shift_of(int(o.node[4:])) - ref)) for o in rep.skew)
    print(f"merge{' --query-indexes' if a.query_indexes else ''}: {a.nodes} nodes x {a.events} events -> "
          f"{sum(rep.added.values())} rows in {merge_s:.1f} s "
          f"({sum(rep.added.values()) / merge_s:,.0f} rows/s; goal < 60 s); skew: worst error "
          f"{worst / 1e6:.3f} ms; {os.path.getsize(out) / 1e6:.0f} MB; phases "
          + ", ".join(f"{k} {v:.1f} s" for k, v in rep.phases.items()), flush=True)
    t = time.monotonic()
    rep2 = merge.merge(str(out), [str(f) for f in files[: max(1, a.nodes // 10)]])
    print(f"merge again of {rep2.inputs} of them (all duplicates): added {sum(rep2.added.values())} rows in "
          f"{time.monotonic() - t:.1f} s", flush=True)

    n_exp = max(1, a.export_events // a.events)
    small = d / "export.db"
    merge.merge(str(small), [str(f) for f in files[:n_exp]])
    t = time.monotonic()
    with open(d / "trace.json", "w") as f:
        counts = perfetto.export(Recording(sqlite3.connect(small)), f)
    export_s = time.monotonic() - t
    print(f"export perfetto: {n_exp * a.events} recorded events -> {counts['events']} trace events in "
          f"{export_s:.1f} s (goal < 30 s); {os.path.getsize(d / 'trace.json') / 1e6:.0f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

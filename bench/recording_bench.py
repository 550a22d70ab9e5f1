"""Recording (SQLite) benchmark: recording rate and the documented join query.

    .venv/bin/python bench/recording_bench.py [--events 1000000] [--rows 1000000]

1. Recording: synthetic CallEvents pushed into a Recorder as fast as one
   producer thread can; the rate is events committed per second until the
   queue is drained (the writer's sustained rate), with the loss count. The
   naive baseline inserts and commits one event at a time into the same
   tables without indexes.
2. Query: the verbatim "slow AllReduce vs retransmits" join of
   docs/queries.md on N nccl_events x N tcp_events, on the recording schema
   and on the same tables without indexes (naive baseline).
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from exporter.records.events import CallEvent
from exporter.records.render import Renderer
from exporter.sinks.recording import schema, writer

JOIN = """WITH slow_collectives AS (
SELECT timestamp_ns, duration_ns, rank, nranks, comm_id_hash, pid
FROM nccl_events
WHERE op = 'ALL_REDUCE'
AND duration_ns > 50000000
)
SELECT s.rank, s.duration_ns/1e6 AS ms,
COUNT(t.timestamp_ns) AS retransmits_in_window
FROM slow_collectives s
LEFT JOIN tcp_events t
ON t.timestamp_ns BETWEEN s.timestamp_ns
AND s.timestamp_ns + s.duration_ns
AND t.event = 'tcp_retransmit_skb'
GROUP BY s.rank, s.duration_ns, s.timestamp_ns
ORDER BY ms DESC
LIMIT 20;"""

T0 = 1_780_000_000_000_000_000
STEP_NS = 1_000_000  # one call per rank every ms: 1 M calls = 125 s of an 8-rank job


def synthetic_events(n: int, seed: int = 1) -> list[CallEvent]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        rank = i % 8
        it = i // 8
        slow = rnd.random() < 0.01
        d = rnd.randint(60_000_000, 400_000_000) if slow else rnd.randint(200_000, 5_000_000)
        start = it * STEP_NS * 8 + rank * 1000
        out.append(CallEvent(kind=1, op="ALL_REDUCE" if i % 3 else "ALL_GATHER", pid=1000 + rank,
                             tid=1000 + rank, start_ns=start, end_ns=start + d, start_real_ns=T0 + start,
                             comm_ptr=0x5500, comm=0xABCDEF0123456789, nccl_comm_hash=0x1122334455667788,
                             seq=it + 1, rank=rank, nranks=8, count=262144, bytes=1 << 20, datatype=7,
                             red_op=0, root=-1, peer=-1, stream=0x7F00DEAD, result=0, color=-1))
    return out


def bench_record(events: list[CallEvent], path: str) -> dict:
    rec = writer.Recorder(path, node="bench", queue_max=len(events) + 1, identify_processes=False)
    t0 = time.perf_counter()
    done = threading.Event()

    def produce():
        for e in events:
            rec(e)
        done.set()

    th = threading.Thread(target=produce)
    th.start()
    th.join()
    put_s = time.perf_counter() - t0
    while rec.total_recorded < len(events):
        time.sleep(0.005)
    drained_s = time.perf_counter() - t0
    rec.close()
    total_s = time.perf_counter() - t0
    return {"rate": len(events) / drained_s, "put_rate": len(events) / put_s, "lost": rec.total_lost,
            "close_s": total_s - drained_s}


def bench_paced(events: list[CallEvent], path: str, rate: float) -> dict:
    """Offer events at `rate`/s with the default queue bound: is anything lost?"""
    rec = writer.Recorder(path, node="bench", identify_processes=False)
    t0 = time.perf_counter()
    chunk = 1000
    for i in range(0, len(events), chunk):
        target = t0 + i / rate
        delay = target - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        for e in events[i:i + chunk]:
            rec(e)
    rec.close()
    return {"offered_rate": len(events) / (time.perf_counter() - t0), "lost": rec.total_lost,
            "recorded": rec.total_recorded}


def create_unindexed_schema(conn) -> None:
    """The naive baseline: the recorder's schema (every migration) without its indexes."""
    for step in schema.MIGRATIONS:
        for sql in step:
            if not sql.lstrip().upper().startswith("CREATE INDEX"):
                conn.execute(sql)


def bench_naive_record(events: list[CallEvent], path: str, limit_s: float = 10.0) -> dict:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    create_unindexed_schema(conn)
    rows = Renderer("bench")
    t0 = time.perf_counter()
    n = 0
    for e in events:
        conn.execute(schema.INSERT["nccl"], rows.call(e))  # autocommit: one transaction per event
        n += 1
        if n % 1000 == 0 and time.perf_counter() - t0 > limit_s:
            break
    conn.close()
    return {"rate": n / (time.perf_counter() - t0), "events": n}


def build_query_db(path: str, n_calls: int, n_tcp: int, indexed: bool) -> None:
    if indexed:
        rec = writer.Recorder(path, node="bench", queue_max=n_calls + n_tcp + 1, identify_processes=False)
    events = synthetic_events(n_calls)
    span = events[-1].start_ns
    rnd = random.Random(2)
    tcp = []
    for _ in range(n_tcp):
        ts = T0 + rnd.randrange(span)
        tcp.append({"timestamp_ns": ts, "event": "tcp_retransmit_skb" if rnd.random() < 0.9 else "tcp_send_reset",
                    "family": "ipv4", "saddr": "10.0.0.%d" % rnd.randrange(8), "daddr": "10.0.0.%d" % rnd.randrange(8),
                    "sport": rnd.randrange(1024, 65535), "dport": 5000, "state": "ESTABLISHED", "seq": 0,
                    "pid": 1000 + rnd.randrange(8), "tid": 0})
    tcp.sort(key=lambda d: d["timestamp_ns"])
    if indexed:
        for e in events:
            rec(e)
        for d in tcp:
            rec(d)
        rec.close()
        return
    conn = sqlite3.connect(path, isolation_level=None)
    create_unindexed_schema(conn)
    rows = Renderer("bench")
    conn.execute("BEGIN")
    conn.executemany(schema.INSERT["nccl"], (rows.call(e) for e in events))
    conn.executemany(schema.INSERT["tcp"], (rows.tcp(d, None) for d in tcp))
    conn.execute("COMMIT")
    conn.close()


def time_query(path: str, sql: str, limit_s: float) -> tuple[float | None, int]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    t0 = time.perf_counter()
    conn.set_progress_handler(lambda: 1 if time.perf_counter() - t0 > limit_s else 0, 100000)
    try:
        n = len(conn.execute(sql).fetchall())
        return time.perf_counter() - t0, n
    except sqlite3.OperationalError:  # interrupted
        return None, 0
    finally:
        conn.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--events", type=int, default=1_000_000, help="events for the recording rate")
    p.add_argument("--rows", type=int, default=1_000_000, help="nccl_events and tcp_events rows for the query")
    p.add_argument("--naive-limit-s", type=float, default=60.0)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        events = synthetic_events(a.events)
        r = bench_record(events, f"{d}/rec.db")
        print(f"record: {r['rate']:,.0f} events/s sustained (writer, {a.events:,} events, lost {r['lost']}); "
              f"listener {r['put_rate']:,.0f} events/s; close (indexes, checkpoint) {r['close_s']:.2f} s")
        paced = bench_paced(events[:400_000], f"{d}/paced.db", 200_000)
        print(f"record paced at 200,000/s with the default queue ({writer.QUEUE_MAX}): offered "
              f"{paced['offered_rate']:,.0f}/s, recorded {paced['recorded']:,}, lost {paced['lost']}")
        n = bench_naive_record(events, f"{d}/naive.db")
        print(f"record naive baseline (one INSERT + commit per event, no indexes): {n['rate']:,.0f} events/s")
        del events

        build_query_db(f"{d}/q.db", a.rows, a.rows, indexed=True)
        build_query_db(f"{d}/qn.db", a.rows, a.rows, indexed=False)
        for name, path in (("recording schema", f"{d}/q.db"), ("naive, no indexes", f"{d}/qn.db")):
            best, nrows = None, 0
            for _ in range(3):
                t, n = time_query(path, JOIN, a.naive_limit_s)
                if t is None:
                    break
                best, nrows = (t, n) if best is None else (min(best, t), n)
            shown = f"{best:.3f} s ({nrows} rows)" if best is not None else f"> {a.naive_limit_s:.0f} s (stopped)"
            print(f"join query, {a.rows:,} nccl_events x {a.rows:,} tcp_events, {name}: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

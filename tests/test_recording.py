"""A recording (SQLite) without BPF: schema and migrations, batching, scope, losses, query guard."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from exporter.records.events import CallEvent, SchedInterval
from exporter.sinks.recording import query, schema, scope, writer

from conftest import REPO


def ev(i, pid=100, op="ALL_REDUCE", dur=1000, kind=1):
    return CallEvent(kind=kind, op=op, pid=pid, tid=pid, start_ns=i * 10, end_ns=i * 10 + dur,
                     start_real_ns=1_700_000_000_000_000_000 + i * 10, comm_ptr=1, comm=0xAB, nccl_comm_hash=0xCD,
                     seq=i, rank=3, nranks=8, count=4, bytes=16, datatype=7, red_op=0, root=-1, peer=-1,
                     stream=0x10, result=0, color=-1)


def tcp(i, pid=100, event="tcp_retransmit_skb"):
    return {"timestamp_ns": 1_700_000_000_000_000_000 + i, "event": event, "family": "ipv4",
            "saddr": "198.18.0.1", "daddr": "198.18.0.2", "sport": 40000, "dport": 5000,
            "state": "ESTABLISHED", "seq": 0, "pid": pid, "tid": pid}


def cli(*argv):
    return subprocess.run([sys.executable, "-m", "exporter", *argv], capture_output=True, text=True, cwd=REPO)


def test_rows_columns_and_meta(tmp_path):
    db = tmp_path / "r.db"
    with writer.Recorder(str(db), node="n1", identify_processes=False) as r:
        r(ev(1))
        r(ev(2, op="COMM_INIT_RANK", kind=2))
        r(tcp(5))
        r(SchedInterval(1_700_000_000_000_000_050, 1_000_000_000, 100, "caller", 250_000, 4))
        r.set_kernel_lost(kernel_nccl_events=3)
    c = sqlite3.connect(db)
    assert c.execute("PRAGMA user_version").fetchone()[0] == schema.SCHEMA_VERSION
    row = c.execute("SELECT op, rank, nranks, comm_id_hash, datatype, red_op, peer, root, result, kind, node "
                    "FROM nccl_events ORDER BY timestamp_ns").fetchall()
    assert row[0] == ("ALL_REDUCE", 3, 8, "00000000000000ab", "ncclFloat32", "ncclSum", None, None,
                      "ncclSuccess", "call", "n1")
    assert row[1][-2] == "lifecycle"
    t = c.execute("SELECT event, family, seq, pid, rank FROM tcp_events").fetchall()
    assert t == [("tcp_retransmit_skb", "ipv4", None, 100, 3)]  # rank: the owner's rank in its comm
    assert c.execute("SELECT * FROM sched_intervals").fetchall() == [
        (1_700_000_000_000_000_050, 1_000_000_000, 100, "caller", 250_000, 4, "n1", 3)]
    meta = dict(c.execute("SELECT key, value FROM meta"))
    assert meta["node"] == "n1" and meta["lost_kernel_nccl_events"] == "3" and meta["lost_total"] == "3"
    assert meta["sched_intervals_recorded"] == "1" and meta["events_recorded"] == "4"
    assert int(meta["end_ns"]) >= int(meta["start_ns"])
    assert c.execute("SELECT comm_id_hash, rank, nranks FROM communicators").fetchall() == [("00000000000000ab", 3, 8)]
    # closed cleanly: one self-contained file
    assert c.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert {i[1] for i in c.execute("PRAGMA index_list(nccl_events)")} >= {
        "nccl_events_op_duration", "nccl_events_time", "nccl_events_comm_seq"}


def test_migrates_an_older_database(tmp_path):
    db = tmp_path / "old.db"
    c = sqlite3.connect(db, isolation_level=None)
    schema.migrate(c, target=1)
    c.execute("INSERT INTO nccl_events (timestamp_ns, duration_ns, op, pid, tid, node, kind) "
              "VALUES (1, 2, 'ALL_REDUCE', 1, 1, 'n', 'call')")
    c.close()
    with writer.Recorder(str(db), node="n", identify_processes=False) as r:
        r(ev(1))
    c = sqlite3.connect(db)
    assert c.execute("PRAGMA user_version").fetchone()[0] == schema.SCHEMA_VERSION
    assert c.execute("SELECT COUNT(*), SUM(runq_wait_ns IS NULL) FROM nccl_events").fetchone() == (2, 1)


def test_migration_8_names_communicators_by_nccls_commhash(tmp_path):
    """Rows written when comm_id_hash was the agent's own id take NCCL's
    commHash where the row knows it (the `comm` label, docs/communicators.md);
    local ids and rows without NCCL's hash keep theirs."""
    db = tmp_path / "v7.db"
    c = sqlite3.connect(db, isolation_level=None)
    schema.migrate(c, target=7)
    rows = [("00000000000000ab", "1111222233334444"), ("local-7-1", "unknown"), ("00000000000000cd", None)]
    for own, nccl in rows:
        c.execute("INSERT INTO nccl_events (timestamp_ns, duration_ns, op, pid, tid, node, kind, comm_id_hash, "
                  "nccl_comm_hash) VALUES (1, 2, 'ALL_REDUCE', 1, 1, 'n', 'call', ?, ?)", (own, nccl))
        c.execute("INSERT INTO communicators (node, pid, comm_id_hash, nccl_comm_hash) VALUES ('n', 1, ?, ?)",
                  (own, nccl))
    schema.migrate(c)
    want = ["0000000000000000cd"[2:], "1111222233334444", "local-7-1"]
    assert sorted(r[0] for r in c.execute("SELECT comm_id_hash FROM nccl_events")) == want
    assert sorted(r[0] for r in c.execute("SELECT comm_id_hash FROM communicators")) == want


def test_refuses_a_newer_schema(tmp_path):
    db = tmp_path / "new.db"
    c = sqlite3.connect(db)
    c.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
    c.close()
    with pytest.raises(schema.RecordingError, match="newer"):
        writer.Recorder(str(db))


def test_batches_commit_within_the_interval(tmp_path):
    db = tmp_path / "b.db"
    r = writer.Recorder(str(db), node="n", identify_processes=False)
    try:
        for i in range(10):
            r(ev(i))
        time.sleep(writer.BATCH_SECONDS * 3 + 0.5)
        c = sqlite3.connect(db)
        assert c.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0] == 10  # committed, not closed
        c.close()
    finally:
        r.close()


def test_full_queue_counts_drops_and_never_blocks(tmp_path):
    db = tmp_path / "d.db"
    r = writer.Recorder(str(db), node="n", queue_max=5, identify_processes=False)
    t0 = time.perf_counter()
    for i in range(20000):
        r(ev(i))
    assert time.perf_counter() - t0 < 2.0
    r.close()
    c = sqlite3.connect(db)
    n = c.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0]
    meta = dict(c.execute("SELECT key, value FROM meta"))
    assert r.dropped > 0 and n + r.dropped == 20000
    assert meta["lost_queue_full"] == str(r.dropped) and meta["events_offered"] == "20000"
    assert f"recorder queue full {r.dropped}" in r.summary()


def test_scope_by_pid_and_netns(tmp_path):
    mine = os.stat("/proc/self/ns/net").st_ino
    s = scope.Scope(netns=mine)
    assert os.getpid() in s and 999_999_999 not in s
    assert scope.netns_inode("/proc/self/ns/net") == mine == scope.netns_inode(str(mine))
    assert scope.netns_inode(f"net:[{mine}]") == mine
    with pytest.raises(schema.RecordingError):
        scope.netns_inode("/nonexistent/ns")
    db = tmp_path / "s.db"
    with writer.Recorder(str(db), node="n", scope=scope.Scope(pids=[7]), identify_processes=False) as r:
        r(ev(1, pid=7))
        r(ev(2, pid=8))
        r(tcp(3, pid=8))
        r(tcp(4, pid=7))
    c = sqlite3.connect(db)
    assert c.execute("SELECT pid FROM nccl_events").fetchall() == [(7,)]
    assert c.execute("SELECT pid FROM tcp_events").fetchall() == [(7,)]
    assert r.out_of_scope == 2


def recording(tmp_path):
    db = tmp_path / "q.db"
    with writer.Recorder(str(db), node="n", identify_processes=False) as r:
        for i in range(5):
            r(ev(i, dur=(i + 1) * 1_000_000))
    return db


def test_query_formats(tmp_path):
    db = recording(tmp_path)
    p = cli("query", str(db), "SELECT op, duration_ns/1e6 AS ms FROM nccl_events ORDER BY ms DESC LIMIT 2")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0].split() == ["op", "ms"] and "(2 rows)" in p.stdout
    p = cli("query", str(db), "SELECT op, rank FROM nccl_events LIMIT 1", "--format", "csv")
    assert p.stdout == "op,rank\nALL_REDUCE,3\n"
    p = cli("query", str(db), "SELECT COUNT(*) AS n FROM nccl_events", "--format", "json")
    assert json.loads(p.stdout) == [{"n": 5}]


@pytest.mark.parametrize("sql, why", [
    ("DELETE FROM nccl_events", "refused: DELETE"),
    ("INSERT INTO meta VALUES ('a', 'b')", "refused: INSERT"),
    ("DROP TABLE meta", "refused"),
    ("CREATE TABLE x (a)", "refused"),
    ("CREATE TEMP TABLE x (a)", "refused"),
    ("ATTACH DATABASE '/tmp/nccl-recording-attach.db' AS x", "refused: ATTACH"),
    ("PRAGMA user_version = 7", "refused: PRAGMA user_version"),
    ("PRAGMA journal_mode = WAL", "refused: PRAGMA journal_mode"),
    ("PRAGMA wal_checkpoint", "refused: PRAGMA wal_checkpoint"),
    ("VACUUM INTO '/tmp/nccl-recording-vacuum.db'", "refused: VACUUM"),
    ("SELEC 1", "SQL error"),
    ("SELECT nope FROM nccl_events", "SQL error: no such column"),
    ("SELECT 1; SELECT 2", "SQL error"),
])
def test_query_refuses_writes_and_reports_errors_in_one_line(tmp_path, sql, why):
    db = recording(tmp_path)
    before = db.read_bytes()
    p = cli("query", str(db), sql)
    assert p.returncode == 2
    assert p.stderr.startswith("nccl-exporter: error: ") and why in p.stderr and p.stderr.count("\n") == 1
    assert db.read_bytes() == before
    assert not os.path.exists("/tmp/nccl-recording-attach.db") and not os.path.exists("/tmp/nccl-recording-vacuum.db")


def test_query_reads_with_read_only_pragmas(tmp_path):
    db = recording(tmp_path)
    names, rows = query.run(str(db), "PRAGMA table_info(tcp_events)")
    assert "event" in [r[1] for r in rows]


def test_query_rejects_missing_and_foreign_files(tmp_path):
    p = cli("query", str(tmp_path / "missing.db"), "SELECT 1")
    assert p.returncode == 2 and "no such file" in p.stderr
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (a)").connection.commit()
    p = cli("query", str(other), "SELECT 1")
    assert p.returncode == 2 and "not an nccl-exporter recording" in p.stderr
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    p = cli("query", str(junk), "SELECT 1")
    assert p.returncode == 2 and "not an nccl-exporter recording" in p.stderr
    assert p.stderr.count("\n") == 1


def test_a_full_batch_is_followed_by_the_next_without_a_pause(tmp_path):
    """The writer pauses (batch_seconds) only when the queue ran dry: with ten
    batches queued and a one-minute pause, all ten are written at once."""
    rows = 100
    rec = writer.Recorder(str(tmp_path / "r.db"), node="n", batch_rows=rows, batch_seconds=60,
                          identify_processes=False)
    try:
        for i in range(10 * rows):
            rec(ev(i))
        deadline = time.monotonic() + 20
        while rec.total_recorded < 10 * rows and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rec.total_recorded == 10 * rows, rec.total_recorded
    finally:
        rec.close()

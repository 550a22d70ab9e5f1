"""`nccl-exporter merge`: row identity, dedup, older schemas, node-name clashes, stored skew.

Recordings here are synthetic, written with the real schema (migrations and
INSERTs of exporter/sinks/recording/schema.py): a job of one rank per node
whose collectives all end together, each node's clock shifted by a known
offset. Real simulator recordings are merged in tests/test_analysis.py.
"""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
import pathlib

import pytest

from exporter.records.render import NCCL_FIELDS, SCHED_FIELDS, TCP_FIELDS
from exporter.sinks.recording import schema
from exporter.sinks.recording.read import Recording
from exporter.offline.fleet import merge

from conftest import REPO
T0 = 1_700_000_000_000_000_000
NODES = 4
SHIFT = {0: 0, 1: 50_000_000, 2: -50_000_000, 3: 7_250_000}


def synth(path, rank, *, node=None, machine=None, shift=0, collectives=200, first=1, version=None, sched_mode=None,
          nranks=NODES, straggler=2) -> pathlib.Path:
    """One node's recording: rank `rank` of an nranks-rank job, its clock `shift` ns ahead."""
    conn = sqlite3.connect(path)
    schema.migrate(conn, version or schema.SCHEMA_VERSION)
    node = node or f"node{rank}"
    pid = 1000 + rank
    nccl, tcp, sched, intervals = [], [], [], []
    for seq in range(first, first + collectives):
        rnd = random.Random(rank * 1_000_003 + seq)  # a collective's times do not depend on the window
        base = T0 + seq * 20_000_000
        arrive = base + rnd.randrange(0, 500_000) + (5_000_000 if rank == straggler else 0)
        end = base + 6_000_000 + rnd.randrange(0, 100_000)  # all ranks leave together
        row = dict.fromkeys(NCCL_FIELDS)
        row.update(timestamp_ns=arrive + shift, duration_ns=end - arrive, op="ALL_REDUCE", rank=rank,
                   nranks=nranks, comm_id_hash="3f00aa00bb00cc00", seq=seq, count=1024, bytes=4096,
                   pid=pid, tid=pid, node=node, kind="call", result="ncclSuccess", runq_wait_ns=0)
        nccl.append(tuple(row[f] for f in NCCL_FIELDS))
        if seq % 10 == 0:
            t = dict.fromkeys(TCP_FIELDS)
            t.update(timestamp_ns=arrive + shift + 1000, event="tcp_retransmit_skb", family="ipv4",
                     saddr=f"10.0.0.{rank + 1}", daddr=f"10.0.0.{(rank + 1) % nranks + 1}", sport=40000,
                     dport=5000, state="ESTABLISHED", seq=None, pid=pid, tid=0, rank=rank, node=node)
            tcp.append(tuple(t[f] for f in TCP_FIELDS))
            s = dict.fromkeys(SCHED_FIELDS)
            s.update(timestamp_ns=arrive + shift - 2000, pid=pid, tid=pid, event="runq_wait", duration_ns=150_000,
                     node=node, rank=rank, thread="caller", comm="python", cpu=0, op=None)
            sched.append(tuple(s[f] for f in SCHED_FIELDS if version is None or version >= 3 or
                               f not in ("rank", "thread", "comm", "cpu", "op")))
        if seq % 50 == 0:  # --sched totals' rows: a second's wait per thread kind
            intervals += [(base + shift, 1_000_000_000, pid, kind, 2_000_000, 9, node, rank)
                          for kind in ("caller", "proxy")]
    with conn:
        conn.executemany(schema.INSERT["nccl"] if (version or 9) >= 3 else
                         schema._insert("nccl_events", NCCL_FIELDS[:-1] if version == 2 else NCCL_FIELDS[:-2]),
                         [r if (version or 9) >= 3 else r[:-1] if version == 2 else r[:-2] for r in nccl])
        conn.executemany(schema.INSERT["tcp"], tcp)
        if (version or 9) >= 3:
            conn.executemany(schema.INSERT["sched"], sched)
        if version is None:
            conn.executemany(schema.INSERT["sched_interval"], intervals)
        conn.execute("INSERT INTO processes (pid, node, launcher, launcher_rank, world_size, command, netns, "
                     "first_seen_ns) VALUES (?, ?, 'torchrun', ?, ?, 'python train.py', 1, ?)",
                     (pid, node, rank, nranks, T0))
        conn.execute("INSERT INTO communicators VALUES (?, ?, '3f00aa00bb00cc00', 'x', ?, ?, ?)",
                     (node, pid, rank, nranks, T0))
        meta = {"node": node, "start_ns": str(T0), "end_ns": str(T0 + 10**10)}
        if sched_mode:
            meta["sched"] = sched_mode
        if machine is not False:
            meta.update(machine_id=machine or f"machine-{node}", boot_id=f"boot-{node}")
        conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", meta.items())
    conn.close()
    return pathlib.Path(path)


def counts(db) -> dict:
    conn = sqlite3.connect(db)
    try:
        return {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                for t in ("nccl_events", "tcp_events", "sched_events", "sched_intervals", "processes",
                          "communicators", "nodes")}
    finally:
        conn.close()


def cli(*args):
    return subprocess.run([sys.executable, "-m", "exporter", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


@pytest.fixture
def nodes(tmp_path):
    return [synth(tmp_path / f"n{r}.db", r, shift=SHIFT[r]) for r in range(NODES)]


def test_merge_keeps_nodes_and_dedups_repeats_and_copies(tmp_path, nodes):
    out = tmp_path / "m.db"
    p = cli("merge", "--db", out, *nodes)
    assert p.returncode == 0, p.stderr
    once = counts(out)
    assert once["nccl_events"] == 200 * NODES and once["tcp_events"] == 20 * NODES and once["nodes"] == NODES
    assert once["sched_intervals"] == 2 * 4 * NODES
    conn = sqlite3.connect(out)
    assert {r[0] for r in conn.execute("SELECT DISTINCT node FROM nccl_events")} == {f"node{r}" for r in range(NODES)}
    conn.close()
    # the same files again, a byte copy of one, and the merged file itself: nothing added
    copy = tmp_path / "copy.db"
    copy.write_bytes(nodes[1].read_bytes())
    p = cli("merge", "--db", out, *nodes, copy)
    assert p.returncode == 0, p.stderr
    assert counts(out) == once
    again = tmp_path / "again.db"
    assert cli("merge", "--db", again, out, nodes[0]).returncode == 0
    assert counts(again) == once


def test_merged_meta_says_how_the_inputs_kept_cpu_waits(tmp_path):
    """explain reads a recording's missing sched_intervals rows as no wait only where meta
    sched says totals: a merge of such recordings says so too, a mix says mixed."""
    def merged_sched(*scheds):
        d = tmp_path / "-".join(scheds)
        d.mkdir()
        out = d / "merged.db"
        ins = [synth(d / f"{i}.db", i, sched_mode=s) for i, s in enumerate(scheds)]
        merge.merge(str(out), [str(p) for p in ins])
        with Recording.open(str(out)) as rec:
            return rec.meta()["sched"]

    assert merged_sched("totals", "totals") == "totals"
    assert merged_sched("totals", "waits") == "mixed"


def test_overlapping_windows_of_one_node_collapse(tmp_path):
    # node0 recorded twice: collectives 1..150 and 100..250 (overlap 100..150)
    a = synth(tmp_path / "a.db", 0, collectives=150, first=1)
    b = synth(tmp_path / "b.db", 0, collectives=151, first=100)
    whole = synth(tmp_path / "whole.db", 0, collectives=250, first=1)
    out = tmp_path / "m.db"
    rep = merge.merge(str(out), [str(a), str(b)])
    assert rep.added["nccl_events"] == 250 and rep.offered["nccl_events"] == 301
    want = counts(whole)
    got = counts(out)
    assert got["nccl_events"] == want["nccl_events"] and got["tcp_events"] == want["tcp_events"]
    assert got["sched_events"] == want["sched_events"]  # the NULL seq of tcp rows compares equal too
    assert got["sched_intervals"] == want["sched_intervals"] > 0


@pytest.mark.parametrize("version", [1, 2, 3])
def test_older_schema_versions_are_migrated_on_a_copy(tmp_path, version):
    old = synth(tmp_path / "old.db", 1, version=version, shift=SHIFT[1])
    before = old.read_bytes()
    new = synth(tmp_path / "new.db", 0)
    out = tmp_path / "m.db"
    p = cli("merge", "--db", out, old, new)
    assert p.returncode == 0, p.stderr
    assert old.read_bytes() == before  # the input is never written
    conn = sqlite3.connect(out)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == schema.SCHEMA_VERSION
    assert conn.execute("SELECT COUNT(*) FROM nccl_events WHERE node = 'node1'").fetchone()[0] == 200
    conn.close()


def test_same_name_two_machines_refused_unless_renamed(tmp_path):
    a = synth(tmp_path / "a.db", 0, node="gpu-017", machine="aaaa")
    b = synth(tmp_path / "b.db", 1, node="gpu-017", machine="bbbb")
    out = tmp_path / "m.db"
    p = cli("merge", "--db", out, a, b)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "gpu-017" in p.stderr and "--rename" in p.stderr, \
        p.stderr
    out2 = tmp_path / "m2.db"
    p = cli("merge", "--db", out2, a, b, "--rename", f"{b}:gpu-017=gpu-017b")
    assert p.returncode == 0, p.stderr
    conn = sqlite3.connect(out2)
    assert dict(conn.execute("SELECT node, COUNT(*) FROM nccl_events GROUP BY node")) == {"gpu-017": 200,
                                                                                          "gpu-017b": 200}
    assert dict(conn.execute("SELECT node, machine_id FROM nodes")) == {"gpu-017": "aaaa", "gpu-017b": "bbbb"}
    conn.close()
    # the same machine under one name (two recordings of it) is fine; unknown machine ids are accepted
    c = synth(tmp_path / "c.db", 0, node="gpu-017", machine="aaaa", first=500)
    d = synth(tmp_path / "d.db", 2, node="gpu-017", machine=False, first=900)
    assert cli("merge", "--db", tmp_path / "m3.db", a, c, d).returncode == 0


def test_bad_inputs_are_one_line(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_text("not sqlite at all")
    for args in (["--db", tmp_path / "m.db", tmp_path / "missing.db"], ["--db", tmp_path / "m.db", junk],
                 ["--db", tmp_path / "m.db", "--rename", "nonsense", junk]):
        p = cli("merge", *args)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr


def test_skew_stored_and_recovered_within_1ms_and_stragglers_aligned(tmp_path, nodes):
    out = tmp_path / "m.db"
    merge.merge(str(out), [str(n) for n in nodes])
    conn = sqlite3.connect(out)
    stored = {r[0]: r[1:]
              for r in conn.execute("SELECT node, offset_ns, reference, collectives, method FROM clock_skew")}
    conn.close()
    for r, s in SHIFT.items():
        offset, ref, n, method = stored[f"node{r}"]
        assert abs(offset - s) < 1_000_000, stored
        assert ref == "node0" and (method == "reference" or (n == 200 and method == "host call ends")), stored
    # aligned, node2's rank (5 ms late at every collective) is the straggler; raw, node1 (+50 ms) looks late
    p = cli("stragglers", out, "--format", "json")
    import json

    rows = json.loads(p.stdout)
    assert max(rows, key=lambda r: r["last_pct"])["node"] == "node2", rows
    raw = json.loads(cli("stragglers", out, "--no-align", "--format", "json").stdout)
    assert max(raw, key=lambda r: r["last_pct"])["node"] == "node1", raw
    # --no-align at merge stores no offsets
    out2 = tmp_path / "raw.db"
    merge.merge(str(out2), [str(n) for n in nodes], align=False)
    conn = sqlite3.connect(out2)
    assert conn.execute("SELECT COUNT(*) FROM clock_skew").fetchone()[0] == 0
    conn.close()


def test_failed_merge_leaves_out_as_it_was(tmp_path, nodes):
    out = tmp_path / "m.db"
    assert cli("merge", "--db", out, nodes[0]).returncode == 0
    before = out.read_bytes()
    clash = synth(tmp_path / "clash.db", 1, node="node0", machine="someone-else")
    p = cli("merge", "--db", out, nodes[1], clash)  # node1 goes in first, then the clash stops it
    assert p.returncode == 2 and "node0" in p.stderr, p.stderr
    assert out.read_bytes() == before and not (tmp_path / "m.db.partial").exists()


def test_query_indexes_are_opt_in_and_change_no_row(tmp_path, nodes):
    full, lean = tmp_path / "full.db", tmp_path / "lean.db"
    assert cli("merge", "--db", full, "--query-indexes", *nodes).returncode == 0
    assert cli("merge", "--db", lean, *nodes).returncode == 0

    def indexes(db):
        conn = sqlite3.connect(db)
        try:
            return {r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")}
        finally:
            conn.close()

    assert {"nccl_events_time", "nccl_events_op_duration", "nccl_events_comm_seq"} <= indexes(full)
    assert "nccl_events_comm_seq" in indexes(lean) and "nccl_events_time" not in indexes(lean)
    assert counts(full) == counts(lean)
    skew_rows = "SELECT node, offset_ns FROM clock_skew ORDER BY node"
    assert sqlite3.connect(full).execute(skew_rows).fetchall() == sqlite3.connect(lean).execute(skew_rows).fetchall()

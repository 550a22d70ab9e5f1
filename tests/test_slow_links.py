"""Slow link or slow GPU, from the profiler plugin's per-peer network waits
(recording table nccl_peer_waits; docs/network.md): the judgement
(exporter/offline/analysis/network.py) on synthetic recordings, and what
`explain` and `stragglers --links` print for them through the real CLI; old
recordings (schema 6, no table) still open and the documented queries run.

The synthetic job: 4 ranks on 4 nodes in a ring (rank r receives from r - 1
and sends to r + 1), 20 AllReduces of 50 ms GPU time each, all ranks
arriving together. Per operation every link's receiver waits 5 ms for data
(recv_wait), every sender waits 4 ms for the network (send_wait) and 1 ms
for its GPU (send_gpu_wait), except:

- slow_link: link 2 → 3 is slow: rank 3 waits 30 ms for rank 2's data, and
  rank 2 waits 28 ms for the network to take it; rank 2's sockets
  retransmitted 3 times to rank 3's address (and once elsewhere);
- gpu:       rank 2's GPU is late: rank 3 waits 30 ms for rank 2's data,
  rank 2's proxy waits 27 ms for its own GPU, its send_wait is as usual;
- healthy:   nothing stands out.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from conftest import REPO
from exporter.sinks.recording import schema
from exporter.sinks.recording.read import Recording
from exporter.offline.analysis import network

NRANKS, OPS = 4, 20
T0 = 1_700_000_000_000_000_000
MS = 1_000_000
# From schema 8 the `comm` id is NCCL's commHash; before, the agent's own id (docs/communicators.md).
NCCL_HASH = COMM = "c0ffee00a1b2c3d4"
AGENT_ID = "5eed00000000c0de"
ADDR = {r: f"198.18.0.{4 + r}" for r in range(NRANKS)}   # rank 2: .6, rank 3: .7


def _nccl_row(r: int, i: int, comm: str) -> tuple:
    ts = T0 + i * 100 * MS
    return (ts, 50 * MS, "ALL_REDUCE", r, NRANKS, comm, NCCL_HASH, i, 1024, 4096, "ncclFloat32", "ncclSum",
            None, None, "0x10", "ncclSuccess", 100 + r, 100 + r, f"n{r}", "call", None, None)


def make_recording(path, scenario: str = "healthy", version: int = schema.SCHEMA_VERSION,
                   ranks_recorded=range(NRANKS), other_rows: bool = True, host_late: int | None = None,
                   one_process: bool = False) -> str:
    """A recording of the synthetic job at schema `version` (peer waits from 7 on); `host_late`: that
    rank calls every AllReduce 5 ms after the others and returns with them (a late arriver on the host);
    `one_process`: every rank in process 100 on node n0 (one process driving every GPU)."""
    conn = sqlite3.connect(path, isolation_level=None)
    schema.migrate(conn, target=version)
    nccl_fields = [f for f in schema.NCCL_FIELDS if f != "proxy_runq_wait_ns" or version >= 3]
    comm = COMM if version >= 8 else AGENT_ID
    conn.execute("BEGIN")
    pid_of = (lambda r: 100) if one_process else (lambda r: 100 + r)
    node_of = (lambda r: "n0") if one_process else (lambda r: f"n{r}")
    for r in ranks_recorded:
        conn.execute("INSERT OR IGNORE INTO communicators (node, pid, comm_id_hash, nccl_comm_hash, rank, "
                     "nranks, first_seen_ns) VALUES (?, ?, ?, ?, ?, ?, ?)",
                     (node_of(r), pid_of(r), comm, NCCL_HASH, r, NRANKS, T0))
        for i in range(OPS):
            row = _nccl_row(r, i, comm)
            row = row[:16] + (pid_of(r), pid_of(r), node_of(r)) + row[19:]
            if r == host_late:
                row = (row[0] + 5 * MS, row[1] - 5 * MS) + row[2:]  # the last to arrive: the short call
            conn.execute(f"INSERT INTO nccl_events ({', '.join(nccl_fields)}) VALUES "
                         f"({', '.join('?' * len(nccl_fields))})", row[:len(nccl_fields)])
            if version >= 5:
                gpu_fields = schema.GPU_FIELDS[:11]  # bytes: from version 9
                conn.execute(f"INSERT INTO gpu_intervals ({', '.join(gpu_fields)}) VALUES ({', '.join('?' * 11)})",
                             (pid_of(r), NCCL_HASH, "ALL_REDUCE", i, "coll", r, None, row[0], row[0] + MS, 50 * MS,
                              node_of(r)))
            if version < 7:
                continue
            src, dst = (r - 1) % NRANKS, (r + 1) % NRANKS
            recv_wait = 30 * MS if (r == 3 and scenario in ("slow_link", "gpu")) else 5 * MS
            send_wait = 28 * MS if (r == 2 and scenario == "slow_link") else 4 * MS
            gpu_wait = 27 * MS if (r == 2 and scenario == "gpu") else 1 * MS
            phases = [("recv", src, "recv_wait", recv_wait, 0), ("recv", src, "recv_flush_wait", MS // 10, 4096),
                      ("recv", src, "recv_gpu_wait", MS // 2, 0), ("send", dst, "send_gpu_wait", gpu_wait, 0),
                      ("send", dst, "send_peer_wait", MS // 2, 0), ("send", dst, "send_wait", send_wait, 4096)]
            for direction, peer, phase, wall, nbytes in phases:
                conn.execute(schema.INSERT["peer_waits"], (pid_of(r), NCCL_HASH, "ALL_REDUCE", i, "coll", r, peer,
                                                           direction, phase, wall, 3 * wall, nbytes, node_of(r)))
            if other_rows:  # the peers beyond the top K, summed: never a link of their own
                conn.execute(schema.INSERT["peer_waits"], (pid_of(r), NCCL_HASH, "ALL_REDUCE", i, "coll", r, None,
                                                           "recv", "recv_wait", 40 * MS, 40 * MS, 0, node_of(r)))
    tcp = [(2, 3, 3), (2, 1, 1), (3, 0, 1)] if scenario == "slow_link" else [(3, 0, 1)]
    for sender, receiver, n in tcp:
        for k in range(n):
            conn.execute(f"INSERT INTO tcp_events ({', '.join(schema.TCP_FIELDS)}) VALUES "
                         f"({', '.join('?' * len(schema.TCP_FIELDS))})",
                         (T0 + k * MS, "tcp_retransmit_skb", "ipv4", ADDR[sender], ADDR[receiver], 40000 + k, 5000,
                          "ESTABLISHED", k, 100 + sender, 100 + sender, sender, f"n{sender}"))
    conn.execute("COMMIT")
    conn.close()
    return str(path)


def judged(path, **kw) -> dict[tuple[int, int], network.Link]:
    conn = sqlite3.connect(path)
    links = network.load(Recording(conn), **kw)
    network.judge(links)
    conn.close()
    return {(lk.sender, lk.receiver): lk for lk in links}


def cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", *argv], capture_output=True, text=True, cwd=REPO)


def explain(db) -> dict:
    p = cli("explain", str(db), "--format", "json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


# --- the judgement ------------------------------------------------------------------------

def test_slow_link_is_named_by_both_ends(tmp_path):
    links = judged(make_recording(tmp_path / "r.db", "slow_link"))
    assert set(links) == {(0, 1), (1, 2), (2, 3), (3, 0)}, "one link per ring edge; peer NULL is no link"
    lk = links[(2, 3)]
    assert lk.verdict == network.SLOW_LINK
    assert lk.recv_wait_ns == OPS * 30 * MS and lk.send_wait_ns == OPS * 28 * MS
    assert lk.recv_x == pytest.approx(6.0) and lk.send_x == pytest.approx(7.0)
    assert lk.share == pytest.approx(30 / 50) and lk.operations == OPS
    assert lk.bytes == OPS * 4096
    assert (lk.retransmits, lk.retransmit_links) == (3, {"198.18.0.6\u2192198.18.0.7": 3}), \
        "the sender's retransmits to the receiver's address only"
    assert [k for k, v in links.items() if v.verdict] == [(2, 3)]
    assert network.headline(lk) == ("rank 3 \u2190 rank 2: recv_wait 6.0× the comm's median pair, and rank 2's "
                                    "send_wait to 3 as high (7.0×); 3 retransmits on 198.18.0.6\u2192198.18.0.7")


def test_one_process_driving_every_gpu_gives_each_rank_its_own_gpu_time(tmp_path):
    """Several ranks of one communicator in one process (ncclCommInitAll): a receiver's time is
    its own operations' GPU time, not every rank's of that process (the share would shrink)."""
    links = judged(make_recording(tmp_path / "r.db", "gpu", one_process=True))
    lk = links[(2, 3)]
    assert lk.receiver_time_ns == OPS * 50 * MS and lk.share == pytest.approx(30 / 50)
    assert lk.verdict == network.GPU_STRAGGLER


def test_late_gpu_is_not_a_slow_link(tmp_path):
    """recv_wait alone is no proof: the receiver waits as long for a sender whose GPU is late."""
    links = judged(make_recording(tmp_path / "r.db", "gpu"))
    lk = links[(2, 3)]
    assert lk.recv_x == pytest.approx(6.0) and lk.send_x == pytest.approx(1.0) and lk.gpu_x == pytest.approx(27.0)
    assert lk.verdict == network.GPU_STRAGGLER
    assert [k for k, v in links.items() if v.verdict] == [(2, 3)]
    assert "slow link" not in network.verdict_line(lk)
    assert network.verdict_line(lk).startswith("GPU straggler: rank 2 on n2 is late producing its data")


def test_healthy_ring_has_no_verdict(tmp_path):
    links = judged(make_recording(tmp_path / "r.db", "healthy"))
    assert links and not any(lk.verdict for lk in links.values())
    assert all(lk.recv_x == pytest.approx(1.0) for lk in links.values())


def test_a_short_wait_is_not_a_slow_link():
    """3× the median but under SHARE of the receiver's time, at either end: not reported."""
    links = []
    for s in range(4):
        lk = network.Link("h", "h", s, (s + 1) % 4, recv={"recv_wait": 1 * MS}, send={"send_wait": 1 * MS},
                          receiver_time_ns=100 * MS)
        links.append(lk)
    links[0].recv["recv_wait"] = links[0].send["send_wait"] = 9 * MS   # 9× the median, 9 % of 100 ms
    assert network.judge(links) == []
    links[0].recv["recv_wait"] = 10 * MS                                 # the receiver 10 %, the sender 9 %
    assert [lk.verdict for lk in network.judge(links)] == [network.UNEXPLAINED]
    links[0].send["send_wait"] = 10 * MS                                 # both 10 %: reported
    assert [lk.verdict for lk in network.judge(links)] == [network.SLOW_LINK]


def test_in_a_ring_every_receiver_waits_and_the_sender_names_the_slow_link():
    """One slow link in a ring: each rank sends on what it received, so every receiver waits
    alike (no recv_wait stands out), but only the slow link's sender waits for the network."""
    links = [network.Link("h", "h", s, (s + 1) % 4, recv={"recv_wait": 40 * MS},
                          send={"send_wait": 1 * MS, "send_gpu_wait": 1 * MS}, receiver_time_ns=100 * MS)
             for s in range(4)]
    links[1].send["send_wait"] = 35 * MS
    assert [(lk.sender, lk.verdict) for lk in network.judge(links)] == [(1, network.SLOW_LINK)]
    links[1].send["send_wait"], links[1].send["send_gpu_wait"] = 1 * MS, 35 * MS   # a slow GPU instead
    assert [(lk.sender, lk.verdict) for lk in network.judge(links)] == [(1, network.GPU_STRAGGLER)]


def test_one_stalled_operation_is_no_slow_link_nor_gpu_straggler():
    """A receiver stopped a moment (SIGSTOP, a debugger) makes its sender wait in one operation:
    most of the link's send_wait in that one is a stall, not a link that slows every operation.
    The same for a sender's GPU that paused once."""
    links = [network.Link("h", "h", s, (s + 1) % 4, recv={"recv_wait": 40 * MS},
                          send={"send_wait": 1 * MS, "send_gpu_wait": 1 * MS}, receiver_time_ns=100 * MS)
             for s in range(4)]
    links[1].send["send_wait"], links[1].send_worst["send_wait"] = 35 * MS, 30 * MS   # 30 of 35 ms in one
    assert network.judge(links) == []
    links[1].send_worst["send_wait"] = 10 * MS                                       # spread: a slow link
    assert [(lk.sender, lk.verdict) for lk in network.judge(links)] == [(1, network.SLOW_LINK)]
    links[1].send["send_wait"], links[1].send["send_gpu_wait"] = 1 * MS, 35 * MS
    links[1].send_worst["send_gpu_wait"] = 34 * MS                                   # the GPU paused once
    assert network.judge(links) == []


def test_a_stall_in_a_recording_is_read_from_its_largest_operation(tmp_path):
    """The worst single operation comes from the recording (nccl_peer_waits' MAX per link)."""
    db = make_recording(tmp_path / "r.db", "slow_link")
    conn = sqlite3.connect(db)
    conn.execute("UPDATE nccl_peer_waits SET wall_ns = 1 WHERE rank = 2 AND phase = 'send_wait' AND seq > 0")
    conn.execute("UPDATE nccl_peer_waits SET wall_ns = ? WHERE rank = 2 AND phase = 'send_wait' AND seq = 0",
                 (OPS * 28 * MS,))
    conn.commit()
    conn.close()
    lk = judged(db)[(2, 3)]
    assert lk.send_worst["send_wait"] == OPS * 28 * MS and lk.send_wait_ns == OPS * 28 * MS + OPS - 1
    assert lk.verdict == network.UNEXPLAINED, "the receiver waited 6×: said, but no slow link named"


def test_two_ranks_compare_the_two_directions():
    """A 2-rank communicator (a pipeline stage's pair): each link against the other way; one
    link alone is compared with nothing."""
    def pair(recv01, send01, gpu01):
        return [network.Link("h", "h", 0, 1, recv={"recv_wait": recv01}, send={"send_wait": send01,
                             "send_gpu_wait": gpu01}, receiver_time_ns=100 * MS),
                network.Link("h", "h", 1, 0, recv={"recv_wait": 5 * MS}, send={"send_wait": 4 * MS,
                             "send_gpu_wait": 1 * MS}, receiver_time_ns=100 * MS)]
    slow = pair(30 * MS, 28 * MS, 1 * MS)
    assert [(lk.sender, lk.verdict) for lk in network.judge(slow)] == [(0, network.SLOW_LINK)]
    assert slow[0].recv_x == pytest.approx(6.0) and slow[1].recv_x == pytest.approx(5 / 30)
    late = pair(30 * MS, 4 * MS, 27 * MS)
    assert [(lk.sender, lk.verdict) for lk in network.judge(late)] == [(0, network.GPU_STRAGGLER)]
    assert network.judge(pair(5 * MS, 4 * MS, 1 * MS)) == []
    assert network.judge(slow[:1]) == [] and network.MIN_PAIRS == 2


def test_sender_not_recorded_is_said_so(tmp_path):
    """One node's recording (rank 2's node not merged): rank 3 waits, the cause is unknown."""
    db = make_recording(tmp_path / "r.db", "slow_link", ranks_recorded=(0, 1, 3))
    lk = judged(db)[(2, 3)]
    assert lk.verdict == network.UNEXPLAINED and not lk.send
    assert "rank 2's side is not in this recording" in network.headline(lk)
    assert any("merge its node's recording" in line for line in network.evidence(lk))


def test_filters(tmp_path):
    db = make_recording(tmp_path / "r.db", "slow_link")
    assert judged(db, op="ALL_GATHER") == {}
    assert judged(db, comm=COMM[:6]) and judged(db, comm=NCCL_HASH[:10])
    assert judged(db, comm="ffff") == {}
    # schema 7: the agent's own communicator id is the label, and a filter too
    db7 = make_recording(tmp_path / "r7.db", "slow_link", version=7)
    assert {lk.label for lk in judged(db7).values()} == {AGENT_ID} and judged(db7, comm=AGENT_ID[:6])


# --- through the CLI ------------------------------------------------------------------------

def test_explain_names_the_slow_link(tmp_path):
    out = explain(make_recording(tmp_path / "r.db", "slow_link"))
    assert out["verdict"] == ("slow link: rank 3 \u2190 rank 2: recv_wait 6.0× the comm's median pair, and rank "
                              "2's send_wait to 3 as high (7.0×); 3 retransmits on 198.18.0.6\u2192198.18.0.7 "
                              f"(on comm {COMM[:8]}\u2026)")
    text = "\n".join(out["evidence"])
    assert "rank 3 on n3 waited 600.0 ms for rank 2's data (recv_wait, wall time) over 20 operations, " \
           "60 % of its time in them; the comm's median pair 100.0 ms" in text
    assert "send_wait (the network taking its data) 560.0 ms" in text


def test_explain_calls_a_late_gpu_a_gpu_straggler(tmp_path):
    out = explain(make_recording(tmp_path / "r.db", "gpu"))
    assert out["verdict"].startswith("GPU straggler: rank 2 on n2 is late producing its data, not the network: "
                                     "rank 3 \u2190 rank 2: recv_wait 6.0×")
    assert "slow link" not in json.dumps(out)
    assert any("send_gpu_wait (its GPU producing the data) 540.0 ms" in e for e in out["evidence"])


def test_explain_names_the_gpu_straggler_before_a_rank_late_on_the_host(tmp_path):
    """In GPU mode the rank after a slow GPU, or the slow GPU's own rank, can look late on the host
    (launches queue behind the GPU): the plugin's waits, in GPU time, name the slow GPU's rank and
    the cause, its GPU."""
    for late in (3, 2):
        out = explain(make_recording(tmp_path / f"r{late}.db", "gpu", host_late=late))
        assert out["verdict"].startswith("GPU straggler: rank 2 on n2 is late producing its data"), out


def test_explain_healthy_says_the_links_were_looked_at(tmp_path):
    out = explain(make_recording(tmp_path / "r.db", "healthy"))
    assert out["verdict"].startswith("no straggler")
    assert any(e.startswith("network waits (profiler plugin): 4 links measured, no receiver waited")
               for e in out["evidence"])


def test_explain_one_nodes_recording_without_collectives(tmp_path):
    """Only rank 3 recorded: no collective on two ranks, but its wait on rank 2 is told."""
    out = explain(make_recording(tmp_path / "r.db", "slow_link", ranks_recorded=(0, 1, 3)))
    assert out["verdict"].startswith("network wait: rank 3 waits for rank 2's data")


def test_stragglers_links_table(tmp_path):
    db = make_recording(tmp_path / "r.db", "slow_link")
    p = cli("stragglers", db, "--links", "--format", "json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert [(r["receiver"], r["sender"]) for r in rows][0] == (3, 2) and len(rows) == 4
    top = rows[0]
    assert top == {"comm": COMM, "receiver": 3, "sender": 2, "receiver_node": "n3", "sender_node": "n2",
                   "operations": 20, "recv_wait_ms": 600.0, "recv_wait_x": 6.0, "recv_share_pct": 60.0,
                   "send_wait_ms": 560.0, "send_wait_x": 7.0, "send_gpu_wait_ms": 20.0, "send_gpu_wait_x": 1.0,
                   "bytes": 81920, "retransmits": 3, "verdict": "slow link"}
    assert all(r["verdict"] == "" for r in rows[1:])
    p = cli("stragglers", db, "--links", "--op", "broadcast")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no network waits match --op broadcast" in p.stderr


def test_stragglers_per_rank_points_at_the_slow_link(tmp_path):
    """The per-rank table cannot show a link: a line on stderr names it, stdout stays the table."""
    p = cli("stragglers", make_recording(tmp_path / "r.db", "slow_link"), "--format", "json")
    assert p.returncode == 0 and len(json.loads(p.stdout)) == NRANKS, p.stderr
    assert p.stderr == ("nccl-exporter: network waits: slow link: rank 3 \u2190 rank 2: recv_wait 6.0× the comm's "
                        "median pair, and rank 2's send_wait to 3 as high (7.0×); 3 retransmits on "
                        "198.18.0.6\u2192198.18.0.7 ('stragglers --links')\n")
    p = cli("stragglers", make_recording(tmp_path / "h.db", "healthy"))
    assert p.returncode == 0 and p.stderr == ""


def test_stragglers_links_refuses_in_one_line_where_there_are_none(tmp_path):
    old = make_recording(tmp_path / "old.db", "slow_link", version=6)
    p = cli("stragglers", old, "--links")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "schema 6 predates the nccl_peer_waits table" in p.stderr and "Traceback" not in p.stderr
    empty = make_recording(tmp_path / "empty.db", "healthy", ranks_recorded=())
    p = cli("stragglers", empty, "--links")
    assert p.returncode == 2 and "holds no network waits" in p.stderr and p.stderr.count("\n") == 1
    p = cli("stragglers", old, "--links", "--collectives")
    assert p.returncode == 2 and "not allowed with" in p.stderr


# --- old recordings and the documented queries ------------------------------------------------

def test_old_recording_still_opens(tmp_path):
    """Schema 6 (no nccl_peer_waits): explain, stragglers and query answer as before."""
    old = make_recording(tmp_path / "old.db", "slow_link", version=6)
    out = explain(old)
    assert out["verdict"].startswith("no straggler") and "network waits" not in json.dumps(out)
    p = cli("stragglers", old, "--format", "json")
    assert p.returncode == 0 and len(json.loads(p.stdout)) == NRANKS, p.stderr
    conn = sqlite3.connect(old)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 6
    assert not network.available(Recording(conn)) and network.load(Recording(conn)) == []
    conn.close()


@pytest.mark.parametrize("version", [6, schema.SCHEMA_VERSION])
def test_documented_queries_run(tmp_path, version):
    """Every query of docs/queries.md runs on a recording of `version`; those on
    nccl_peer_waits need schema 7 and answer an old one with a one-line error."""
    from test_queries import documented_queries

    db = make_recording(tmp_path / "r.db", "slow_link", version=version)
    queries = documented_queries()
    assert any("nccl_peer_waits" in sql for sql in queries.values())
    for name, sql in queries.items():
        p = cli("query", db, sql, "--format", "json")
        if "nccl_peer_waits" in sql and version < 7:
            assert p.returncode == 2 and "no such table: nccl_peer_waits" in p.stderr, name
            continue
        assert p.returncode == 0, f"{name}: {p.stderr}"


def test_documented_slow_link_query_names_the_link(tmp_path):
    from test_queries import documented_queries

    db = make_recording(tmp_path / "r.db", "slow_link")
    p = cli("query", db, documented_queries()["slow-links"], "--format", "json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert (rows[0]["receiver"], rows[0]["sender"]) == (3, 2)
    assert rows[0]["recv_wait_ms"] == 600.0 and rows[0]["send_wait_ms"] == 560.0


def test_a_window_keeps_the_gpu_operations_and_network_waits_of_the_window(tmp_path):
    """The query endpoint's window (`explain --nodes --since`): GPU operations that started in it
    and their per-peer waits, not the whole recording's (a live agent's recording holds every job
    it saw: an earlier job's slow link must not be this window's verdict)."""
    from exporter.sinks.recording.window import window_copy

    db = make_recording(tmp_path / "r.db", "slow_link")
    window_copy(db, str(tmp_path / "w.db"), T0 + 1000 * MS, None)   # operations 10..19 of 20
    conn = sqlite3.connect(tmp_path / "w.db")
    try:
        assert conn.execute("SELECT MIN(seq), COUNT(DISTINCT seq) FROM gpu_intervals").fetchone() == (10, 10)
        assert conn.execute("SELECT MIN(seq), COUNT(DISTINCT seq) FROM nccl_peer_waits").fetchone() == (10, 10)
    finally:
        conn.close()
    window_copy(db, str(tmp_path / "none.db"), T0 + 10_000 * MS, None)  # after the job: nothing of it
    conn = sqlite3.connect(tmp_path / "none.db")
    try:
        assert conn.execute("SELECT COUNT(*) FROM nccl_peer_waits").fetchone() == (0,)
    finally:
        conn.close()
    assert not explain(tmp_path / "none.db")["verdict"].startswith("slow link")


def test_a_window_copy_reads_each_network_wait_once(tmp_path, monkeypatch):
    """The endpoint's window of a long GPU job: each per-peer wait row of the recording finds its
    operation among the window's by an index, so a window twice as long costs about the same
    (it cost recording x window: explain --nodes on a live agent outran its node timeout). Counted
    in SQLite virtual-machine steps, not seconds."""
    from exporter.sinks.recording import window

    ops, t0 = 400, 1_700_000_000_000_000_000
    db = tmp_path / "long.db"
    conn = sqlite3.connect(db, isolation_level=None)
    schema.migrate(conn)
    conn.execute("BEGIN")
    for i in range(ops):
        for r in range(NRANKS):
            ts = t0 + i * MS
            conn.execute(schema.INSERT["gpu"], (100 + r, NCCL_HASH, "ALL_REDUCE", i, "coll", r, None, ts, ts, MS,
                                                f"n{r}", 4096))
            for phase in ("send_gpu_wait", "send_peer_wait", "send_wait"):
                conn.execute(schema.INSERT["peer_waits"], (100 + r, NCCL_HASH, "ALL_REDUCE", i, "coll", r,
                                                           (r + 1) % NRANKS, "send", phase, MS, MS, 0, f"n{r}"))
    conn.execute("COMMIT")
    conn.close()
    steps = []
    connect = sqlite3.connect

    def counted(*a, **kw):
        c = connect(*a, **kw)
        c.set_progress_handler(lambda: steps.append(1) and 0, 1000)
        return c

    monkeypatch.setattr(window.sqlite3, "connect", counted)
    cost = {}
    for share in (10, 20):
        steps.clear()
        window.window_copy(str(db), str(tmp_path / f"w{share}.db"), t0 + ops * (100 - share) // 100 * MS, None)
        cost[share] = len(steps)
        w = connect(tmp_path / f"w{share}.db")
        try:
            assert w.execute("SELECT COUNT(*) FROM nccl_peer_waits").fetchone() == (3 * NRANKS * ops * share // 100,)
            assert not w.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (window._WINDOW_KEY,)).fetchall()
        finally:
            w.close()
    assert cost[20] < 1.5 * cost[10], cost

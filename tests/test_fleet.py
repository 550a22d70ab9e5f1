"""The node query endpoint and the fleet fan-out (docs/fleet-live.md).

Hundreds of light in-process endpoints on loopback run the real handler
(exporter/sinks/recording/endpoint.py: auth, read-only guard, caps, streaming)
over small recordings made by the real Recorder; some are slow, dead,
hanging or want another token. One test starts a real `nccl-exporter run
--db --query-listen` (root).
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import sqlite3
import subprocess
import time
import tracemalloc
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from exporter.records.events import CallEvent
from exporter.sinks.recording.writer import Recorder
from exporter.cli import main as cli_main
from exporter.offline.fleet import client
from exporter.sinks.recording.endpoint import EndpointError, Handler, QueryEndpoint

TOKEN = "s3cret-token"
T0 = 1_700_000_000_000_000_000
NODES = 200


def ev(i, dur_ns=500_000, rank=3, pid=100, op="ALL_REDUCE"):
    return CallEvent(kind=1, op=op, pid=pid, tid=pid, start_ns=i * 1000, end_ns=i * 1000 + dur_ns,
                     start_real_ns=T0 + i * 1_000_000, comm_ptr=1, comm=0xAB, nccl_comm_hash=0xCD,
                     seq=i, rank=rank, nranks=8, count=4, bytes=16, datatype=7, red_op=0, root=-1,
                     peer=-1, stream=0x10, result=0, color=-1)


def make_recording(path, n, dur_ns=500_000, node="n"):
    r = Recorder(str(path), node=node, identify_processes=False)
    for i in range(n):
        r(ev(i, dur_ns))
    r.close()
    return str(path)


class DelayHandler(Handler):
    """The real handler, answering after the endpoint's `delay` seconds."""

    def do_POST(self):
        time.sleep(getattr(self.server.endpoint, "delay", 0))
        super().do_POST()


@pytest.fixture(scope="module")
def recs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet")
    return {"small": make_recording(d / "small.db", 100),
            "big": make_recording(d / "big.db", 2000),
            "outlier": make_recording(d / "outlier.db", 100, dur_ns=30_000_000)}


@contextlib.contextmanager
def endpoints(dbs, token=TOKEN, **kw):
    eps = []
    try:
        for i, db in enumerate(dbs):
            eps.append(QueryEndpoint(db, f"node-{i:03d}", token, handler=DelayHandler, **kw).start())
        yield eps
    finally:
        with ThreadPoolExecutor(64) as pool:  # each close waits up to a poll interval
            list(pool.map(QueryEndpoint.close, eps))


_DEAD: list[socket.socket] = []  # bound, never listening: connecting is refused, and no call reuses the port


def dead_url():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _DEAD.append(s)
    return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def hanging_url():
    """Accepts connections (the kernel's backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


def post(url, body, token=TOKEN, path="/api/v1/query"):
    req = urllib.request.Request(url + path, data=body.encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def ndjson(text):
    return [json.loads(line) for line in text.splitlines()]


def cli(capsys, *argv):
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_text(TOKEN + "\n")
    return p


# --- the endpoint -------------------------------------------------------------------

def test_rows_stream_as_ndjson_with_columns_first_and_a_trailer(recs):
    with endpoints([recs["small"]]) as (ep,):
        code, text = post(ep.url, "SELECT seq, duration_ns FROM nccl_events ORDER BY seq LIMIT 3")
        assert code == 200
        lines = ndjson(text)
        assert lines[0] == ["seq", "duration_ns"]
        assert lines[1:4] == [[0, 500000], [1, 500000], [2, 500000]]
        assert lines[4] == {"node": "node-000", "rows": 3, "complete": True}
        code, text = post(ep.url, json.dumps({"sql": "SELECT COUNT(*) AS n FROM nccl_events"}))
        assert code == 200 and ndjson(text)[1] == [100]


def test_a_bearer_token_is_required(recs):
    with endpoints([recs["small"]]) as (ep,):
        for token in (None, "wrong"):
            for path, body in (("/api/v1/query", "SELECT 1"), ("/api/v1/time", None),
                               ("/api/v1/recording", None)):
                code, text = post(ep.url, body, token=token, path=path)
                assert code == 401, (token, path, code, text)
                assert json.loads(text)["node"] == "node-000"


@pytest.mark.parametrize("sql, word", [
    ("INSERT INTO meta (key, value) VALUES ('x', 'y')", "INSERT"),
    ("DELETE FROM nccl_events", "DELETE"),
    ("UPDATE nccl_events SET rank = 0", "UPDATE"),
    ("CREATE TEMP TABLE t AS SELECT 1", "refused"),
    ("DROP TABLE nccl_events", "refused"),
    ("ATTACH DATABASE '/tmp/x.db' AS x", "ATTACH"),
    ("PRAGMA user_version = 99", "PRAGMA"),
    ("PRAGMA journal_mode = DELETE", "PRAGMA"),
    ("VACUUM", "VACUUM"),
    ("SELECT load_extension('/tmp/evil.so')", "extension"),
    ("SELECT 1; DELETE FROM nccl_events", "one statement"),
])
def test_writes_are_refused_with_400_naming_the_node(recs, sql, word):
    with endpoints([recs["small"]]) as (ep,):
        code, text = post(ep.url, sql)
        assert code == 400, text
        err = json.loads(text)
        assert err["node"] == "node-000"
        assert word.lower() in err["error"].lower(), err
        assert ndjson(post(ep.url, "SELECT COUNT(*) FROM nccl_events")[1])[1] == [100]


def test_bad_sql_is_a_400_with_the_problem(recs):
    with endpoints([recs["small"]]) as (ep,):
        code, text = post(ep.url, "SELECT * FROM no_such_table")
        assert code == 400
        assert json.loads(text) == {"node": "node-000", "error": "SQL error: no such table: no_such_table"}
        assert post(ep.url, "")[0] == 400
        assert post(ep.url, json.dumps({"nosql": 1}))[0] == 400


def test_row_byte_and_time_caps(recs):
    with endpoints([recs["big"]], max_rows=10) as (ep,):
        lines = ndjson(post(ep.url, "SELECT seq FROM nccl_events")[1])
        assert len(lines) == 12 and lines[-1]["complete"] is False
        assert lines[-1]["truncated"] == "row cap 10"
        # a client may ask for fewer, never more
        lines = ndjson(post(ep.url, json.dumps({"sql": "SELECT seq FROM nccl_events", "max_rows": 3}))[1])
        assert lines[-1] == {"node": "node-000", "rows": 3, "complete": False, "truncated": "row cap 3"}
    with endpoints([recs["big"]], max_bytes=10_000) as (ep,):
        text = post(ep.url, "SELECT * FROM nccl_events")[1]
        assert len(text) < 11_000
        assert ndjson(text)[-1]["truncated"] == "byte cap 10000"
    with endpoints([recs["small"]], time_limit=0.3) as (ep,):
        t = time.monotonic()
        code, text = post(ep.url, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                                  "SELECT MAX(x) FROM c")
        assert time.monotonic() - t < 3
        assert code == 400 and "time limit of 0.3 s" in json.loads(text)["error"]
        code, text = post(ep.url, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                                  "SELECT x FROM c")
        assert code == 200
        # whichever cap comes first cuts the endless answer; the trailer names it and counts the rows sent
        lines = ndjson(text)
        trailer = lines[-1]
        assert trailer["complete"] is False and trailer["rows"] == len(lines) - 2 >= 1
        assert trailer["truncated"] in ("time limit of 0.3 s reached", "row cap 100000")
        assert trailer["rows"] == 100000 or trailer["truncated"].startswith("time")


def test_tls_is_required_off_loopback_and_a_token_always(recs):
    with pytest.raises(EndpointError, match="needs --query-tls-cert"):
        QueryEndpoint(recs["small"], "n", TOKEN, host="0.0.0.0")
    with pytest.raises(EndpointError, match="token"):
        QueryEndpoint(recs["small"], "n", "", host="127.0.0.1")


def test_tls_with_a_ca_file(recs, tmp_path, capsys, token_file):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    ep = QueryEndpoint(recs["small"], "tls-node", TOKEN, host="127.0.0.1",
                       tls_cert=str(cert), tls_key=str(key)).start()
    try:
        assert ep.url.startswith("https://")
        code, out, err = cli(capsys, "fleet", "query", "--nodes", ep.url, "--token-file", token_file,
                             "--ca-file", cert, "--format", "csv", "SELECT COUNT(*) AS n FROM nccl_events")
        assert code == 0 and out.splitlines() == ["node,n", "tls-node,100"], err
        # without the CA: one warning naming the node, exit 1
        code, out, err = cli(capsys, "fleet", "query", "--nodes", ep.url, "--token-file", token_file,
                             "SELECT 1")
        assert code == 1 and "TLS" in err and "127.0.0.1" in err
    finally:
        ep.close()


# --- fan-out -------------------------------------------------------------------------

def test_fan_out_to_200_nodes_is_parallel_and_survives_bad_nodes(recs, capsys, token_file):
    """~ceil(nodes/concurrency) x the slowest, not the sum; each failing node: one warning line."""
    good = NODES - 10
    with endpoints([recs["small"]] * good) as eps, \
            endpoints([recs["small"]] * 3, token="another-token") as wrong_token, \
            hanging_url() as hang1, hanging_url() as hang2:
        for i, e in enumerate(eps):
            e.delay = 1.0 if i % 40 == 7 else 0.25   # 5 slow ones
        dead = [dead_url() for _ in range(3)]
        hanging = [hang1, hang2]
        bad_sql = QueryEndpoint(recs["small"], "old-schema", TOKEN).start()
        try:
            urls = [e.url for e in eps] + [e.url for e in wrong_token] + dead + hanging + [bad_sql.url]
            assert len(urls) == NODES - 1
            nodes_file = token_file.parent / "nodes.txt"
            nodes_file.write_text("# the fleet\n" + "\n".join(urls) + "\n")
            t = time.monotonic()
            code, out, err = cli(capsys, "fleet", "query", "--nodes-file", nodes_file,
                                 "--nodes", bad_sql.url,  # given twice: asked once
                                 "--token-file", token_file, "--concurrency", 64, "--timeout", "2s",
                                 "--format", "csv", "SELECT COUNT(*) AS n, MAX(seq) AS top FROM nccl_events")
            wall = time.monotonic() - t
        finally:
            bad_sql.close()
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "node,n,top"
    assert sorted(lines[1:]) == sorted(f"node-{i:03d},100,99" for i in range(good)) + ["old-schema,100,99"] \
        or len(lines) == good + 2
    warnings = [w for w in err.splitlines() if "warning" in w]
    assert len(warnings) == 3 + 3 + 2, err
    for u in dead:
        assert sum(u.split("//")[1] in w and "connection refused" in w for w in warnings) == 1
    for u in hanging:
        assert sum(u.split("//")[1] in w and "timed out" in w for w in warnings) == 1
    assert sum("HTTP 401" in w for w in warnings) == 3
    assert f"{good + 1} of {NODES - 1} nodes answered" in err
    # sequentially: 185 x 0.25 s + 5 x 1 s + 2 x 2 s timeouts = 55 s
    serial = (good - 5) * 0.25 + 5 * 1.0 + 2 * 2.0
    ideal = math.ceil(NODES / 64) * 1.0
    print(f"\nfan-out: {NODES - 1} nodes, concurrency 64: {wall:.2f} s "
          f"(serial sum {serial:.1f} s, ceil(n/c) x slowest {ideal:.1f} s)")
    assert wall < 0.4 * serial
    assert wall < ideal + 4.5


def test_no_node_answering_is_exit_1(capsys, token_file):
    code, out, err = cli(capsys, "fleet", "query", "--nodes", f"{dead_url()},{dead_url()}",
                         "--token-file", token_file, "SELECT 1")
    assert code == 1 and out == ""
    assert err.count("warning") == 2 and "0 of 2 nodes answered" in err


def _serve_many(db, n, pipe):
    """In a child process: n endpoints on db; sends their URLs, closes them when told."""
    eps = [QueryEndpoint(db, f"node-{i:03d}", TOKEN, time_limit=300).start() for i in range(n)]
    pipe.send([e.url for e in eps])
    pipe.recv()
    with ThreadPoolExecutor(64) as pool:
        list(pool.map(QueryEndpoint.close, eps))


@pytest.mark.slow   # a load test, not logic: 80 MB through 200 real endpoints (7 s, mostly CPU)
def test_memory_stays_bounded_while_200_nodes_stream(recs):
    """200 nodes x 500 rows of ~1 KB (about 80 MB of NDJSON) through the fan-out: the client's
    traced peak stays a small fraction of it (the nodes run in another process)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve_many, args=(recs["big"], NODES, there), daemon=True)
    proc.start()
    try:
        assert here.poll(60), "the endpoints did not start"
        urls = here.recv()
        sql = "SELECT *, hex(randomblob(300)) AS pad FROM nccl_events LIMIT 500"
        opts = client.FleetOptions(token=TOKEN, concurrency=64, timeout=30)
        tracemalloc.start()
        try:
            rows = nbytes = 0
            t = time.monotonic()
            for ev_ in client.stream_query(urls, sql, opts):
                if ev_.kind == "rows":
                    rows += len(ev_.rows)
                    nbytes += len(json.dumps(ev_.rows))
                elif ev_.kind == "done":
                    assert ev_.result.ok and not ev_.result.truncated, ev_.result
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        wall = time.monotonic() - t
    finally:
        here.send("stop")
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    print(f"\nmemory: {rows} rows, {nbytes / 1e6:.0f} MB of NDJSON from {NODES} nodes in {wall:.1f} s; "
          f"client tracemalloc peak {peak / 1e6:.1f} MB")
    assert rows == NODES * 500
    assert nbytes > 60e6
    assert peak < 16e6 and peak < nbytes / 5


def test_summary_puts_the_outlier_first(recs, capsys, token_file):
    with endpoints([recs["small"]] * 9 + [recs["outlier"]]) as eps:
        code, out, err = cli(capsys, "fleet", "query", "--nodes", ",".join(e.url for e in eps),
                             "--token-file", token_file, "--summary", "--format", "json",
                             "SELECT op, duration_ns / 1e6 AS ms FROM nccl_events")
    assert code == 0, err
    rows = json.loads(out)
    assert len(rows) == 10
    top = rows[0]
    assert top["node"] == "node-009" and top["p50_ms"] == 30.0 and top["rows"] == 100
    assert top["x_fleet_median"] == 60.0
    assert all(r["p50_ms"] == 0.5 for r in rows[1:])


def test_clock_estimate_recovers_a_known_skew(recs, capsys, token_file):
    skews = [0, 50_000_000, -50_000_000]
    eps = [QueryEndpoint(recs["small"], f"clock-{i}", TOKEN, clock=lambda s=s: time.time_ns() + s).start()
           for i, s in enumerate(skews)]
    try:
        code, out, err = cli(capsys, "fleet", "query", "--nodes", ",".join(e.url for e in eps),
                             "--token-file", token_file, "--clock", "--format", "json")
    finally:
        for e in eps:
            e.close()
    assert code == 0, err
    got = {r["node"]: r for r in json.loads(out)}
    for i, s in enumerate(skews):
        r = got[f"clock-{i}"]
        assert abs(r["clock_offset_ms"] - s / 1e6) <= r["clock_pm_ms"] + 1.0, r
        assert r["clock_pm_ms"] == pytest.approx(r["best_rtt_ms"] / 2, abs=0.002)


def test_columns_that_differ_leave_that_node_out(recs, capsys, token_file, tmp_path):
    other = tmp_path / "other.db"
    make_recording(other, 5)
    con = sqlite3.connect(other)
    con.execute("CREATE VIEW v AS SELECT 1 AS something_else")
    con.commit()
    con.close()
    with endpoints([recs["small"], str(other)]) as eps:
        code, out, err = cli(capsys, "fleet", "query", "--nodes", ",".join(e.url for e in eps),
                             "--token-file", token_file, "--format", "csv", "SELECT COUNT(*) AS n FROM nccl_events")
    assert code == 0 and sorted(out.splitlines()) == ["node,n", "node-000,100", "node-001,5"]


@pytest.mark.parametrize("argv, message", [
    (["fleet", "query", "SELECT 1"], "no nodes"),
    (["fleet", "query", "--nodes", "ftp://x:1", "SELECT 1"], "not a node URL"),
    (["fleet", "query", "--nodes", "http://x:1"], "give the SQL"),
    (["fleet", "query", "--nodes-file", "/nonexistent", "SELECT 1"], "--nodes-file"),
    (["fleet", "query", "--nodes", "http://x:1", "--token-file", "/nonexistent", "SELECT 1"], "--token-file"),
    (["fleet", "fetch", "--nodes", "http://x:1", "-o", "/tmp/x", "--since", "yesterday"], "--since"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    code, out, err = cli(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


# --- fetch ---------------------------------------------------------------------------

def test_fetch_writes_openable_recordings_whole_or_windowed(recs, capsys, token_file, tmp_path):
    with endpoints([recs["small"]] * 3) as eps:
        urls = ",".join([e.url for e in eps] + [dead_url()])
        code, out, err = cli(capsys, "fleet", "fetch", "--nodes", urls, "--token-file", token_file,
                             "-o", tmp_path / "all")
        assert code == 0 and err.count("warning") == 1
        for i in range(3):
            con = sqlite3.connect(tmp_path / "all" / f"node-{i:03d}.db")
            assert con.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0] == 100
            assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        # a window: calls 10..19 (timestamps T0 + i ms)
        code, out, err = cli(capsys, "fleet", "fetch", "--nodes", eps[0].url, "--token-file", token_file,
                             "-o", tmp_path / "win", "--since", T0 + 10_000_000, "--until", T0 + 19_000_000)
        assert code == 0, err
        con = sqlite3.connect(tmp_path / "win" / "node-000.db")
        assert [r[0] for r in con.execute("SELECT seq FROM nccl_events ORDER BY seq")] == list(range(10, 20))
        meta = dict(con.execute("SELECT key, value FROM meta"))
        assert meta["window_since_ns"] == str(T0 + 10_000_000) and meta["node"] == "n"
        # the fetched file answers the ordinary query command
        code, out, err = cli(capsys, "query", tmp_path / "win" / "node-000.db", "SELECT COUNT(*) AS n FROM nccl_events",
                             "--format", "csv")
        assert out.splitlines() == ["n", "10"]


# --- a real agent ---------------------------------------------------------------------

def test_real_agent_answers_queries_on_its_recording(tmp_path, token_file, capsys, launch_exporter, simulator_lib):
    """`nccl-exporter run --db --query-listen 127.0.0.1:P` with the simulator's libnccl
    (root)."""
    from conftest import free_port

    lib = simulator_lib
    qport = free_port()
    db = tmp_path / "agent.db"
    with launch_exporter("--db", db, "--query-listen", f"127.0.0.1:{qport}",
                          "--query-token-file", token_file, "--nccl-lib", lib) as exporter:
        url = f"http://127.0.0.1:{qport}"
        deadline = time.monotonic() + 30
        while True:
            try:
                code, text = post(url, "SELECT COUNT(*) AS n FROM nccl_events")
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise AssertionError(exporter.output()) from None
                time.sleep(0.2)
        assert code == 200, text
        assert ndjson(text)[0] == ["n"]
        assert post(url, "SELECT 1", token="bad")[0] == 401
        code, text = post(url, "DELETE FROM nccl_events")
        assert code == 400 and "refused: DELETE" in text
        code, out, err = cli(capsys, "fleet", "query", "--nodes", url, "--token-file", token_file,
                             "--clock", "--format", "csv", "SELECT key FROM meta WHERE key = 'node'")
        assert code == 0 and out.splitlines()[1].endswith(",node"), (out, err)
        code, out, err = cli(capsys, "fleet", "fetch", "--nodes", url, "--token-file", token_file,
                             "-o", tmp_path / "fetched")
        assert code == 0, err
        assert "read-only queries at" in exporter.output()


@pytest.mark.parametrize("argv, message", [
    (["--query-listen", "127.0.0.1:1"], "needs --db"),
    (["--db", "x.db", "--query-listen", "127.0.0.1:1"], "needs --query-token-file"),
    (["--db", "x.db", "--query-listen", "0.0.0.0:9402", "--query-token-file", "TOKEN"], "not loopback-only"),
    (["--db", "x.db", "--query-token-file", "TOKEN"], "need --query-listen"),
    (["--db", "x.db", "--query-listen", "127.0.0.1:1", "--query-token-file", "/nonexistent"],
     "--query-token-file /nonexistent"),
])
def test_run_checks_the_query_options_before_starting(capsys, token_file, argv, message):
    """Refused before the agent starts (no root needed): one line, exit 2."""
    argv = [str(token_file) if a == "TOKEN" else a for a in argv]
    code, out, err = cli(capsys, "run", "--listen", "127.0.0.1:1", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err

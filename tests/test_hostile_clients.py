"""Hostile and slow clients against the node query endpoint, /metrics, fleet, merge
and MCP (docs/fleet-live.md "Limits", docs/architecture.md "Serving HTTP").

Everything runs on loopback against the real servers (exporter/sinks/serving.py
under sinks/http.py and sinks/recording/endpoint.py) and small recordings made by the
real Recorder; the memory test runs the endpoint in a child process and reads its
peak RSS from /proc. No BPF, no agent: no lock needed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from exporter.sinks import serving
from exporter.sinks.http import HttpServer
from exporter.sinks.recording import query
from exporter.sinks.recording.writer import Recorder
from exporter.sinks.recording.endpoint import LIMITS, QueryEndpoint
from tests.test_fleet import TOKEN, cli, ev, make_recording, post

AUTH = f"Authorization: Bearer {TOKEN}\r\n"


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return make_recording(tmp_path_factory.mktemp("hostile") / "rec.db", 2000)


@pytest.fixture(scope="module")
def big_db(tmp_path_factory):
    """About 8 MB: more than any socket buffers hold."""
    return make_recording(tmp_path_factory.mktemp("hostile-big") / "big.db", 40_000)


@contextlib.contextmanager
def endpoint(db, **kw):
    ep = QueryEndpoint(db, "node-a", TOKEN, **kw).start()
    try:
        yield ep
    finally:
        ep.close()


def raw(port, data: bytes, timeout=10.0, host="127.0.0.1") -> bytes:
    """Send bytes, read the whole answer (until the server closes)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else -1


def query_request(body: str) -> bytes:
    b = body.encode()
    return (f"POST /api/v1/query HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: {len(b)}\r\n\r\n").encode() + b


# --- bad input gets a 4xx with one line --------------------------------------------

@pytest.mark.parametrize("body", [
    '{"sql": "SELECT 1", "max_rows": 1e999}',
    '{"sql": "SELECT 1", "max_rows": -1e999}',
    '{"sql": "SELECT 1", "a": ' + "[" * 20000 + "]" * 20000 + "}",
], ids=["max_rows_inf", "max_rows_minus_inf", "nested_20000"])
def test_bad_json_bodies_get_a_400(db, body):
    with endpoint(db) as ep:
        answer = raw(ep.port, query_request(body))
    assert status_of(answer) == 400, answer[:200]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert "max_rows" in error or "nested too deep" in error
    assert "\n" not in error


@pytest.mark.parametrize("since", ["99999999999999999999999", "9999-12-31T23:59:59Z", "0001-01-01",
                                   "-99999999999999999999999"])
def test_recording_window_out_of_range_gets_a_400(db, since):
    with endpoint(db) as ep:
        req = f"GET /api/v1/recording?since={since} HTTP/1.1\r\nHost: x\r\n{AUTH}\r\n".encode()
        answer = raw(ep.port, req)
    assert status_of(answer) == 400, answer[:200]
    assert b"out of range" in answer


def test_pragma_table_info_and_dbstat_are_answered(db):
    names, rows = query.run(db, "SELECT name FROM pragma_table_info('nccl_events')")
    assert ("duration_ns",) in rows
    names, rows = query.run(db, "SELECT COUNT(*) FROM dbstat")
    assert rows[0][0] > 0
    with pytest.raises(query.QueryError, match="refused: PRAGMA writable_schema"):
        query.run(db, "PRAGMA writable_schema = 1")


# --- memory ------------------------------------------------------------------------

ENDPOINT_CHILD = """
import sys
from exporter.sinks.recording.endpoint import QueryEndpoint
ep = QueryEndpoint(sys.argv[1], "child", sys.argv[2]).start()
print(ep.port, flush=True)
sys.stdin.read()
"""


def peak_rss_mb(pid) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_huge_values_do_not_grow_the_endpoint(db):
    proc = subprocess.Popen([sys.executable, "-c", ENDPOINT_CHILD, db, TOKEN], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}"
        base = peak_rss_mb(proc.pid)
        for sql in ["SELECT zeroblob(200000000)", "SELECT printf('%.*c', 200000000, 'x')",
                    "SELECT length(zeroblob(200000000))"]:
            code, text = post(url, json.dumps({"sql": sql}))
            # refused with one line, or answered without the value ever existing
            assert code in (200, 400), text
            if code == 400:
                assert "too big" in json.loads(text)["error"]
        grown = peak_rss_mb(proc.pid) - base
        assert grown < 64, f"the endpoint's peak RSS grew by {grown:.0f} MB"
    finally:
        proc.stdin.close()
        proc.wait(10)


# --- slow and stuck clients ----------------------------------------------------------------

def stuck_reader(port, request: bytes) -> socket.socket:
    """A client that sends its request and then never reads (a tiny receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(request)
    return s


def drain(s, timeout=10.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(1 << 20):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out


def test_a_client_that_stops_reading_loses_its_query_at_the_time_limit(db):
    sql = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
           "SELECT x, printf('%.500c', 'x') FROM c")
    with endpoint(db, time_limit=1.0) as ep:
        s = stuck_reader(ep.port, query_request(json.dumps({"sql": sql})))
        time.sleep(1.0 + 2.0 + 1.5)  # the time limit, the write grace, and some
        t0 = time.monotonic()
        got = drain(s)
        s.close()
    # The server gave the answer up: the stream ends without its trailer, at once.
    assert time.monotonic() - t0 < 3
    last = got.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    assert b'"complete"' not in last, last[:200]


def test_downloads_that_never_read_do_not_block_the_next(big_db):
    """Both workers (LIMITS.workers) held by downloads nobody reads; the write
    timeout is shortened from 10 s to 3 s so the test waits less, not less strictly."""
    assert LIMITS.workers == 2
    limits = serving.Limits(**{**LIMITS.__dict__, "write_timeout": 3.0})
    request = f"GET /api/v1/recording HTTP/1.1\r\nHost: x\r\n{AUTH}\r\n".encode()
    with endpoint(big_db, limits=limits) as ep:
        stuck = [stuck_reader(ep.port, request) for _ in range(2)]
        time.sleep(1.0)  # both copies prepared, both writes stuck
        t0 = time.monotonic()
        req = urllib.request.Request(ep.url + "/api/v1/recording", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=limits.write_timeout + 20) as r:
            assert r.status == 200
            assert len(r.read()) == int(r.headers["Content-Length"])
        # at worst it waits for a stuck one's write deadline; never a 503
        assert time.monotonic() - t0 < limits.write_timeout + 10
        for s in stuck:
            s.close()


def test_idle_connections_hold_no_threads(db):
    before = threading.active_count()
    with endpoint(db) as ep:
        conns = [socket.create_connection(("127.0.0.1", ep.port)) for _ in range(400)]
        time.sleep(0.5)
        held = threading.active_count() - before
        code, _ = post(ep.url, "SELECT 1")  # and a query still gets through
        for c in conns:
            c.close()
    assert held <= LIMITS.workers + 2, f"{held} threads for 400 idle connections"
    assert code == 200


def test_a_short_body_is_answered_408_after_the_body_timeout(db):
    """The endpoint's body timeout (LIMITS.body_timeout, 10 s; 1 s here, so the test
    waits less): the 408 comes when it passes, not before and not much later."""
    limits = serving.Limits(**{**LIMITS.__dict__, "body_timeout": 1.0})
    with endpoint(db, limits=limits) as ep:
        s = socket.create_connection(("127.0.0.1", ep.port), timeout=limits.body_timeout + 8)
        t0 = time.monotonic()
        s.sendall(f"POST /api/v1/query HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 100\r\n\r\nSELECT 1".encode())
        answer = drain(s, timeout=limits.body_timeout + 8)
        waited = time.monotonic() - t0
        s.close()
    assert status_of(answer) == 408, answer[:200]
    assert limits.body_timeout - 0.05 < waited < limits.body_timeout + 3


def test_idle_connections_are_closed_after_the_idle_timeout(db):
    limits = serving.Limits(**{**LIMITS.__dict__, "idle_timeout": 1.0})
    with endpoint(db, limits=limits) as ep:
        s = socket.create_connection(("127.0.0.1", ep.port), timeout=8)
        t0 = time.monotonic()
        assert drain(s, timeout=8) == b""
        s.close()
    assert time.monotonic() - t0 < 4


@contextlib.contextmanager
def metrics_server(host="127.0.0.1", limits=None):
    registry = CollectorRegistry()
    Counter("hostile_test", "a counter", registry=registry).inc()
    server = HttpServer(host, 0, registry, **({"limits": limits} if limits else {}))
    try:
        yield server
    finally:
        server.shutdown()


def test_http09_request_is_answered_at_once():
    with metrics_server() as server:
        t0 = time.monotonic()
        answer = raw(server.port, b"GET /metrics\r\n", timeout=8)
    assert status_of(answer) == 400, answer[:200]
    assert time.monotonic() - t0 < 2


def test_slow_request_head_gets_408():
    limits = serving.Limits(**{**serving.Limits().__dict__, "header_timeout": 1.0})
    with metrics_server(limits=limits) as server:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=8)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        answer = drain(s, timeout=8)
        s.close()
    assert status_of(answer) == 408


def test_huge_request_head_gets_431():
    with metrics_server() as server:
        answer = raw(server.port, b"GET /metrics HTTP/1.1\r\n" + b"X-A: " + b"a" * 60000 + b"\r\n\r\n")
    assert status_of(answer) == 431


def listen_backlog(port) -> int:
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
    return int(out.split()[2])  # State Recv-Q Send-Q: Send-Q is the backlog of a listener


def test_listen_backlogs_are_at_least_128(db):
    with metrics_server() as server, endpoint(db) as ep:
        assert listen_backlog(server.port) >= 128
        assert listen_backlog(ep.port) >= 128


def test_metrics_and_queries_listen_on_ipv6_loopback(db):
    with metrics_server("::1") as server, endpoint(db, host="::1") as ep:
        with urllib.request.urlopen(f"http://[::1]:{server.port}/metrics", timeout=5) as r:
            assert b"hostile_test_total 1.0" in r.read()
        code, text = post(ep.url, "SELECT COUNT(*) FROM nccl_events")
        assert code == 200 and "2000" in text


def test_beyond_the_queue_is_503_with_retry_after(db):
    """One worker, no queue place: a second request while the first is served gets 503."""
    limits = serving.Limits(**{**LIMITS.__dict__, "workers": 1, "queue": 0})
    sql = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"
    with endpoint(db, limits=limits, time_limit=2.0) as ep:
        slow = threading.Thread(target=post, args=(ep.url, sql))
        slow.start()
        time.sleep(0.5)
        answer = raw(ep.port, query_request("SELECT 1"))
        slow.join()
    assert status_of(answer) == 503 and b"Retry-After: 1" in answer


def test_a_503_is_not_lost_to_a_reset_when_the_body_comes_late(db):
    """The 503 is sent on the head; the body that follows must not turn it into a reset."""
    limits = serving.Limits(**{**LIMITS.__dict__, "workers": 1, "queue": 0})
    sql = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"
    with endpoint(db, limits=limits, time_limit=2.0) as ep:   # busy past the late body (0.8 s)
        slow = threading.Thread(target=post, args=(ep.url, sql))
        slow.start()
        time.sleep(0.5)
        body = b"SELECT 1" * 1000
        with socket.create_connection(("127.0.0.1", ep.port), timeout=10) as s:
            s.sendall(f"POST /api/v1/query HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: {len(body)}\r\n\r\n"
                      .encode())
            time.sleep(0.3)
            s.sendall(body)
            answer = drain(s)
        slow.join()
    assert status_of(answer) == 503, answer[:100]


def test_metrics_keep_client_python_features():
    with metrics_server() as server:
        base = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(base + "/metrics?name[]=hostile_test_total", timeout=5) as r:
            text = r.read().decode()
        assert "hostile_test_total 1.0" in text and "hostile_test_created" not in text
        req = urllib.request.Request(base + "/metrics", method="HEAD")
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200 and r.read() == b"" and int(r.headers["Content-Length"]) > 0


# --- fleet ---------------------------------------------------------------------------------

class _Evil(threading.Thread):
    """A node that answers every query with `body` (and its name with `node`)."""

    def __init__(self, body: bytes, node: bytes = b"evil"):
        super().__init__(daemon=True)
        self.body, self.node = body, node
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                c.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += c.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int(next((l.split(b":")[1] for l in head.split(b"\r\n")
                                   if l.lower().startswith(b"content-length")), b"0"))
                while len(rest) < length:
                    rest += c.recv(65536)
                c.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/x-ndjson\r\nX-Nccl-Node: " + self.node
                          + b"\r\n\r\n" + self.body)


@pytest.mark.parametrize("body", [
    b'["x"]\n5\n{"rows": 1, "complete": true}\n',            # a row that is not a list
    b'null\n[1]\n{"rows": 1, "complete": true}\n',            # a null header
    b'["x"]\n[{"a": 1}]\n{"rows": 1, "complete": true}\n',    # a value that is an object
    b'["x"]\n[1, 2]\n{"rows": 1, "complete": true}\n',        # a row of the wrong width
])
@pytest.mark.parametrize("summary", [False, True])
def test_fleet_keeps_good_rows_when_a_node_answers_garbage(db, capsys, tmp_path, body, summary):
    token = tmp_path / "tok"
    token.write_text(TOKEN)
    evil = _Evil(body)
    evil.start()
    try:
        with endpoint(db) as ep:
            code, out, err = cli(capsys, "fleet", "query", "--nodes", f"{ep.url},{evil.url}",
                                 "--token-file", token, "--format", "csv",
                                 *(["--summary"] if summary else []),
                                 "SELECT duration_ns AS x FROM nccl_events LIMIT 5")
    finally:
        evil.sock.close()
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "malformed answer" in warnings[0], err
    assert "Traceback" not in err
    assert "node-a" in out


def test_fleet_warnings_are_terminal_safe(capsys, tmp_path):
    token = tmp_path / "tok"
    token.write_text(TOKEN)
    evil = _Evil(b"\x00\xff\r\x1b[2Jgarbage\n", node=b"ev\x1bil")
    evil.start()
    try:
        code, out, err = cli(capsys, "fleet", "query", "--nodes", evil.url, "--token-file", token, "SELECT 1")
    finally:
        evil.sock.close()
    assert code == 1
    for line in err.splitlines():
        assert line.isprintable(), repr(line)


def test_fleet_fetch_leaves_no_partial_files(db, tmp_path, capsys):
    token = tmp_path / "tok"
    token.write_text(TOKEN)
    # a WAL-mode recording, as a live one is
    live = tmp_path / "live.db"
    r = Recorder(str(live), node="live", identify_processes=False)
    for i in range(50):
        r(ev(i))
    r._wake.set()
    time.sleep(0.5)
    try:
        with endpoint(str(live)) as ep:
            code, out, err = cli(capsys, "fleet", "fetch", "--nodes", ep.url, "--token-file", token,
                                 "-o", tmp_path / "out")
    finally:
        r.close()
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "out")) == ["node-a.db"]


# --- merge ---------------------------------------------------------------------------------

def test_merge_of_a_corrupt_input_is_one_line_exit_2(db, tmp_path, capsys):
    bad = tmp_path / "bad.db"
    data = bytearray(open(db, "rb").read())
    for i in range(len(data) // 2 // 4096 * 4096, len(data) - 4096, 4096):  # the later half's pages
        data[i + 8:i + 400] = b"\xff" * 392                                  # (rows, not the schema)
    bad.write_bytes(bytes(data))
    code, out, err = cli(capsys, "merge", "--db", tmp_path / "out.db", bad)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out.db").exists()


def test_merge_of_a_schema_version_that_lies_is_one_line_exit_2(db, tmp_path, capsys):
    liar = tmp_path / "liar.db"
    conn = sqlite3.connect(liar)
    conn.executescript(open_schema_of(db))
    conn.execute("ALTER TABLE tcp_events RENAME TO tcp_events_old")
    conn.commit()
    conn.close()
    code, out, err = cli(capsys, "merge", "--db", tmp_path / "out.db", liar)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not match" in err, err


def open_schema_of(db) -> str:
    conn = sqlite3.connect(db)
    try:
        sql = ";\n".join(r[0] for r in conn.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL "
                                                     "AND name NOT LIKE 'sqlite_%'"))
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()
    return sql + f";\nPRAGMA user_version = {version};"


# --- recording into an existing file -------------------------------------------------------

def test_recording_again_keeps_start_and_counts(tmp_path):
    path = tmp_path / "again.db"
    make_recording(path, 30)
    conn = sqlite3.connect(path)
    first = dict(conn.execute("SELECT key, value FROM meta"))
    conn.close()
    time.sleep(0.01)
    make_recording(path, 20)
    conn = sqlite3.connect(path)
    meta = dict(conn.execute("SELECT key, value FROM meta"))
    rows = conn.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0]
    conn.close()
    assert meta["start_ns"] == first["start_ns"]
    assert int(meta["events_recorded"]) == rows == 50


# --- MCP (stdio) -----------------------------------------------------------------------------

def test_mcp_stdio_answers_bad_lines_with_jsonrpc_errors(db):
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "1"}}}
    lines = ["{not json", "[1,2,3]", '{"jsonrpc": "2.0", "id": 5}', json.dumps(init)]
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "mcp", "--db", db], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        proc.stdin.write(("\n".join(lines) + "\n").encode())
        proc.stdin.flush()
        out = b""
        deadline = time.monotonic() + 30
        while out.count(b"\n") < 4 and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 0.5)[0]:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
        answers = [json.loads(line) for line in out.splitlines()]
    finally:
        proc.kill()
        proc.wait(10)
    assert len(answers) == 4, answers
    assert [a.get("error", {}).get("code") for a in answers[:3]] == [-32700, -32600, -32600]
    assert [a["id"] for a in answers] == [None, None, 5, 1]
    assert "result" in answers[3]


def test_every_one_of_many_concurrent_queries_gets_an_answer(db):
    """Beyond the workers and the queue each gets its 503, never a reset connection."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor

    sql = json.dumps({"sql": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                             "SELECT max(x) FROM c"})

    def ask(_):
        c = http.client.HTTPConnection("127.0.0.1", ep.port, timeout=30)
        try:
            c.request("POST", "/api/v1/query", sql, {"Authorization": f"Bearer {TOKEN}"})
            r = c.getresponse()
            r.read()
            return r.status
        except OSError as e:
            return type(e).__name__
        finally:
            c.close()

    with endpoint(db, time_limit=0.5) as ep:   # 5 rounds of 2 workers: 2.5 s of refusing the rest
        with ThreadPoolExecutor(50) as pool:
            got = list(pool.map(ask, range(50)))
    assert set(got) <= {200, 400, 503}, got
    assert got.count(503) >= 50 - LIMITS.workers - LIMITS.queue - 5

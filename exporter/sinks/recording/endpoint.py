"""The node query endpoint: read-only SQL on this node's recording over HTTP.

`nccl-exporter run --db PATH --query-listen HOST:PORT --query-token-file F`
starts it on its own listener, apart from /metrics (docs/fleet-live.md):

    POST /api/v1/query       body: the SQL, or JSON {"sql": "...", "max_rows": N}
                             200: NDJSON, streamed: the column names (a JSON
                             array), one JSON array per row, then one JSON
                             object, the trailer: {"rows": N, "complete": true}
                             or {"rows": N, "complete": false, "truncated": why}
                             400: {"node": ..., "error": ...} (bad or refused SQL)
    GET  /api/v1/recording   ?since=NS&until=NS (ns since the epoch, or ISO 8601):
                             a SQLite file of the same schema holding the rows
                             whose timestamp_ns lies in the window (every row
                             without a window), for `fleet fetch`
    GET  /api/v1/time        {"node": ..., "time_ns": wall clock} (clock estimate)

Every request needs `Authorization: Bearer <token>` (401 otherwise). A query
is the one guarded read-only query (query.ReadOnlyQuery: the authorizer, the
VACUUM refusal, the time limit, value, column and cache limits) with
query.SHARED's limits; rows and bytes are capped. The listener is
sinks/serving.py under LIMITS (connections, workers, timeouts, write
deadlines). Every answer names the node (X-Nccl-Node header).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import os
import shutil
import sqlite3
import ssl
import tempfile
import threading
import time
from urllib.parse import parse_qs, urlsplit

from exporter.sinks import serving
from exporter.sinks.recording import query
from exporter.sinks.recording.window import window_copy
from exporter.sinks.recording.protocol import QUERY_PATH, RECORDING_PATH, TIME_PATH, is_loopback, parse_time_ns

DEFAULT_MAX_ROWS = 100_000
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_TIME_LIMIT_S = 10.0
WRITE_GRACE_S = 2.0          # an answer's writing ends this long after the query's time limit
# Queries and downloads served at once (workers), waiting (queue; beyond: 503 + Retry-After),
# connections open, and the deadlines (docs/fleet-live.md, "Limits"). Memory: each query
# at most query.SHARED's per-query bound, times `workers`.
LIMITS = serving.Limits(workers=2, queue=8, max_connections=128, backlog=128,
                        idle_timeout=10.0, header_timeout=10.0, body_timeout=10.0,
                        write_timeout=10.0, max_header_bytes=16 << 10, max_body_bytes=64 << 10)
FLUSH_BYTES = 64 << 10       # rows are written in pieces of about this size
RECORDING_CHUNK = 1 << 20


class EndpointError(RuntimeError):
    """The endpoint cannot start (one line)."""


class _Cut(Exception):
    """A cap was reached while streaming."""


def parse_query_body(body: str) -> tuple[str, int | None]:
    """{"sql": "...", "max_rows": N} -> (sql, N or None); ValueError (one line) otherwise."""
    try:
        obj = json.loads(body)
    except RecursionError:
        raise ValueError("nested too deep") from None
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    sql = obj.get("sql")
    if not isinstance(sql, str):
        raise ValueError("sql must be a string")
    n = obj.get("max_rows")
    if n is None:
        return sql, None
    if isinstance(n, bool) or not isinstance(n, (int, float)) or n != n or n in (float("inf"), -float("inf")):
        raise ValueError(f"max_rows must be a whole number, not {str(n)[:40]}")
    if n != int(n):
        raise ValueError(f"max_rows must be a whole number, not {n}")
    return sql, max(0, min(int(n), 1 << 62))


class Handler(serving.Handler):
    """The endpoint's requests; `self.server.endpoint` is the QueryEndpoint. Answers end
    with the connection (HTTP/1.0): rows stream without a length."""

    server_version = "nccl-exporter-query"

    @property
    def ep(self) -> "QueryEndpoint":
        return self.server.endpoint

    # --- helpers ---------------------------------------------------------------------

    def _json(self, code: int, obj: dict, headers: dict | None = None) -> None:
        body = (json.dumps(obj) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Nccl-Node", self.ep.node)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, message: str, headers: dict | None = None) -> None:
        self._json(code, {"node": self.ep.node, "error": message}, headers)

    def _authorized(self) -> bool:
        got = self.headers.get("Authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.ep.token.encode()):
            return True
        self._error(401, "missing or wrong bearer token" if got else "a bearer token is required",
                    {"WWW-Authenticate": 'Bearer realm="nccl-exporter"'})
        return False

    # --- routes ----------------------------------------------------------------------

    def do_GET(self):
        url = urlsplit(self.path)
        if url.path not in (TIME_PATH, RECORDING_PATH):
            self._error(404, f"no such endpoint {url.path}; try POST {QUERY_PATH}")
            return
        if not self._authorized():
            return
        if url.path == TIME_PATH:
            self._json(200, {"node": self.ep.node, "time_ns": self.ep.clock()})
            return
        self._recording(parse_qs(url.query))

    def do_POST(self):
        url = urlsplit(self.path)
        if url.path != QUERY_PATH:
            self._error(404, f"no such endpoint {url.path}; try POST {QUERY_PATH}")
            return
        if not self._authorized():
            return
        raw = self.read_body()  # 411/413/408 answered there
        if raw is None:
            return
        if not raw.strip():
            self._error(400, "the request body must hold the SQL")
            return
        body = raw.decode("utf-8", "replace")
        max_rows = self.ep.max_rows
        sql = body
        if body.lstrip().startswith("{"):
            try:
                sql, asked = parse_query_body(body)
            except ValueError as e:
                self._error(400, f'a JSON body must be {{"sql": "...", "max_rows": N}}: {e}')
                return
            if asked is not None:
                max_rows = min(max_rows, asked)
        self._query(sql, max_rows)

    # --- the query -------------------------------------------------------------------

    def _query(self, sql: str, max_rows: int) -> None:
        ep = self.ep
        if not sql.strip():
            self._error(400, "empty SQL")
            return
        # a client that stops reading loses its answer when the query's time is up
        self.write_deadline = time.monotonic() + ep.time_limit + WRITE_GRACE_S
        try:
            q = query.ReadOnlyQuery(ep.db, sql, ep.limits)
        except query.QueryError as e:
            self._error(503 if e.kind == "open" else 400, str(e))
            return
        try:
            if not q.names:
                self._error(400, "the statement returns no rows (queries are read-only SELECTs)")
                return
            rows = iter(q)
            try:
                first = next(rows, None)
            except query.QueryError as e:
                self._error(400, str(e) + (" before the first row" if e.kind == "time" else ""))
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("X-Nccl-Node", ep.node)
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self._stream(rows, q.names, first, max_rows)
        finally:
            q.close()

    def _stream(self, rows, names, first, max_rows) -> None:
        ep = self.ep
        buf = [json.dumps(names)]
        size = len(buf[0]) + 1
        sent = size
        n = 0
        why = None
        row = first
        try:
            while row is not None:
                if n >= max_rows:
                    raise _Cut(f"row cap {max_rows}")
                line = json.dumps([v.hex() if isinstance(v, bytes) else v for v in row])
                if sent + len(line) + 1 > ep.max_bytes:
                    raise _Cut(f"byte cap {ep.max_bytes}")
                buf.append(line)
                n += 1
                size += len(line) + 1
                sent += len(line) + 1
                if size >= FLUSH_BYTES:
                    self.wfile.write(("\n".join(buf) + "\n").encode())
                    buf, size = [], 0
                row = next(rows, None)
        except _Cut as cut:
            why = str(cut)
        except query.QueryError as e:
            why = str(e)
        except (OSError, ValueError):
            return  # the client went away, or stopped reading past the write deadline
        trailer = {"node": ep.node, "rows": n, "complete": why is None}
        if why:
            trailer["truncated"] = why
        buf.append(json.dumps(trailer))
        try:
            self.wfile.write(("\n".join(buf) + "\n").encode())
        except (OSError, ValueError):
            pass

    # --- the recording ---------------------------------------------------------------

    def _recording(self, params: dict) -> None:
        ep = self.ep
        try:
            since = parse_time_ns((params.get("since") or [None])[0])
            until = parse_time_ns((params.get("until") or [None])[0])
        except ValueError as e:
            self._error(400, str(e))
            return
        if since is not None and until is not None and until < since:
            self._error(400, "until is before since")
            return
        if not ep.copies.acquire(blocking=False):
            self._error(503, "another recording download is being prepared; retry shortly",
                        {"Retry-After": "5"})
            return
        tmp = tempfile.mkdtemp(prefix="nccl-fetch-")
        try:
            path = os.path.join(tmp, "window.db")
            try:
                window_copy(ep.db, path, since, until)
            except query.QueryError as e:
                self._error(503, str(e))
                return
            except sqlite3.DatabaseError as e:
                self._error(500, f"cannot copy the recording: {e}")
                return
            finally:
                ep.copies.release()  # preparing copies is bounded; sending is the workers' and deadlines'
            size = os.path.getsize(path)
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.sqlite3")
            self.send_header("Content-Length", str(size))
            self.send_header("X-Nccl-Node", ep.node)
            self.end_headers()
            with open(path, "rb") as f:  # each write ends within write_timeout, or the download does
                while chunk := f.read(RECORDING_CHUNK):
                    self.wfile.write(chunk)
        except (OSError, ValueError):
            pass  # the client went away or stopped reading
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class QueryEndpoint:
    """The node query endpoint on its own listener (a thread); close() stops it."""

    def __init__(self, db: str, node: str, token: str, host: str = "127.0.0.1", port: int = 0,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 max_rows: int = DEFAULT_MAX_ROWS, max_bytes: int = DEFAULT_MAX_BYTES,
                 time_limit: float = DEFAULT_TIME_LIMIT_S, handler=Handler, clock=time.time_ns,
                 limits: serving.Limits = None):
        limits = limits or LIMITS
        if not token:
            raise EndpointError("the query endpoint needs a bearer token (--query-token-file)")
        if bool(tls_cert) != bool(tls_key):
            raise EndpointError("--query-tls-cert and --query-tls-key go together")
        if not tls_cert and not is_loopback(host):
            raise EndpointError(f"--query-listen {host}:{port} is not loopback-only: "
                                "it needs --query-tls-cert and --query-tls-key")
        self.db, self.node, self.token = db, node, token
        self.max_rows, self.max_bytes, self.time_limit = int(max_rows), int(max_bytes), float(time_limit)
        self.limits = dataclasses.replace(query.SHARED, time_s=self.time_limit)  # per query
        self.clock = clock  # the wall clock /api/v1/time reports (tests give a skewed one)
        self.copies = threading.Semaphore(2)  # recording copies prepared at once
        self.tls = bool(tls_cert)
        ctx = None
        if tls_cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                ctx.load_cert_chain(tls_cert, tls_key)
            except (OSError, ssl.SSLError) as e:
                raise EndpointError(f"--query-tls-cert/--query-tls-key: {e}") from None
        try:
            # the handshake happens in a worker, under the header timeout, not in the accept loop
            self.server = serving.BoundedServer(host, port, handler, limits, ssl_context=ctx,
                                                name="nccl-query")
        except OSError as e:
            raise EndpointError(f"cannot listen on {host}:{port} for queries: {e.strerror or e}") from None
        self.server.endpoint = self
        self.host = host
        self.port = self.server.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def start(self) -> "QueryEndpoint":
        self.server.start()
        return self

    def close(self) -> None:
        self.server.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

"""Fan-out to the nodes' query endpoints (exporter/sinks/recording/endpoint.py).

    for ev in stream_query(urls, "SELECT ...", FleetOptions(token=...)):
        ev.kind == "columns"  ev.node, ev.names      (first answer of a node)
        ev.kind == "rows"     ev.node, ev.rows       (a batch: at most BATCH rows, about BATCH_BYTES)
        ev.kind == "done"     ev.result              (NodeResult: ok, error, rows, clock)

Nodes are asked in parallel by a pool of at most `concurrency` threads
(http.client, no other dependency); each node has its own timeout. Rows go
through a bounded queue to the caller as they arrive, so memory stays
bounded whatever the nodes send: a fast node waits while the caller writes.
One node failing (refused, slow, wrong token, bad SQL) ends in a NodeResult
with its error; the others still answer.

The clock estimate is NTP-style: several GET /api/v1/time, each bracketed by
the local wall clock; the sample with the lowest round trip wins, and the
node's offset is its time minus the midpoint, ± half that round trip.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import shutil
import ssl
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from exporter.offline.fleet.nodes import FleetError, parse_nodes  # noqa: F401 - callers find them here

from exporter.sinks.recording.protocol import QUERY_PATH, RECORDING_PATH, TIME_PATH
from exporter.sinks.recording.read import Recording

BATCH = 256                 # rows per event at most,
BATCH_BYTES = 16 << 10      # and about this many bytes of NDJSON
QUEUE_EVENTS = 32           # events in flight between the pool and the caller
MAX_LINE = 16 << 20         # one NDJSON line (a row) at most
CLOCK_SAMPLES = 5


@dataclass
class FleetOptions:
    token: str | None = None
    ca_file: str | None = None
    concurrency: int = 64
    timeout: float = 10.0
    max_rows: int | None = None     # per node; the node's own cap applies too
    clock: bool = False
    clock_samples: int = CLOCK_SAMPLES


@dataclass
class Clock:
    offset_ns: int          # node clock - local clock
    uncertainty_ns: int     # half the best round trip
    rtt_ns: int
    samples: int


@dataclass
class NodeResult:
    url: str
    node: str                       # the node's name (X-Nccl-Node), else host:port
    ok: bool = False
    error: str | None = None
    rows: int = 0
    truncated: str | None = None    # the node stopped early: row/byte cap or time limit
    elapsed_s: float = 0.0
    clock: Clock | None = None
    path: str | None = None         # fetch: the file written


@dataclass
class Event:
    kind: str
    node: str
    url: str
    names: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    result: NodeResult | None = None


# --- one node -------------------------------------------------------------------

def _label(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


def _node_name(text: str | None) -> str | None:
    """A node's name as it says it (X-Nccl-Node), kept only when printable and short: it goes
    to terminals, file names and the node column."""
    if not text or len(text) > 253 or not text.isprintable():
        return None
    return text


class _Conn:
    """One HTTP(S) exchange with a node."""

    def __init__(self, url: str, opts: FleetOptions, timeout: float):
        u = urllib.parse.urlsplit(url)
        self.prefix = u.path
        if u.scheme == "https":
            ctx = ssl.create_default_context(cafile=opts.ca_file) if opts.ca_file else ssl.create_default_context()
            self.conn = http.client.HTTPSConnection(u.hostname, u.port or 443, timeout=timeout, context=ctx)
        else:
            self.conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
        self.headers = {"Authorization": f"Bearer {opts.token}"} if opts.token else {}

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        self.conn.request(method, self.prefix + path, body=body, headers={**self.headers, **(headers or {})})
        return self.conn.getresponse()

    def close(self):
        self.conn.close()


def _http_error(resp) -> str:
    body = resp.read(4096)
    try:
        msg = json.loads(body).get("error")
    except (ValueError, AttributeError):
        msg = None
    return f"HTTP {resp.status}: {msg or body.decode('utf-8', 'replace').strip()[:200] or resp.reason}"


def _describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, ssl.SSLError):
        return f"TLS: {e.reason or e}"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    if isinstance(e, RecursionError):
        return "malformed answer: nested too deep"
    if isinstance(e, (ValueError, KeyError, TypeError)) and not isinstance(e, MalformedAnswer):
        return f"malformed answer: {type(e).__name__}: {e}"
    return str(e) or type(e).__name__


def estimate_clock(url: str, opts: FleetOptions, res: NodeResult | None = None) -> Clock:
    """NTP-style: samples of the node's wall clock; the lowest round trip wins."""
    best = None
    for _ in range(max(1, opts.clock_samples)):
        c = _Conn(url, opts, opts.timeout)
        try:
            c.conn.connect()  # the handshake is not part of the round trip
            t0 = time.time_ns()
            resp = c.request("GET", TIME_PATH)
            body = resp.read(4096)
            t1 = time.time_ns()
        finally:
            c.close()
        if resp.status != 200:
            raise RuntimeError(f"clock: HTTP {resp.status}")
        answer = json.loads(body)
        remote = int(answer["time_ns"])
        if res is not None and isinstance(answer, dict) and isinstance(answer.get("node"), str):
            res.node = _node_name(answer["node"]) or res.node
        rtt = t1 - t0
        if best is None or rtt < best[0]:
            best = (rtt, remote - (t0 + t1) // 2)
    return Clock(offset_ns=best[1], uncertainty_ns=best[0] // 2, rtt_ns=best[0],
                 samples=max(1, opts.clock_samples))


class MalformedAnswer(ValueError):
    """A node's answer is not the endpoint's NDJSON (one line)."""


def _check_names(item) -> list[str]:
    if not isinstance(item, list) or not item or not all(isinstance(n, str) for n in item):
        raise MalformedAnswer(f"malformed answer: the first line is not a list of column names "
                              f"({type(item).__name__})")
    return item


def _check_row(item, width: int, n: int) -> list:
    if not isinstance(item, list) or len(item) != width:
        raise MalformedAnswer(f"malformed answer: row {n + 1} is not a list of {width} values "
                              f"({type(item).__name__})")
    for v in item:
        if v is not None and not isinstance(v, (str, int, float)):
            raise MalformedAnswer(f"malformed answer: row {n + 1} holds a {type(v).__name__}")
    return item


def _query_node(url: str, sql: str, opts: FleetOptions, put) -> NodeResult:
    res = NodeResult(url=url, node=_label(url))
    t0 = time.monotonic()
    c = None
    try:
        if opts.clock:
            res.clock = estimate_clock(url, opts, res)
        if sql is None:
            res.ok = True
            return res
        c = _Conn(url, opts, opts.timeout)
        body = {"sql": sql}
        if opts.max_rows is not None:
            body["max_rows"] = opts.max_rows
        resp = c.request("POST", QUERY_PATH, json.dumps(body).encode(),
                         {"Content-Type": "application/json"})
        res.node = _node_name(resp.getheader("X-Nccl-Node")) or res.node
        if resp.status != 200:
            res.error = _http_error(resp)
            return res
        names = None
        batch: list = []
        held = 0
        trailer = None
        while True:
            line = resp.readline(MAX_LINE)
            if not line:
                break
            if not line.endswith(b"\n"):
                raise RuntimeError(f"a line longer than {MAX_LINE} bytes, or a cut stream")
            item = json.loads(line)
            if isinstance(item, dict):
                trailer = item
                break
            if names is None:
                names = _check_names(item)
                put(Event("columns", res.node, url, names=names))
                continue
            batch.append(_check_row(item, len(names), res.rows))
            held += len(line)
            res.rows += 1
            if len(batch) >= BATCH or held >= BATCH_BYTES:
                put(Event("rows", res.node, url, rows=batch))
                batch, held = [], 0
        if batch:
            put(Event("rows", res.node, url, rows=batch))
        if trailer is None:
            res.error = f"the answer ended early after {res.rows} rows (no trailer)"
            return res
        if not trailer.get("complete", False):
            res.truncated = trailer.get("truncated") or "incomplete"
        res.ok = True
    except Exception as e:  # noqa: BLE001 - one node's failure is a warning
        res.error = _describe(e)
    finally:
        if c is not None:
            c.close()
        res.elapsed_s = time.monotonic() - t0
    return res


def stream_query(urls: list[str], sql: str | None, opts: FleetOptions):
    """Events of a fan-out (see the module doc), as they arrive; a bounded queue between."""
    q: queue.Queue = queue.Queue(maxsize=QUEUE_EVENTS)
    cancelled = threading.Event()

    def put(ev):
        while not cancelled.is_set():
            try:
                q.put(ev, timeout=0.2)
                return
            except queue.Full:
                continue
        raise RuntimeError("cancelled")

    def work(url):
        res = _query_node(url, sql, opts, put)
        try:
            put(Event("done", res.node, url, result=res))
        except RuntimeError:
            pass

    pool = ThreadPoolExecutor(max_workers=max(1, min(opts.concurrency, len(urls))),
                              thread_name_prefix="fleet")
    for url in urls:
        pool.submit(work, url)
    done = 0
    try:
        while done < len(urls):
            ev = q.get()
            if ev.kind == "done":
                done += 1
            yield ev
    finally:
        cancelled.set()
        pool.shutdown(wait=False, cancel_futures=True)


# --- fetch ------------------------------------------------------------------------

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def fetch_one(url: str, outdir: str, opts: FleetOptions, since: int | None, until: int | None,
              taken: set, lock: threading.Lock) -> NodeResult:
    res = NodeResult(url=url, node=_label(url))
    t0 = time.monotonic()
    c = _Conn(url, opts, opts.timeout)
    part = None
    try:
        params = {k: str(v) for k, v in (("since", since), ("until", until)) if v is not None}
        path = RECORDING_PATH + ("?" + urllib.parse.urlencode(params) if params else "")
        resp = c.request("GET", path)
        res.node = _node_name(resp.getheader("X-Nccl-Node")) or res.node
        if resp.status != 200:
            res.error = _http_error(resp)
            return res
        base = _SAFE.sub("_", res.node).strip("._") or _SAFE.sub("_", _label(url))
        with lock:
            name = base if base not in taken else _SAFE.sub("_", f"{base}-{_label(url)}")
            taken.add(name)
        final = os.path.join(outdir, name + ".db")
        part = final + ".part"
        with open(part, "wb") as f:
            shutil.copyfileobj(resp, f, 1 << 20)
        expected = resp.getheader("Content-Length")
        if expected is not None and os.path.getsize(part) != int(expected):
            raise RuntimeError(f"cut short: {os.path.getsize(part)} of {expected} bytes")
        # immutable: no -shm/-wal beside the part file, whatever journal mode the copy has
        with Recording.open_copy(part) as rec:
            res.rows = rec.count_calls()
        os.replace(part, final)
        part = None
        res.path = final
        res.ok = True
    except Exception as e:  # noqa: BLE001
        res.error = _describe(e)
    finally:
        c.close()
        if part:  # failed: nothing of it stays
            for leftover in (part, part + "-shm", part + "-wal", part + "-journal"):
                try:
                    os.unlink(leftover)
                except FileNotFoundError:
                    pass
        res.elapsed_s = time.monotonic() - t0
    return res


def fetch(urls: list[str], outdir: str, opts: FleetOptions, since: int | None = None,
          until: int | None = None):
    """Each node's recording (or its window) to OUTDIR/<node>.db; yields NodeResults as they end
    (result.path: the file written)."""
    os.makedirs(outdir, exist_ok=True)
    taken: set = set()
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=max(1, min(opts.concurrency, len(urls))),
                            thread_name_prefix="fetch") as pool:
        futures = [pool.submit(fetch_one, u, outdir, opts, since, until, taken, lock) for u in urls]
        from concurrent.futures import as_completed

        for f in as_completed(futures):
            yield f.result()

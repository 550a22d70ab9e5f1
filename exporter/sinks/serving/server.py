"""HTTP serving with every limit explicit, for both listeners (/metrics in http.py,
the node query endpoint in sinks/recording/endpoint.py). Why not a server library:
docs/architecture.md, "Serving HTTP".

The standard library's http.server parses the requests; what it lacks is here:

- one thread waits for every connection that has not yet sent a request
  (a selector, no thread per connection); a connection is handed to a worker
  only once its first bytes have arrived;
- `workers` threads serve requests; `queue` requests may wait for one; beyond
  that a request is answered 503 with Retry-After at once (TLS: closed);
- at most `max_connections` connections are open; at the limit the one that
  has waited longest without sending anything is closed for the newcomer, so
  idle connections never take a scrape's place;
- deadlines: `idle_timeout` from accept to the first byte, `header_timeout`
  for the whole request head (408 after it, 431 beyond `max_header_bytes`),
  `body_timeout` for the body; every write has a deadline (`write_timeout`
  for each write, or the handler's own `write_deadline`), so a client that
  stops reading loses its answer and its worker;
- one request per connection (HTTP/1.0 answers, Connection: close): no
  keep-alive connection holds a worker between requests;
- the listen backlog is `backlog`; the address family comes from getaddrinfo
  (so [::1]:P works), and the descriptor limit is raised to its hard limit.

This module is the connections (the selector, the worker threads and their
queue, 503s, eviction, lingering closes, stopping) and the Limits; handler.py
is one request on one connection (the deadlines and sizes of its reads and
writes).
"""

from __future__ import annotations

import collections
import queue
import resource
import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    workers: int = 8               # requests served at once (threads)
    queue: int = 256               # requests waiting for a worker; beyond: 503 + Retry-After
    max_connections: int = 512     # open connections (as Prometheus's --web.max-connections)
    backlog: int = 512             # the kernel's accept queue
    idle_timeout: float = 10.0     # accept -> first byte of a request
    header_timeout: float = 10.0   # first byte -> end of the request head
    body_timeout: float = 10.0     # the request body
    write_timeout: float = 10.0    # each write of the answer
    max_header_bytes: int = 16 << 10
    max_body_bytes: int = 64 << 10
    retry_after_s: int = 1


LINGER_S = 1.0          # after an answer: how long unread request bytes are read and dropped,
LINGER_BYTES = 256 << 10  # and how many: closing with them unread would reset the connection,
                          # and the client could lose the answer (a 413 before a large body)


def _linger(conn) -> None:
    """Half-close, then drop what the client still sends until it closes (bounded)."""
    try:
        if isinstance(conn, ssl.SSLSocket):
            return  # TLS: its close_notify is the end; a reset there loses nothing readable
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + LINGER_S
        dropped = 0
        while dropped < LINGER_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            conn.settimeout(left)
            chunk = conn.recv(65536)
            if not chunk:
                return
            dropped += len(chunk)
    except OSError:
        pass


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
        except (ValueError, OSError):
            pass


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on host:port, of the family getaddrinfo gives (OSError otherwise)."""
    infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class BoundedServer:
    """HTTP on host:port under `limits` (module doc); start() serves from threads, close() stops."""

    def __init__(self, host: str, port: int, handler, limits: Limits = Limits(),
                 ssl_context: ssl.SSLContext | None = None, name: str = "http"):
        raise_fd_limit()
        self.handler, self.limits, self.ssl_context, self.name = handler, limits, ssl_context, name
        self.socket = listening_socket(host, port, limits.backlog)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self._sel = selectors.DefaultSelector()
        self._waiting: collections.OrderedDict = collections.OrderedDict()  # sock -> deadline
        self._closing: dict = {}  # answered 503, dropping what the client still sends -> deadline
        self._work: queue.Queue = queue.Queue()  # bounded in _ready: limits.queue beyond the workers
        self._lock = threading.Lock()
        self._open = 0               # connections accepted and not yet closed
        self._idle_workers = 0
        self._workers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-accept", daemon=True)
        self.refused = 0             # answered 503 (no worker free, queue full)
        self.evicted = 0             # idle connections closed for a newcomer

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> "BoundedServer":
        self._thread.start()
        return self

    # --- the accept and wait loop -------------------------------------------------------

    def _loop(self) -> None:
        self._sel.register(self.socket, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.25):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    self._wake_r.recv(64)
                elif key.data == "closing":
                    self._linger_some(key.fileobj)
                else:
                    self._ready(key.fileobj)
            self._reap()
        for s in list(self._waiting):
            self._close_waiting(s)
        for s in list(self._closing):
            self._end_linger(s)
        self._sel.close()

    def _accept(self) -> None:
        for _ in range(64):
            try:
                conn, _addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # EMFILE and friends: the backlog keeps the rest
            with self._lock:
                full = self._open >= self.limits.max_connections
            if full and self._waiting:
                oldest = next(iter(self._waiting))
                self._close_waiting(oldest)
                self.evicted += 1
            elif full:
                self._overflow(conn)
                continue
            with self._lock:
                self._open += 1
            conn.setblocking(False)
            self._waiting[conn] = time.monotonic() + self.limits.idle_timeout
            self._sel.register(conn, selectors.EVENT_READ, "conn")

    def _ready(self, conn) -> None:
        self._sel.unregister(conn)
        self._waiting.pop(conn, None)
        with self._lock:
            unstarted = self.limits.workers - len(self._workers)
            waiting = self._work.qsize() + 1 - self._idle_workers - unstarted  # with this one
            if waiting > self.limits.queue:
                full = True
            else:
                full = False
                self._work.put_nowait(conn)
                spawn = self._work.qsize() > self._idle_workers and unstarted > 0
                if spawn:
                    self._idle_workers += 1  # counted idle until it takes its first request
        if full:
            self._overflow(conn)
            self._closed()
            return
        if spawn:
            t = threading.Thread(target=self._work_loop, name=f"{self.name}-{len(self._workers)}",
                                 daemon=True)
            self._workers.append(t)
            t.start()

    def _reap(self) -> None:
        now = time.monotonic()
        for conn, deadline in list(self._closing.items()):
            if deadline <= now:
                self._end_linger(conn)
        while self._waiting:
            conn, deadline = next(iter(self._waiting.items()))
            if deadline > now:
                break
            self._close_waiting(conn)

    def _close_waiting(self, conn) -> None:
        self._waiting.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        self._closed()

    def _closed(self) -> None:
        with self._lock:
            self._open -= 1

    def _overflow(self, conn) -> None:
        """No worker and no queue place: 503 + Retry-After, without waiting for the client."""
        self.refused += 1
        if self.ssl_context is None:
            body = b"busy: too many requests at once; retry shortly\n"
            try:
                conn.setblocking(False)
                conn.send(b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: %d\r\n"
                          b"Content-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n"
                          b"Connection: close\r\n\r\n%s" % (self.limits.retry_after_s, len(body), body))
            except OSError:
                pass
        try:
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            conn.close()
            return
        # what the client still sends is read and dropped for up to LINGER_S, from this
        # thread: a close with unread bytes would reset the connection, and the 503 with it
        self._closing[conn] = time.monotonic() + LINGER_S
        self._sel.register(conn, selectors.EVENT_READ, "closing")
        self._linger_some(conn)

    def _linger_some(self, conn) -> None:
        try:
            while True:
                if not conn.recv(65536):
                    break
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._end_linger(conn)

    def _end_linger(self, conn) -> None:
        if self._closing.pop(conn, None) is not None:
            try:
                self._sel.unregister(conn)
            except (KeyError, ValueError):
                pass
        conn.close()

    # --- the workers ------------------------------------------------------------------------

    def _work_loop(self) -> None:
        while True:
            conn = self._work.get()
            if conn is None:
                return
            with self._lock:
                self._idle_workers -= 1
            try:
                self._serve(conn)
            finally:
                with self._lock:
                    self._idle_workers += 1
                self._closed()

    def _serve(self, conn) -> None:
        addr = None
        try:
            conn.setblocking(True)
            addr = conn.getpeername()
            if self.ssl_context is not None:
                conn.settimeout(self.limits.header_timeout)
                conn = self.ssl_context.wrap_socket(conn, server_side=True)
            self.handler(conn, addr, self)
            _linger(conn)
        except (OSError, ssl.SSLError, ValueError):
            pass  # a failed handshake, a client gone: nothing to answer
        finally:
            try:
                conn.close()
            except OSError:
                pass

    # --- stopping ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting, close waiting connections; requests in service end on their own
        (their threads are daemons, bounded by the deadlines)."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        for _ in self._workers:
            try:
                self._work.put_nowait(None)
            except queue.Full:
                break
        self.socket.close()
        self._wake_r.close()
        self._wake_w.close()

    @property
    def threads(self) -> int:
        return 1 + len(self._workers)

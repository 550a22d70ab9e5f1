"""The agent's HTTP endpoints, and the systemd readiness notification.

    GET /metrics    the Prometheus exposition (OpenMetrics when asked; delimited
                    protobuf with native histograms when asked: sinks/protobuf.py), gzipped
                    when the client sends Accept-Encoding: gzip; served from the
                    start (an empty page until the collector is registered)
    GET /-/ready    503 until the NCCL probes are loaded and every library found
                    at start is attached, then 200: counting has started (the
                    body names the sources still loading: "ready; loading tcp, sched")
    GET /-/healthy  200 while the agent's loop turns (liveness); 503 while the
                    agent starts (compiling, attaching: what a startupProbe
                    waits for) and when its loop has not turned for STALL_S
    anything else   404

`notify_systemd("READY=1")` sends the sd_notify datagram to $NOTIFY_SOCKET
(a path, or an abstract socket written '@name'), without libsystemd.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from urllib.parse import urlsplit

from prometheus_client.exposition import make_wsgi_app

from exporter.sinks import protobuf, serving

READY_PATH = "/-/ready"
HEALTHY_PATH = "/-/healthy"
METRICS_PATH = "/metrics"
# /-/healthy answers 503 once the agent's loop has not turned for this long.
# A turn waits at most 0.1 s for events; pruning, attaching a library or a
# detach take well under a second: 30 s is a loop that is stuck, not slow.
STALL_S = 30.0

# /metrics under Prometheus's own defaults: --web.max-connections 512, and
# scrapes answered from a few threads (docs/architecture.md, "Serving HTTP").
LIMITS = serving.Limits(workers=8, queue=256, max_connections=512, backlog=512,
                        idle_timeout=10.0, header_timeout=10.0, body_timeout=5.0,
                        write_timeout=10.0, max_header_bytes=16 << 10, max_body_bytes=0)


class _Handler(serving.Handler):
    """The dispatcher: /metrics to an exposition encoder, /-/ready, /-/healthy, 404."""

    server: "_Server"
    server_version = "nccl-exporter"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == METRICS_PATH:
            self._metrics(url.query)
        elif url.path == READY_PATH:
            if self.server.ready.is_set():
                loading = self.server.loading()
                self._text(200, f"ready; loading {', '.join(loading)}\n" if loading else "ready\n")
            else:
                self._text(503, "not ready: loading the probes and attaching to libnccl\n")
        elif url.path == HEALTHY_PATH:
            self._text(*self.server.health())
        else:
            self._text(404, f"not found; try {METRICS_PATH}, {READY_PATH} or {HEALTHY_PATH}\n")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _metrics(self, query: str) -> None:
        app = self.server.exposition(self.headers.get("Accept", ""))
        got: dict = {}

        def start_response(status, headers):
            got["status"], got["headers"] = status, headers

        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": METRICS_PATH, "QUERY_STRING": query,
                   "HTTP_ACCEPT": self.headers.get("Accept", ""),
                   "HTTP_ACCEPT_ENCODING": self.headers.get("Accept-Encoding", "")}
        try:
            body = b"".join(app(environ, start_response))
        except Exception as e:  # a collector failed: say so, keep serving
            self._text(500, f"error collecting metrics: {e}\n")
            raise
        self._send(int(got["status"].split()[0]), body, dict(got["headers"]))

    def _text(self, code: int, text: str) -> None:
        self._send(code, text.encode(), {"Content-Type": "text/plain; charset=utf-8"})

    def _send(self, code: int, body: bytes, headers: dict) -> None:
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class _Server(serving.BoundedServer):
    def __init__(self, host, port, registry, limits, protobuf_classic=False):
        super().__init__(host, port, _Handler, limits, name="nccl-exporter-http")
        self.registry = registry
        self.ready = threading.Event()
        self.loading = list  # () -> the names of the sources still loading once ready
        # () -> CLOCK_MONOTONIC s of the agent loop's latest turn, None before
        # its first; None: no agent watched (the server alone answers 200)
        self.heartbeat = None
        self.stall_s = STALL_S
        # client_python's own text exposition: Prometheus text or OpenMetrics by Accept,
        # name[] filtering, gzip when asked
        self._text_app = make_wsgi_app(registry)
        # delimited protobuf with native histograms (client_python cannot write them);
        # protobuf_classic: classic buckets beside the native ones
        self._protobuf_app = protobuf.make_wsgi_app(registry, protobuf_classic)

    def health(self) -> tuple[int, str]:
        if self.heartbeat is None:
            return 200, "healthy\n"
        beat = self.heartbeat()
        if beat is None:
            return 503, "starting: loading the probes and attaching to libnccl\n"
        age = time.monotonic() - beat
        if age > self.stall_s:
            return 503, f"unhealthy: the agent's loop has not turned for {age:.0f} s (limit {self.stall_s:g} s)\n"
        return 200, "healthy\n"

    def exposition(self, accept: str):
        """The one place an exposition format is chosen by the Accept header. Everything
        client_python encodes (Prometheus text, OpenMetrics) is its WSGI app; a protobuf
        encoder for `application/vnd.google.protobuf` goes here, before the fallback."""
        if protobuf.accepts_protobuf(accept):
            return self._protobuf_app
        return self._text_app


class HttpServer:
    """The endpoints above on HOST:PORT ([::1] and names too: getaddrinfo), served by threads
    under LIMITS."""

    def __init__(self, host: str, port: int, registry, limits: serving.Limits = LIMITS,
                 protobuf_classic: bool = False):
        self._server = _Server(host, port, registry, limits, protobuf_classic).start()

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def server(self) -> serving.BoundedServer:
        return self._server

    def watch(self, heartbeat, stall_s: float = STALL_S) -> None:
        """/-/healthy follows `heartbeat()`: the CLOCK_MONOTONIC time of the
        agent loop's latest turn (None: still starting)."""
        self._server.stall_s = stall_s
        self._server.heartbeat = heartbeat

    def set_ready(self, loading=None) -> None:
        """/-/ready answers 200; `loading()`: the sources still loading, named in its body."""
        if loading is not None:
            self._server.loading = loading
        self._server.ready.set()

    @property
    def ready(self) -> bool:
        return self._server.ready.is_set()

    def shutdown(self) -> None:
        self._server.close()


def notify_systemd(state: str = "READY=1", environ=None) -> bool:
    """Send `state` to $NOTIFY_SOCKET (sd_notify(3)); False when unset or unreachable."""
    address = (environ if environ is not None else os.environ).get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        return False  # vsock and others: not supported
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(state.encode(), address)
    except OSError:
        return False
    return True

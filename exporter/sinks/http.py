"""The agent's HTTP endpoints, and the systemd readiness notification.

    GET /metrics    the Prometheus exposition (OpenMetrics when asked), gzipped
                    when the client sends Accept-Encoding: gzip; served from the
                    start (an empty page until the collector is registered)
    GET /-/ready    503 until the kernel side is loaded and every library found
                    at start is attached, then 200: counting has started
    GET /-/healthy  200 while the process serves (liveness)
    anything else   404

`notify_systemd("READY=1")` sends the sd_notify datagram to $NOTIFY_SOCKET
(a path, or an abstract socket written '@name'), without libsystemd.
"""

from __future__ import annotations

import gzip
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from prometheus_client.exposition import choose_encoder, gzip_accepted

READY_PATH = "/-/ready"
HEALTHY_PATH = "/-/healthy"
METRICS_PATH = "/metrics"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, handler, registry, family):
        self.address_family = family
        self.registry = registry
        self.ready = threading.Event()
        super().__init__(address, handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = urlsplit(self.path).path
        if path == METRICS_PATH:
            self._metrics()
        elif path == READY_PATH:
            if self.server.ready.is_set():
                self._text(200, "ready\n")
            else:
                self._text(503, "not ready: loading the probes and attaching to libnccl\n")
        elif path == HEALTHY_PATH:
            self._text(200, "healthy\n")
        else:
            self._text(404, f"not found; try {METRICS_PATH}, {READY_PATH} or {HEALTHY_PATH}\n")

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def _metrics(self) -> None:
        registry = self.server.registry
        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        names = parse_qs(urlsplit(self.path).query).get("name[]")
        if names:
            registry = registry.restricted_registry(names)
        try:
            body = encoder(registry)
        except Exception as e:  # a collector failed: say so, keep serving
            self._text(500, f"error collecting metrics: {e}\n")
            raise
        headers = {"Content-Type": content_type}
        if gzip_accepted(self.headers.get("Accept-Encoding", "")):
            body = gzip.compress(body, compresslevel=6)
            headers["Content-Encoding"] = "gzip"
        self._send(200, body, headers)

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

    def log_message(self, format, *args) -> None:  # noqa: A002 (http.server's name)
        pass  # no access log


class HttpServer:
    """The endpoints above on HOST:PORT, served by a daemon thread."""

    def __init__(self, host: str, port: int, registry):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = _Server((host, port), _Handler, registry, family)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                         name="nccl-exporter-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def set_ready(self) -> None:
        self._server.ready.set()

    @property
    def ready(self) -> bool:
        return self._server.ready.is_set()

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()


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

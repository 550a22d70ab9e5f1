"""One request on one connection under the server's Limits: a deadline on every
read and write, the request head and body bounded in size and time (the
package's docstring has the whole list)."""

from __future__ import annotations

import io
import time
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exporter.sinks.serving.server import BoundedServer


class _DeadlineIO(io.RawIOBase):
    """A socket as a raw stream whose reads and writes end at the handler's deadlines."""

    def __init__(self, sock, handler):
        self.sock, self.h = sock, handler
        self.read_bytes = 0

    def readable(self):
        return True

    def writable(self):
        return True

    def _timeout(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return left

    def readinto(self, b):
        try:
            self.sock.settimeout(self._timeout(self.h.read_deadline))
            n = self.sock.recv_into(b)
        except TimeoutError:  # not http.server's: it would drop the connection without a word
            raise _Late() from None
        self.read_bytes += n
        if self.h.read_budget is not None and self.read_bytes > self.h.read_budget:
            raise _TooLarge()
        return n

    def write(self, b):
        deadline = self.h.write_deadline or (time.monotonic() + self.h.limits.write_timeout)
        self.sock.settimeout(self._timeout(deadline))
        self.sock.sendall(b)
        return len(b)


class _TooLarge(Exception):
    """The request head is larger than max_header_bytes."""


class _Late(Exception):
    """The request head or body did not arrive before its deadline."""


class Handler(BaseHTTPRequestHandler):
    """A BaseHTTPRequestHandler under the server's limits: one request, deadlines on
    every read and write. Handlers read a body with `read_body()`; one that must
    finish its answer by a given time sets `write_deadline` (time.monotonic())."""

    protocol_version = "HTTP/1.0"
    server: "BoundedServer"

    def setup(self):
        self.limits = self.server.limits
        self.connection = self.request
        self.read_deadline = time.monotonic() + self.limits.header_timeout
        self.read_budget = self.limits.max_header_bytes
        self.write_deadline = None
        self._raw = _DeadlineIO(self.request, self)
        self.rfile = io.BufferedReader(self._raw, 4096)
        self.wfile = self._raw

    def finish(self):
        pass  # the server closes the socket

    def handle(self):
        self.close_connection = True
        try:
            self.handle_one_request()
        except _TooLarge:
            self._refuse(431, "request head too large")
        except _Late:
            self._refuse(408, f"request not received within {self.limits.header_timeout:g} s")
        except (OSError, ValueError):
            pass  # the client went away, or a write passed its deadline

    def _refuse(self, code: int, message: str) -> None:
        if getattr(self, "_headers_buffer", None):
            return  # an answer had begun
        self.request_version = "HTTP/1.0"
        self.read_budget = None
        self.write_deadline = time.monotonic() + 1.0
        try:
            self.send_error(code, message)
        except (OSError, ValueError):
            pass

    def parse_request(self) -> bool:
        self.requestline = self.raw_requestline.decode("iso-8859-1", "replace").rstrip("\r\n")
        words = self.requestline.split()
        if len(words) == 2:  # HTTP/0.9: no headers follow, and no status line could answer
            self.request_version = "HTTP/1.0"
            self.command, self.path = words
            self.send_error(400, "HTTP/0.9 is not served")
            return False
        ok = super().parse_request()
        if ok:  # the head is in: the body has its own deadline and size
            self.read_budget = None
            self.read_deadline = time.monotonic() + self.limits.body_timeout
        return ok

    def read_body(self) -> bytes | None:
        """The request body (Content-Length required), or None after answering 400/411/413/408."""
        try:
            length = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            length = -1
        if length < 0:
            self.send_error(411, "Content-Length required")
            return None
        if length > self.limits.max_body_bytes:
            self.send_error(413, f"the body is {length} bytes; at most {self.limits.max_body_bytes}")
            return None
        try:
            body = self.rfile.read(length)
        except _Late:
            body = b""
        if len(body) != length:
            self._refuse(408, f"the body did not arrive whole ({length} bytes) within "
                               f"{self.limits.body_timeout:g} s")
            return None
        return body

    def log_message(self, format, *args):  # noqa: A002 - no access log
        pass

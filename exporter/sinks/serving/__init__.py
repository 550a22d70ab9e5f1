"""The bounded HTTP server of both listeners (/metrics and the node query
endpoint): server.py has the connections, the workers and every limit (its
docstring lists them), handler.py one request under its deadlines. Why not a
server library: docs/architecture.md, "Serving HTTP".
"""

from __future__ import annotations

from exporter.sinks.serving.handler import Handler
from exporter.sinks.serving.server import (
    LINGER_BYTES,
    LINGER_S,
    BoundedServer,
    Limits,
    listening_socket,
    raise_fd_limit,
)

__all__ = ["LINGER_BYTES", "LINGER_S", "BoundedServer", "Handler", "Limits", "listening_socket",
           "raise_fd_limit"]

"""HTTP serving with every limit explicit, for both listeners (/metrics in http.py,
the node query endpoint in offline/fleet/endpoint.py). Why not a server library:
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

By concern: handler.py is one request on one connection (deadlines on every
read and write, the head's and body's sizes); server.py is the connections
(the selector, the worker threads and their queue, 503s, eviction, lingering
closes, stopping) and its Limits.
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

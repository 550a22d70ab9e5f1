"""Asking the nodes' query endpoints: the flags and helpers `fleet` and `explain --nodes` share."""

from __future__ import annotations

import argparse
import sys
import time

from exporter.cli.common import output
from exporter.cli.common.options import CliError, parse_duration, positive_duration, positive_int


def add_node_options(p) -> None:
    """--nodes, --nodes-file, --token-file, --ca-file, --concurrency, --timeout."""
    p.add_argument("--nodes", action="append", metavar="URL[,URL...]",
                   help="the nodes' query endpoints, e.g. https://gpu-017:9402 (repeatable; "
                        "host:port means https)")
    p.add_argument("--nodes-file", metavar="FILE", help="one URL per line (# comments)")
    p.add_argument("--token-file", metavar="F",
                   help="the bearer token (default: $NCCL_EXPORTER_QUERY_TOKEN)")
    p.add_argument("--ca-file", metavar="F", help="CA bundle that signed the nodes' certificates")
    p.add_argument("--concurrency", type=positive_int, default=64, metavar="N",
                   help="nodes asked at once (default 64)")
    p.add_argument("--timeout", type=positive_duration, default=10.0, metavar="D",
                   help="per node: to connect and start answering, and the longest pause while "
                        "streaming (default 10s)")


def fleet_options(args):
    """The node URLs and client options the flags of add_node_options name."""
    from exporter.offline.fleet import client
    from exporter.sinks.recording import protocol

    try:
        urls = client.parse_nodes(args.nodes, args.nodes_file)
        token = protocol.read_token(args.token_file)
    except (client.FleetError, protocol.ProtocolError) as e:
        raise CliError(str(e)) from None
    if args.ca_file:
        try:
            open(args.ca_file).close()
        except OSError as e:
            raise CliError(f"--ca-file {args.ca_file}: {e.strerror or e}") from None
    opts = client.FleetOptions(token=token, ca_file=args.ca_file, concurrency=args.concurrency,
                               timeout=args.timeout)
    return urls, opts


def warn(res) -> None:
    where = res.node if res.node in res.url else f"{res.node} ({res.url})"
    warning(f"node {where}: {res.error}")


def warning(text: str) -> None:
    """One line on stderr, whatever a node sent (output.terminal_safe)."""
    print(f"nccl-exporter: warning: {output.terminal_safe(text, 500)}", file=sys.stderr, flush=True)


def time_arg(flag, text):
    """--since/--until: ns since the epoch, ISO 8601 or a duration ago; None stays None."""
    from exporter.sinks.recording.protocol import parse_time_ns

    if text is None:
        return None
    try:
        return parse_time_ns(text)
    except ValueError:
        pass
    try:
        return time.time_ns() - int(parse_duration(text) * 1e9)
    except argparse.ArgumentTypeError:
        raise CliError(f"{flag} {text!r}: ns since the epoch, ISO 8601 (2026-01-02T03:04:05Z) "
                       "or a duration ago (30m)") from None

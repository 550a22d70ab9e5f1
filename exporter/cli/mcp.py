"""`nccl-exporter mcp`: an MCP server (stdio, or streamable HTTP) over recordings and the fleet."""

from __future__ import annotations

import argparse
import os

from exporter.cli.common.options import CliError, parse_listen


def add_parser(sub) -> None:
    m = sub.add_parser("mcp", help="serve recordings and the fleet to AI assistants (Model Context Protocol)",
                       description="An MCP server: tools fleet_query, slowest_collectives, "
                                   "retransmits_by_link, hang_status, explain, stragglers, slow_links; the schema "
                                   "and documented queries as resources (docs/fleet-live.md). "
                                   "stdio by default. Needs the 'mcp' extra: pip install 'nccl-exporter[mcp]' "
                                   "(not in the OCI image).")
    m.add_argument("--db", action="append", default=[], metavar="PATH",
                   help="a local recording to answer from (repeatable)")
    m.add_argument("--nodes", action="append", metavar="URL[,URL...]",
                   help="nodes' query endpoints to fan out to (as 'fleet query')")
    m.add_argument("--nodes-file", metavar="FILE", help="one node URL per line (# comments), as 'fleet query'")
    m.add_argument("--token-file", metavar="F",
                   help="the nodes' bearer token (default: $NCCL_EXPORTER_QUERY_TOKEN)")
    m.add_argument("--ca-file", metavar="F", help="CA bundle that signed the nodes' certificates")
    m.add_argument("--concurrency", type=int, default=64, metavar="N", help="nodes asked at once (default 64)")
    m.add_argument("--timeout", default="10s", metavar="D",
                   help="per node: to connect and start answering, and the longest pause while "
                        "streaming (default 10s)")
    m.add_argument("--http", metavar="HOST:PORT",
                   help="streamable HTTP on this loopback address (path /mcp) instead of stdio")
    m.set_defaults(func=main)


def main(args) -> int:
    try:
        from exporter.offline import mcp_server
    except ImportError as e:
        raise CliError(f"the MCP server needs the 'mcp' extra (pip install 'nccl-exporter[mcp]', "
                       f"or pip install 'mcp>=2.3,<3'): {e}") from None
    from exporter.cli.common.options import parse_duration
    from exporter.offline.fleet import client
    from exporter.sinks.recording import protocol

    for db in args.db:
        if not os.path.isfile(db):
            raise CliError(f"--db {db}: no such file")
    nodes = []
    try:
        if args.nodes or args.nodes_file:
            nodes = client.parse_nodes(args.nodes, args.nodes_file)
        token = protocol.read_token(args.token_file)
    except (client.FleetError, protocol.ProtocolError) as e:
        raise CliError(str(e)) from None
    try:
        timeout = parse_duration(args.timeout)
    except argparse.ArgumentTypeError as e:
        raise CliError(f"--timeout: {e}") from None
    if args.concurrency < 1:
        raise CliError("--concurrency: at least 1")
    http = None
    if args.http:
        host, port = parse_listen(args.http, "--http")
        if not protocol.is_loopback(host):
            raise CliError(f"--http {args.http}: the MCP server has no authentication; listen on "
                           "loopback (127.0.0.1) and put an authenticating proxy in front")
        http = (host, port)
    targets = mcp_server.Targets(dbs=list(args.db), nodes=nodes,
                             options=client.FleetOptions(token=token, ca_file=args.ca_file,
                                                         concurrency=args.concurrency, timeout=timeout))
    mcp_server.serve(targets, http)
    return 0

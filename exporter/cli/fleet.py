"""`nccl-exporter fleet query|fetch`: one question to every node's query endpoint.

    fleet query --nodes URL[,URL...] | --nodes-file FILE [--token-file F] [--ca-file F]
                [--concurrency 64] [--timeout 10s] [--format table|csv|json]
                [--summary [--summary-column COL]] [--clock] [SQL]
    fleet fetch --nodes ... -o DIR [--since T] [--until T]

Rows are written as they arrive, `node` first (docs/fleet-live.md). A node
that fails gives one warning line on stderr; the exit status is 0 when at
least one node answered, 1 when none did, 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys
import time

from exporter.cli.common import output
from exporter.cli.common.options import CliError, parse_duration, positive_duration, positive_int
from exporter.offline.fleet.summary import Summary, clock_table

def _common(p) -> None:
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


def add_parser(sub) -> None:
    f = sub.add_parser("fleet", help="ask every node's query endpoint (query, fetch)",
                       description="Fan out to the nodes' query endpoints "
                                   "('run --db --query-listen'); docs/fleet-live.md.")
    fsub = f.add_subparsers(dest="fleet_command", metavar="SUBCOMMAND")
    q = fsub.add_parser("query", help="read-only SQL on every node, one table with a node column",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Run one read-only SQL statement on every node's recording, "
                                    "in parallel; one table, node first.",
                        epilog="examples:\n"
                               "  nccl-exporter fleet query --nodes-file nodes.txt --token-file tok \\\n"
                               "      \"SELECT op, COUNT(*) FROM nccl_events GROUP BY op\"\n"
                               "  nccl-exporter fleet query --nodes-file nodes.txt --summary \\\n"
                               "      \"SELECT duration_ns/1e6 AS ms FROM nccl_events WHERE op='ALL_REDUCE'\"\n"
                               "  nccl-exporter fleet query --nodes-file nodes.txt --clock\n")
    _common(q)
    q.add_argument("--format", choices=["table", "csv", "json"], default="table",
                   help="table (default, aligned columns), csv (with a header row) or json (an array of one object per row)")
    q.add_argument("--max-rows", type=positive_int, metavar="N",
                   help="rows per node at most (the node's own cap applies too)")
    q.add_argument("--summary", action="store_true",
                   help="instead of the rows: per node its row count, time, and p50/max of a "
                        "numeric column, the slowest first")
    q.add_argument("--summary-column", metavar="COL",
                   help="the column --summary describes (default: the first numeric one)")
    q.add_argument("--clock", action="store_true",
                   help="also estimate each node's clock offset (NTP-style, best of 5 round "
                        "trips): with --summary as columns, else a table on stderr "
                        "(on stdout when no SQL is given)")
    q.add_argument("sql", metavar="SQL", nargs="?", help="one SELECT (or WITH ...) statement")
    q.set_defaults(func=main_query)
    g = fsub.add_parser("fetch", help="download each node's recording (or a time window of it)",
                        description="Download each node's recording to DIR/<node>.db, for "
                                    "offline review (query, merge).")
    _common(g)
    g.add_argument("-o", "--out", required=True, metavar="DIR",
                   help="the directory the recordings go to, DIR/<node>.db each (created if absent)")
    g.add_argument("--since", metavar="T",
                   help="window start: ns since the epoch, ISO 8601, or a duration ago (30m)")
    g.add_argument("--until", metavar="T", help="window end (same forms)")
    g.set_defaults(func=main_fetch)
    f.set_defaults(func=lambda args: (f.print_help(), 2)[1])


def _options(args):
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


def _warn(res) -> None:
    where = res.node if res.node in res.url else f"{res.node} ({res.url})"
    _warning(f"node {where}: {res.error}")


def _warning(text: str) -> None:
    """One line on stderr, whatever a node sent (output.terminal_safe)."""
    print(f"nccl-exporter: warning: {output.terminal_safe(text, 500)}", file=sys.stderr, flush=True)


# --- fleet query -------------------------------------------------------------------

def main_query(args) -> int:
    from exporter.offline.fleet import client

    if not args.sql and not args.clock:
        raise CliError("fleet query: give the SQL (or --clock alone for clock offsets)")
    if args.summary_column and not args.summary:
        raise CliError("--summary-column goes with --summary")
    urls, opts = _options(args)
    opts.max_rows = args.max_rows
    opts.clock = args.clock
    out = sys.stdout
    writer = None if args.summary or not args.sql else output.STREAM_WRITERS[args.format](out)
    names = None
    summary = Summary(args.summary_column)
    bad_columns: set = set()
    results = []
    t0 = time.monotonic()
    for ev in client.stream_query(urls, args.sql, opts):
        if ev.kind == "columns":
            if names is None:
                names = list(ev.names)
                if writer:
                    writer.header(["node", *names])
                if args.summary_column and args.summary_column not in names:
                    raise CliError(f"--summary-column {args.summary_column!r}: the query's columns are "
                                   + ", ".join(names))
            elif list(ev.names) != names:
                bad_columns.add(ev.url)
                _warning(f"node {ev.node}: columns {ev.names} differ from {names}; its rows are left out")
        elif ev.kind == "rows":
            if ev.url in bad_columns:
                continue
            if writer:
                writer.rows([(ev.node, *r) for r in ev.rows])
            else:
                summary.add(ev.url, names, ev.rows)
        else:
            res = ev.result
            if res.url in bad_columns:
                res.ok, res.error = False, "columns differ from the other nodes'"
            elif not res.ok:
                _warn(res)
            elif res.truncated:
                _warning(f"node {res.node}: answer cut at its {res.truncated}")
            results.append(res)
    answered = [r for r in results if r.ok]
    if writer:
        writer.end(len(answered))
    if args.summary and args.sql:
        output.write(*summary.table(names, answered, args.clock), args.format, out)
    elif args.clock:
        output.write(*clock_table(answered), args.format, out if not args.sql else sys.stderr)
    print(f"nccl-exporter: {len(answered)} of {len(urls)} nodes answered in "
          f"{time.monotonic() - t0:.2f} s", file=sys.stderr, flush=True)
    return 0 if answered else 1


# --- fleet fetch ------------------------------------------------------------------

def _time_arg(flag, text):
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


def main_fetch(args) -> int:
    from exporter.offline.fleet import client

    since, until = _time_arg("--since", args.since), _time_arg("--until", args.until)
    if since is not None and until is not None and until < since:
        raise CliError("--until is before --since")
    urls, opts = _options(args)
    ok = 0
    t0 = time.monotonic()
    try:
        results = client.fetch(urls, args.out, opts, since, until)
        for res in results:
            if res.ok:
                ok += 1
                print(f"{res.node}: {res.path} ({res.rows} NCCL calls)", flush=True)
            else:
                _warn(res)
    except OSError as e:
        raise CliError(f"-o {args.out}: {e.strerror or e}") from None
    print(f"nccl-exporter: {ok} of {len(urls)} recordings fetched to {args.out} in "
          f"{time.monotonic() - t0:.2f} s", file=sys.stderr, flush=True)
    return 0 if ok else 1

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

from exporter.cli.common import nodes, output
from exporter.cli.common.options import CliError, positive_int
from exporter.offline.fleet.summary import Summary, clock_table

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
    nodes.add_node_options(q)
    output.add_format_option(q)
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
    nodes.add_node_options(g)
    g.add_argument("-o", "--out", required=True, metavar="DIR",
                   help="the directory the recordings go to, DIR/<node>.db each (created if absent)")
    g.add_argument("--since", metavar="T",
                   help="window start: ns since the epoch, ISO 8601, or a duration ago (30m)")
    g.add_argument("--until", metavar="T", help="window end (same forms)")
    g.set_defaults(func=main_fetch)
    f.set_defaults(func=lambda args: (f.print_help(), 2)[1])


# --- fleet query -------------------------------------------------------------------

def main_query(args) -> int:
    from exporter.offline.fleet import client

    if not args.sql and not args.clock:
        raise CliError("fleet query: give the SQL (or --clock alone for clock offsets)")
    if args.summary_column and not args.summary:
        raise CliError("--summary-column goes with --summary")
    urls, opts = nodes.fleet_options(args)
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
                nodes.warning(f"node {ev.node}: columns {ev.names} differ from {names}; its rows are left out")
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
                nodes.warn(res)
            elif res.truncated:
                nodes.warning(f"node {res.node}: answer cut at its {res.truncated}")
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

def main_fetch(args) -> int:
    from exporter.offline.fleet import client

    since, until = nodes.time_arg("--since", args.since), nodes.time_arg("--until", args.until)
    if since is not None and until is not None and until < since:
        raise CliError("--until is before --since")
    urls, opts = nodes.fleet_options(args)
    ok = 0
    t0 = time.monotonic()
    try:
        results = client.fetch(urls, args.out, opts, since, until)
        for res in results:
            if res.ok:
                ok += 1
                print(f"{res.node}: {res.path} ({res.rows} NCCL calls)", flush=True)
            else:
                nodes.warn(res)
    except OSError as e:
        raise CliError(f"-o {args.out}: {e.strerror or e}") from None
    print(f"nccl-exporter: {ok} of {len(urls)} recordings fetched to {args.out} in "
          f"{time.monotonic() - t0:.2f} s", file=sys.stderr, flush=True)
    return 0 if ok else 1

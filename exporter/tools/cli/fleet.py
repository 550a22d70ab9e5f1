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
import csv
import json
import random
import statistics
import sys
import time

from exporter.tools import output
from exporter.tools.cli.options import CliError, parse_duration

TABLE_SAMPLE_ROWS = 1000   # the table's column widths come from the first rows
SUMMARY_SAMPLE = 10_000    # values kept per node for the summary's p50 (reservoir)


def _positive_int(text):
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return n


def _duration(text):
    seconds = parse_duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0: {text!r}")
    return seconds


def _common(p) -> None:
    p.add_argument("--nodes", action="append", metavar="URL[,URL...]",
                   help="the nodes' query endpoints, e.g. https://gpu-017:9402 (repeatable; "
                        "host:port means https)")
    p.add_argument("--nodes-file", metavar="FILE", help="one URL per line (# comments)")
    p.add_argument("--token-file", metavar="F",
                   help="the bearer token (default: $NCCL_EXPORTER_QUERY_TOKEN)")
    p.add_argument("--ca-file", metavar="F", help="CA bundle that signed the nodes' certificates")
    p.add_argument("--concurrency", type=_positive_int, default=64, metavar="N",
                   help="nodes asked at once (default 64)")
    p.add_argument("--timeout", type=_duration, default=10.0, metavar="D",
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
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.add_argument("--max-rows", type=_positive_int, metavar="N",
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
    g.add_argument("-o", "--out", required=True, metavar="DIR", help="where the files go")
    g.add_argument("--since", metavar="T",
                   help="window start: ns since the epoch, ISO 8601, or a duration ago (30m)")
    g.add_argument("--until", metavar="T", help="window end (same forms)")
    g.set_defaults(func=main_fetch)
    f.set_defaults(func=lambda args: (f.print_help(), 2)[1])


def _options(args):
    from exporter.tools.fleet import client

    try:
        urls = client.parse_nodes(args.nodes, args.nodes_file)
        token = client.read_token(args.token_file)
    except client.FleetError as e:
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
    print(f"nccl-exporter: warning: node {where}: {res.error}", file=sys.stderr, flush=True)


# --- writers: rows as they come ---------------------------------------------------

class _Table:
    """The aligned table, streamed: column widths from the first TABLE_SAMPLE_ROWS rows."""

    def __init__(self, out):
        self.out, self.names, self.held, self.layout, self.n = out, None, [], None, 0

    def header(self, names):
        self.names = names

    def rows(self, rows):
        self.n += len(rows)
        if self.layout is None:
            self.held += rows
            if len(self.held) >= TABLE_SAMPLE_ROWS:
                self._start()
        else:
            self.out.write(self.layout.lines(rows))

    def _start(self):
        self.layout = output.TableLayout(self.names or [], self.held)
        self.out.write(self.layout.header() + self.layout.lines(self.held))
        self.held = []

    def end(self, nodes):
        if self.names is None:
            return
        if self.layout is None:
            self._start()
        self.out.write(f"({self.n} row{'s' if self.n != 1 else ''} from {nodes} "
                       f"node{'s' if nodes != 1 else ''})\n")


class _Csv:
    def __init__(self, out):
        self.w = csv.writer(out, lineterminator="\n")

    def header(self, names):
        self.w.writerow(names)

    def rows(self, rows):
        self.w.writerows(rows)

    def end(self, nodes):
        pass


class _Json:
    def __init__(self, out):
        self.out, self.names, self.first = out, None, True

    def header(self, names):
        self.names = names
        self.out.write("[")

    def rows(self, rows):
        parts = [json.dumps(dict(zip(self.names, r))) for r in rows]
        if parts:
            self.out.write(("\n" if self.first else ",\n") + ",\n".join(parts))
            self.first = False

    def end(self, nodes):
        if self.names is not None:
            self.out.write("\n]\n" if not self.first else "]\n")


WRITERS = {"table": _Table, "csv": _Csv, "json": _Json}


# --- summary ---------------------------------------------------------------------

class _Stats:
    def __init__(self):
        self.n, self.max, self.sample, self.rng = 0, None, [], random.Random(0)

    def add(self, v):
        self.n += 1
        self.max = v if self.max is None or v > self.max else self.max
        if len(self.sample) < SUMMARY_SAMPLE:
            self.sample.append(v)
        else:
            j = self.rng.randrange(self.n)
            if j < SUMMARY_SAMPLE:
                self.sample[j] = v

    def p50(self):
        return statistics.median(self.sample) if self.sample else None


def _clock_cols(clock):
    if clock is None:
        return [None, None]
    return [round(clock.offset_ns / 1e6, 3), round(clock.uncertainty_ns / 1e6, 3)]


# --- fleet query -------------------------------------------------------------------

def main_query(args) -> int:
    from exporter.tools.fleet import client

    if not args.sql and not args.clock:
        raise CliError("fleet query: give the SQL (or --clock alone for clock offsets)")
    if args.summary_column and not args.summary:
        raise CliError("--summary-column goes with --summary")
    urls, opts = _options(args)
    opts.max_rows = args.max_rows
    opts.clock = args.clock
    out = sys.stdout
    writer = None if args.summary or not args.sql else WRITERS[args.format](out)
    names = None
    stats: dict[str, _Stats] = {}
    col: dict[str, int] = {}      # node -> index of the summary column in its rows
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
                print(f"nccl-exporter: warning: node {ev.node}: columns {ev.names} differ from "
                      f"{names}; its rows are left out", file=sys.stderr, flush=True)
        elif ev.kind == "rows":
            if ev.url in bad_columns:
                continue
            if writer:
                writer.rows([(ev.node, *r) for r in ev.rows])
            else:
                s = stats.setdefault(ev.url, _Stats())
                i = col.get(ev.url)
                for r in ev.rows:
                    if i is None:
                        if args.summary_column:
                            i = names.index(args.summary_column)
                        else:
                            i = next((k for k, v in enumerate(r)
                                      if isinstance(v, (int, float)) and not isinstance(v, bool)), -1)
                        col[ev.url] = i
                    v = r[i] if i >= 0 else None
                    if isinstance(v, (int, float)):
                        s.add(float(v))
                    else:
                        s.n += 1
        else:
            res = ev.result
            if res.url in bad_columns:
                res.ok, res.error = False, "columns differ from the other nodes'"
            elif not res.ok:
                _warn(res)
            elif res.truncated:
                print(f"nccl-exporter: warning: node {res.node}: answer cut at its {res.truncated}",
                      file=sys.stderr, flush=True)
            results.append(res)
    answered = [r for r in results if r.ok]
    if writer:
        writer.end(len(answered))
    if args.summary and args.sql:
        _write_summary(args, names, answered, stats, col, out)
    elif args.clock:
        _write_clock(answered, out if not args.sql else sys.stderr, args.format)
    print(f"nccl-exporter: {len(answered)} of {len(urls)} nodes answered in "
          f"{time.monotonic() - t0:.2f} s", file=sys.stderr, flush=True)
    return 0 if answered else 1


def _write_summary(args, names, answered, stats, col, out) -> None:
    idx = next((i for i in col.values() if i is not None and i >= 0), -1)
    colname = args.summary_column or (names[idx] if names and idx >= 0 else "value")
    rows = []
    for r in answered:
        s = stats.get(r.url, _Stats())
        rows.append([r.node, r.rows, round(r.elapsed_s * 1000, 1), s.p50(), s.max])
    p50s = [row[3] for row in rows if row[3] is not None]
    fleet = statistics.median(p50s) if p50s else None
    header = ["node", "rows", "answer_ms", f"p50_{colname}", f"max_{colname}", "x_fleet_median"]
    for row in rows:
        row.append(round(row[3] / fleet, 2) if fleet and row[3] is not None else None)
    if args.clock:
        header += ["clock_offset_ms", "clock_pm_ms"]
        by_url = {r.url: r for r in answered}
        for row, r in zip(rows, answered):
            row += _clock_cols(by_url[r.url].clock)
    order = sorted(range(len(rows)), key=lambda k: (rows[k][3] is None, -(rows[k][3] or 0), rows[k][0]))
    output.write(header, [tuple(rows[k]) for k in order], args.format, out)


def _write_clock(answered, out, fmt) -> None:
    rows = [(r.node, *_clock_cols(r.clock), round(r.clock.rtt_ns / 1e6, 3) if r.clock else None)
            for r in answered]
    rows.sort(key=lambda r: -abs(r[1] or 0))
    output.write(["node", "clock_offset_ms", "clock_pm_ms", "best_rtt_ms"], rows, fmt, out)


# --- fleet fetch ------------------------------------------------------------------

def _time_arg(flag, text):
    from exporter.tools.fleet.endpoint import parse_time_ns

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
    from exporter.tools.fleet import client

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


# --- the node side: `run --db --query-listen` (used by exporter/tools/cli/run.py) ---------

def add_query_endpoint_options(r) -> None:
    g = r.add_argument_group("query endpoint (with --db; docs/fleet-live.md)")
    g.add_argument("--query-listen", metavar="HOST:PORT",
                   help="answer read-only SQL on the recording here (POST /api/v1/query), and "
                        "serve it for 'fleet fetch'; off by default")
    g.add_argument("--query-token-file", metavar="F", help="the bearer token clients must send (required)")
    g.add_argument("--query-tls-cert", metavar="F", help="TLS certificate (required unless loopback only)")
    g.add_argument("--query-tls-key", metavar="F", help="TLS private key")
    g.add_argument("--query-max-rows", type=_positive_int, metavar="N",
                   help="rows per answer at most (default 100000)")
    g.add_argument("--query-time-limit", type=_duration, metavar="D",
                   help="per query (default 10s)")


def open_query_endpoint(args):
    """Validate the --query-* options and bind the listener (not serving yet); None when off."""
    from exporter.tools.fleet import endpoint

    if not getattr(args, "query_listen", None):
        if any(getattr(args, k, None) for k in ("query_token_file", "query_tls_cert", "query_tls_key")):
            raise CliError("--query-token-file/--query-tls-* need --query-listen HOST:PORT")
        return None
    if not args.db:
        raise CliError("--query-listen needs --db PATH: queries are answered from the recording")
    if not args.query_token_file:
        raise CliError("--query-listen needs --query-token-file F (a bearer token)")
    from exporter.tools.cli.options import parse_listen

    try:
        host, port = parse_listen(args.query_listen)
    except CliError as e:
        raise CliError(str(e).replace("--listen", "--query-listen")) from None
    try:
        return endpoint.QueryEndpoint(
            args.db, node="", token=endpoint.read_token(args.query_token_file), host=host, port=port,
            tls_cert=args.query_tls_cert, tls_key=args.query_tls_key,
            max_rows=args.query_max_rows or endpoint.DEFAULT_MAX_ROWS,
            time_limit=args.query_time_limit or endpoint.DEFAULT_TIME_LIMIT_S)
    except endpoint.EndpointError as e:
        raise CliError(str(e)) from None


def serve_queries(ep, node) -> None:
    """Start answering, once the recording exists."""
    if ep is None:
        return
    ep.node = node
    ep.start()
    print(f"read-only queries at {ep.url}/api/v1/query (bearer token)", flush=True)

"""`nccl-exporter query`: read-only SQL on a recording."""

from __future__ import annotations

from exporter.sinks.recording import query
from exporter.cli.common import output
from exporter.cli.common.options import CliError


def add_parser(sub) -> None:
    q = sub.add_parser("query", help="run read-only SQL on a recording made by 'trace --db' or 'run --db'",
                       description="Run one read-only SQL statement on a recording "
                                   "(tables: docs/schema.md; examples: docs/queries.md).")
    q.add_argument("db", metavar="DB", help="the recording (.db)")
    q.add_argument("sql", metavar="SQL", help="one SELECT (or WITH ...) statement")
    output.add_format_option(q)
    q.set_defaults(func=main)


def main(args) -> int:
    try:
        names, rows = query.run(args.db, args.sql)
    except query.QueryError as e:
        raise CliError(str(e)) from None
    output.write(names, rows, args.format)
    return 0

"""`nccl-exporter explain`: one verdict line, then the evidence."""

from __future__ import annotations

import json
import sqlite3

from exporter.tools.cli.options import CliError


def add_parser(sub) -> None:
    p = sub.add_parser("explain", help="a one-line verdict (straggler, CPU starvation, lossy link or "
                                       "healthy) and its evidence",
                       description="Read a recording (or a merged one) and say what held the job's "
                                   "collectives up: a late rank and why, a starved rank, a lossy link, "
                                   "or nothing (docs/fleet.md).")
    p.add_argument("db", metavar="DB", help="a recording, or a merged one ('merge')")
    p.add_argument("--no-align", action="store_true", help="raw node clocks: no skew correction")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.set_defaults(func=main)


def main(args) -> int:
    from exporter.tools.analysis import explain
    from exporter.tools.cli.stragglers import open_recording

    conn = open_recording(args.db)
    try:
        lines = [line for line in explain.explain(conn, align=not args.no_align) if line]
    except sqlite3.DatabaseError as e:
        raise CliError(f"{args.db}: {e}") from None
    finally:
        conn.close()
    if args.format == "json":
        print(json.dumps({"verdict": lines[0], "evidence": lines[1:]}, indent=1))
    else:
        print(lines[0])
        for line in lines[1:]:
            print("  - " + line)
    return 0

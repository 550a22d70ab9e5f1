"""`nccl-exporter export perfetto`: a recording as a timeline (Chrome/Perfetto JSON trace)."""

from __future__ import annotations

import sqlite3
import sys

from exporter.cli.common.options import CliError
from exporter.cli.common.recording import open_recording


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a recording as a Perfetto/Chrome timeline (JSON trace)",
                       description="Write a recording (or a merged one) as a timeline: a process per "
                                   "node, a thread per rank, a slice per NCCL call, flows linking the "
                                   "slices of one collective, retransmits as instants, run-queue waits "
                                   "as slices; node clocks aligned (docs/fleet.md). Open it in "
                                   "https://ui.perfetto.dev or chrome://tracing.")
    p.add_argument("format", choices=["perfetto"], help="the output format")
    p.add_argument("db", metavar="DB", help="a recording, or a merged one ('merge')")
    p.add_argument("-o", "--out", required=True, metavar="FILE",
                   help="the Perfetto trace file to write, not a recording ('-': stdout)")
    p.add_argument("--no-align", action="store_true", help="raw node clocks: no skew correction")
    p.set_defaults(func=main)


def main(args) -> int:
    from exporter.offline.export import perfetto

    rec = open_recording(args.db)
    try:
        out = sys.stdout if args.out == "-" else open(args.out, "w")
    except OSError as e:
        rec.close()
        raise CliError(f"{args.out}: {e.strerror or e}") from None
    try:
        counts = perfetto.export(rec, out, align=not args.no_align)
    except sqlite3.DatabaseError as e:
        raise CliError(f"{args.db}: {e}") from None
    finally:
        rec.close()
        if out is not sys.stdout:
            out.close()
    print(f"wrote {counts['events']} trace events to {args.out}: {counts['slices']} NCCL call slices, "
          f"{counts['flows']} collectives linked, {counts['instants']} TCP events, "
          f"{counts['runq_slices']} run-queue waits", file=sys.stderr)
    return 0

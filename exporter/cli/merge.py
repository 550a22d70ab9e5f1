"""`nccl-exporter merge`: many nodes' recordings into one file, deduplicated, with clock offsets."""

from __future__ import annotations

import sys

from exporter.cli.common.options import CliError, add_deprecated_alias


def add_parser(sub) -> None:
    p = sub.add_parser("merge", help="merge recordings of many nodes into one (deduplicated, skew estimated)",
                       description="Merge recordings (any schema version) into --db OUT: each row keeps its "
                                   "node; rows already there are skipped (row identity: docs/fleet.md), so "
                                   "merging a file twice or overlapping windows adds nothing; the nodes' "
                                   "clock offsets, estimated from collective ends, go to clock_skew.")
    p.add_argument("inputs", nargs="+", metavar="IN.db", help="recordings to merge (trace --db, run --db, "
                   "or merged ones)")
    p.add_argument("--db", metavar="OUT.db", help="the merged recording: created, or added to (required)")
    add_deprecated_alias(p, ("-o", "--out"), "--db")
    p.add_argument("--rename", action="append", metavar="[FILE:]OLD=NEW",
                   help="rename node OLD to NEW (in FILE only, or in every input); repeatable")
    p.add_argument("--no-align", action="store_true", help="store no clock offsets (raw clocks)")
    p.add_argument("--query-indexes", action="store_true",
                   help="also build the time and slow-call indexes the documented queries use (a new "
                        "OUT only; about twice the merge time on a big fleet). Without them every "
                        "query still answers, by scanning; stragglers and explain use the "
                        "(comm, op, seq) index, which is always built")
    p.set_defaults(func=main)


def main(args) -> int:
    from exporter.offline.fleet import merge

    if not getattr(args, "db", None):
        raise CliError("merge needs --db OUT.db: the recording to merge into")
    try:
        rep = merge.merge(args.db, args.inputs, merge.parse_renames(args.rename), align=not args.no_align,
                          query_indexes=args.query_indexes)
    except merge.MergeError as e:
        raise CliError(str(e)) from None
    added = ", ".join(f"{n} {t}" for t, n in rep.added.items() if rep.offered[t])
    dup = sum(rep.offered.values()) - sum(rep.added.values())
    print(f"merged {rep.inputs} recordings ({rep.nodes} nodes) into {args.db} in {rep.seconds:.1f} s: "
          f"added {added or 'nothing'}; {dup} rows already there", file=sys.stderr)
    for o in rep.skew:
        print(f"  clock {o.node}: {o.offset_ns / 1e6:+.3f} ms vs {o.reference} ({o.method}, "
              f"{o.collectives} collectives, residual {o.residual_ns / 1e6:.3f} ms)", file=sys.stderr)
    return 0

"""`nccl-exporter explain`: one verdict line, then the evidence."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import tempfile

from exporter.cli.common import nodes
from exporter.cli.common.options import CliError
from exporter.cli.common.recording import open_recording


def add_parser(sub) -> None:
    p = sub.add_parser("explain", help="a one-line verdict (straggler, CPU starvation, lossy link or "
                                       "healthy) and its evidence",
                       description="Read a recording (or a merged one) and say what held the job's "
                                   "collectives up: a late rank and why, a starved rank, a lossy link, "
                                   "or nothing (docs/fleet.md).")
    p.add_argument("db", metavar="DB", nargs="?",
                   help="a recording, or a merged one ('merge'); or ask live agents with --nodes")
    p.add_argument("--no-align", action="store_true", help="raw node clocks: no skew correction")
    live = p.add_argument_group("live: the nodes' query endpoints ('run --db --query-listen')")
    nodes.add_node_options(live)
    live.add_argument("--since", default="10m", metavar="T",
                      help="the window fetched from each node: a duration ago (default 10m), ISO "
                           "8601 or ns since the epoch")
    p.add_argument("--format", choices=["text", "json"], default="text",
                   help="text (default): the verdict and its evidence; json: the same as one object")
    p.set_defaults(func=main)


def fetch_and_merge(args, workdir: str) -> str:
    """--nodes: each node's recording window, fetched and merged into one
    file (clocks aligned) in workdir; returns its path."""
    from exporter.offline.fleet import client, merge

    urls, opts = nodes.fleet_options(args)
    since = nodes.time_arg("--since", args.since)
    got = []
    for res in client.fetch(urls, os.path.join(workdir, "nodes"), opts, since, None):
        if res.ok:
            got.append(res.path)
        else:
            nodes.warn(res)
    if not got:
        raise CliError(f"no node answered (of {len(urls)})")
    out = os.path.join(workdir, "merged.db")
    try:
        merge.merge(out, got)
    except merge.MergeError as e:
        raise CliError(str(e)) from None
    print(f"nccl-exporter: {len(got)} of {len(urls)} nodes' recordings since {args.since} merged",
          file=sys.stderr, flush=True)
    return out


def main(args) -> int:
    if bool(args.db) == bool(args.nodes or args.nodes_file):
        raise CliError("give a recording (DB) or --nodes/--nodes-file, not both and not neither")
    if args.nodes or args.nodes_file:
        with tempfile.TemporaryDirectory(prefix="nccl-explain-") as d:
            args.db = fetch_and_merge(args, d)
            return _explain(args)
    return _explain(args)


def _explain(args) -> int:
    from exporter.offline.analysis import explain

    rec = open_recording(args.db)
    try:
        lines = [line for line in explain.explain(rec, align=not args.no_align) if line]
    except sqlite3.DatabaseError as e:
        raise CliError(f"{args.db}: {e}") from None
    finally:
        rec.close()
    if args.format == "json":
        print(json.dumps({"verdict": lines[0], "evidence": lines[1:]}, indent=1))
    else:
        print(lines[0])
        for line in lines[1:]:
            print("  - " + line)
    return 0

"""`nccl-exporter stragglers`: who arrives last at each collective, and what was in its way."""

from __future__ import annotations

import sqlite3
import sys

from exporter.cli.common import output
from exporter.cli.common.options import CliError
from exporter.cli.common.recording import open_recording


def add_parser(sub) -> None:
    p = sub.add_parser("stragglers", help="per rank: how often it arrived last at a collective, its lag, "
                                          "retransmits and CPU waits; --links: per link, network waits",
                       description="Per collective (comm, op, seq) each rank's arrival (call start, "
                                   "skew-aligned); per rank how often it was last, its median lag (last "
                                   "arrival - median arrival) and the retransmits and run-queue waits in "
                                   "its windows (docs/fleet.md). With --links, per link (sender → receiver) "
                                   "the profiler plugin's network waits and which link is slow "
                                   "(docs/network.md).")
    p.add_argument("db", metavar="DB", help="a recording, or a merged one ('merge')")
    p.add_argument("--comm", metavar="C", help="only this communicator (comm_id_hash or a prefix)")
    p.add_argument("--op", metavar="OP", help="only this op, e.g. ALL_REDUCE")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--collectives", action="store_true",
                       help="one row per collective (arrivals, last rank, lag) instead of per rank")
    shape.add_argument("--links", action="store_true",
                       help="one row per link (sender → receiver of a communicator) from the profiler "
                            "plugin's network waits: the receiver's recv_wait, the sender's send_wait and "
                            "send_gpu_wait against the communicator's median pair, retransmits, and the "
                            "verdict (slow link, GPU straggler); any NET transport (docs/network.md)")
    p.add_argument("--no-align", action="store_true", help="raw node clocks: no skew correction")
    output.add_format_option(p)
    p.set_defaults(func=main)


def main(args) -> int:
    from exporter.offline.analysis import stragglers

    if args.links:
        return _links(args)
    from exporter.offline.analysis import network

    rec = open_recording(args.db)
    try:
        collectives, _ = stragglers.load(rec, align=not args.no_align, comm=args.comm,
                                         op=args.op.upper() if args.op else None)
        if not collectives and (args.op or args.comm):
            raise CliError(f"no collective matches {_filters(args)} in {args.db}; "
                           + stragglers.what_there_is(rec))
        judged = network.judge(network.load(rec, comm=args.comm, op=args.op.upper() if args.op else None))
    except sqlite3.DatabaseError as e:
        raise CliError(f"{args.db}: {e}") from None
    finally:
        rec.close()
    if args.collectives:
        output.write(stragglers.COLLECTIVE_COLUMNS, stragglers.collective_rows(collectives), args.format)
    else:
        output.write(stragglers.RANK_COLUMNS, stragglers.rank_rows(stragglers.worst_first(
            stragglers.per_rank(collectives))), args.format)
    for lk in judged[:3]:  # what arrival times cannot show: a link or a GPU inside the calls
        print(f"nccl-exporter: network waits: {lk.verdict}: {network.headline(lk)} ('stragglers --links')",
              file=sys.stderr)
    return 0


def _links(args) -> int:
    from exporter.offline.analysis import network

    rec = open_recording(args.db)
    try:
        if not network.available(rec):
            version = rec.version
            raise CliError(f"{args.db} has no network waits: recording schema {version} predates the "
                           "nccl_peer_waits table (7); record with this nccl-exporter and the profiler plugin "
                           "(docs/network.md)")
        links = network.load(rec, comm=args.comm, op=args.op.upper() if args.op else None)
        if not links:
            if args.op or args.comm:
                raise CliError(f"no network waits match {_filters(args)} in {args.db}")
            raise CliError(f"{args.db} holds no network waits: the profiler plugin was not loaded, its proxy "
                           "accounting was off, or no transfer went over a NET transport (IB, RoCE, Socket, "
                           "a net plugin; not P2P, SHM or NVLS: docs/network.md)")
        network.judge(links)
    except sqlite3.DatabaseError as e:
        raise CliError(f"{args.db}: {e}") from None
    finally:
        rec.close()
    output.write(network.LINK_COLUMNS, network.link_rows(links), args.format)
    return 0


def _filters(args) -> str:
    return " ".join(f"--{k} {v}" for k, v in (("op", args.op), ("comm", args.comm)) if v)

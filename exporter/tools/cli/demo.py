"""`nccl-exporter demo`: the simulated cluster, as in `make demo`."""

from __future__ import annotations

from exporter.records import contract
from exporter.tools.cli.options import require_privileges


def add_parser(sub) -> None:
    d = sub.add_parser("demo", help="run an 8-rank simulated job with loss and a straggler, "
                                    "and show what the exporter sees",
                       description="Build the simulated libnccl, start a cluster of network namespaces "
                                   "(one per rank, 198.18.0.0/15), drop packets on one rank's link, slow "
                                   "another, run the agent on it, and print what the exporter sees: per-rank "
                                   "call durations, retransmits by link, the straggler. Needs root; removes "
                                   "every namespace and nft table it made, also on Ctrl-C (docs/simulator.md).")
    d.add_argument("--ranks", type=int, default=8, help="ranks, one per simulated host (default 8)")
    d.add_argument("--seconds", type=float, default=30.0, help="how long the job runs (default 30)")
    d.add_argument("--lossy-rank", type=int, default=5, help="rank whose link drops packets (default 5)")
    d.add_argument("--loss-percent", type=int, default=3, help="packet loss on that link (default 3)")
    d.add_argument("--straggler-rank", type=int, default=2,
                   help="rank that computes longer before each collective (default 2)")
    d.add_argument("--gpu", action="store_true",
                   help="run the job in the simulator's GPU-like mode with the profiler plugin, and show "
                        "host time and GPU time side by side")
    d.add_argument("--listen", default=f"127.0.0.1:{contract.DEFAULT_PORT}", metavar="HOST:PORT",
                   help=f"where the demo's agent serves /metrics (default 127.0.0.1:{contract.DEFAULT_PORT})")
    d.set_defaults(func=main)


def main(args) -> int:
    from exporter.tools import demo

    require_privileges()
    return demo.main(args)

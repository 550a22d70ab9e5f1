"""Small CLI: build the library, run a job on a simulated cluster, clean up.

    python -m exporter.simulator build
    python -m exporter.simulator run --hosts 4 --workload mixed --iterations 5 \\
        [--loss 1:2] [--straggler 3:200] [--ipv6] [--keep DIR]
    python -m exporter.simulator cleanup
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile

from exporter.simulator.build import build_library
from exporter.simulator.cluster import Cluster, cleanup_stale, run_job


def _pairs(items: list[str]) -> dict[int, int]:
    out = {}
    for it in items or []:
        k, v = it.split(":", 1)
        out[int(k)] = int(v)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m exporter.simulator")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile libnccl.so.2 and print its path")
    b.add_argument("--outdir")
    r = sub.add_parser("run", help="run a job, one rank per simulated host")
    r.add_argument("--hosts", type=int, default=4)
    r.add_argument("--workload", choices=["mixed", "allreduce", "hang", "train"], default="mixed")
    r.add_argument("--iterations", type=int, default=5)
    r.add_argument("--count", type=int, default=1024)
    r.add_argument("--loss", action="append", metavar="HOST:PERCENT")
    r.add_argument("--straggler", action="append", metavar="RANK:MS", help="compute delay before collectives")
    r.add_argument("--ipv6", action="store_true")
    r.add_argument("--timeout", type=float, default=120)
    r.add_argument("--keep", help="directory for rendezvous files, truth and rank output")
    sub.add_parser("cleanup", help="remove namespaces left by dead runs")
    a = p.parse_args(argv)

    if a.cmd == "build":
        print(build_library(a.outdir))
        return 0
    if a.cmd == "cleanup":
        for name in cleanup_stale():
            print("removed", name)
        return 0
    lib = build_library()
    work = a.keep or tempfile.mkdtemp(prefix="ncclsim-")
    with Cluster(a.hosts) as c:
        for host, pct in _pairs(a.loss).items():
            c.set_loss(host, pct)
        res = run_job(c, lib, a.workload, a.iterations, f"{work}/rdv", f"{work}/truth", count=a.count,
                      compute_delay_ms=_pairs(a.straggler), timeout=a.timeout, ipv6=a.ipv6)
    print(res.summary())
    print(f"truth: {len(res.truth)} records in {work}/truth:",
          dict(collections.Counter(r['op'] for r in res.truth)))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())

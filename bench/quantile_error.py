#!/usr/bin/env python3
"""Quantile error against the truth, per histogram exposition.

Runs a 2-rank simulated job (network namespaces; no agent needed: the
simulator writes each call's true duration) in which rank 1 computes
--slow-peer-ms before every AllReduce, so rank 0 waits for it. Three
distributions of the calls' true durations: rank 0 (waits for the peer),
rank 1 (the peer itself: short calls), and both ranks together (bimodal: a
straggler's communicator). Each is put in the kernel's schema-3 slots
(records/histogram.py: the same function as bpf/histogram.h, exact), and
p50, p90 and p99 are estimated from:

  classic coarse   the text scrape's buckets (each power of two seconds),
                   histogram_quantile's linear interpolation
  classic fine     `--histogram-resolution fine` (each quarter power of two)
  native           the protobuf scrape's native histogram, as Prometheus 2.42
                   interpolates it (linear inside the bucket)
  native midpoint  the geometric midpoint of the native bucket

against the nearest-rank quantile of the true durations. With each, the
scrape bytes and time of an 8 ranks x 3 comms x 3 ops node
(bench/scrape_bench.py). Run as root, from the repository root:

    .venv/bin/python bench/quantile_error.py [--calls 3000] [--slow-peer-ms 4]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exporter.records import histogram

D = histogram.DURATION
COARSE, FINE = histogram.CLASSIC["coarse"], histogram.CLASSIC["fine"]


def per_bucket(classic, slots):
    cum = classic.cumulative(D, slots)
    return [c - p for c, p in zip(cum, [0] + cum[:-1])]


ESTIMATORS = {
    "classic coarse": ("text coarse", lambda s, q: COARSE.quantile(D, per_bucket(COARSE, s), q)),
    "classic fine": ("text fine", lambda s, q: FINE.quantile(D, per_bucket(FINE, s), q)),
    "native": ("protobuf", lambda s, q: D.quantile(s, q)),
    "native midpoint": ("protobuf", lambda s, q: D.midpoint_quantile(s, q)),
}


def true_quantile(values, q):
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)] / 1e9


def distributions(calls: int, slow_peer_ms: float) -> dict[str, list[int]]:
    from exporter.simulator.build import build_library
    from exporter.simulator.cluster import Cluster, cleanup_stale, run_job
    from exporter.simulator.truth import calls as truth_calls
    from exporter.simulator.truth import load_truth

    with tempfile.TemporaryDirectory(prefix="nccl-qerr-") as work:
        lib = build_library(Path(work) / "lib")
        cleanup_stale()
        with Cluster(2) as cluster:
            res = run_job(cluster, lib, "allreduce", iterations=calls, rendezvous_dir=Path(work) / "rdv",
                          truth_dir=Path(work) / "truth", compute_delay_ms={0: 0, 1: slow_peer_ms},
                          timeout=calls * (slow_peer_ms + 5) / 1000 + 60)
        if not res.ok:
            raise SystemExit("the simulated job failed:\n" + res.summary())
        truth = truth_calls(load_truth(Path(work) / "truth"), op="ALL_REDUCE")
    by_rank = {r: [c["end_mono_ns"] - c["start_mono_ns"] for c in truth if c["rank"] == r] for r in (0, 1)}
    return {"rank 0 (waits for the peer)": by_rank[0], "rank 1 (the slow peer)": by_rank[1],
            "both (bimodal)": by_rank[0] + by_rank[1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=3000, help="AllReduce calls per rank (default 3000)")
    p.add_argument("--slow-peer-ms", type=float, default=4.0, help="rank 1's compute before each call")
    args = p.parse_args(argv)
    import scrape_bench

    series = scrape_bench.make_series(3, 8, 3, random.Random(1))
    scrape = {enc: scrape_bench.measure(series, enc, 5) for enc in ("text coarse", "text fine", "protobuf")}
    print(f"{args.calls} AllReduce calls per rank, rank 1 computes {args.slow_peer_ms:g} ms before each\n")
    print(f"{'distribution':28} {'estimate':16} {'p50 err':>8} {'p90 err':>8} {'p99 err':>8}   "
          f"{'8x3x3 scrape':>12} {'ms':>6}")
    for name, values in distributions(args.calls, args.slow_peer_ms).items():
        slots = [0] * D.slots
        for v in values:
            slots[D.slot_of(v)] += 1
        truth = {q: true_quantile(values, q) for q in (0.5, 0.9, 0.99)}
        print(f"{name:28} {'truth':16} " + " ".join(f"{truth[q] * 1e3:7.3f}m" for q in truth))
        for est, (encoding, fn) in ESTIMATORS.items():
            errs = " ".join(f"{(fn(slots, q) - truth[q]) / truth[q]:+8.2%}" for q in truth)
            s = scrape[encoding]
            print(f"{'':28} {est:16} {errs}   {s['plain'] / 1e3:9.1f} KB {s['ms']:6.1f}")
    print(f"\nbounds: classic coarse x2; classic fine {2 ** 0.25 - 1:.1%}; native {histogram.MAX_RELATIVE_ERROR:.2%}; "
          f"native midpoint {histogram.MIDPOINT_ERROR:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

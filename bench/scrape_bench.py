#!/usr/bin/env python3
"""Bytes and milliseconds per /metrics scrape against series count.

Builds the exposition with the real collector (exporter/sinks/prometheus.py
NcclCollector) fed by a fake reader that returns N Series records, so no BPF
is needed. For each histogram layout (exporter/records/histogram.py: coarse,
the default, and fine, `run --histogram-resolution fine`) it prints the plain
and gzipped size of the whole scrape and of the duration histogram family,
and the median time of one scrape (collect + text exposition [+ gzip]).

    .venv/bin/python bench/scrape_bench.py [--reps 7]

Exits 1 if one of these goals (bench/README.md, "Scrape size benchmark") is missed by
the default layout:
  one 4-rank job x 6 ops on one communicator: < 200 KB plain;
  8 ranks x 3 comms x 3 ops: < 300 KB plain per histogram family,
  < 30 KB gzipped, < 50 ms per scrape.
"""

from __future__ import annotations

import argparse
import gzip
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.exposition import generate_latest  # noqa: E402

from exporter.records import contract, histogram  # noqa: E402
from exporter.records.events import Series  # noqa: E402

OPS = list(contract.COLLECTIVE_OPS.values())


class FakeProbes:
    reports: list = []

    def entries(self, name):
        return 0

    def recursion_misses(self):
        return {}


class FakeReader:
    def __init__(self, series):
        self._series = series
        self.probes = FakeProbes()

    def series(self):
        return self._series

    def errors(self):
        return {}

    def async_errors(self):
        return []

    def communicators(self):
        return []

    def inflight(self):
        return []

    def counters(self):
        return {name: 0 for name in contract.COUNTERS}


class FakeProcesses:
    def identity(self, pid):
        return {}

    def rank_of(self, pid, communicators=()):
        return None

    def mark_collectives(self, communicators, series_keys):
        pass


def make_series(n_comms: int, n_ranks: int, n_ops: int, rng: random.Random) -> list[Series]:
    """Series with realistic histograms: each series' calls spread over a few
    neighbouring buckets around a typical duration (10 us .. 1 s)."""
    out = []
    for c in range(n_comms):
        comm_hash = rng.getrandbits(64) | 1
        for r in range(n_ranks):
            for o in range(n_ops):
                counts = [0] * histogram.SLOTS
                centre = histogram.bucket_of(int(10 ** rng.uniform(4, 9)))
                for _ in range(200):
                    i = min(histogram.SLOTS - 1, max(0, centre + int(rng.gauss(0, histogram.SUB))))
                    counts[i] += 1
                out.append(Series(op=OPS[o % len(OPS)], comm_hash=comm_hash, rank=r, nranks=n_ranks,
                                  calls=sum(counts), bytes=rng.getrandbits(30), sum_ns=rng.getrandbits(40),
                                  buckets=tuple(counts), slot=len(out)))
    return out


def measure(series: list[Series], reps: int) -> dict:
    import importlib

    import exporter.sinks.prometheus as prometheus

    # prometheus.py computes the duration bounds at import: import it again
    # under the selected layout (the agent selects before it is imported).
    NcclCollector = importlib.reload(prometheus).NcclCollector
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NcclCollector("node-0", FakeReader(series), FakeProcesses()))
    times, gz_times, collect_times = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        text = generate_latest(registry)
        t1 = time.perf_counter()
        gz = gzip.compress(text)
        t2 = time.perf_counter()
        times.append((t1 - t0) * 1e3)
        t3 = time.perf_counter()
        list(registry.collect())
        collect_times.append((time.perf_counter() - t3) * 1e3)
        gz_times.append((t2 - t0) * 1e3)
    family = b"\n".join(line for line in text.split(b"\n")
                        if line.startswith(b"nccl_collective_duration_seconds"))
    return {
        "series": len(series),
        "plain": len(text), "gzip": len(gz),
        "family_plain": len(family), "family_gzip": len(gzip.compress(family)),
        "ms": statistics.median(times), "ms_spread": (min(times), max(times)),
        "ms_gzip": statistics.median(gz_times),
        "ms_collect": statistics.median(collect_times),
    }


SCENARIOS = [
    ("4 ranks x 1 comm x 6 ops", (1, 4, 6)),
    ("8 ranks x 3 comms x 3 ops", (3, 8, 3)),
    ("1k series (10 comms x 10 ranks x 10 ops)", (10, 10, 10)),
    ("10k series (100 comms x 10 ranks x 10 ops)", (100, 10, 10)),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    results = {}
    print(f"{'layout':7} {'scenario':44} {'series':>6} {'plain KB':>9} {'gzip KB':>8} "
          f"{'family KB':>9} {'fam gz KB':>9} {'ms':>7} {'ms+gz':>7} {'collect':>7}  (ms min..max)")
    for name in ("coarse", "fine"):
        with histogram.selected(name):
            for title, shape in SCENARIOS:
                reps = args.reps if shape[0] * shape[1] * shape[2] < 5000 else 1
                r = measure(make_series(*shape, random.Random(1)), reps)
                results[(name, title)] = r
                print(f"{name:7} {title:44} {r['series']:6d} {r['plain'] / 1e3:9.1f} {r['gzip'] / 1e3:8.1f} "
                      f"{r['family_plain'] / 1e3:9.1f} {r['family_gzip'] / 1e3:9.1f} {r['ms']:7.1f} "
                      f"{r['ms_gzip']:7.1f} {r['ms_collect']:7.1f}  ({r['ms_spread'][0]:.1f}..{r['ms_spread'][1]:.1f})")
    one = results[("coarse", SCENARIOS[0][0])]
    node = results[("coarse", SCENARIOS[1][0])]
    goals = [
        ("one 4-rank job x 6 ops: scrape < 200 KB plain", one["plain"] < 200e3),
        ("8x3x3: duration family < 300 KB plain", node["family_plain"] < 300e3),
        ("8x3x3: duration family < 30 KB gzipped", node["family_gzip"] < 30e3),
        ("8x3x3: < 50 ms per scrape", node["ms_gzip"] < 50),
    ]
    for text, ok in goals:
        print(f"goal {'met ' if ok else 'MISSED'}: {text}")
    return 0 if all(ok for _, ok in goals) else 1


if __name__ == "__main__":
    sys.exit(main())

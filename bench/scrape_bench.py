#!/usr/bin/env python3
"""Bytes and milliseconds per /metrics scrape against series count.

Builds the exposition with the real collector (exporter/sinks/prometheus/:
Collector with the NCCL and plugin parts) fed by a fake reader that returns N Series records, so no BPF
is needed. For each encoding of a scrape it prints the plain and gzipped
size of the whole scrape and of the duration histogram family, and the
median time of one scrape (collect + encode [+ gzip]):

  text coarse      text 0.0.4, classic buckets at each power of two seconds
                   (the default; what Prometheus without native histograms gets)
  text fine        the same with `run --histogram-resolution fine`
  protobuf         delimited MetricFamily, native histograms only (Prometheus
                   with --enable-feature=native-histograms)
  protobuf+classic the same with `run --protobuf-classic-buckets`

    .venv/bin/python bench/scrape_bench.py [--reps 7]

Exits 1 if a goal is missed (bench/README.md, "Scrape size benchmark"):
  8 ranks x 3 comms x 3 ops: protobuf (no classic) <= 60 KB;
  1,000 series: protobuf (no classic) <= 400 KB and <= 100 ms;
  text (coarse and fine): the duration family no larger than before native
  histograms (TEXT_BEFORE, from this bench on the previous layout). The
  family, not the whole scrape: families added since (network waits,
  returns missed) grow the scrape for reasons of their own.
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

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from exporter.records import contract, histogram
from exporter.records.events import Series
from exporter.sinks import protobuf
from exporter.sinks.prometheus import Collector, NcclCollector, PluginCollector

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

    def exits(self):
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
    """Series with realistic histograms: each series' 200 calls log-normally
    spread (sigma: a factor 2) around a typical duration (10 us .. 1 s)."""
    d = histogram.DURATION
    out = []
    for _c in range(n_comms):
        comm = rng.getrandbits(64) | 1
        for r in range(n_ranks):
            for o in range(n_ops):
                counts = [0] * d.slots
                centre = d.slot_of(int(10 ** rng.uniform(4, 9)))
                for _ in range(200):
                    i = min(d.slots - 1, max(0, centre + int(rng.gauss(0, histogram.PER_OCTAVE))))
                    counts[i] += 1
                out.append(Series(op=OPS[o % len(OPS)], comm=comm, rank=r, nranks=n_ranks,
                                  calls=sum(counts), bytes=rng.getrandbits(30), sum_ns=rng.getrandbits(40),
                                  buckets=tuple(counts), slot=len(out)))
    return out


ENCODINGS = {
    "text coarse": ("coarse", lambda reg: generate_latest(reg)),
    "text fine": ("fine", lambda reg: generate_latest(reg)),
    "protobuf": ("coarse", lambda reg: protobuf.encode(reg)),
    "protobuf+classic": ("coarse", lambda reg: protobuf.encode(reg, classic=True)),
}


def measure(series: list[Series], encoding: str, reps: int) -> dict:
    classic, encode = ENCODINGS[encoding]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector("node-0", FakeProcesses(), [NcclCollector(FakeReader(series)), PluginCollector(None)],
                                classic=histogram.CLASSIC[classic]))
    times, gz_times = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        body = encode(registry)
        t1 = time.perf_counter()
        gz = gzip.compress(body)
        t2 = time.perf_counter()
        times.append((t1 - t0) * 1e3)
        gz_times.append((t2 - t0) * 1e3)
    if encoding.startswith("text"):
        family = b"\n".join(line for line in body.split(b"\n")
                            if line.startswith(b"nccl_collective_duration_seconds"))
    else:
        family = b"".join(f.SerializeToString() for f in protobuf.decode(body)
                          if f.name == "nccl_collective_duration_seconds")
    return {
        "series": len(series),
        "plain": len(body), "gzip": len(gz),
        "family_plain": len(family), "family_gzip": len(gzip.compress(family)),
        "ms": statistics.median(times), "ms_spread": (min(times), max(times)),
        "ms_gzip": statistics.median(gz_times),
    }


SCENARIOS = [
    ("4 ranks x 1 comm x 6 ops", (1, 4, 6)),
    ("8 ranks x 3 comms x 3 ops", (3, 8, 3)),
    ("1k series (10 comms x 10 ranks x 10 ops)", (10, 10, 10)),
    ("10k series (100 comms x 10 ranks x 10 ops)", (100, 10, 10)),
]
# The nccl_collective_duration_seconds family in text (plain bytes) before
# native histograms, from this bench on that code (main at 03103d2): coarse,
# 29 buckets at 2^10..2^37 ns; fine, 106 linear quarter-octave buckets.
TEXT_BEFORE = {
    ("text coarse", SCENARIOS[0][0]): 92_000, ("text coarse", SCENARIOS[1][0]): 281_600,
    ("text coarse", SCENARIOS[2][0]): 3_808_500,
    ("text fine", SCENARIOS[0][0]): 321_600, ("text fine", SCENARIOS[1][0]): 984_900,
    ("text fine", SCENARIOS[2][0]): 13_320_900,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    results = {}
    print(f"{'encoding':16} {'scenario':44} {'series':>6} {'plain KB':>9} {'gzip KB':>8} "
          f"{'family KB':>9} {'fam gz KB':>9} {'ms':>7} {'ms+gz':>7}  (ms min..max)")
    for title, shape in SCENARIOS:
        series = make_series(*shape, random.Random(1))
        for encoding in ENCODINGS:
            reps = args.reps if len(series) < 5000 else 1
            r = measure(series, encoding, reps)
            results[(encoding, title)] = r
            print(f"{encoding:16} {title:44} {r['series']:6d} {r['plain'] / 1e3:9.1f} {r['gzip'] / 1e3:8.1f} "
                  f"{r['family_plain'] / 1e3:9.1f} {r['family_gzip'] / 1e3:9.1f} {r['ms']:7.1f} "
                  f"{r['ms_gzip']:7.1f}  ({r['ms_spread'][0]:.1f}..{r['ms_spread'][1]:.1f})")
    node = results[("protobuf", SCENARIOS[1][0])]
    k1 = results[("protobuf", SCENARIOS[2][0])]
    goals = [
        ("8x3x3: protobuf scrape <= 60 KB (no classic buckets)", node["plain"] <= 60e3),
        ("1k series: protobuf scrape <= 400 KB (no classic buckets)", k1["plain"] <= 400e3),
        ("1k series: protobuf scrape <= 100 ms", k1["ms"] <= 100),
    ]
    for (encoding, title), before in TEXT_BEFORE.items():
        now = results[(encoding, title)]["family_plain"]
        goals.append((f"{encoding}, {title}: duration family {now / 1e3:.1f} KB <= {before / 1e3:.1f} KB before",
                      now <= before))
    for text, ok in goals:
        print(f"goal {'met ' if ok else 'MISSED'}: {text}")
    return 0 if all(ok for _, ok in goals) else 1


if __name__ == "__main__":
    sys.exit(main())

"""exporter/records/histogram.py: bucket edges, layout, and the stated quantile
error, for every layout (coarse: the default; fine: --histogram-resolution fine)."""

from __future__ import annotations

import bisect
import math
import random

import pytest

from exporter.records import histogram as h
from exporter.records import metrics
from exporter.sinks.prometheus import Histograms, duration_bounds_s

B: list[int] = []


@pytest.fixture(autouse=True, params=sorted(h.LAYOUTS))
def layout(request):
    global B
    with h.selected(request.param) as layout:
        B = h.UPPER_BOUNDS_NS
        yield layout
    B = h.UPPER_BOUNDS_NS


def test_default_layout_is_bounded():
    """The default exposition: at most ~30 buckets per series, 1 us .. 2 min."""
    assert h.DEFAULT == "coarse"
    d = h.LAYOUTS[h.DEFAULT]
    assert d.slots <= 30
    assert d.upper_bounds_ns()[0] <= 1_100 and d.upper_bounds_ns()[-1] >= 120e9
    assert h.LAYOUTS["fine"].slots == 106  # the old layout, opt-in


def test_generated_header_follows_selection():
    from exporter.sources.bpf import generated_header

    text = generated_header()
    assert f"#define HIST_SUB_BITS {h.SUB_BITS}\n" in text
    assert f"#define HIST_MAX_LOG2 {h.MAX_LOG2}\n" in text


def _bucket_by_search(d: int) -> int:
    """Independent definition: the first bucket whose (inclusive) upper bound holds d."""
    return bisect.bisect_left(B, d)  # len(B) == FINITE: the overflow bucket


def test_layout():
    assert len(B) == h.FINITE
    assert h.SLOTS == h.FINITE + 1
    assert B[0] == 1 << h.MIN_LOG2 == 1024
    assert B[-1] == 1 << h.MAX_LOG2
    assert all(isinstance(b, int) for b in B)
    assert all(a < b for a, b in zip(B, B[1:])), "upper bounds strictly increasing"
    # Each power of two is cut into SUB equal steps.
    for k in range(h.MIN_LOG2, h.MAX_LOG2):
        for s in range(h.SUB):
            assert (1 << k) + (s + 1) * (1 << k) // h.SUB in B
    # The widest bucket, relatively, is at most (1 + MAX_RELATIVE_ERROR)x its lower bound.
    assert max(hi / lo for lo, hi in zip(B, B[1:])) == pytest.approx(1 + h.MAX_RELATIVE_ERROR)
    assert all(hi <= lo * (1 + h.MAX_RELATIVE_ERROR) for lo, hi in zip(B, B[1:]))


def test_first_buckets(layout):
    if layout.name == "coarse":
        assert [h.bucket_of(d) for d in (0, 1024, 1025, 2048, 2049, 4096, 4097)] == [0, 0, 1, 1, 2, 2, 3]
        return
    assert h.bucket_of(0) == 0
    assert h.bucket_of(1) == 0
    assert h.bucket_of(1023) == 0
    assert h.bucket_of(1024) == 0  # exactly le=1024 ns: bucket 0
    assert h.bucket_of(1025) == 1
    assert h.bucket_of(1280) == 1
    assert h.bucket_of(1281) == 2
    assert h.bucket_of(2048) == 4
    assert h.bucket_of(2049) == 5


def test_every_edge_belongs_to_its_own_bucket():
    for i, bound in enumerate(B):
        assert h.bucket_of(bound) == i, bound
        assert h.bucket_of(bound + 1) == i + 1, bound
        assert h.bucket_of(bound - 1) == (i if i == 0 or bound - 1 > B[i - 1] else i - 1)


def test_overflow():
    assert h.bucket_of(1 << h.MAX_LOG2) == h.FINITE - 1
    assert h.bucket_of((1 << h.MAX_LOG2) + 1) == h.FINITE
    assert h.bucket_of(1 << 50) == h.FINITE
    assert h.bucket_of((1 << 64) - 1) == h.FINITE


def test_matches_search_definition():
    rng = random.Random(1)
    values = [rng.randrange(0, 1 << 40) for _ in range(20000)]
    values += [int(2 ** rng.uniform(0, 40)) for _ in range(20000)]
    for d in values:
        assert h.bucket_of(d) == _bucket_by_search(d), d


def test_cumulative_buckets():
    counts = [0] * h.SLOTS
    counts[0], counts[1], counts[10], counts[h.FINITE] = 2, 3, 5, 7
    # The one histogram builder of the Prometheus sink, as the collector uses it.
    hist = Histograms(metrics.COLLECTIVE_DURATION, duration_bounds_s())
    hist.add(("n", "ALL_REDUCE", "c", "0", "1"), counts, 0.0)
    pairs = [(s.labels["le"], s.value) for s in hist.family().samples if s.name.endswith("_bucket")]
    assert len(pairs) == h.FINITE + 1
    assert pairs[-1] == ("+Inf", 17)
    assert [float(le) for le, _ in pairs[:-1]] == [b / 1e9 for b in B]
    assert pairs[0][1] == 2 and pairs[1][1] == 5 and pairs[10][1] == 10
    assert pairs[h.FINITE - 1][1] == 10  # the overflow is only in +Inf
    cum = [n for _, n in pairs]
    assert cum == sorted(cum)


def _exact_quantile(sorted_values, q):
    """Nearest-rank quantile of a sample: the ceil(q*n)-th smallest value."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantile_error_on_log_uniform_durations(seed):
    rng = random.Random(seed)
    lo, hi = math.log(2e3), math.log(60e9)  # 2 us .. 60 s, in ns
    durations = sorted(int(math.exp(rng.uniform(lo, hi))) for _ in range(20000))
    counts = [0] * h.SLOTS
    for d in durations:
        counts[h.bucket_of(d)] += 1
    assert counts[h.FINITE] == 0  # 60 s < 2^36 ns
    for q in (0.5, 0.9, 0.99):
        exact = _exact_quantile(durations, q) / 1e9
        estimate = h.quantile(counts, q)
        assert abs(estimate - exact) / exact <= h.MAX_RELATIVE_ERROR, (q, exact, estimate)


def test_quantile_error_worst_case():
    """All samples at the low edge of the relatively widest bucket."""
    for lower in (B[4], B[20], B[len(B) * 3 // 5 // h.SUB * h.SUB]):  # 2^k: the next bucket is (2^k, (1 + 1/SUB) 2^k]
        d = lower + 1
        counts = [0] * h.SLOTS
        counts[h.bucket_of(d)] = 100
        for q in (0.5, 0.9, 0.99, 1.0):
            estimate = h.quantile(counts, q)
            assert abs(estimate - d / 1e9) / (d / 1e9) <= h.MAX_RELATIVE_ERROR


def test_quantile_edge_cases():
    assert math.isnan(h.quantile([0] * h.SLOTS, 0.5))
    counts = [0] * h.SLOTS
    counts[h.FINITE] = 5  # only overflow: the largest finite bound, as Prometheus does
    assert h.quantile(counts, 0.5) == B[-1] / 1e9
    counts = [0] * h.SLOTS
    counts[3] = 4
    assert h.quantile(counts, 1.0) == B[3] / 1e9
    assert B[2] / 1e9 < h.quantile(counts, 0.5) < B[3] / 1e9


def test_scrape_size_budget():
    """The scrape's byte budgets (bench/README.md), built by the real collector (bench/scrape_bench.py):
    an 8-GPU node (8 ranks x 3 communicators x 3 ops) under 300 KB plain and
    30 KB gzipped for the duration family, one 4-rank job x 6 ops under 200 KB.
    Sizes only: the timings live in the bench."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import scrape_bench

    with h.selected("coarse"):  # the default layout
        node = scrape_bench.measure(scrape_bench.make_series(3, 8, 3, random.Random(1)), reps=1)
        job = scrape_bench.measure(scrape_bench.make_series(1, 4, 6, random.Random(1)), reps=1)
    assert node["series"] == 72
    assert node["family_plain"] < 300e3 and node["family_gzip"] < 30e3, node
    assert job["plain"] < 200e3, job

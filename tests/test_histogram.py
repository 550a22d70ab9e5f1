"""exporter/records/histogram.py and bpf/histogram.h: the schema-3 buckets.

Every bound of every layout is checked, +-1 unit, against the exact geometric
bound floor(2^(i/8) * units per second) computed here independently with
decimal arithmetic: in Python (Layout.slot_of) and in the running kernel
(bpf/histogram.h's schema3_slot, run with BPF_PROG_TEST_RUN)."""

from __future__ import annotations

import bisect
import ctypes
import math
import random
from decimal import ROUND_FLOOR, Decimal, localcontext

import pytest

from exporter.records import histogram as h
from exporter.records import metrics
from exporter.sinks.prometheus import Histograms


def exact_bound(layout: h.Layout, index: int) -> int:
    """floor(2^(index/8) * per_second) with 100 decimal digits (independent of _root8)."""
    with localcontext() as ctx:
        ctx.prec = 100
        x = Decimal(2) ** (Decimal(index) / 8) * layout.per_second
        return int(x.to_integral_value(rounding=ROUND_FLOOR))


def expected_slot(layout: h.Layout, bounds: list[int], v: int) -> int:
    """The definition: the first bucket whose bound holds v (slot 0: v <= zero threshold)."""
    return min(bisect.bisect_left(bounds, v), layout.slots - 1)


def probe_values(layout: h.Layout) -> tuple[list[int], list[int]]:
    """(bounds from the zero threshold to the top, every bound and its +-1 and some more)."""
    bounds = [exact_bound(layout, i) for i in range(h.ZERO_INDEX, layout.top_index + 1)]
    values = {0, 1, 2, 3, (1 << 64) - 1, bounds[-1] * 1000}
    for b in bounds + [exact_bound(layout, layout.top_index + 1)]:
        values |= {b - 1, b, b + 1}
    return bounds, sorted(v for v in values if 0 <= v < 1 << 64)


@pytest.mark.parametrize("layout", h.LAYOUTS, ids=lambda lay: lay.name)
def test_every_bound_plus_minus_one_in_python(layout):
    bounds, values = probe_values(layout)
    assert [layout.upper_bound(i) for i in range(h.ZERO_INDEX, layout.top_index + 1)] == bounds
    for v in values:
        assert layout.slot_of(v) == expected_slot(layout, bounds, v), v


def test_layouts_cover_what_they_say():
    d = h.DURATION
    assert exact_bound(d, h.ZERO_INDEX) == 953  # the zero bucket: <= 0.95 us
    assert d.upper_bound(h.ZERO_INDEX + 1) <= 1_100  # resolution from ~1 us
    assert d.upper_bound(d.top_index) == 128 * 10**9  # > 100 s
    assert d.slots == 218 and d.bytes_per_series == 1744
    assert h.RUNQ.upper_bound(h.RUNQ.top_index) == 4 * 10**9
    assert h.SRTT.upper_bound(h.SRTT.top_index) == 8 * 10**6
    assert math.isclose(h.MAX_RELATIVE_ERROR, 0.0905, abs_tol=5e-5)
    assert h.MIDPOINT_ERROR < 0.0443  # "4.4 %"


def test_random_values_against_the_definition():
    rng = random.Random(1)
    for layout in h.LAYOUTS:
        bounds = [layout.upper_bound(i) for i in range(h.ZERO_INDEX, layout.top_index + 1)]
        for _ in range(20000):
            v = int(2 ** rng.uniform(0, 45))
            assert layout.slot_of(v) == expected_slot(layout, bounds, v), (layout.name, v)


def test_generated_header_carries_each_layout():
    from exporter.sources.bpf import generated_header

    text = generated_header()
    for layout in h.LAYOUTS:
        for name, value in layout.c_defines().items():
            assert f"#define {name} {value}\n" in text


# --- the kernel's own code --------------------------------------------------

KERNEL_TEST = r"""
#include "histogram.h"
// in[0]: the layout (0 HIST, 1 RUNQ, 2 SRTT), in[1]: the value; out[0]: its slot
BPF_ARRAY(in, u64, 2);
BPF_ARRAY(out, u32, 1);

int run(struct __sk_buff *skb) {
    u32 zero = 0, one = 1;
    u64 *layout = in.lookup(&zero), *v = in.lookup(&one);
    u32 *o = out.lookup(&zero);
    if (!layout || !v || !o)
        return 0;
    if (*layout == 0)
        *o = SCHEMA3_SLOT(HIST, *v);
    else if (*layout == 1)
        *o = SCHEMA3_SLOT(RUNQ, *v);
    else
        *o = SCHEMA3_SLOT(SRTT, *v);
    return 0;
}
"""


class _TestRunOpts(ctypes.Structure):
    """libbpf's struct bpf_test_run_opts up to `repeat` (sz tells libbpf how much)."""
    _fields_ = [("sz", ctypes.c_size_t), ("data_in", ctypes.c_void_p), ("data_out", ctypes.c_void_p),
                ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
                ("ctx_in", ctypes.c_void_p), ("ctx_out", ctypes.c_void_p),
                ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
                ("retval", ctypes.c_uint32), ("repeat", ctypes.c_int), ("duration", ctypes.c_uint32)]


def test_every_bound_plus_minus_one_in_the_kernel(bpf):
    """bpf/histogram.h compiled by BCC with the generated header, run in the kernel."""
    bcc = pytest.importorskip("bcc")
    from bcc.libbcc import lib

    from exporter.sources.bpf import bpf_source_dir, generated_header

    b = bcc.BPF(text=generated_header() + KERNEL_TEST,
                cflags=[f"-I{bpf_source_dir()}", "-Wno-unused-function"])
    try:
        fn = b.load_func("run", bcc.BPF.SOCKET_FILTER)
        lib.bpf_prog_test_run_opts.argtypes = [ctypes.c_int, ctypes.POINTER(_TestRunOpts)]
        packet = ctypes.create_string_buffer(64)
        opts = _TestRunOpts(sz=ctypes.sizeof(_TestRunOpts), data_in=ctypes.addressof(packet),
                            data_size_in=64, repeat=1)
        inp, out = b["in"], b["out"]
        for code, layout in enumerate(h.LAYOUTS):
            bounds, values = probe_values(layout)
            inp[ctypes.c_int(0)] = ctypes.c_uint64(code)
            wrong = []
            for v in values:
                inp[ctypes.c_int(1)] = ctypes.c_uint64(v)
                assert lib.bpf_prog_test_run_opts(fn.fd, ctypes.byref(opts)) == 0
                got, want = out[ctypes.c_int(0)].value, expected_slot(layout, bounds, v)
                if got != want:
                    wrong.append((v, got, want))
            assert not wrong, f"{layout.name}: (value, kernel, exact): {wrong[:5]}"
    finally:
        b.cleanup()


# --- reading the slots ---------------------------------------------------------


def test_classic_buckets_are_derived_at_powers_of_two_seconds():
    d = h.DURATION
    counts = [0] * d.slots
    counts[0], counts[1], counts[8], counts[9], counts[d.slots - 1] = 2, 3, 5, 7, 11
    hist = Histograms(metrics.COLLECTIVE_DURATION, d, h.CLASSIC["coarse"])
    hist.add(("n", "ALL_REDUCE", "c", "0"), counts, 1_500_000_000)
    samples = hist.family().samples
    pairs = [(s.labels["le"], s.value) for s in samples if s.name.endswith("_bucket")]
    assert len(pairs) == 29
    assert [float(le) for le, _ in pairs[:-1]] == [2.0 ** k for k in range(-20, 8)]
    # le 2^-20: the zero bucket; le 2^-19: slots 1..8; le 2^-18: + slot 9; +Inf: + the overflow
    assert [n for _, n in pairs[:3]] == [2, 10, 17]
    assert pairs[-2] == ("128.0", 17) and pairs[-1] == ("+Inf", 28)
    count = [s.value for s in samples if s.name.endswith("_count")]
    assert count == [28]


def test_fine_le_values_split_integer_values_where_the_bounds_do():
    # A fine bound 2^(i/8) s is irrational; its `le` is the shortest decimal
    # that puts every integer value (ns, or us for srtt) on the same side, as
    # text prints it and as the double protobuf carries. Checked against the
    # bound itself in exact decimal arithmetic, not against upper_bound().
    from decimal import Decimal, getcontext
    from fractions import Fraction

    from prometheus_client.utils import floatToGoString

    getcontext().prec = 60
    fine = h.CLASSIC["fine"]
    for layout in h.LAYOUTS:
        for i, le in zip(fine.bounds(layout), fine.le_seconds(layout)):
            bound = Decimal(2) ** (Decimal(i) / 8) * layout.per_second  # in units, 60 digits
            last_in = int(bound)  # the largest integer value at or below the bound
            for shown in (Fraction(floatToGoString(le)), Fraction(le)):
                units = shown * layout.per_second
                assert last_in <= units < last_in + 1, (layout.name, i, le)
            assert len(floatToGoString(le)) <= 13, (layout.name, i, le)


def test_fine_classic_buckets_every_quarter_octave():
    d, fine = h.DURATION, h.CLASSIC["fine"]
    assert len(fine.bounds(d)) == 105  # + Inf: 106, as the linear layout it replaces
    assert fine.le_seconds(d)[0] == 1.9071e-06  # 2^-19 s = 1907.35 ns: integer ns <= 1907
    counts = [0] * d.slots
    counts[0], counts[3], counts[10] = 1, 2, 4
    cum = fine.cumulative(d, counts)
    assert cum[0] == 3 and cum[1] == 7  # le 2^-19 s: slots 0..8; le 2^-18.75 s: slots 9, 10
    assert [fine.bucket_of_slot(d, s) for s in (0, 3, 8, 9, 10, 11)] == [0, 0, 0, 1, 1, 2]
    for slot in range(d.slots):  # the classic bucket of a slot is where cumulative counts it
        one = [0] * d.slots
        one[slot] = 1
        assert fine.cumulative(d, one).index(1) == fine.bucket_of_slot(d, slot), slot
        assert h.CLASSIC["coarse"].cumulative(d, one).index(1) == h.CLASSIC["coarse"].bucket_of_slot(d, slot)


def test_native_spans_and_deltas():
    d = h.DURATION
    counts = [0] * d.slots
    counts[0] = 4
    for slot, n in ((10, 1), (11, 2), (14, 3), (30, 5), (d.slots - 1, 6)):
        counts[slot] = n
    zero, spans, values = d.native(counts)
    assert zero == 4
    # slots 10, 11 and 14 in one span (a gap of two is carried as zeros), 30 alone,
    # the overflow as bucket top + 1
    assert spans == [(h.ZERO_INDEX + 10, 5), (30 - 14 - 1, 1), (d.slots - 1 - 30 - 1, 1)]
    assert values == [1, 2, 0, 0, 3, 5, 6]
    assert d.index_of_slot(d.slots - 1) == d.top_index + 1


def _exact_quantile(sorted_values, q):
    """Nearest-rank quantile of a sample: the ceil(q*n)-th smallest value."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantile_error_on_log_uniform_durations(seed):
    rng = random.Random(seed)
    lo, hi = math.log(2e3), math.log(100e9)  # 2 us .. 100 s, in ns
    durations = sorted(int(math.exp(rng.uniform(lo, hi))) for _ in range(20000))
    counts = [0] * h.DURATION.slots
    for d in durations:
        counts[h.bucket_of(d)] += 1
    for q in (0.5, 0.9, 0.99):
        exact = _exact_quantile(durations, q) / 1e9
        assert abs(h.quantile(counts, q) - exact) / exact <= h.MAX_RELATIVE_ERROR, q
        assert abs(h.DURATION.midpoint_quantile(counts, q) - exact) / exact <= h.MIDPOINT_ERROR, q


def test_quantile_error_worst_case():
    """All samples at one edge of a bucket: within one bucket either way."""
    for index in (-150, -40, 0, 30):
        for d in (h.DURATION.upper_bound(index - 1) + 1, h.DURATION.upper_bound(index)):
            counts = [0] * h.DURATION.slots
            counts[h.bucket_of(d)] = 100
            for q in (0.5, 0.99, 1.0):
                est = h.quantile(counts, q)
                assert abs(est - d / 1e9) / (d / 1e9) <= h.MAX_RELATIVE_ERROR + 1e-9
                mid = h.DURATION.midpoint_quantile(counts, q)
                assert abs(mid - d / 1e9) / (d / 1e9) <= h.MIDPOINT_ERROR + 1e-9


def test_quantile_edge_cases():
    assert math.isnan(h.quantile([0] * h.DURATION.slots, 0.5))
    counts = [0] * h.DURATION.slots
    counts[3] = 4
    lower, upper = h.DURATION.bounds_s(h.ZERO_INDEX + 3)
    assert h.quantile(counts, 1.0) == upper
    assert lower < h.quantile(counts, 0.5) < upper


def test_scrape_size_budget():
    """The scrape's byte budgets (bench/README.md), built by the real collector
    (bench/scrape_bench.py). Text, default buckets: an 8-GPU node (8 ranks x 3
    communicators x 3 ops) under 300 KB plain and 30 KB gzipped for the
    duration family, one 4-rank job x 6 ops under 200 KB. Protobuf without
    classic buckets: the node <= 60 KB, 1,000 series <= 400 KB. Sizes only:
    the timings live in the bench."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import scrape_bench

    node_series = scrape_bench.make_series(3, 8, 3, random.Random(1))
    node = scrape_bench.measure(node_series, "text coarse", reps=1)
    job = scrape_bench.measure(scrape_bench.make_series(1, 4, 6, random.Random(1)), "text coarse", reps=1)
    assert node["series"] == 72
    assert node["family_plain"] < 300e3 and node["family_gzip"] < 30e3, node
    assert job["plain"] < 200e3, job
    assert scrape_bench.measure(node_series, "protobuf", reps=1)["plain"] <= 60e3
    k1 = scrape_bench.make_series(10, 10, 10, random.Random(1))
    assert scrape_bench.measure(k1, "protobuf", reps=1)["plain"] <= 400e3


# --- sums over processes ------------------------------------------------------------


# Three processes' run-queue delays (ns) whose float sums in seconds differ with their
# order: 12.750356015000001 s added in this order, 12.750356015 s with the first added last.
THREE_NS = (5_743_465_891, 3_860_265_803, 3_146_624_321)


def test_a_sum_over_processes_is_the_same_in_any_order():
    # A label set sums several processes (the same launcher rank in two jobs, one
    # of them ended); when the ended one expires its totals move to the retired
    # list, so the order of the addends changes. A float sum then came out one
    # ulp lower: Prometheus's rate() reads any decrease as a counter reset and
    # counted the whole 11 s again (a rank seen waiting 1.1 s per second for a
    # CPU, NcclRankCpuStarved pending, in a benchmark run where nothing waited).
    from exporter.records.events import SchedStats
    from exporter.sinks.prometheus import sched_families

    class Table:
        layout = None   # SchedTotals: a count and a sum only

        def __init__(self, order):
            self.pairs = [(("2", "caller"), SchedStats(pid, "caller", 1, ns, ns, (1,)))
                          for pid, ns in order]

        def labelled(self, rank_label):
            return self.pairs

    procs = list(enumerate(THREE_NS))
    sums = set()
    for order in (procs, procs[1:] + procs[:1], procs[::-1]):
        for f in sched_families("n", Table(order), lambda pid: "2"):
            sums |= {(s.name, s.value) for s in f.samples if s.name.endswith(("_sum", "_total"))}
    assert sums == {("nccl_runqueue_delay_seconds_sum", sum(THREE_NS) / 1e9),
                    ("nccl_offcpu_seconds_total", sum(THREE_NS) / 1e9)}


def test_histogram_sums_are_exact_in_the_layouts_unit():
    for layout in (h.DURATION, h.SRTT):
        hist = Histograms(metrics.TCP_SRTT if layout is h.SRTT else metrics.COLLECTIVE_DURATION, layout)
        for ns in THREE_NS[1:] + THREE_NS[:1]:
            hist.add(("n", "x", "y", "z"), [1], ns)
        (_, _, total_s, _), = hist.family().series
        assert total_s == sum(THREE_NS) / layout.per_second

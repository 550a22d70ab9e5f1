"""The kernel's latency histograms: exponential buckets of schema 3.

Every histogram the kernel keeps (collective host and GPU durations,
lifecycle durations, run-queue delays, TCP srtt) uses the buckets that
Prometheus native histograms call schema 3 and OpenTelemetry exponential
histograms call scale 3: bucket `i` holds the values v with

    2^((i-1)/8) s < v <= 2^(i/8) s

eight buckets per power of two, a ratio of 2^(1/8) ~ 1.0905 between bounds.
A value counted in a bucket is known within 9.05 %; a quantile estimated
from the bucket's geometric midpoint is within 4.4 %.

The kernel measures integers (nanoseconds, or microseconds for srtt), so a
bound is the exact integer floor(2^(i/8) * units per second): an integer
value v is <= 2^(i/8) s exactly when v <= that floor. `Layout.upper_bound`
computes it with integer arithmetic only (an integer 8th root).

How the kernel finds the bucket, with no loop and no division
(bpf/histogram.h, `schema3_slot`): the eight bounds inside any power of two
of the unit, [2^k, 2^(k+1)), sit at the same eight mantissas m_0 < ... < m_7
in [1, 2) (the grid repeats every factor 2). With k = floor(log2 v) (a bit
scan) and M = v << (63 - k) (v's mantissa as a 64-bit fixed-point number,
exact), v is above the s-th bound of its octave exactly when M > C_s =
floor(m_s * 2^63); the bucket is then 8k - J + the number of C_s below M,
where J = floor(8 log2(units per second)). The eight C_s and the offsets
are generated into the C header (`generated_header()` in
exporter/sources/bpf.py) from this module; tests/test_histogram.py checks
every bound, +-1, against an independent decimal computation, in Python and
in the running kernel.

Slots of a layout (what a kernel map holds per series, 8 bytes each):
slot 0 is the zero bucket (v <= 2^(ZERO_INDEX/8) s = 2^-20 s ~ 0.95 us,
Prometheus's zero threshold); slot s in 1..finite is bucket ZERO_INDEX + s;
the last slot counts values above 2^(top_index/8) s. A native histogram and
an OTLP exponential histogram carry that overflow in the bucket just above
the top (they have no +Inf bucket); classic buckets in +Inf.

Classic buckets (Prometheus text scrapes) are derived from the same slots at
every `step`-th bound: coarse = each power of two seconds from 2^-20 s (2^k s
are schema-3 bounds), fine = each quarter octave (schema 2) from 2^-19 s. `CLASSIC` names them
(`run --histogram-resolution coarse|fine`); the kernel never changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from fractions import Fraction
from functools import cache, cached_property
from math import isqrt

SCHEMA = 3
PER_OCTAVE = 1 << SCHEMA  # 8 buckets per power of two
ZERO_INDEX = -160  # zero threshold 2^(-160/8) s = 2^-20 s ~ 0.954 us
ZERO_THRESHOLD_S = 2.0 ** (ZERO_INDEX / PER_OCTAVE)
MAX_RELATIVE_ERROR = 2 ** (1 / PER_OCTAVE) - 1  # a value's bucket: within 9.05 %
MIDPOINT_ERROR = 2 ** (1 / (2 * PER_OCTAVE)) - 1  # its geometric midpoint: within 4.4 %


def _root8(n: int) -> int:
    """floor(n ** (1/8)), exactly (floor(sqrt(floor(sqrt(y)))) == floor(y ** (1/4)))."""
    return isqrt(isqrt(isqrt(n)))


@dataclass(frozen=True)
class Layout:
    """One kernel histogram: its unit and its highest finite bucket.

    name: what it measures; macro: the C prefix of its generated constants;
    per_second: units per second (10**9: ns, 10**6: us); top_index: the last
    finite bucket, upper bound 2^(top_index/8) s."""

    name: str
    macro: str
    per_second: int
    top_index: int

    @property
    def finite(self) -> int:
        """Buckets between the zero bucket and the overflow."""
        return self.top_index - ZERO_INDEX

    @property
    def slots(self) -> int:
        return self.finite + 2  # + the zero bucket + the overflow

    @property
    def bytes_per_series(self) -> int:
        return 8 * self.slots

    def index_of_slot(self, slot: int) -> int:
        """The schema-3 bucket index of a slot (1..slots-1; the overflow: top + 1)."""
        if not 1 <= slot < self.slots:
            raise ValueError(f"slot {slot} has no bucket index (zero bucket or out of range)")
        return ZERO_INDEX + slot

    def upper_bound(self, index: int) -> int:
        """floor(2^(index/8) * per_second): bucket `index`'s inclusive upper bound in units."""
        p8 = self.per_second ** PER_OCTAVE
        return _root8(p8 << index if index >= 0 else p8 >> -index)

    @cached_property
    def octave_offset(self) -> int:
        """J = floor(8 log2(per_second)): the first bound at or above 2^k units is index 8k - J."""
        return (self.per_second ** PER_OCTAVE).bit_length() - 1

    @cached_property
    def thresholds(self) -> tuple[int, ...]:
        """C_s = floor(m_s * 2^63): the mantissas of the eight bounds in every octave."""
        p8, j = self.per_second ** PER_OCTAVE, self.octave_offset
        return tuple(_root8(p8 << (s - j + 63 * PER_OCTAVE)) for s in range(PER_OCTAVE))

    @property
    def base(self) -> int:
        """slot = 8k + (C_s below the mantissa) - base."""
        return self.octave_offset + ZERO_INDEX

    def slot_of(self, value: int) -> int:
        """The slot bpf/histogram.h's schema3_slot puts `value` (units) in: the same steps."""
        if value <= 0:
            return 0
        k = value.bit_length() - 1
        m = value << (63 - k)
        s = PER_OCTAVE * k + sum(m > c for c in self.thresholds) - self.base
        return 0 if s <= 0 else min(s, self.slots - 1)

    def c_defines(self) -> dict[str, str]:
        """The constants bpf/histogram.h's <macro>_SLOT_OF(v) needs."""
        return {
            f"{self.macro}_SLOTS": str(self.slots),
            f"{self.macro}_BASE": str(self.base),
            f"{self.macro}_THRESHOLDS": ", ".join(f"0x{c:016x}ULL" for c in self.thresholds),
        }

    # --- reading a series' slots -------------------------------------------------

    def bounds_s(self, index: int) -> tuple[float, float]:
        """(lower, upper) of bucket `index` in seconds, as Prometheus reads them."""
        return 2.0 ** ((index - 1) / PER_OCTAVE), 2.0 ** (index / PER_OCTAVE)

    def native(self, counts) -> tuple[int, list[tuple[int, int]], list[int]]:
        """(zero count, spans, counts) of the populated buckets: spans are
        (offset, length) as in Prometheus's BucketSpan (the first offset is the
        index of the first bucket, the others the gap after the previous span);
        a gap of up to two empty buckets is carried as zeros inside a span,
        which is smaller than a new span. The overflow slot is bucket top + 1."""
        spans: list[list[int]] = []
        values: list[int] = []
        last = None
        for slot in range(1, min(len(counts), self.slots)):
            n = counts[slot]
            if not n:
                continue
            index = ZERO_INDEX + slot
            if last is not None and index - last <= 3:
                values.extend([0] * (index - last - 1))
                spans[-1][1] += index - last
            else:
                spans.append([index if last is None else index - last - 1, 1])
            values.append(n)
            last = index
        return counts[0] if counts else 0, [(o, n) for o, n in spans], values

    def quantile(self, counts, q: float) -> float:
        """histogram_quantile(q, ...) of a native histogram as Prometheus 2.42
        computes it (linear inside the bucket; the zero bucket from 0), seconds."""
        total = sum(counts)
        if total == 0:
            return float("nan")
        rank = q * total
        seen = counts[0]
        if seen >= rank:
            return ZERO_THRESHOLD_S * rank / seen
        for slot in range(1, len(counts)):
            n = counts[slot]
            if n and seen + n >= rank:
                lower, upper = self.bounds_s(ZERO_INDEX + slot)
                return lower + (upper - lower) * (rank - seen) / n
            seen += n
        return self.bounds_s(ZERO_INDEX + len(counts) - 1)[1]

    def midpoint_quantile(self, counts, q: float) -> float:
        """The geometric midpoint of the bucket holding the q-quantile: within
        MIDPOINT_ERROR (4.4 %) of the true value when it lies in a finite bucket."""
        total = sum(counts)
        if total == 0:
            return float("nan")
        rank, seen = q * total, 0
        for slot, n in enumerate(counts):
            seen += n
            if n and seen >= rank:
                if slot == 0:
                    return ZERO_THRESHOLD_S / 2
                lower, upper = self.bounds_s(ZERO_INDEX + slot)
                return math.sqrt(lower * upper)
        return float("nan")


# Collective, GPU and lifecycle durations (bpf/nccl.c, bpf/plugin.c), ns:
# 0.95 us .. 2^7 s = 128 s; 218 slots.
DURATION = Layout("duration", "HIST", 10**9, 7 * PER_OCTAVE)
# Run-queue delay (bpf/sched.c, --sched waits), ns: up to 2^2 s = 4 s; 178 slots.
RUNQ = Layout("runqueue", "RUNQ", 10**9, 2 * PER_OCTAVE)
# TCP smoothed RTT (bpf/tcp.c, the kernel's srtt_us), us: up to 2^3 s = 8 s; 186 slots.
SRTT = Layout("srtt", "SRTT", 10**6, 3 * PER_OCTAVE)
LAYOUTS = (DURATION, RUNQ, SRTT)


@dataclass(frozen=True)
class Classic:
    """Classic (le) buckets derived from a layout's slots at every `step`-th
    schema-3 bound: step 8 = each power of two seconds, 2 = each quarter octave."""

    name: str
    step: int
    first: int = ZERO_INDEX  # the lowest bound's index (a multiple of step above it)

    def bounds(self, layout: Layout) -> list[int]:
        """The schema-3 indexes of the finite `le` bounds, from `first` up."""
        return list(range(self.first, layout.top_index + 1, self.step))

    def le_seconds(self, layout: Layout) -> list[float]:
        """The `le` values. Powers of two only (coarse): each as itself. With
        bounds between them (fine: 2^(i/8) s, irrational), every bound as the
        shortest decimal that splits the kernel's integer values where the
        bound does (short_bound_s): at most 13 characters, where the nearest
        double of the bound prints in up to 21."""
        return list(self._le_seconds(layout))

    @cache  # noqa: B019 - two instances, CLASSIC's, alive as long as the process; every text scrape asks, per family; fine's bounds take ~2 ms to find
    def _le_seconds(self, layout: Layout) -> tuple[float, ...]:
        if self.step % PER_OCTAVE == 0:
            return tuple(2.0 ** (i // PER_OCTAVE) for i in self.bounds(layout))
        return tuple(short_bound_s(layout, i) for i in self.bounds(layout))

    def cumulative(self, layout: Layout, counts) -> list[int]:
        """Cumulative counts at each finite bound, then the total (+Inf)."""
        out, total, slot = [], 0, 0
        for index in self.bounds(layout):
            last = index - ZERO_INDEX  # the slot whose upper bound is this bound
            while slot <= last and slot < len(counts):
                total += counts[slot]
                slot += 1
            out.append(total)
        out.append(total + sum(counts[slot:]))
        return out

    def bucket_of_slot(self, layout: Layout, slot: int) -> int:
        """The classic bucket (position in `cumulative`) that holds a slot."""
        if slot == 0:
            return 0
        if slot >= layout.slots - 1:
            return len(self.bounds(layout))
        # the first bound at or above the slot's upper bound
        return max(0, -(-(ZERO_INDEX + slot - self.first) // self.step))


    def quantile(self, layout: Layout, per_bucket, q: float) -> float:
        """histogram_quantile() on classic buckets (per-bucket counts, +Inf last),
        as Prometheus computes it: linear inside the bucket, from 0 in the first."""
        total = sum(per_bucket)
        if total == 0:
            return float("nan")
        les = self.le_seconds(layout)
        rank, seen, lower = q * total, 0, 0.0
        for le, n in zip(les, per_bucket):
            if n and seen + n >= rank:
                return lower + (le - lower) * (rank - seen) / n
            seen += n
            lower = le
        return les[-1]


def short_bound_s(layout: Layout, index: int) -> float:
    """The shortest decimal d (seconds) with B <= d * units < B + 1, where B =
    floor(2^(index/8) * units) is bucket `index`'s bound in the kernel's
    integer units, and the same for d's nearest double (what protobuf
    carries): an integer value v is <= d exactly when v <= B, so d
    classifies every measured value as the irrational bound does. Printed,
    it takes at most 13 characters where the bound's nearest double takes 21
    (0.001161335 for 0.0011613350732448448 s)."""
    b, units = layout.upper_bound(index), layout.per_second
    lo, hi = Fraction(b, units), Fraction(b + 1, units)
    exact = Decimal(b) / Decimal(units)  # exact: units is a power of ten
    for digits in range(1, 20):
        step = Decimal(1).scaleb(exact.adjusted() - digits + 1)
        d = exact.quantize(step, rounding=ROUND_CEILING)
        for cand in (d, d + step):
            if Fraction(cand) < hi and lo <= Fraction(float(cand)) < hi:
                return float(cand)
    raise AssertionError(f"no decimal for bound {index}")


# fine starts at 2^-19 s: 106 buckets per series, as many as the linear
# quarter-octave layout it replaces.
CLASSIC = {"coarse": Classic("coarse", PER_OCTAVE), "fine": Classic("fine", 2, ZERO_INDEX + PER_OCTAVE)}
DEFAULT_CLASSIC = "coarse"


def bucket_of(duration_ns: int) -> int:
    """The slot bpf/nccl.c and bpf/plugin.c put a duration in."""
    return DURATION.slot_of(duration_ns)


def quantile(counts, q: float) -> float:
    """histogram_quantile() of a duration series' slots, as Prometheus 2.42
    computes it on the native histogram, in seconds."""
    return DURATION.quantile(counts, q)

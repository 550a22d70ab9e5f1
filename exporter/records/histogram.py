"""The latency histogram layout shared by bpf/nccl.c and the exposition.

Two layouts, chosen when the agent loads bpf/nccl.c (`run
--histogram-resolution coarse|fine`); the selected one's constants are
generated into the C header, so the kernel and Prometheus agree on every edge.
Upper bounds are exact integers of nanoseconds.

- **coarse** (the default): bucket 0 holds durations up to 2^10 ns (1.02 us);
  then one bucket per power of two up to 2^37 ns (137 s); one more takes
  everything longer: 28 finite buckets + Inf = 29 per series. A bucket's
  upper bound is 2x its lower bound, so a quantile read from these buckets
  (histogram_quantile's linear interpolation, or the bucket's upper bound)
  lies in the same factor-2 bucket as the true value: at most +100 % / -50 %
  off (MAX_RELATIVE_ERROR = 1.0); for log-uniformly spread durations the
  interpolated estimate is typically within ~20 %.
- **fine**: every power of two from 2^10 to 2^36 ns (68.7 s) cut into four
  equal sub-buckets: 105 finite buckets + Inf = 106 per series; any quantile
  within 25 % (MAX_RELATIVE_ERROR = 0.25), 12.5 % on average over an octave.

The module-level names (MIN_LOG2, MAX_LOG2, SUB_BITS, SUB, FINITE, SLOTS,
UPPER_BOUNDS_NS, MAX_RELATIVE_ERROR) always describe the selected layout;
`select(name)` switches it (the agent does, from its config, before it loads
bpf/nccl.c). Durations below 1 us share one bucket in both.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    name: str
    min_log2: int
    max_log2: int
    sub_bits: int

    @property
    def sub(self) -> int:
        return 1 << self.sub_bits

    @property
    def finite(self) -> int:
        return 1 + (self.max_log2 - self.min_log2) * self.sub

    @property
    def slots(self) -> int:
        return self.finite + 1  # + overflow (+Inf)

    @property
    def max_relative_error(self) -> float:
        return 1.0 / self.sub  # the widest bucket, relatively: 2^k .. (1 + 1/SUB) 2^k

    def upper_bounds_ns(self) -> list[int]:
        """Upper bound (inclusive) of each finite bucket, in nanoseconds."""
        bounds = [1 << self.min_log2]
        for k in range(self.min_log2, self.max_log2):
            step = 1 << (k - self.sub_bits)
            bounds.extend((1 << k) + (s + 1) * step for s in range(self.sub))
        return bounds


LAYOUTS = {
    "coarse": Layout("coarse", 10, 37, 0),
    "fine": Layout("fine", 10, 36, 2),
}
DEFAULT = "coarse"


def select(name: str = DEFAULT) -> Layout:
    """Make `name` the layout of this process (module-level names, bucket_of, ...)."""
    global LAYOUT, MIN_LOG2, MAX_LOG2, SUB_BITS, SUB, FINITE, SLOTS, UPPER_BOUNDS_NS, MAX_RELATIVE_ERROR
    try:
        layout = LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown histogram resolution {name!r}; one of: {', '.join(LAYOUTS)}") from None
    LAYOUT = layout
    MIN_LOG2, MAX_LOG2, SUB_BITS = layout.min_log2, layout.max_log2, layout.sub_bits
    SUB, FINITE, SLOTS = layout.sub, layout.finite, layout.slots
    UPPER_BOUNDS_NS = layout.upper_bounds_ns()
    MAX_RELATIVE_ERROR = layout.max_relative_error
    assert len(UPPER_BOUNDS_NS) == FINITE
    return layout


@contextlib.contextmanager
def selected(name: str):
    """Use layout `name` inside a with-block (tests), then the previous one."""
    before = LAYOUT.name
    select(name)
    try:
        yield LAYOUTS[name]
    finally:
        select(before)


LAYOUT: Layout
MIN_LOG2 = MAX_LOG2 = SUB_BITS = SUB = FINITE = SLOTS = 0
UPPER_BOUNDS_NS: list[int] = []
MAX_RELATIVE_ERROR = 0.0
select(DEFAULT)


def upper_bounds_ns() -> list[int]:
    """Upper bound (inclusive) of each finite bucket of the selected layout, in ns."""
    return LAYOUT.upper_bounds_ns()


def bucket_of(duration_ns: int) -> int:
    """The bucket bpf/nccl.c puts a duration in."""
    if duration_ns <= (1 << MIN_LOG2):
        return 0
    v = duration_ns - 1
    k = v.bit_length() - 1
    if k >= MAX_LOG2:
        return FINITE
    sub = (v >> (k - SUB_BITS)) & (SUB - 1)
    return 1 + (k - MIN_LOG2) * SUB + sub


def quantile(counts, q: float) -> float:
    """histogram_quantile() as Prometheus computes it, in seconds."""
    total = sum(counts)
    if total == 0:
        return float("nan")
    rank = q * total
    seen = 0
    lower = 0.0
    for i, n in enumerate(counts[:FINITE]):
        upper = UPPER_BOUNDS_NS[i] / 1e9
        if n and seen + n >= rank:
            return lower + (upper - lower) * (rank - seen) / n
        seen += n
        lower = upper
    return UPPER_BOUNDS_NS[-1] / 1e9

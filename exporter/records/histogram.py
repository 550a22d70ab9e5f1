"""The latency histogram layout shared by bpf/nccl.c and the exposition.

Bucket 0 holds durations up to 2^10 ns (1.02 us). Above that, every power of
two is cut into four equal sub-buckets up to 2^36 ns (68.7 s); one more
bucket takes everything longer. Upper bounds are exact integers of
nanoseconds, so the kernel and Prometheus agree on every edge.

Quantile error: a bucket's upper bound is at most 1.25x its lower bound
(2^k .. 1.25*2^k is the widest, relatively), so any quantile read from these
buckets -- by histogram_quantile's interpolation or by taking the bucket's
upper bound -- is within 25 % of the true value, and within 12.5 % on
average over a power of two. Durations below 1 us share one bucket.
"""

MIN_LOG2 = 10
MAX_LOG2 = 36
SUB_BITS = 2
SUB = 1 << SUB_BITS
FINITE = 1 + (MAX_LOG2 - MIN_LOG2) * SUB
SLOTS = FINITE + 1  # + overflow (+Inf)
MAX_RELATIVE_ERROR = 0.25


def upper_bounds_ns() -> list[int]:
    """Upper bound (inclusive) of each finite bucket, in nanoseconds."""
    bounds = [1 << MIN_LOG2]
    for k in range(MIN_LOG2, MAX_LOG2):
        step = 1 << (k - SUB_BITS)
        bounds.extend((1 << k) + (s + 1) * step for s in range(SUB))
    return bounds


UPPER_BOUNDS_NS = upper_bounds_ns()
assert len(UPPER_BOUNDS_NS) == FINITE


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


def cumulative_buckets(counts) -> list[tuple[str, int]]:
    """Per-bucket counts -> Prometheus (le in seconds, cumulative count) pairs."""
    out = []
    total = 0
    for bound, n in zip(UPPER_BOUNDS_NS, counts):
        total += n
        out.append((repr(bound / 1e9), total))
    total += sum(counts[FINITE:])
    out.append(("+Inf", total))
    return out


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

// The kernel's latency histograms: exponential buckets of schema 3 (bucket i
// holds 2^((i-1)/8) s < v <= 2^(i/8) s), as exporter/records/histogram.py
// defines them; that module explains the method and generates the constants
// (<P>_SLOTS, <P>_BASE, <P>_THRESHOLDS for P = HIST (durations, ns), RUNQ
// (run-queue delay, ns), SRTT (srtt, us)). No maps here: tests compile this
// file alone and run it in the kernel (tests/test_histogram.py).

#ifndef NCCL_EXPORTER_HISTOGRAM_H
#define NCCL_EXPORTER_HISTOGRAM_H

static __always_inline u32 log2_floor(u64 v) {
    u32 r = 0;
    if (v >> 32) { v >>= 32; r += 32; }
    if (v >> 16) { v >>= 16; r += 16; }
    if (v >> 8)  { v >>= 8;  r += 8; }
    if (v >> 4)  { v >>= 4;  r += 4; }
    if (v >> 2)  { v >>= 2;  r += 2; }
    if (v >> 1)  { r += 1; }
    return r;
}

// The slot of value v (integer units): 0 is the zero bucket (v <= 2^-20 s),
// 1..last-1 the buckets above it, `last` everything above the top bound.
// The 8 bounds inside each power of two of the unit have the same mantissas,
// c0..c7 (floor(mantissa * 2^63)): v's mantissa M (v shifted so its top bit
// is bit 63: exact) is above the s-th bound of its octave iff M > c_s. So the
// bucket is 8 * log2_floor(v) + (c_s below M) - base: a bit scan and eight
// compares, no loop, no division.
static __always_inline u32 schema3_slot(u64 v, s32 base, u32 last, u64 c0, u64 c1, u64 c2,
                                        u64 c3, u64 c4, u64 c5, u64 c6, u64 c7) {
    if (v == 0)
        return 0;
    u32 k = log2_floor(v);
    u64 m = v << (63 - k);
    s64 s = 8 * (s64)k - base;
    s += (m > c0) + (m > c1) + (m > c2) + (m > c3) + (m > c4) + (m > c5) + (m > c6) + (m > c7);
    if (s <= 0)
        return 0;
    if (s >= last)
        return last;
    return (u32)s;
}

#define SCHEMA3_SLOT(P, v) schema3_slot((v), P##_BASE, P##_SLOTS - 1, P##_THRESHOLDS)

#endif

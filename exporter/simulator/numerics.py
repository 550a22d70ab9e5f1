"""The simulator's numerics: NCCL data types and reduction ops as Python
sees them, buffers encoded and decoded, and the results a collective must
give (what the workloads in rank.py check the library against)."""

from __future__ import annotations

import struct

# ncclDataType_t -> struct format ("bf16" handled by hand), size
DTYPES = {
    0: ("b", 1), 1: ("B", 1), 2: ("i", 4), 3: ("I", 4), 4: ("q", 8), 5: ("Q", 8),
    6: ("e", 2), 7: ("f", 4), 8: ("d", 8), 9: ("bf16", 2),
}
INT_DTYPES = {0: (8, True), 1: (8, False), 2: (32, True), 3: (32, False), 4: (64, True), 5: (64, False)}
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4
FLOAT32, INT32, FLOAT16, BF16, FLOAT64, INT8, UINT8, UINT32, INT64, UINT64 = 7, 2, 6, 9, 8, 0, 1, 3, 4, 5


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _f2bf_bits(x: float) -> int:
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return ((u >> 16) | 0x40) & 0xFFFF
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFFFFFF
    return u >> 16


def _bf_bits2f(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (b & 0xFFFF) << 16))[0]


def encode(dt: int, values: list) -> bytes:
    fmt, _ = DTYPES[dt]
    if fmt == "bf16":
        return struct.pack(f"<{len(values)}H", *(_f2bf_bits(float(v)) for v in values))
    if dt in INT_DTYPES:
        values = [wrap(dt, int(v)) for v in values]
    return struct.pack(f"<{len(values)}{fmt}", *values)


def decode(dt: int, raw: bytes) -> list:
    fmt, size = DTYPES[dt]
    n = len(raw) // size
    if fmt == "bf16":
        return [_bf_bits2f(b) for b in struct.unpack(f"<{n}H", raw[: n * 2])]
    return list(struct.unpack(f"<{n}{fmt}", raw[: n * size]))


def wrap(dt: int, v: int) -> int:
    bits, signed = INT_DTYPES[dt]
    v &= (1 << bits) - 1
    if signed and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def quantize(dt: int, v: float) -> float:
    """What one float value looks like after a store in dtype dt."""
    if dt == FLOAT32:
        return _f32(v)
    if dt == FLOAT16:
        return struct.unpack("<e", struct.pack("<e", _f32(v)))[0]
    if dt == BF16:
        return _bf_bits2f(_f2bf_bits(_f32(v)))
    return float(v)


def reduce_expected(dt: int, op: int, per_rank: list[list]) -> list:
    n = len(per_rank)
    out = []
    for vals in zip(*per_rank):
        if op in (SUM, AVG):
            v = sum(vals)
        elif op == PROD:
            v = 1
            for x in vals:
                v *= x
        elif op == MAX:
            v = max(vals)
        else:
            v = min(vals)
        if dt in INT_DTYPES:
            v = wrap(dt, v)
            if op == AVG:
                v = int(v / n)  # C division truncates toward zero
        else:
            if op == AVG:
                v = v / n
            v = quantize(dt, v)
        out.append(v)
    return out


def close_enough(dt: int, got: list, want: list) -> bool:
    if len(got) != len(want):
        return False
    if dt in INT_DTYPES:
        return got == want
    rel = 1e-2 if dt in (FLOAT16, BF16) else 1e-6
    return all(abs(g - w) <= 1e-6 + rel * abs(w) for g, w in zip(got, want))

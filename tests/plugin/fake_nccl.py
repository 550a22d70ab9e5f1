"""NCCL's side of the profiler interface, in Python (ctypes), for tests that
need one exact sequence of callbacks: the plugin is loaded as NCCL loads it
(dlopen, ``ncclProfiler_vN``) and called with descriptors laid out as in
plugin/profiler_abi.h (v4 .. v7; v4's type is one byte). Run it in a
subprocess: a plugin that crashes takes that process with it.

    P = Plugin(path, version); ctx = P.init(nranks=8, rank=0)
    h = P.coll(ctx, "AllReduce", seq=0, nch=2); P.stop(h)
    k = P.kch(ctx, h, channel=0, timer=t0); P.kch_stop(k, t1)
    P.finalize(ctx); P.stats() -> completed, abandoned, dropped, ...
"""

from __future__ import annotations

import ctypes
import struct

EV_GROUP, EV_COLL, EV_P2P, EV_PROXY_OP, EV_PROXY_STEP, EV_KERNEL_CH = 0x1, 0x2, 0x4, 0x8, 0x10, 0x40
ST_KERNEL_CH_STOP = 22
GPU_T0 = 1_700_000_000_000_000_000

_c = ctypes
INIT_V4 = _c.CFUNCTYPE(_c.c_int, _c.POINTER(_c.c_void_p), _c.POINTER(_c.c_int), _c.c_char_p, _c.c_uint64, _c.c_int,
                       _c.c_int, _c.c_int, _c.c_void_p)
INIT_V5 = _c.CFUNCTYPE(_c.c_int, _c.POINTER(_c.c_void_p), _c.c_uint64, _c.POINTER(_c.c_int), _c.c_char_p, _c.c_int,
                       _c.c_int, _c.c_int, _c.c_void_p)
START = _c.CFUNCTYPE(_c.c_int, _c.c_void_p, _c.POINTER(_c.c_void_p), _c.c_void_p)
STOP = _c.CFUNCTYPE(_c.c_int, _c.c_void_p)
RECORD = _c.CFUNCTYPE(_c.c_int, _c.c_void_p, _c.c_int, _c.c_void_p)
FINI = _c.CFUNCTYPE(_c.c_int, _c.c_void_p)


class Plugin:
    def __init__(self, path: str, version: int):
        self.dl = _c.CDLL(str(path))
        self.ver = version
        tbl = (_c.c_void_p * 6).in_dll(self.dl, f"ncclProfiler_v{version}")
        self._init = (INIT_V4 if version == 4 else INIT_V5)(tbl[1])
        self._start, self._stop = START(tbl[2]), STOP(tbl[3])
        self._record, self._fini = RECORD(tbl[4]), FINI(tbl[5])
        self.mask = _c.c_int(0)
        self._strings: dict[str, _c.c_char_p] = {}   # static strings, as NCCL's are
        self._d = _c.create_string_buffer(136)
        self._args = _c.create_string_buffer(8)
        self.hash = 0x1111222233330000

    def s(self, text: str) -> int:
        if text not in self._strings:
            self._strings[text] = _c.c_char_p(text.encode())
        return _c.cast(self._strings[text], _c.c_void_p).value

    def init(self, nranks: int = 8, rank: int = 0, comm_hash: int | None = None, with_mask: bool = True) -> int:
        ctx = _c.c_void_p(0)
        self.hash = comm_hash if comm_hash is not None else self.hash + 1
        mask = _c.byref(self.mask) if with_mask else None
        if self.ver == 4:
            r = self._init(_c.byref(ctx), mask, None, self.hash, 1, nranks, rank, None)
        else:
            r = self._init(_c.byref(ctx), self.hash, mask, None, 1, nranks, rank, None)
        self.last_init = r
        return ctx.value or 0

    def _descr(self, type_: int, parent: int, rank: int = 0) -> bytearray:
        d = bytearray(b"\xa5" * 136 if self.ver <= 5 else 136)   # v4/v5: NCCL does not zero the rest
        if self.ver == 4:
            d[0] = type_
        else:
            struct.pack_into("<Q", d, 0, type_)
        struct.pack_into("<Qi", d, 8, parent or 0, rank)
        return d

    def gated(self, t: int) -> bool:
        """NCCL's gating: is an event of type t started, given the mask?"""
        m, net = self.mask.value, EV_PROXY_OP | EV_PROXY_STEP | EV_KERNEL_CH | 0x80
        want = {EV_GROUP: EV_GROUP | EV_COLL | EV_P2P | net, EV_COLL: EV_COLL | net, EV_P2P: EV_P2P | net}.get(t, t)
        return bool(m & want)

    def _go(self, ctx: int, d: bytearray) -> int:
        if not self.gated(d[0] if self.ver == 4 else struct.unpack_from("<Q", d)[0]):
            return 0
        _c.memmove(self._d, bytes(d), 136)
        h = _c.c_void_p(0xdeadbeef)   # NCCL's slot may hold a stale value
        self._start(ctx, _c.byref(h), self._d)
        return h.value or 0

    def coll(self, ctx: int, func: str = "AllReduce", seq: int = 0, nch: int = 2, count: int = 1024,
             dtype: str = "ncclFloat32", parent: int = 0, rank: int = 0) -> int:
        d = self._descr(EV_COLL, parent, rank)
        struct.pack_into("<QQQQQi", d, 24, seq, self.s(func), 0, 0, count, -1)
        struct.pack_into("<QBB", d, 72, self.s(dtype), nch, 16)
        struct.pack_into("<QQ", d, 88, self.s("RING"), self.s("SIMPLE"))
        if self.ver >= 5:
            struct.pack_into("<Q", d, 104, 0)
        return self._go(ctx, d)

    def p2p(self, ctx: int, func: str, peer: int, nch: int = 1, count: int = 256, dtype: str = "ncclFloat32",
            rank: int = 0) -> int:
        d = self._descr(EV_P2P, 0, rank)
        struct.pack_into("<QQQQiB", d, 24, self.s(func), 0, self.s(dtype), count, peer, nch)
        if self.ver >= 5:
            struct.pack_into("<Q", d, 64, 0)
        return self._go(ctx, d)

    def kch(self, ctx: int, parent: int, channel: int, timer: int) -> int:
        d = self._descr(EV_KERNEL_CH, parent)
        struct.pack_into("<B", d, 24, channel)
        struct.pack_into("<Q", d, 32, timer)
        return self._go(ctx, d)

    def kch_stop(self, h: int, timer: int) -> None:
        if not h:
            return
        struct.pack_into("<Q", self._args, 0, timer)
        self._record(h, ST_KERNEL_CH_STOP, self._args)
        self._stop(h)

    def proxy_op(self, ctx: int, parent: int, pid: int, peer: int, is_send: int, channel: int = 0) -> int:
        d = self._descr(EV_PROXY_OP, parent)
        struct.pack_into("<iBxxxiiii", d, 24, pid, channel, peer, 8, 1 << 17, is_send)
        return self._go(ctx, d)

    def group(self, ctx: int) -> int:
        return self._go(ctx, self._descr(EV_GROUP, 0))

    def stop(self, h: int) -> None:
        if h:
            self._stop(h)

    def finalize(self, ctx: int) -> int:
        return self._fini(ctx) if ctx else 0

    def stats(self) -> dict:
        out = (_c.c_uint64 * 6)()
        self.dl.nccl_exporter_profiler_stats(out)
        pools = (_c.c_uint64 * 8)()
        self.dl.nccl_exporter_profiler_pools(pools)
        return {"completed": out[0], "abandoned": out[1], "dropped": out[2], "stale": out[3], "disabled": out[5],
                "slots_used": pools[0], "pops_used": pools[1], "proxy_ops": pools[2], "proxy_dropped": pools[6]}

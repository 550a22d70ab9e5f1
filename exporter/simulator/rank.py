"""One simulated training rank: NCCL workloads, every result checked (unless --no-check).

The workloads call libnccl.so.2 the way PyTorch's ProcessGroupNCCL would
(ncclUniqueId passed by value) through binding.py, and check each result
against numerics.py.

    python -m exporter.simulator.rank --lib build/sim/libnccl.so.2 \
        --rank 0 --nranks 4 --rendezvous /tmp/rdv --workload mixed

Exit status 0 only if every NCCL call succeeded and every checked result was correct.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import random
import struct
import sys
import time
from ctypes import c_int, c_void_p

from exporter.simulator.faults import desync_call
from exporter.simulator.binding import Nccl, NcclError, publish_or_fetch
from exporter.simulator.numerics import (AVG, BF16, DTYPES, FLOAT16, FLOAT32, FLOAT64, INT8, INT32, INT64,
                                         INT_DTYPES, MAX, MIN, PROD, SUM, UINT8, UINT32, UINT64,
                                         close_enough, decode, encode, quantize, reduce_expected)


# ----------------------------------------------------------------- workloads --
class Rank:
    def __init__(self, args):
        self.a = args
        self.rank, self.n = args.rank, args.nranks
        self.rdv = pathlib.Path(args.rendezvous)
        self.nccl: Nccl | None = None
        self.checks = 0
        self.rng = random.Random(args.seed)

    # buffers
    def buf(self, dt: int, values: list | None = None, count: int | None = None):
        if values is not None:
            raw = encode(dt, values)
            return ctypes.create_string_buffer(raw, len(raw))
        return ctypes.create_string_buffer(max(1, count * DTYPES[dt][1]))

    def read(self, dt: int, b, count: int) -> list:
        return decode(dt, b.raw[: count * DTYPES[dt][1]])

    def check(self, what: str, dt: int, got: list, want: list) -> None:
        self.checks += 1
        if not close_enough(dt, got, want):
            bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
            raise NcclError(f"wrong result in {what}: index {bad}: got {got[bad] if bad is not None else got[:4]} "
                            f"want {want[bad] if bad is not None else want[:4]}")

    def delay(self) -> None:
        if self.a.compute_delay_ms > 0:
            time.sleep(self.a.compute_delay_ms / 1000.0)

    @staticmethod
    def values(dt: int, op: int, rank: int, it: int, count: int, salt: int = 0) -> list:
        if op == PROD:
            base = [((rank + i + it + salt) % 2) + 1 for i in range(count)]
        else:
            base = [((rank * 7 + i * 3 + it + salt) % 5) + 1 for i in range(count)]
        return base if dt in INT_DTYPES else [float(v) for v in base]

    def comm_init(self, name: str, config: bool = False) -> c_void_p:
        uid = publish_or_fetch(self.nccl, self.rank, self.rdv, name)
        comm = c_void_p()
        if config:
            cfg = ctypes.create_string_buffer(256)  # opaque ncclConfig_t; ignored by the simulator
            self.nccl("ncclCommInitRankConfig", ctypes.byref(comm), self.n, uid, self.rank, cfg)
        else:
            self.nccl("ncclCommInitRank", ctypes.byref(comm), self.n, uid, self.rank)
        return comm

    # -------- individual collectives, each checked
    def allreduce(self, comm, crank, cn, dt, op, it, count, fn="ncclAllReduce", inplace=False):
        vals = [self.values(dt, op, r, it, count) for r in range(cn)]
        sb = self.buf(dt, vals[crank])
        rb = sb if inplace else self.buf(dt, count=count)
        self.delay()
        extra = (None,) if fn == "ncclAllReduceConfig" else ()
        self.nccl(fn, sb, rb, count, dt, op, comm, self.nccl.stream, *extra)
        self.check(f"{fn}(dt={dt},op={op})", dt, self.read(dt, rb, count), reduce_expected(dt, op, vals))

    def allgather(self, comm, crank, cn, dt, it, count):
        vals = [self.values(dt, SUM, r, it, count, 11) for r in range(cn)]
        sb, rb = self.buf(dt, vals[crank]), self.buf(dt, count=count * cn)
        self.delay()
        self.nccl("ncclAllGather", sb, rb, count, dt, comm, self.nccl.stream)
        want = [v for r in range(cn) for v in vals[r]]
        if dt not in INT_DTYPES:
            want = [quantize(dt, v) for v in want]
        self.check("ncclAllGather", dt, self.read(dt, rb, count * cn), want)

    def reducescatter(self, comm, crank, cn, dt, op, it, count):
        vals = [self.values(dt, op, r, it, count * cn, 5) for r in range(cn)]
        sb, rb = self.buf(dt, vals[crank]), self.buf(dt, count=count)
        self.delay()
        self.nccl("ncclReduceScatter", sb, rb, count, dt, op, comm, self.nccl.stream)
        full = reduce_expected(dt, op, vals)
        self.check("ncclReduceScatter", dt, self.read(dt, rb, count), full[crank * count:(crank + 1) * count])

    def broadcast(self, comm, crank, cn, dt, root, it, count, bcast=False):
        src = self.values(dt, SUM, root, it, count, 3)
        want = src if dt in INT_DTYPES else [quantize(dt, v) for v in src]
        self.delay()
        if bcast:
            b = self.buf(dt, src) if crank == root else self.buf(dt, count=count)
            self.nccl("ncclBcast", b, count, dt, root, comm, self.nccl.stream)
            self.check("ncclBcast", dt, self.read(dt, b, count), want)
        else:
            sb = self.buf(dt, src) if crank == root else self.buf(dt, count=count)
            rb = self.buf(dt, count=count)
            self.nccl("ncclBroadcast", sb, rb, count, dt, root, comm, self.nccl.stream)
            self.check("ncclBroadcast", dt, self.read(dt, rb, count), want)

    def reduce(self, comm, crank, cn, dt, op, root, it, count):
        vals = [self.values(dt, op, r, it, count, 7) for r in range(cn)]
        sb, rb = self.buf(dt, vals[crank]), self.buf(dt, count=count)
        self.delay()
        self.nccl("ncclReduce", sb, rb, count, dt, op, root, comm, self.nccl.stream)
        if crank == root:
            self.check("ncclReduce", dt, self.read(dt, rb, count), reduce_expected(dt, op, vals))

    def gather(self, comm, crank, cn, dt, root, it, count):
        vals = [self.values(dt, SUM, r, it, count, 13) for r in range(cn)]
        sb, rb = self.buf(dt, vals[crank]), self.buf(dt, count=count * cn)
        self.delay()
        self.nccl("ncclGather", sb, rb, count, dt, root, comm, self.nccl.stream)
        if crank == root:
            self.check("ncclGather", dt, self.read(dt, rb, count * cn), [v for r in range(cn) for v in vals[r]])

    def scatter(self, comm, crank, cn, dt, root, it, count):
        full = self.values(dt, SUM, root, it, count * cn, 17)
        sb = self.buf(dt, full) if crank == root else self.buf(dt, count=count * cn)
        rb = self.buf(dt, count=count)
        self.delay()
        self.nccl("ncclScatter", sb, rb, count, dt, root, comm, self.nccl.stream)
        self.check("ncclScatter", dt, self.read(dt, rb, count), full[crank * count:(crank + 1) * count])

    def alltoall(self, comm, crank, cn, dt, it, count):
        def chunk(src, dst):
            return [((src * 31 + dst * 7 + i + it) % 100) for i in range(count)]
        mine = [v for d in range(cn) for v in chunk(crank, d)]
        sb, rb = self.buf(dt, mine), self.buf(dt, count=count * cn)
        self.delay()
        self.nccl("ncclAlltoAll", sb, rb, count, dt, comm, self.nccl.stream)
        self.check("ncclAlltoAll", dt, self.read(dt, rb, count * cn), [v for s in range(cn) for v in chunk(s, crank)])

    def sendrecv_ring(self, comm, crank, cn, dt, it, count):
        nxt, prv = (crank + 1) % cn, (crank - 1) % cn
        out = [((crank * 13 + i + it) % 97) for i in range(count)]
        sb, rb = self.buf(dt, out), self.buf(dt, count=count)
        self.delay()
        self.nccl("ncclGroupStart")
        self.nccl("ncclSend", sb, count, dt, nxt, comm, self.nccl.stream)
        self.nccl("ncclRecv", rb, count, dt, prv, comm, self.nccl.stream)
        self.nccl("ncclGroupEnd")
        self.check("ncclSend/ncclRecv", dt, self.read(dt, rb, count),
                   [((prv * 13 + i + it) % 97) for i in range(count)])

    # -------- workloads
    def run_allreduce(self):
        world = self.comm_init("world")
        for it in range(self.a.iterations):
            self.allreduce(world, self.rank, self.n, FLOAT32, SUM, it, self.a.count)
        self.nccl("ncclCommDestroy", world)

    def run_mixed(self):
        if self.n < 4:
            raise NcclError("workload 'mixed' needs --nranks >= 4")
        r, n, cnt = self.rank, self.n, self.a.count
        world = self.comm_init("world")
        world2 = self.comm_init("world2", config=True)
        split = c_void_p()
        self.nccl("ncclCommSplit", world, r % 2, r, ctypes.byref(split), None)
        srank, scount = c_int(-1), c_int(-1)
        self.nccl("ncclCommUserRank", split, ctypes.byref(srank))
        self.nccl("ncclCommCount", split, ctypes.byref(scount))
        want_n = len([x for x in range(n) if x % 2 == r % 2])
        if (srank.value, scount.value) != (r // 2, want_n):
            raise NcclError(f"split: got rank {srank.value}/{scount.value}, want {r // 2}/{want_n}")
        sr, sn = srank.value, scount.value
        reduce_cases = [(FLOAT32, SUM), (INT32, MAX), (FLOAT16, SUM), (BF16, AVG), (FLOAT64, PROD),
                        (INT8, MIN), (UINT64, SUM), (INT64, AVG), (UINT8, PROD), (UINT32, MIN)]
        for it in range(self.a.iterations):
            root = it % n
            for dt, op in reduce_cases:
                self.allreduce(world, r, n, dt, op, it, cnt)
            self.allreduce(world, r, n, FLOAT32, AVG, it, cnt, inplace=True)
            self.allreduce(world2, r, n, FLOAT32, SUM, it, cnt, fn="ncclAllReduceConfig")
            self.allgather(world2, r, n, FLOAT32, it, cnt)
            self.reducescatter(split, sr, sn, INT32, SUM, it, cnt)
            self.reducescatter(world, r, n, FLOAT16, MAX, it, cnt)
            self.broadcast(world, r, n, FLOAT32, root, it, cnt)
            self.broadcast(split, sr, sn, INT64, it % sn, it, cnt, bcast=True)
            self.reduce(world, r, n, FLOAT64, SUM, root, it, cnt)
            self.gather(world2, r, n, INT32, root, it, cnt)
            self.scatter(world, r, n, FLOAT32, root, it, cnt)
            self.alltoall(world, r, n, INT32, it, cnt)
            self.sendrecv_ring(world, r, n, FLOAT32, it, cnt)
            self.sendrecv_ring(split, sr, sn, UINT8, it, cnt)
        self.nccl("ncclCommFinalize", world2)
        for c in (split, world2, world):
            self.nccl("ncclCommDestroy", c)

    def run_train(self):
        """AllReduce (float32 sum) every iteration until --iterations or --duration-s.

        The last element of every AllReduce is a stop vote (1.0 once a rank's
        time is up), so all ranks leave the loop after the same iteration
        without an extra collective.
        """
        r, n = self.rank, self.n
        cnt = max(2, self.a.count)
        world = self.comm_init("world")
        # A second communicator, as data/tensor-parallel groups are: even and odd ranks.
        half = c_void_p()
        self.nccl("ncclCommSplit", world, r % 2, r, ctypes.byref(half), None)
        hrank, hcount = c_int(-1), c_int(-1)
        self.nccl("ncclCommUserRank", half, ctypes.byref(hrank))
        self.nccl("ncclCommCount", half, ctypes.byref(hcount))
        vals = [[float((q * 7 + i * 3) % 5 + 1) for i in range(cnt)] for q in range(n)]
        send_raw = encode(FLOAT32, vals[r])
        want = encode(FLOAT32, reduce_expected(FLOAT32, SUM, vals))[: (cnt - 1) * 4]
        vote_off = (cnt - 1) * 4
        sb, rb = ctypes.create_string_buffer(send_raw, len(send_raw)), ctypes.create_string_buffer(len(send_raw))
        deadline = time.monotonic() + self.a.duration_s if self.a.duration_s > 0 else None
        it = 0
        while it < self.a.iterations:
            it += 1
            stop = 1.0 if (deadline is not None and time.monotonic() >= deadline) or it >= self.a.iterations else 0.0
            ctypes.memmove(ctypes.addressof(sb) + vote_off, struct.pack("<f", stop), 4)
            self.delay()
            call = desync_call(r, n, cnt, sb, rb)
            if call:  # another collective, or count, than its peers' (docs/simulator.md, "Desync")
                print(f"rank {r}: iteration {it}: {call[0]}", flush=True)
                self.nccl(*call[1], world, self.nccl.stream)
                raise NcclError(f"the desync returned: {call[0]} (iteration {it})")
            self.nccl("ncclAllReduce", sb, rb, cnt, FLOAT32, SUM, world, self.nccl.stream)
            raw = rb.raw
            self.checks += 1
            if raw[:vote_off] != want and not self.a.no_check:
                raise NcclError(f"wrong result in ncclAllReduce (train iteration {it})")
            self.allreduce(half, hrank.value, hcount.value, FLOAT32, SUM, it, max(1, cnt // 8))
            if struct.unpack("<f", raw[vote_off:vote_off + 4])[0] > 0:
                break
        self.a.iterations = it
        self.nccl("ncclCommDestroy", half)
        self.nccl("ncclCommDestroy", world)

    def run_gpu(self):
        """For the GPU-like mode (NCCL_SIM_GPU=1): a 1-rank communicator (split by
        rank: NCCL gives no profiler events for it), then --iterations of an
        AllReduce on the world communicator and, every third iteration, a
        Send/Recv ring, enqueued WITHOUT waiting; the stream is synchronized and
        results checked every --sync-every iterations (0: only at the end).
        --finish abort: ncclCommAbort right after the last enqueue (no sync).
        --no-check: zero-filled buffers and no result checks (the Python
        reference values would cost more than the collective: benches)."""
        r, n, cnt = self.rank, self.n, self.a.count
        nccl = self.nccl
        world = self.comm_init("world")
        solo = c_void_p()
        nccl("ncclCommSplit", world, r, 0, ctypes.byref(solo), None)
        self.allreduce(solo, 0, 1, FLOAT32, SUM, 0, cnt)
        nccl.sync(solo)
        nccl("ncclCommDestroy", solo)
        nccl.autosync = False
        pending = []

        def settle():
            nccl.sync(world)
            for what, dt, b, c, want in pending:
                if what != "keep":  # "keep": a send buffer held until the stream is done with it
                    self.check(what, dt, self.read(dt, b, c), want)
            pending.clear()

        for it in range(self.a.iterations):
            self.delay()
            if self.a.no_check:
                sb, rb = self.buf(FLOAT32, count=cnt), self.buf(FLOAT32, count=cnt)
                nccl("ncclAllReduce", sb, rb, cnt, FLOAT32, SUM, world, nccl.stream)
                pending.append(("keep", FLOAT32, sb, 0, []))
                pending.append(("keep", FLOAT32, rb, 0, []))
                if self.a.sync_every > 0 and (it + 1) % self.a.sync_every == 0:
                    settle()
                continue
            vals = [self.values(FLOAT32, SUM, q, it, cnt) for q in range(n)]
            sb, rb = self.buf(FLOAT32, vals[r]), self.buf(FLOAT32, count=cnt)
            nccl("ncclAllReduce", sb, rb, cnt, FLOAT32, SUM, world, nccl.stream)
            pending.append((f"ncclAllReduce#{it}", FLOAT32, rb, cnt, reduce_expected(FLOAT32, SUM, vals)))
            pending.append(("keep", FLOAT32, sb, 0, []))
            if n > 1 and it % 3 == 2:
                nxt, prv = (r + 1) % n, (r - 1) % n
                ssb = self.buf(INT32, [((r * 13 + i + it) % 97) for i in range(cnt)])
                rrb = self.buf(INT32, count=cnt)
                nccl("ncclGroupStart")
                nccl("ncclSend", ssb, cnt, INT32, nxt, world, nccl.stream)
                nccl("ncclRecv", rrb, cnt, INT32, prv, world, nccl.stream)
                nccl("ncclGroupEnd")
                pending.append((f"ncclRecv#{it}", INT32, rrb, cnt, [((prv * 13 + i + it) % 97) for i in range(cnt)]))
                pending.append(("keep", INT32, ssb, 0, []))
            if self.a.sync_every > 0 and (it + 1) % self.a.sync_every == 0:
                settle()
        if self.a.finish == "abort":
            if self.a.finish_delay_ms > 0:
                time.sleep(self.a.finish_delay_ms / 1000.0)
            nccl("ncclCommAbort", world)
            return
        settle()
        nccl("ncclCommDestroy", world)

    def run_hang(self):
        """Every rank makes --hang-after AllReduces; then rank 0 stops (sleeps
        forever, never entering the next one) while the others enter it."""
        world = self.comm_init("world")
        for _ in range(self.a.hang_after):
            self.allreduce(world, self.rank, self.n, FLOAT32, SUM, 0, self.a.count)
        if self.rank == 0:
            sys.stdout.write(f"rank 0: {self.a.hang_after} AllReduce(s) done, hanging "
                             f"(never enters the next ncclAllReduce)\n")
            sys.stdout.flush()
            while True:
                time.sleep(3600)
        self.allreduce(world, self.rank, self.n, FLOAT32, SUM, 0, self.a.count)
        self.nccl("ncclCommDestroy", world)

    def main(self) -> int:
        t0 = time.monotonic()
        self.nccl = Nccl(self.a.lib, self.rank)
        if self.a.startup_delay_ms > 0:
            time.sleep(self.a.startup_delay_ms / 1000.0)
        try:
            getattr(self, f"run_{self.a.workload}")()
        except NcclError as e:
            print(f"rank {self.rank}: FAIL workload={self.a.workload} pid={os.getpid()} calls={self.nccl.ncalls} "
                  f"checks={self.checks}: {e}", flush=True)
            return 1
        print(f"rank {self.rank}: OK workload={self.a.workload} pid={os.getpid()} iterations={self.a.iterations} "
              f"calls={self.nccl.ncalls} checks={self.checks} elapsed={time.monotonic() - t0:.2f}s", flush=True)
        return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m exporter.simulator.rank", description=__doc__.splitlines()[0])
    p.add_argument("--lib", required=True, help="path of libnccl.so.2")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--nranks", type=int, required=True)
    p.add_argument("--rendezvous", required=True, help="directory shared by all ranks (<name>.uid files)")
    p.add_argument("--workload", choices=["mixed", "allreduce", "hang", "train", "gpu"], default="allreduce")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--hang-after", type=int, default=0,
                   help="hang: AllReduces every rank completes before rank 0 stops")
    p.add_argument("--count", type=int, default=1024, help="elements per collective")
    p.add_argument("--compute-delay-ms", type=float, default=0.0, help="sleep before every collective")
    p.add_argument("--startup-delay-ms", type=float, default=0.0, help="sleep before the first NCCL call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration-s", type=float, default=float(os.environ.get("NCCL_SIM_DURATION_S") or 0),
                   help="train: stop after this long (default $NCCL_SIM_DURATION_S; 0 = only --iterations)")
    p.add_argument("--sync-every", type=int, default=10,
                   help="gpu: synchronize the stream and check results every N iterations (0: only at the end)")
    p.add_argument("--finish", choices=["destroy", "abort"], default="destroy",
                   help="gpu: end with sync + ncclCommDestroy, or ncclCommAbort with work still pending")
    p.add_argument("--finish-delay-ms", type=float, default=0.0, help="gpu: sleep before --finish abort")
    p.add_argument("--no-check", action="store_true", default=bool(os.environ.get("NCCL_SIM_NO_CHECK")),
                   help="gpu: zero buffers, no checks or Send/Recv (benches); train: go on past a wrong result "
                        "(a training job checks none; default: $NCCL_SIM_NO_CHECK)")
    p.add_argument("--truth", default=None, help="append ground truth (JSON lines) to this file")
    a = p.parse_args(argv)
    if not (0 <= a.rank < a.nranks):
        p.error("--rank must be in [0, nranks)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.truth:
        os.environ["NCCL_SIM_TRUTH"] = str(pathlib.Path(a.truth).resolve())
    pathlib.Path(a.rendezvous).mkdir(parents=True, exist_ok=True)
    return Rank(a).main()


if __name__ == "__main__":
    sys.exit(main())

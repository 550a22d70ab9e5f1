"""Part a of the GPU check on the simulator's GPU-like mode (docs/simulator.md),
for machines without a GPU: the same calls as bench/gpu/workload.py's
`correctness` mode, the same output, so the same checks run on it.

    python3 bench/gpu/simworkload.py LIBNCCL DIR WORLD [straggler]

`straggler` (part d): BENCH_GPU_STRAGGLER_ITERS (default 20) 1 MB AllReduces
instead, the last rank's GPU slowed by the job's NCCL_SIM_SLOW_GPU.

All ranks of the world run in this one process (ncclCommInitAll over
localhost; the plugin's log tells them apart by rank). The simulator's
stream stands in for the GPU and its truth for the CUDA events: a call's
"elapsed" time is its kernel's interval on the stream, on the synthetic GPU
clock (truth GPU_KERNEL's timers).
AllToAll is grouped Send/Recv to every other rank (the simulator has no
self-send), its own chunk copied locally; the calls' `expect` says so.
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from exporter.simulator.truth import gpu_kernels, load_truth  # noqa: E402

F32, SUM = 7, 0
MB = 1 << 20
SIZES = [int(s) for s in os.environ.get("BENCH_GPU_SIZES", f"4096,65536,{MB}").split(",")]


def buf(n: int, v: float = 0.0):
    a = array.array("f", [v]) * n
    return a, ctypes.c_void_p(a.buffer_info()[0])


def main() -> int:
    lib, d, world = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    nccl = ctypes.CDLL(lib)
    c_p, c_i, c_sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    nccl.ncclAllReduce.argtypes = [c_p, c_p, c_sz, c_i, c_i, c_p, c_p]
    nccl.ncclAllGather.argtypes = [c_p, c_p, c_sz, c_i, c_p, c_p]
    nccl.ncclReduceScatter.argtypes = [c_p, c_p, c_sz, c_i, c_i, c_p, c_p]
    nccl.ncclBroadcast.argtypes = [c_p, c_p, c_sz, c_i, c_i, c_p, c_p]
    nccl.ncclSend.argtypes = [c_p, c_sz, c_i, c_i, c_p, c_p]
    nccl.ncclRecv.argtypes = [c_p, c_sz, c_i, c_i, c_p, c_p]
    nccl.ncclCommInitAll.argtypes = [ctypes.POINTER(c_p), c_i, ctypes.POINTER(c_i)]
    nccl.ncclCommDestroy.argtypes = [c_p]
    nccl.simStreamSynchronize.argtypes = [c_p]
    comms = (c_p * world)()
    assert nccl.ncclCommInitAll(comms, world, None) == 0
    if sys.argv[4:] == ["straggler"]:
        return straggler(nccl, comms, d, world)

    def group(fn):
        assert nccl.ncclGroupStart() == 0
        for r in range(world):
            fn(r)
        assert nccl.ncclGroupEnd() == 0
        for r in range(world):
            assert nccl.simStreamSynchronize(comms[r]) == 0

    calls = defaultdict(list)  # rank -> [(call dict, truth keys)]
    coll_seq = defaultdict(int)  # (rank, op) -> next seq
    p2p_seq = defaultdict(int)   # (rank, peer, SEND|RECV) -> next seq
    total = world * (world + 1) / 2

    def coll(r, op, key, nbytes, ok):
        s = coll_seq[(r, key)]
        coll_seq[(r, key)] += 1
        calls[r].append(({"kind": "call", "rank": r, "world": world, "op": op, "bytes": nbytes, "ok": ok,
                          "expect": {"coll": op}}, [(key, s, -1)]))

    for size in SIZES:
        n = size // 4
        b = [buf(n, r + 1.0) for r in range(world)]
        group(lambda r: nccl.ncclAllReduce(b[r][1], b[r][1], n, F32, SUM, comms[r], None))
        for r in range(world):
            coll(r, "AllReduce", "ALL_REDUCE", size, b[r][0][0] == total and b[r][0][-1] == total)
        src = [buf(n, float(r)) for r in range(world)]
        dst = [buf(world * n) for _ in range(world)]
        group(lambda r: nccl.ncclAllGather(src[r][1], dst[r][1], n, F32, comms[r], None))
        for r in range(world):
            coll(r, "AllGather", "ALL_GATHER", size, all(dst[r][0][k * n] == k for k in range(world)))
        src = [buf(world * n, r + 1.0) for r in range(world)]
        dst = [buf(n) for _ in range(world)]
        group(lambda r: nccl.ncclReduceScatter(src[r][1], dst[r][1], n, F32, SUM, comms[r], None))
        for r in range(world):
            coll(r, "ReduceScatter", "REDUCE_SCATTER", size, dst[r][0][0] == total)
        b = [buf(n, float(r)) for r in range(world)]
        group(lambda r: nccl.ncclBroadcast(b[r][1], b[r][1], n, F32, 0, comms[r], None))
        for r in range(world):
            coll(r, "Broadcast", "BROADCAST", size, b[r][0][-1] == 0.0)
        # AllToAll as grouped Send/Recv to every other rank
        chunk = n // world
        src = [buf(n, float(r)) for r in range(world)]
        dst = [buf(n, -1.0) for _ in range(world)]

        def a2a(r):
            for p in range(world):
                if p != r:
                    nccl.ncclSend(ctypes.c_void_p(src[r][1].value + 4 * chunk * p), chunk, F32, p, comms[r], None)
                    nccl.ncclRecv(ctypes.c_void_p(dst[r][1].value + 4 * chunk * p), chunk, F32, p, comms[r], None)
        group(a2a)
        for r in range(world):
            keys = []
            for p in range(world):
                if p != r:
                    for k in ("SEND", "RECV"):
                        keys.append((k, p2p_seq[(r, p, k)], p))
                        p2p_seq[(r, p, k)] += 1
            ok = all(dst[r][0][p * chunk] == p for p in range(world) if p != r)
            calls[r].append(({"kind": "call", "rank": r, "world": world, "op": "AllToAll", "bytes": size, "ok": ok,
                              "expect": {"Send": [chunk * 4] * (world - 1), "Recv": [chunk * 4] * (world - 1)}}, keys))
        # Send/Recv: even ranks send to the next
        b = [buf(n, float(r)) for r in range(world)]
        group(lambda r: (nccl.ncclSend if r % 2 == 0 else nccl.ncclRecv)(b[r][1], n, F32,
                                                                         r + 1 if r % 2 == 0 else r - 1,
                                                                   comms[r], None))
        for r in range(world):
            p, k = (r + 1, "SEND") if r % 2 == 0 else (r - 1, "RECV")
            calls[r].append(({"kind": "call", "rank": r, "world": world, "op": "Send/Recv", "bytes": size,
                              "ok": r % 2 == 0 or b[r][0][0] == p,
                              "expect": {"Send": [size]} if k == "SEND" else {"Recv": [size]}},
                             [(k, p2p_seq[(r, p, k)], p)]))
            p2p_seq[(r, p, k)] += 1
    for r in range(world):
        assert nccl.ncclCommDestroy(comms[r]) == 0

    # the stream's kernel intervals stand in for the CUDA events
    truth = {}
    unnumbered = defaultdict(int)  # (rank, op) -> kernels NCCL gave no seqNumber (a desynced Broadcast), in run order
    for k in gpu_kernels(load_truth(os.environ["NCCL_SIM_TRUTH"])):
        peer = k["peer"] if k["coll_op"] in ("SEND", "RECV") else -1
        seq = k["seq"]
        if k.get("unnumbered"):
            seq = unnumbered[(k["rank"], k["coll_op"])]
            unnumbered[(k["rank"], k["coll_op"])] += 1
        truth[(k["rank"], k["coll_op"], seq, peer)] = k
    for r in range(world):
        with open(d / f"calls.{r}.jsonl", "w") as out:
            for c, keys in calls[r]:
                ks = [truth[(r, op, s, p)] for op, s, p in keys]
                # on the GPU's clock, as CUDA events measure (the synthetic timer drifts from CLOCK_MONOTONIC)
                c["elapsed_ns"] = max(k["gpu_stop_timer"] for k in ks) - min(k["gpu_start_timer"] for k in ks)
                out.write(json.dumps(c) + "\n")
        (d / f"result.{r}.json").write_text(json.dumps({
            "kind": "result", "rank": r, "world": world, "pid": os.getpid(), "shared_pid": True,
            "nccl_version": None, "calls": len(calls[r])}))
    return 0


def straggler(nccl, comms, d: Path, world: int) -> int:
    n = MB // 4
    b = [buf(n, 1.0) for _ in range(world)]
    iters = int(os.environ.get("BENCH_GPU_STRAGGLER_ITERS", "20"))
    for _ in range(iters):
        assert nccl.ncclGroupStart() == 0
        for r in range(world):
            nccl.ncclAllReduce(b[r][1], b[r][1], n, F32, SUM, comms[r], None)
        assert nccl.ncclGroupEnd() == 0
        for r in range(world):
            assert nccl.simStreamSynchronize(comms[r]) == 0
    for r in range(world):
        assert nccl.ncclCommDestroy(comms[r]) == 0
    for r in range(world):
        (d / f"result.{r}.json").write_text(json.dumps({
            "kind": "result", "rank": r, "world": world, "pid": os.getpid(), "shared_pid": True,
            "iters": iters, "straggler": world - 1}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

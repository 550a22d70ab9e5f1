"""One rank of the GPU check's torch.distributed job (NCCL backend).

    python3 bench/gpu/workload.py MODE DIR

Started by bench/gpu/__main__.py with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and NCCL's environment (docs/plugin.md, "Running the GPU check").
Writes DIR/calls.<rank>.jsonl (one line per call: bench/gpu/checks.py) and
DIR/result.<rank>.json. Modes:

  correctness  AllReduce, AllGather, ReduceScatter, Broadcast, AllToAll and
               Send/Recv, 4 KB .. 64 MB (BENCH_GPU_SIZES), each call bracketed
               by CUDA events on the current stream (torch makes it wait for
               the NCCL stream), results checked
  fault        the last rank enqueues a 64 MB AllReduce and SIGKILLs itself;
               the others repeat that AllReduce until NCCL/torch fails them
  graph        an AllReduce and an AllGather captured in a CUDA graph,
               replayed BENCH_GPU_REPLAYS times (default 50)
  cost         BENCH_GPU_ITERS (default 300) 1 MB AllReduces, synchronized,
               host time per iteration
  straggler    BENCH_GPU_STRAGGLER_ITERS (default 20) 4 MB AllReduces; before
               each the last rank keeps its GPU busy BENCH_GPU_STRAGGLER_MS
               (default 20) with a spinning kernel on the same stream
               (torch.cuda._sleep): a GPU straggler; its measured busy time
               goes into the result

BENCH_GPU_DEVICE=cpu runs the same calls on the CPU with the gloo backend
(host clock instead of CUDA events, no graph mode): for checking this file's
logic on a machine without a GPU; no NCCL, so no plugin records.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

MB = 1 << 20
CPU = os.environ.get("BENCH_GPU_DEVICE") == "cpu"
SIZES = [int(s) for s in os.environ.get("BENCH_GPU_SIZES", f"{4096},{65536},{MB},{16 * MB},{64 * MB}").split(",")]
ITERS = int(os.environ.get("BENCH_GPU_CALL_ITERS", "2"))


def sync() -> None:
    if not CPU:
        torch.cuda.synchronize()


def timed(fn) -> float:
    """ns between two CUDA events on the current stream around fn()."""
    if CPU:
        t = time.perf_counter_ns()
        fn()
        return float(time.perf_counter_ns() - t)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e6


def correctness(rank: int, world: int, dev, out) -> int:
    n = 0

    def emit(op, nbytes, el, ok, expect):
        nonlocal n
        n += 1
        out.write(json.dumps({"kind": "call", "rank": rank, "world": world, "op": op, "bytes": nbytes,
                              "elapsed_ns": el, "ok": bool(ok), "expect": expect}) + "\n")
        out.flush()

    total = world * (world + 1) / 2
    for size in SIZES:
        numel = size // 4
        for _ in range(ITERS):
            t = torch.full((numel,), float(rank + 1), device=dev)
            el = timed(lambda: dist.all_reduce(t))
            emit("AllReduce", size, el, t[0].item() == total and t[-1].item() == total, {"coll": "AllReduce"})
            inp = torch.full((numel,), float(rank), device=dev)
            o = torch.empty(world * numel, device=dev)
            el = timed(lambda: dist.all_gather_into_tensor(o, inp))
            emit("AllGather", size, el, all(o[k * numel].item() == k for k in range(world)), {"coll": "AllGather"})
            inp = torch.full((world * numel,), float(rank + 1), device=dev)
            o = torch.empty(numel, device=dev)
            el = timed(lambda: dist.reduce_scatter_tensor(o, inp))
            emit("ReduceScatter", size, el, o[0].item() == total, {"coll": "ReduceScatter"})
            t = torch.full((numel,), float(rank), device=dev)
            el = timed(lambda: dist.broadcast(t, src=0))
            emit("Broadcast", size, el, t[-1].item() == 0.0, {"coll": "Broadcast"})
            # AllToAll: NCCL makes one Send and one Recv P2p record per peer,
            # self included (PyTorch's grouped send/recv and NCCL 2.28's
            # ncclAlltoAll both enumerate every rank)
            chunk = numel // world
            inp = torch.cat([torch.full((chunk,), float(rank * world + j), device=dev) for j in range(world)])
            o = torch.empty(numel, device=dev)
            el = timed(lambda: dist.all_to_all_single(o, inp))
            ok = all(o[j * chunk].item() == j * world + rank for j in range(world))
            emit("AllToAll", size, el, ok, {"Send": [chunk * 4] * world, "Recv": [chunk * 4] * world})
            # Send/Recv: even ranks send to the next, odd ranks receive
            peer = rank + 1 if rank % 2 == 0 else rank - 1
            t = torch.full((numel,), float(rank), device=dev)
            if rank % 2 == 0:
                el = timed(lambda: dist.send(t, peer))
                emit("Send/Recv", size, el, True, {"Send": [size]})
            else:
                el = timed(lambda: dist.recv(t, peer))
                emit("Send/Recv", size, el, t[0].item() == peer, {"Recv": [size]})
    return n


def fault(rank: int, world: int, dev, d: Path, res: dict) -> None:
    t = torch.ones(64 * MB // 4, device=dev)
    for _ in range(3):
        dist.all_reduce(t)
    sync()
    dist.barrier()
    if rank == world - 1:  # the victim: in the middle of a collective
        dist.all_reduce(t, async_op=True)
        time.sleep(0.05)
        (d / "kill_time").write_text(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 300:
            w = dist.all_reduce(t, async_op=True)
            w.wait()
            sync()
        res["outcome"] = "completed"
    except Exception as e:  # noqa: BLE001 - what the survivor sees: the same with and without the plugin
        t_err = time.monotonic()
        res["outcome"] = type(e).__name__
        res["message"] = (str(e).splitlines() or [""])[0][:300]
        kt = d / "kill_time"
        if kt.exists():
            res["t_error_s"] = t_err - float(kt.read_text())


def graph(rank: int, world: int, dev, d: Path, res: dict) -> None:
    replays = int(os.environ.get("BENCH_GPU_REPLAYS", "50"))
    x = torch.ones(MB // 4, device=dev)
    z = torch.full((64 * 1024 // 4,), float(rank), device=dev)
    y = torch.empty(world * z.numel(), device=dev)
    w1, w2 = torch.ones(1024, device=dev), torch.empty(world * 1024, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up at other sizes (told apart from the captured ops by bytes)
        for _ in range(3):
            dist.all_reduce(w1)
            dist.all_gather_into_tensor(w2, w1)
    torch.cuda.current_stream().wait_stream(s)
    sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dist.all_reduce(x)
        dist.all_gather_into_tensor(y, z)
    sync()
    el = []
    for _ in range(replays):
        x.fill_(1.0)
        el.append(timed(g.replay))
    sync()
    res.update(replays=replays, captured={"AllReduce": x.numel() * 4, "AllGather": z.numel() * 4},
               replay_elapsed_ns=el, result_ok=bool(x[0].item() == world and y[-1].item() == world - 1))


def cost(rank: int, world: int, dev, d: Path, res: dict) -> None:
    iters = int(os.environ.get("BENCH_GPU_ITERS", "300"))
    t = torch.ones(MB // 4, device=dev)
    for _ in range(20):
        dist.all_reduce(t)
    sync()
    times = []
    for _ in range(iters):
        a = time.perf_counter()
        dist.all_reduce(t)
        sync()
        times.append(time.perf_counter() - a)
    times.sort()
    res.update(iters=iters, mean_s=sum(times) / len(times), p10_s=times[len(times) // 10],
               p50_s=times[len(times) // 2], p90_s=times[9 * len(times) // 10])


def straggler(rank: int, world: int, dev, d: Path, res: dict) -> None:
    iters = int(os.environ.get("BENCH_GPU_STRAGGLER_ITERS", "20"))
    delay_ms = float(os.environ.get("BENCH_GPU_STRAGGLER_MS", "20"))
    t = torch.ones(4 * MB // 4, device=dev)
    for _ in range(3):
        dist.all_reduce(t)
    sync()
    late = rank == world - 1
    cycles = 0
    if late and not CPU:  # the spin kernel's cycles per ms, measured alone on this GPU
        cycles = 1_000_000
        el = timed(lambda: torch.cuda._sleep(cycles))
        cycles = max(1, int(cycles * delay_ms * 1e6 / max(el, 1.0)))
    dist.barrier()
    busy = []
    for _ in range(iters):
        spin = None
        if late and CPU:
            busy.append(timed(lambda: time.sleep(delay_ms / 1e3)))
        elif late:  # queued, not waited for: the host enqueues its AllReduce on time, its GPU starts it late
            spin = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            spin[0].record()
            torch.cuda._sleep(cycles)
            spin[1].record()
        dist.all_reduce(t)
        sync()
        if spin is not None:
            busy.append(spin[0].elapsed_time(spin[1]) * 1e6)
    res.update(iters=iters, straggler=world - 1, delay_ms=delay_ms)
    if busy:
        busy.sort()
        res["busy_ms"] = busy[len(busy) // 2] / 1e6  # median, CUDA events around the spin kernel


def main() -> int:
    mode, d = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    res = {"kind": "result", "rank": rank, "world": world, "pid": os.getpid(), "mode": mode,
           "torch": torch.__version__}
    rpath = d / f"result.{rank}.json"
    try:
        timeout = datetime.timedelta(seconds=float(os.environ.get("BENCH_GPU_PG_TIMEOUT_S", "30")))
        t0 = time.monotonic()
        if CPU:
            dev = torch.device("cpu")
            res["device"] = "cpu (gloo)"
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        else:
            res["nccl_version"] = list(torch.cuda.nccl.version())
            torch.cuda.set_device(0)
            dev = torch.device("cuda", 0)
            res["device"] = torch.cuda.get_device_name(0)
            dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=dev)
        dist.barrier()  # a framework call: counted and named by the checks
        res["init_s"] = time.monotonic() - t0
        res["comm_rank"] = dist.get_rank()
        if mode == "correctness":
            with open(d / f"calls.{rank}.jsonl", "w") as out:
                res["calls"] = correctness(rank, world, dev, out)
        elif mode == "fault":
            fault(rank, world, dev, d, res)
        elif mode == "graph":
            graph(rank, world, dev, d, res)
        elif mode == "cost":
            cost(rank, world, dev, d, res)
        elif mode == "straggler":
            straggler(rank, world, dev, d, res)
        sync()
    except Exception as e:  # noqa: BLE001 - the error goes into the result file
        res["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    rpath.write_text(json.dumps(res))  # before teardown: a hang there keeps the result
    try:
        dist.destroy_process_group()
        res["destroy"] = "ok"
    except Exception as e:  # noqa: BLE001 - the error goes into the result file
        res["destroy"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    rpath.write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One habit's soak job (bench/plugin_soak_sim.py runs it): two ranks of the
simulator's libnccl in GPU-like mode in this process, the plugin loaded by the
simulator as NCCL loads it, the habit switched on by the environment
(NCCL_SIM_GPU_*). Runs until the plugin has ended at least --ops operations,
sampling RSS and the plugin's pools; then waits for the streams and measures
how long anything stays in flight after the job's last call. Prints one JSON
line.

    python bench/plugin_soak_job.py LIBNCCL PLUGIN --ops N
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("plugin")
    ap.add_argument("--ops", type=int, required=True)
    ap.add_argument("--limit-s", type=float, default=10.0, help="give up waiting for the pools after this")
    a = ap.parse_args()
    nccl = ctypes.CDLL(a.lib)
    c_p, c_i, c_sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    nccl.ncclAllReduce.argtypes = [c_p, c_p, c_sz, c_i, c_i, c_p, c_p]
    nccl.ncclAllGather.argtypes = [c_p, c_p, c_sz, c_i, c_p, c_p]
    nccl.ncclBroadcast.argtypes = [c_p, c_p, c_sz, c_i, c_i, c_p, c_p]
    nccl.ncclAlltoAll.argtypes = [c_p, c_p, c_sz, c_i, c_p, c_p]
    nccl.ncclSend.argtypes = [c_p, c_sz, c_i, c_i, c_p, c_p]
    nccl.ncclRecv.argtypes = [c_p, c_sz, c_i, c_i, c_p, c_p]
    nccl.ncclCommInitAll.argtypes = [ctypes.POINTER(c_p), c_i, ctypes.POINTER(c_i)]
    nccl.ncclCommDestroy.argtypes = [c_p]
    nccl.simStreamSynchronize.argtypes = [c_p]
    n = 2
    comms = (c_p * n)()
    assert nccl.ncclCommInitAll(comms, n, None) == 0
    # the simulator loaded the plugin: the same library, for its counters
    plug = ctypes.CDLL(a.plugin, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    stats, pools = (ctypes.c_uint64 * 6)(), (ctypes.c_uint64 * 8)()

    def sample() -> tuple[int, int, int, int, int]:
        plug.nccl_exporter_profiler_stats(stats)
        plug.nccl_exporter_profiler_pools(pools)
        return stats[0] + stats[1], pools[0], pools[1], stats[2], pools[6]

    # buffers made once: a soak that allocated per call would measure Python
    f32 = ctypes.c_float * 256
    a_in = [f32() for _ in range(n)]
    a_out = [f32() for _ in range(n)]
    g_out = [(ctypes.c_float * (128 * n))() for _ in range(n)]
    a2a_in = [(ctypes.c_float * (32 * n))() for _ in range(n)]
    a2a_out = [(ctypes.c_float * (32 * n))() for _ in range(n)]
    sb = [(ctypes.c_int * 64)() for _ in range(n)]
    rb = [(ctypes.c_int * 64)() for _ in range(n)]
    t0 = time.monotonic()
    rss, peak_slots, peak_pops, it, calls = [], 0, 0, 0, 0
    ended = 0
    while ended < a.ops and calls < 8 * a.ops:   # (a plugin NCCL closed ends nothing)
        nccl.ncclGroupStart()     # a group of two collectives per communicator (a batch where NCCL_SIM_GPU_BATCH=1)
        for r in range(n):
            nccl.ncclAllReduce(a_in[r], a_out[r], 256, 7, 0, comms[r], None)
            nccl.ncclAllGather(a_in[r], g_out[r], 128, 7, comms[r], None)
        nccl.ncclGroupEnd()
        nccl.ncclGroupStart()
        for r in range(n):
            nccl.ncclSend(sb[r], 64, 2, (r + 1) % n, comms[r], None)
            nccl.ncclRecv(rb[r], 64, 2, (r - 1) % n, comms[r], None)
        nccl.ncclGroupEnd()
        calls += 4 * n
        if it % 4 == 3:
            nccl.ncclGroupStart()
            for r in range(n):
                nccl.ncclAlltoAll(a2a_in[r], a2a_out[r], 32, 7, comms[r], None)
                nccl.ncclBroadcast(a_in[r], a_out[r], 256, 7, 0, comms[r], None)
            nccl.ncclGroupEnd()
            calls += 2 * n
        it += 1
        if it % 64 == 0:   # a training step's end: the pools with its work queued, then the host waits for it
            ended, slots, pops, _, _ = sample()
            peak_slots, peak_pops = max(peak_slots, slots), max(peak_pops, pops)
            for r in range(n):
                nccl.simStreamSynchronize(comms[r])
            if it % 1024 == 0:
                rss.append(rss_kib())
    for r in range(n):
        assert nccl.simStreamSynchronize(comms[r]) == 0
    t_end = time.monotonic()   # every kernel ran: what is still in flight waits for the plugin's sweep
    while True:
        ended, slots, pops, dropped, pdropped = sample()
        waited = time.monotonic() - t_end
        if (slots == 0 and pops == 0) or waited > a.limit_s:
            break
        time.sleep(0.005)
    wall = time.monotonic() - t0
    rss.append(rss_kib())
    for r in range(n):
        assert nccl.ncclCommDestroy(comms[r]) == 0
    print(json.dumps({"ops": ended, "calls": calls, "wall_s": round(wall, 2), "in_flight_after_s": round(waited, 3),
                      "left_slots": slots, "left_proxyops": pops, "peak_slots": peak_slots,
                      "peak_proxyops": peak_pops, "dropped": dropped, "proxy_dropped": pdropped,
                      "rss_kib": rss}), flush=True)


if __name__ == "__main__":
    main()

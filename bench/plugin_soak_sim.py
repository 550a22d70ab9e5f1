#!/usr/bin/env python3
"""Soak through the simulator: the profiler plugin under each NCCL habit the
simulator's GPU-like mode reproduces (docs/plugin.md and docs/simulator.md,
"NCCL habits"), one after another, then the ones that combine all at once.

Run from the repository root:

    .venv/bin/python bench/plugin_soak_sim.py [--ops 1000000] [--version 6]

Each habit is one job (bench/plugin_soak_job.py: two ranks of the simulator's
libnccl in one process, the plugin as NCCL loads it, with its defaults: 1 s
announce period and SETTLE_MS, a 4,096-record pool) that runs until the
plugin has ended its share of --ops operations: AllReduce + AllGather in one
group per communicator, a Send/Recv pair, every fourth step an AlltoAll and a
Broadcast, the host waiting for the GPU every 64 steps. After the job's last
kernel it measures how long records stay in flight (limit 2 s), and the job's
RSS (sampled every 1,024 steps; flat: at most --rss-slack-kib over the first
sample) and the pools' use (sampled every 64 steps; the peak) with the drops.
Exits 1 if anything stayed in flight over 2 s, was dropped, or RSS grew.

The default interface is v6 (NCCL 2.29/2.30), the one version where every
habit played here exists: the stale KernelCh handle is NCCL <= 2.30, the
Broadcast without a Coll event >= 2.29.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from exporter.simulator.build import build_library  # noqa: E402
from exporter.sources.plugin.build import build_plugin  # noqa: E402

# Each habit's switch (docs/simulator.md), in turn. "none" is the baseline.
HABITS = {
    "none": {},
    "pxn_foreign_context": {"NCCL_SIM_GPU_PXN": "1"},
    "pxn_same_process": {"NCCL_SIM_GPU_PXN": "2"},
    "recv_step_restarted": {"NCCL_SIM_GPU_RECV_RESTART": "1"},
    "stale_kernelch_handle": {"NCCL_SIM_GPU_STALE_KCH": "3"},
    "proxyops_never_stopped": {"NCCL_SIM_GPU_PROXY_NO_STOP": "1"},
    "collnet_no_channel_count": {"NCCL_SIM_GPU_COLLNET": "1"},
    "alltoall_as_p2p": {"NCCL_SIM_GPU_ALLTOALL_P2P": "1"},
    "graph_replays": {"NCCL_SIM_GPU_GRAPH_REPLAYS": "3"},
    "batched_collectives": {"NCCL_SIM_GPU_BATCH": "1"},
    "broadcast_desync": {"NCCL_SIM_GPU_BCAST_DESYNC": "2"},
    "kernelch_start_after_kernel": {"NCCL_SIM_GPU_LATE_EVERY": "1"},
    "unload_failed_init": {"NCCL_SIM_GPU_UNLOAD": "1", "NCCL_SIM_GPU_FAILED_INIT": "1"},
    "unload_init_error_2_30": {"NCCL_SIM_GPU_UNLOAD": "1", "NCCL_SIM_GPU_INIT_ERROR_UNLOADS": "1"},
    "mask_counts": {"NCCL_EXPORTER_PROFILER_MASK": "counts"},
}
# All at once: every switch above that combines with the others. Left out:
# PXN=2 (the same variable as PXN=1: one value at a time), ProxyOps never
# stopped (it sends no ProxyStep at all, so the step habits would not run: it
# has its own pass with the stale handle below), the counts mask (no KernelCh:
# every GPU habit off).
ALL_AT_ONCE = {k: v for name, env in HABITS.items() for k, v in env.items()
               if name not in ("pxn_same_process", "proxyops_never_stopped", "mask_counts")}
HABITS["all_at_once"] = ALL_AT_ONCE
HABITS["stale_handle_and_proxyops_never_stopped"] = {"NCCL_SIM_GPU_STALE_KCH": "3",
                                                     "NCCL_SIM_GPU_PROXY_NO_STOP": "1"}


def run_habit(lib: Path, plugin: Path, version: int, env: dict, ops: int) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_SIM", "NCCL_EXPORTER_"))}
    e.update(NCCL_SIM_GPU="1", NCCL_PROFILER_PLUGIN=str(plugin), NCCL_SIM_GPU_PROFILER_VERSION=str(version), **env)
    p = subprocess.run([sys.executable, str(REPO / "bench" / "plugin_soak_job.py"), str(lib), str(plugin),
                        "--ops", str(ops)], env=e, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {p.stderr[-1500:]}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=1_000_000, help="operations in all, shared by the habits")
    ap.add_argument("--version", type=int, default=6, choices=(4, 5, 6, 7), help="profiler interface (default v6)")
    ap.add_argument("--habits", default="", help="comma-separated subset of: " + ", ".join(HABITS))
    ap.add_argument("--rss-slack-kib", type=int, default=1024)
    ap.add_argument("--plugin", help="a plugin library to soak instead of this tree's build")
    a = ap.parse_args()
    names = [h for h in a.habits.split(",") if h] or list(HABITS)
    unknown = [h for h in names if h not in HABITS]
    if unknown:
        print(f"plugin_soak_sim: unknown habit(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    lib = build_library()
    plugin = Path(a.plugin) if a.plugin else build_plugin()
    per = -(-a.ops // len(names))
    print(f"soak (simulator): plugin v{a.version}, {per * len(names)} operations, {per} per habit", flush=True)
    print(f"{'habit':40} {'ops':>8} {'wall s':>7} {'in flight after':>15} {'peak records':>12} "
          f"{'peak ProxyOps':>13} {'dropped':>7} {'RSS first..last KiB':>20}")
    bad, total, t0 = [], 0, time.monotonic()
    for name in names:
        r = run_habit(lib, plugin, a.version, HABITS[name], per)
        if "error" in r:
            bad.append(f"{name}: {r['error']}")
            print(f"{name:40} FAILED", flush=True)
            continue
        total += r["ops"]
        rss = r["rss_kib"]
        growth = rss[-1] - rss[0]
        print(f"{name:40} {r['ops']:>8} {r['wall_s']:>7.1f} {r['in_flight_after_s'] * 1e3:>12.0f} ms "
              f"{r['peak_slots']:>12} {r['peak_proxyops']:>13} {r['dropped'] + r['proxy_dropped']:>7} "
              f"{rss[0]:>9}..{rss[-1]:<9}", flush=True)
        if r["in_flight_after_s"] > 2.0 or r["left_slots"] or r["left_proxyops"]:
            bad.append(f"{name}: in flight {r['in_flight_after_s']} s after the last kernel "
                       f"({r['left_slots']} records, {r['left_proxyops']} ProxyOps left)")
        if r["dropped"] or r["proxy_dropped"]:
            bad.append(f"{name}: dropped {r['dropped']} records, {r['proxy_dropped']} ProxyOps")
        if growth > a.rss_slack_kib:
            bad.append(f"{name}: RSS grew by {growth} KiB")
        if r["ops"] < per:
            bad.append(f"{name}: the plugin ended {r['ops']} operations of {per} ({r['calls']} calls)")
    print(f"\nsummary: {total} operations in {time.monotonic() - t0:.0f} s, {len(names)} habits")
    for b in bad:
        print("FAIL", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

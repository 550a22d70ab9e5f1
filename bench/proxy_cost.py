#!/usr/bin/env python3
"""What proxy accounting (the profiler plugin's ProxyOp/ProxyStep figures,
docs/plugin.md "Network time per peer") costs a job's bus bandwidth.

The simulator in its GPU-like mode: --ranks ranks in network namespaces
back-to-back AllReduces of --mb MB (`--no-check`, synchronized every
iteration), the network moved in steps of 128 KiB by each rank's proxy
thread, which calls the plugin at every step state as NCCL's does
(exporter/simulator/nccl_sim/netsteps.c). Two conditions, both with the
plugin loaded and no agent (the agent adds one uprobe hit per operation,
whatever the steps):

  off  NCCL_EXPORTER_PROFILER_PROXY=0: the plugin does not ask for proxy
       events; the proxy thread makes no callback
  on   the default: every step's start, three states and stop go to the plugin

Bus bandwidth = 2(n-1)/n x size / time per AllReduce (the median rank's
loop time per iteration, from the simulator's truth). The conditions
alternate for --reps rounds (>= 10); a round's figure is on/off. Judged as
bench/training_loop.py judges: the 90 % bootstrap interval of the mean of
the rounds' ratios; goal >= 99 % ("met" when the interval's lower end is at
or above 0.99, "MISSED" when its upper end is below, else "not resolved").

As root, under the heavy-test lock (a few minutes):

    flock /tmp/nccl-heavy.lock .venv/bin/python bench/proxy_cost.py [--reps 10] [--iterations 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.training_loop import bootstrap_ci  # noqa: E402
from exporter.simulator.build import build_library  # noqa: E402
from exporter.simulator.cluster import Cluster, cleanup_stale, start_job  # noqa: E402
from exporter.simulator.truth import calls  # noqa: E402
from exporter.sources.plugin.build import build_plugin  # noqa: E402

GOAL = 0.99


def time_per_op(truth, nranks: int) -> float:
    """Seconds per AllReduce of the median rank (first entry to last return)."""
    per_rank: dict[int, list[dict]] = {}
    for r in calls(truth, "ALL_REDUCE"):
        if r["nranks"] == nranks:
            per_rank.setdefault(r["rank"], []).append(r)
    spans = [(max(c["end_mono_ns"] for c in cs) - min(c["start_mono_ns"] for c in cs)) / (len(cs) - 1) / 1e9
             for cs in per_rank.values() if len(cs) > 1]
    return statistics.median(spans)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10, help="rounds of off/on (default 10; at least 10 to judge)")
    ap.add_argument("--iterations", type=int, default=60, help="AllReduces per run (default 60)")
    ap.add_argument("--ranks", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--mb", type=float, default=8.0, help="AllReduce size in MB (default 8)")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("run as root (network namespaces)")
    cleanup_stale()
    count = int(a.mb * (1 << 20)) // 4
    size = count * 4
    with tempfile.TemporaryDirectory(prefix="nccl-proxycost-") as d:
        work = Path(d)
        lib, plugin = build_library(work / "lib"), build_plugin()
        base = {"NCCL_SIM_GPU": "1", "NCCL_PROFILER_PLUGIN": str(plugin), "NCCL_SIM_GPU_LATE_EVERY": "0"}
        conds = {"off": {**base, "NCCL_EXPORTER_PROFILER_PROXY": "0"}, "on": base}
        results: dict[str, list[float]] = {c: [] for c in conds}
        names = list(conds)
        with Cluster(a.ranks) as cluster:
            for rep in range(a.reps):
                for cond in names[rep % 2:] + names[:rep % 2]:
                    for old in work.glob("truth/*"):
                        old.unlink()
                    res = start_job(cluster, lib, "gpu", a.iterations, work / "rdv", work / "truth", count=count,
                                    extra_env=conds[cond],
                                    extra_args=["--sync-every", "1", "--no-check"]).wait(timeout=600)
                    if not res.ok:
                        sys.exit("the simulated job failed:\n" + res.summary())
                    t = time_per_op(res.truth, a.ranks)
                    busbw = 2 * (a.ranks - 1) / a.ranks * size / t
                    results[cond].append(busbw)
                    print(f"  round {rep + 1}/{a.reps} {cond:3s} {busbw / 1e9:7.3f} GB/s bus bandwidth "
                          f"({t * 1e3:.2f} ms per AllReduce)", flush=True)
    print(f"\n{a.ranks} ranks, {a.mb:g} MB AllReduce, {a.iterations} iterations, {a.reps} rounds (alternating)")
    for cond in names:
        v = results[cond]
        print(f"  {cond:3s} {statistics.median(v) / 1e9:7.3f} GB/s  ({min(v) / 1e9:.3f}..{max(v) / 1e9:.3f})")
    rounds = [on / off for on, off in zip(results["on"], results["off"])]
    mean, (lo, hi) = statistics.fmean(rounds), bootstrap_ci(rounds)
    verdict = ("met" if lo >= GOAL else "MISSED" if hi < GOAL else "not resolved by this run (the interval holds 99 %)")
    print(f"  proxy accounting on / off: mean {100 * mean:.2f} %, 90 % interval {100 * lo:.2f} .. {100 * hi:.2f} % "
          f"(bootstrap), median {100 * statistics.median(rounds):.2f} %")
    print(f"  goal >= 99 % of the bus bandwidth: {verdict}")
    return 0 if lo >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())

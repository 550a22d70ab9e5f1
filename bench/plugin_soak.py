#!/usr/bin/env python3
"""Soak: the profiler plugin through NCCL's habits, one after another, for
many operations; after each habit nothing stays in flight, and the process's
RSS and the plugin's pool use stay flat.

Run from the repository root:

    .venv/bin/python bench/plugin_soak.py [--ops 1000000] [--version 7]

NCCL's side is tests/plugin/fake_nccl.py (the exact callback sequences of
docs/plugin.md "NCCL habits"), in this process, one communicator per habit
round. Habits, in rounds until --ops operations were made:
  plain       a collective on 4 channels, KernelCh and two ProxyOps per channel
  alltoall    an ncclAlltoAll at 2,048 ranks: 4,096 P2p operations, a ProxyOp
              each, the Send/Recv to the rank itself without KernelCh on <= v6
  collnet     Coll with nChannels 0, its KernelCh children still come
  batch       three collectives with one interval (one kernel, one batch)
  replay      graph replays: a Group and a Coll with no API parent per replay
  abandoned   collectives whose KernelCh never stop (the communicator is
              finalized with them open)
  counts      the counts mask (a child process: the mask is read at the
              first init), collectives done at their enqueue
After each habit's last operation (before its communicator is finalized,
except for `abandoned`): the plugin's record and ProxyOp pools must be empty
within 2 s, and every operation must have given exactly one done or
abandoned record; then VmRSS is sampled. Prints one line
per round and a summary; exits 1 if anything stayed in flight or RSS grew by
more than --rss-slack-kib between the second round and the last.

bench/plugin_soak_sim.py soaks the plugin through the simulator instead, one
job per habit switch of its GPU-like mode (the proxy thread's habits too).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "plugin"))

from exporter.sources.plugin.build import build_plugin  # noqa: E402
from fake_nccl import GPU_T0, Plugin  # noqa: E402


def rss_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Soak:
    def __init__(self, P: Plugin):
        self.P = P
        self.t = GPU_T0
        self.pid = os.getpid()
        self.ops = 0

    def tick(self, dt: int = 2000) -> int:
        self.t += dt
        return self.t

    def plain(self, n: int) -> None:
        P = self.P
        ctx = P.init(nranks=8, rank=0)
        for i in range(n):
            h = P.coll(ctx, seq=i, nch=4)
            P.stop(h)
            t = self.tick(100_000)
            ks = [P.kch(ctx, h, c, t + c) for c in range(4)]
            pos = [P.proxy_op(ctx, h, self.pid, 1 + c % 7, c % 2, c) for c in range(8)]
            for po in pos:
                P.stop(po)
            for k in ks:
                P.kch_stop(k, t + 50_000)
        self.ops += n
        return ctx

    def alltoall(self, n: int) -> None:
        P, nr, me = self.P, 2048, 3
        ctx = P.init(nranks=nr, rank=me)
        done = 0
        while done < n:
            ops = []
            for r in range(nr):
                for f in ("Send", "Recv"):
                    h = P.p2p(ctx, f, peer=r, nch=1, rank=me)
                    P.stop(h)
                    ops.append((h, r, f))
            for h, r, f in ops:
                if r == me and P.ver <= 6:
                    continue
                po = P.proxy_op(ctx, h, self.pid, r, f == "Send") if r != me else 0
                t = self.tick()
                k = P.kch(ctx, h, 0, t)
                P.kch_stop(k, t + 1000)
                P.stop(po)
            done += len(ops)
        self.ops += done
        return ctx

    def collnet(self, n: int) -> None:
        P = self.P
        ctx = P.init(nranks=8, rank=0)
        for i in range(n):
            h = P.coll(ctx, seq=i, nch=0)
            P.stop(h)
            t = self.tick(100_000)
            ks = [P.kch(ctx, h, c, t + c) for c in range(2)]
            for k in ks:
                P.kch_stop(k, t + 40_000)
        self.ops += n
        return ctx

    def batch(self, n: int) -> None:
        P = self.P
        ctx = P.init(nranks=8, rank=0)
        for i in range(0, n, 3):
            hs = [P.coll(ctx, func=f, seq=i, nch=2) for f in ("AllReduce", "AllGather", "ReduceScatter")]
            for h in hs:
                P.stop(h)
            t = self.tick(100_000)
            ks = [P.kch(ctx, h, c, t) for h in hs for c in range(2)]
            for k in ks:
                P.kch_stop(k, t + 30_000)
        self.ops += (n + 2) // 3 * 3
        return ctx

    def replay(self, n: int) -> None:
        P = self.P
        ctx = P.init(nranks=8, rank=0)
        for i in range(n):
            g = P.group(ctx)
            h = P.coll(ctx, seq=i, nch=2, parent=g if P.ver == 4 else 0)
            P.stop(h)
            P.stop(g)
            t = self.tick(100_000)
            ks = [P.kch(ctx, h, c, t) for c in range(2)]
            for k in ks:
                P.kch_stop(k, t + 20_000)
        self.ops += n
        return ctx

    def abandoned(self, n: int) -> None:
        P = self.P
        ctx = P.init(nranks=8, rank=0)
        for i in range(n):
            h = P.coll(ctx, seq=i, nch=2)
            P.stop(h)
            if i % 2:   # started on the GPU, never stopped; else never started
                P.kch(ctx, h, 0, self.tick())
        P.finalize(ctx)   # NCCL purges them: no stopEvent
        self.ops += n
        return 0


def settle(P: Plugin, limit_s: float = 2.0) -> tuple[float, dict]:
    """Seconds until both pools are empty (or limit_s), and the last stats."""
    t0 = time.monotonic()
    while True:
        st = P.stats()
        if st["slots_used"] == 0 and st["pops_used"] == 0:
            return time.monotonic() - t0, st
        if time.monotonic() - t0 > limit_s:
            return float("inf"), st
        time.sleep(0.01)


def counts_child(plugin: str, version: int, n: int) -> dict:
    code = f"""
import sys, json
sys.path.insert(0, {str(REPO / 'tests' / 'plugin')!r})
from fake_nccl import Plugin
P = Plugin({plugin!r}, {version})
ctx = P.init(nranks=8, rank=0)
for i in range({n}):
    h = P.coll(ctx, seq=i, nch=2); P.stop(h)
st = P.stats(); P.finalize(ctx)
print(json.dumps(st))
"""
    env = dict(os.environ, NCCL_EXPORTER_PROFILER_MASK="counts")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    import json
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=1_000_000, help="operations in all (default 1,000,000)")
    ap.add_argument("--version", type=int, default=7, choices=(4, 5, 6, 7))
    ap.add_argument("--per-habit", type=int, default=8192, help="operations per habit per round")
    ap.add_argument("--rss-slack-kib", type=int, default=2048)
    ap.add_argument("--plugin", help="a plugin library to soak instead of this tree's (e.g. an older build)")
    a = ap.parse_args()
    for k in [k for k in os.environ if k.startswith("NCCL_EXPORTER_")]:
        del os.environ[k]
    os.environ["NCCL_EXPORTER_PROFILER_ANNOUNCE_MS"] = "50"
    plugin = a.plugin or str(build_plugin())
    P = Plugin(plugin, a.version)
    soak = Soak(P)
    habits = ["plain", "alltoall", "collnet", "batch", "replay", "abandoned", "counts"]
    rss: list[int] = []
    worst = 0.0
    bad = []
    rnd = 0
    t0 = time.monotonic()
    print(f"soak: plugin v{a.version}, {a.ops} operations, {a.per_habit} per habit and round", flush=True)
    while soak.ops < a.ops:
        rnd += 1
        line = []
        for h in habits:
            n = min(a.per_habit, a.ops - soak.ops)
            if n <= 0:
                break
            if h == "counts":
                st = counts_child(plugin, a.version, n)
                soak.ops += n
                if st["completed"] != n or st["slots_used"]:
                    bad.append(f"round {rnd} counts: {st}")
                line.append("counts ok")
                continue
            before, ops0 = P.stats(), soak.ops
            ctx = getattr(soak, h)(n)
            took, st = settle(P)   # before the finalize: nothing may wait for it
            P.finalize(ctx)
            st = P.stats()
            got = st["completed"] + st["abandoned"] - before["completed"] - before["abandoned"]
            if got != soak.ops - ops0:   # every operation is accounted: done or abandoned, once
                bad.append(f"round {rnd} {h}: {soak.ops - ops0} operations, {got} records")
            worst = max(worst, took)
            if took > 2.0:
                bad.append(f"round {rnd} {h}: still in flight after 2 s: {st}")
            line.append(f"{h} {took * 1e3:.0f}ms")
        rss.append(rss_kib())
        st = P.stats()
        print(f"round {rnd}: ops {soak.ops}, rss {rss[-1]} KiB, completed {st['completed']} abandoned "
              f"{st['abandoned']} dropped {st['dropped']} proxy_dropped {st['proxy_dropped']} stale {st['stale']}; "
              + ", ".join(line), flush=True)
    el = time.monotonic() - t0
    st = P.stats()
    growth = rss[-1] - rss[min(1, len(rss) - 1)]
    print(f"\nsummary: {soak.ops} operations in {el:.0f} s ({soak.ops / el:.0f}/s), {rnd} rounds; "
          f"slowest settle {worst * 1e3:.0f} ms (limit 2000); pools at the end: records {st['slots_used']}, "
          f"ProxyOps {st['pops_used']}; dropped {st['dropped']}, proxy_dropped {st['proxy_dropped']}; "
          f"RSS round 1 {rss[0]} KiB, round 2 {rss[min(1, len(rss) - 1)]} KiB, last {rss[-1]} KiB "
          f"(growth after round 2: {growth} KiB)")
    if growth > a.rss_slack_kib:
        bad.append(f"RSS grew by {growth} KiB after round 2")
    if st["dropped"] or st["proxy_dropped"]:
        bad.append("drops")
    for b in bad:
        print("FAIL", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

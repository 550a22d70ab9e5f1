#!/usr/bin/env python3
"""What the profiler plugin costs NCCL per collective, measured in one run.

Run from the repository root (root and BCC only for the `agent` row):

    .venv/bin/python bench/plugin_cost.py [--n N] [--reps R] [--channels C ...] [--no-agent]

tests/plugin/driver.c in its `bench` mode makes, N times in a tight loop on
one thread, the callback sequence NCCL makes for one eager collective with
the plugin's mask (Coll|P2p|KernelCh): startEvent GroupApi, recordEventState
x2, startEvent/stopEvent CollApi, startEvent Group, startEvent Coll,
stopEvent Coll/Group/GroupApi, then per channel startEvent KernelCh,
recordEventState(KernelChStop), stopEvent KernelCh -- and prints ns per
collective (CLOCK_MONOTONIC around the loop).

Configurations (R repetitions interleaved in a rotating order, median kept):
  none    NCCL with no plugin: the mask is 0, NCCL makes no callback
  noop    tests/plugin/noop.c: a v7 plugin that returns at once
  plugin  nccl-exporter's plugin, no agent attached (the hooks are empty calls)
  agent   the same plugin, a private copy of it, with uprobes on its three
          per-record hooks running a BPF program like the agent's would
          (copy the 144-byte record, bump a log2 histogram in a hash map)
  NAME    --baseline NAME=LIB: another build of the plugin (an older commit's,
          built in a `git worktree` of it), in the same rotation, so that load
          hits both alike; `plugin / NAME` is printed
  agent-real  the same plugin, another copy, with the real agent program
          (bpf/plugin.c via PluginSource, after bpf/nccl.c): uprobes on all
          six hooks, GPU histogram + in-flight map updates

Then the network steps (proxy accounting, docs/plugin.md "Network time per
peer"): the driver's `netbench` mode makes, per collective, per channel a
send and a recv ProxyOp with --steps steps each, every step startEvent,
three recordEventState and stopEvent (NCCL's proxy thread's sequence), plus
the KernelCh events, and prints ns per step event (5 per step). Rows: noop
(given the proxy events too), plugin-noproxy (NCCL_EXPORTER_PROFILER_PROXY=0:
NCCL would send no proxy events, the driver sends them anyway), plugin
(proxy accounting on). The goal is <= 100 ns per step event above noop.

Then the activation masks (NCCL_EXPORTER_PROFILER_MASK, docs/plugin.md "The
activation mask"): the driver's `netbench` sequence gated by the mask the
plugin asked for, as NCCL gates it (no KernelCh events under `counts`, no
ProxyOp/ProxyStep under `counts` and `gpu`), ns per collective: none (no
plugin), counts (Coll only: Coll|P2p), gpu (Coll|P2p|KernelCh), net
(+ProxyOp/ProxyStep, the default). Host cost on the calling and proxy threads
only: what KernelCh costs inside NCCL's kernels (KernelPhase writes on 2.31)
needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from exporter.sources.plugin.build import build_plugin  # noqa: E402

BPF = r"""
#include <uapi/linux/ptrace.h>
struct rec { u32 version, size; u64 id, comm_hash, seq, count, bytes, enq, ev, gs, ge, gsm, gem; s64 off;
             s32 rank, nranks, peer; u32 flags; u8 kind, op, dtype, state, nch, cs, cp, iface; char name[16]; };
struct key { u64 comm; u8 op, state, bucket, pad[5]; };
BPF_HASH(hist, struct key, u64, 4096);
static int handle(struct pt_regs *ctx) {
    struct rec r = {};
    if (bpf_probe_read_user(&r, sizeof(r), (void *)PT_REGS_PARM1(ctx))) return 0;
    if (r.version != 1) return 0;
    u64 d = r.ge > r.gs ? r.ge - r.gs : 0;
    struct key k = {.comm = r.comm_hash, .op = r.op, .state = r.state, .bucket = (u8)bpf_log2l(d + 1)};
    u64 zero = 0, *v = hist.lookup_or_try_init(&k, &zero);
    if (v) __sync_fetch_and_add(v, 1);
    return 0;
}
int on_queued(struct pt_regs *ctx) { return handle(ctx); }
int on_start(struct pt_regs *ctx) { return handle(ctx); }
int on_done(struct pt_regs *ctx) { return handle(ctx); }
"""


def compile_helpers(d: Path) -> tuple[Path, Path]:
    inc = ["-I", str(REPO / "plugin")]
    drv, noop = d / "driver", d / "noop.so"
    subprocess.run(["gcc", "-O2", "-pthread", *inc, "-o", str(drv), str(REPO / "tests/plugin/driver.c"), "-ldl"],
                   check=True)
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", *inc, "-o", str(noop), str(REPO / "tests/plugin/noop.c")],
                   check=True)
    return drv, noop


def run_once(drv: Path, lib: str, n: int, ch: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_EXPORTER_")}
    out = subprocess.run([str(drv), lib, "7", "bench", str(n), str(ch)], capture_output=True, text=True,
                         env=env, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("bench "))
    return float(line.split("ns_per_coll=")[1].split()[0])


def run_net(drv: Path, lib: str, n: int, ch: int, steps: int, env_extra: dict) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_EXPORTER_")}
    env.update(env_extra)
    out = subprocess.run([str(drv), lib, "7", "netbench", str(n), str(ch), str(steps)], capture_output=True,
                         text=True, env=env, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("netbench "))
    return float(line.split("ns_per_step_event=")[1].split()[0])


def run_mask(drv: Path, lib: str, n: int, ch: int, steps: int, mode: str) -> float:
    """ns per collective of the netbench sequence under the mask the plugin asks for with `mode`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_EXPORTER_")}
    env["NCCL_EXPORTER_PROFILER_MASK"] = mode
    out = subprocess.run([str(drv), lib, "7", "netbench", str(n), str(ch), str(steps)], capture_output=True,
                         text=True, env=env, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("netbench "))
    f = dict(kv.split("=", 1) for kv in line.split()[1:])
    return float(f["ns_per_step_event"]) * int(f["events"]) / int(f["n"])


def attach_agent(lib: Path):
    from bcc import BPF as Bpf  # noqa: N811
    b = Bpf(text=BPF)
    for sym, fn in (("nccl_exporter_coll_queued", "on_queued"), ("nccl_exporter_gpu_start", "on_start"),
                    ("nccl_exporter_gpu_done", "on_done")):
        b.attach_uprobe(name=str(lib), sym=sym, fn_name=fn)
    return b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200000, help="collectives per timed run")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--channels", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--no-agent", action="store_true")
    ap.add_argument("--steps", type=int, default=8, help="network steps per ProxyOp (netbench)")
    ap.add_argument("--net-n", type=int, default=20000, help="collectives per timed netbench run")
    ap.add_argument("--net-only", action="store_true", help="only the network-step rows")
    ap.add_argument("--masks-only", action="store_true", help="only the activation-mask rows")
    ap.add_argument("--collectives-only", action="store_true", help="only the per-collective rows")
    ap.add_argument("--baseline", action="append", default=[], metavar="NAME=LIB",
                    help="another build of the plugin (e.g. an older commit's, built in a worktree of it) "
                         "measured in the same rotation as the row NAME, with plugin/NAME printed; repeatable")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="plugin-cost."))
    try:
        drv, noop = compile_helpers(tmp)
        plugin = build_plugin()
        configs = {"none": "none", "noop": str(noop), "plugin": str(plugin)}
        for b in a.baseline:
            name, sep, lib = b.partition("=")
            if not sep or not Path(lib).is_file() or name in configs:
                ap.error(f"--baseline {b}: want NAME=LIB, a new name and an existing library")
            configs[name] = str(Path(lib).resolve())
        bpf = None
        real: list = []
        if not a.no_agent:
            agent_copy = tmp / "libnccl-profiler-exporter-agent.so"
            shutil.copy2(plugin, agent_copy)
            try:
                bpf = attach_agent(agent_copy)
                configs["agent"] = str(agent_copy)
            except Exception as e:  # noqa: BLE001 - no root / no BCC: report without that row
                print(f"agent row skipped: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
            real_copy = tmp / "libnccl-profiler-exporter-real.so"
            shutil.copy2(plugin, real_copy)
            try:
                from exporter.sources.nccl.probes import NcclProbes
                from exporter.sources.plugin.source import PluginSource
                real = [NcclProbes()]
                real.append(PluginSource())
                real[1].attach(str(real_copy))
                configs["agent-real"] = str(real_copy)
            except Exception as e:  # noqa: BLE001 - no real plugin here: report without that row
                print(f"agent-real row skipped: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        masks = {"none": "none", "counts": str(plugin), "gpu": str(plugin), "net": str(plugin)}
        for ch in ([] if a.collectives_only else a.channels):
            res_m: dict[str, list[float]] = {k: [] for k in masks}
            names = list(masks)
            for r in range(a.reps):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    res_m[name].append(run_mask(drv, masks[name], a.net_n, ch, a.steps, name))
            med = {k: statistics.median(v) for k, v in res_m.items()}
            print(f"\nactivation masks: {ch} channels x 2 ProxyOps x {a.steps} steps, {a.net_n} collectives x "
                  f"{a.reps} reps (median ns per collective [min..max]):")
            for k in names:
                extra = "" if k == "none" else f"  (+{med[k] - med['none']:.1f} ns over none)"
                print(f"  {k:8s} {med[k]:10.1f} ns  [{min(res_m[k]):.1f}..{max(res_m[k]):.1f}]{extra}")
        if a.masks_only:
            return 0
        net = {"noop": (str(noop), {"DRIVER_PROXY_MASK": "1"}),
               "plugin-noproxy": (str(plugin), {"DRIVER_PROXY_MASK": "1", "NCCL_EXPORTER_PROFILER_PROXY": "0"}),
               "plugin": (str(plugin), {})}
        for ch in ([] if a.collectives_only else a.channels):
            res: dict[str, list[float]] = {k: [] for k in net}
            names = list(net)
            for r in range(a.reps):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    res[name].append(run_net(drv, net[name][0], a.net_n, ch, a.steps, net[name][1]))
            med = {k: statistics.median(v) for k, v in res.items()}
            print(f"\nnetwork steps: {ch} channels x 2 ProxyOps x {a.steps} steps, {a.net_n} collectives x "
                  f"{a.reps} reps (median ns per step event):")
            for k in names:
                extra = "" if k == "noop" else f"  (+{med[k] - med['noop']:.1f} ns over noop)"
                print(f"  {k:15s} {med[k]:8.1f} ns  [{min(res[k]):.1f}..{max(res[k]):.1f}]{extra}")
        for ch in ([] if a.net_only else a.channels):
            results: dict[str, list[float]] = {k: [] for k in configs}
            names = list(configs)
            for r in range(a.reps):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    results[name].append(run_once(drv, configs[name], a.n, ch))
            med = {k: statistics.median(v) for k, v in results.items()}
            print(f"\n{ch} channels, {a.n} collectives x {a.reps} reps (median ns per collective):")
            for k in names:
                extra = ""
                if k != "none":
                    extra = f"  (+{med[k] - med['none']:.1f} ns over none"
                    if k not in ("noop",):
                        extra += f", +{med[k] - med['noop']:.1f} ns over noop, x{med[k] / med['noop']:.2f} noop"
                    extra += ")"
                spread = f"[{min(results[k]):.1f}..{max(results[k]):.1f}]"
                print(f"  {k:10s} {med[k]:8.1f} ns  {spread}{extra}")
            for b in a.baseline:
                name = b.partition("=")[0]
                print(f"  plugin / {name}: x{med['plugin'] / med[name]:.3f}")
        if bpf is not None:
            total = sum(v.value for v in bpf["hist"].values())
            print(f"\nagent BPF program saw {total} records")
            bpf.cleanup()
        if len(real) == 2:
            print(f"agent-real GPU histograms counted {sum(x.calls for x in real[1].series())} collectives")
        for prog in reversed(real):
            prog.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU check: one script, one device call (docs/plugin.md, "Running the GPU check").

    bench/gpu/run.sh [--out DIR] [--parts adceb] [--budget-s 240] [--simulate] [--proxy]

Runs parts a (correctness), d (faults), c (CUDA graphs), e (cost), b (the
agent there), in that order, each within its share of --budget-s; each
part's verdict is appended to DIR/verdicts.txt as it ends and its logs packed
into DIR/part-<x>.tar.gz, so a run cut off still reports what it finished.
The last line printed (and written) is the one verdict line.

On a GPU it needs only the working tree, python3 with torch (NCCL backend)
and gcc: the plugin is built with gcc from plugin/. --simulate runs part a
on the simulator's GPU-like mode instead (no torch, no GPU), part d's GPU
straggler too, and part b's checks of this kernel; c, e and d's killed rank
need torch on a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu import checks  # noqa: E402
from bench.gpu.checks import Verdict  # noqa: E402

# seconds of --budget-s each part may use at most (scaled to the budget)
SHARES = {"a": 75, "d": 70, "c": 30, "e": 50, "b": 15, "p": 60}
MIN_PART_S = 10


class Ctx:
    def __init__(self, out: Path, work: Path, budget_s: float, simulate: bool):
        self.out, self.work, self.simulate = out, work, simulate
        self.t_end = time.monotonic() + budget_s
        self.part_end = self.t_end
        self.plugin: Path | None = None
        self.lib: Path | None = None  # the simulator's libnccl (--simulate)

    def left(self) -> float:
        return max(0.0, min(self.part_end, self.t_end) - time.monotonic())


def log(msg: str) -> None:
    print(f"[bench/gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_plugin(work: Path) -> Path:
    """The plugin built by exporter/sources/plugin/build.py (every .c of plugin/, its
    flags): that module needs only the standard library and exporter/cbuild.py, so
    it runs from the working tree without the exporter's dependencies installed."""
    from exporter.sources.plugin.build import build_plugin as build
    return build(work / "plugin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- launching a job -----------------------------------------------------------------

class Job:
    """One torch.distributed job (or, simulated, one process holding all ranks)."""

    def __init__(self, ctx: Ctx, tag: str, mode: str, world: int, plugin: bool, env: dict | None = None,
                 log: bool = True):
        self.dir = ctx.work / tag
        self.dir.mkdir(parents=True)
        self.tag, self.mode, self.world, self.plugin = tag, mode, world, plugin
        # NCCL's and torch's NCCL settings are the check's own; BENCH_GPU_ENV="K=V,..." adds to them
        base = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH_NCCL_"))}
        base.update(env or {})
        base.update(kv.split("=", 1) for kv in os.environ.get("BENCH_GPU_ENV", "").split(",") if "=" in kv)
        if plugin:
            base["NCCL_PROFILER_PLUGIN"] = str(ctx.plugin)
            if log:  # logging mode: a line per record (what the checks read); without, as under the agent
                base["NCCL_EXPORTER_PROFILER_LOG"] = str(self.dir / "plugin.%p.log")
        self.procs: list[subprocess.Popen] = []
        if ctx.simulate:
            e = dict(base, NCCL_SIM_GPU="1", NCCL_SIM_TRUTH=str(self.dir / "truth.jsonl"))
            self.procs.append(subprocess.Popen([sys.executable, str(HERE / "simworkload.py"), str(ctx.lib),
                                                str(self.dir), str(world), *([mode] if mode == "straggler" else [])],
                                               env=e,
                                               stdout=open(self.dir / "sim.out", "w"), stderr=subprocess.STDOUT,
                                               start_new_session=True))
            return
        port = free_port()
        for r in range(world):
            e = dict(base, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
                     # several ranks on one GPU (NCCL <= 2.29 refuses two ranks of one host on
                     # one GPU: each rank its own host, the Socket transport over loopback)
                     NCCL_HOSTID=f"bench-gpu-{tag}-{r}", NCCL_SOCKET_IFNAME="lo", NCCL_P2P_DISABLE="1",
                     NCCL_SHM_DISABLE="1", NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,ENV,NET",
                     NCCL_DEBUG_FILE=str(self.dir / "nccl.%h.%p.log"))
            self.procs.append(subprocess.Popen([sys.executable, str(HERE / "workload.py"), mode, str(self.dir)],
                                               env=e, stdout=open(self.dir / f"rank{r}.out", "w"),
                                               stderr=subprocess.STDOUT, start_new_session=True))

    def wait(self, ctx: Ctx) -> dict:
        """Wait for every process (until the part's time is up: then kill it, as hung)."""
        rcs = []
        for p in self.procs:
            try:
                rcs.append(p.wait(timeout=max(1.0, ctx.left())))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
                rcs.append("hung")
        results = []
        for f in sorted(self.dir.glob("result.*.json")):
            try:
                results.append(json.loads(f.read_text()))
            except ValueError:
                continue
        calls = []
        for f in sorted(self.dir.glob("calls.*.jsonl")):
            calls += checks.parse_jsonl(f.read_text())
        records = []
        for f in sorted(self.dir.glob("plugin.*.log")):
            records += checks.parse_plugin_log(f.read_text())
        return {"label": f"{self.world} ranks{'' if self.plugin else ' (control, no plugin)'}", "rcs": rcs,
                "results": results, "calls": calls, "records": records, "control": not self.plugin}


def planned_calls(world: int, simulate: bool) -> int:
    sizes = os.environ.get("BENCH_GPU_SIZES")
    n = len(sizes.split(",")) if sizes else (3 if simulate else 5)
    iters = 1 if simulate else int(os.environ.get("BENCH_GPU_CALL_ITERS", "2"))
    return 6 * n * iters


# --- the parts -----------------------------------------------------------------------

def part_a(ctx: Ctx) -> Verdict:
    """Correctness: 2 ranks with the plugin beside a 2-rank control, then 4 ranks."""
    runs = []
    j2, jc = Job(ctx, "a-2", "correctness", 2, True), Job(ctx, "a-2-control", "correctness", 2, False)
    for j in (j2, jc):
        runs.append(j.wait(ctx))
    runs.append(Job(ctx, "a-4", "correctness", 4, True).wait(ctx))
    for r in runs:
        r["planned"] = planned_calls(int(r["label"].split()[0]), ctx.simulate)
        hung = [i for i, rc in enumerate(r["rcs"]) if rc == "hung"]
        if hung:
            r["results"] = [dict(x, error=x.get("error") or "hung") for x in r["results"]] or \
                [{"rank": i, "error": "hung"} for i in hung]
    v = checks.check_correctness(runs)
    nv = next((x.get("nccl_version") for r in runs for x in r["results"] if x.get("nccl_version")), None)
    dev = next((x.get("device") for r in runs for x in r["results"] if x.get("device")), None)
    v.lines.insert(0, f"{'simulator GPU-like mode' if ctx.simulate else dev}, NCCL "
                      f"{'.'.join(map(str, nv)) if nv else 'simulated'}")
    return v


def part_d(ctx: Ctx) -> Verdict:
    """Faults, as bench/faults injects them, those that run on ranks of one GPU: a GPU
    straggler, then a killed rank. Simulated: the straggler only."""
    found = [part_d_straggler(ctx)]
    if not ctx.simulate:
        found.append(part_d_killed(ctx))
    return checks.worst("d", found, "; ".join(f"{v.part} {v.status}" for v in found))


def part_d_straggler(ctx: Ctx, world: int = 2, delay_ms: float = 20.0) -> Verdict:
    """The last of `world` ranks a GPU straggler (bench/gpu/straggler.py), on the Socket
    transport with Ring/Simple (as part p: ProxyOp/ProxyStep events, per-peer waits).
    Simulated: NCCL_SIM_SLOW_GPU delays that rank's data 2 ms a network step."""
    env = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "BENCH_GPU_STRAGGLER_MS": str(delay_ms)}
    if ctx.simulate:
        env["NCCL_SIM_SLOW_GPU"] = f"{world - 1}:2000"
    run = Job(ctx, "d-straggler", "straggler", world, True, env).wait(ctx)
    failed = [r for r in run["results"] if r.get("error")]
    if failed or not run["results"]:
        return Verdict("straggler", "FAIL", [f"the straggler job failed: {failed[:2] or run['rcs']}"])
    busy = next((f"{r['busy_ms']:.1f} ms" for r in run["results"] if "busy_ms" in r),
                "2 ms a network step (NCCL_SIM_SLOW_GPU)" if ctx.simulate else "?")
    from bench.gpu import straggler
    return straggler.check(run["records"], world - 1, world, busy)


def part_d_killed(ctx: Ctx) -> Verdict:
    """The last of 2 ranks killed mid-collective, with and without the plugin (side by side)."""
    env = {"BENCH_GPU_PG_TIMEOUT_S": "30", "TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    jp, jc = Job(ctx, "d-plugin", "fault", 2, True, env), Job(ctx, "d-control", "fault", 2, False, env)
    rp, rc = jp.wait(ctx), jc.wait(ctx)

    def survivors(run):
        out = []
        for res in run["results"]:
            if res["rank"] == run_world(run) - 1:
                continue
            out.append(dict(res, rc=run["rcs"][res["rank"]], outcome=res.get("outcome") or
                            ("hung" if run["rcs"][res["rank"]] == "hung" else res.get("error", "crashed"))))
        if not out:
            out.append({"rank": 0, "rc": run["rcs"][0], "outcome": "hung" if run["rcs"][0] == "hung" else "crashed"})
        return out

    v = checks.check_faults(survivors(rp), survivors(rc), rp["records"])
    v.part = "killed"
    return v


def part_p(ctx: Ctx) -> Verdict:
    """Network time per peer (docs/network.md): 4 ranks on the Socket transport
    (each rank its own host, Job) with NCCL_ALGO=Ring NCCL_PROTO=Simple, the
    plugin in logging mode with proxy accounting (its default)."""
    world = 4
    ctx.part_end = min(ctx.part_end, time.monotonic() + 60)  # <= 60 s whatever the budget
    run = Job(ctx, "p-ring", "correctness", world, True, {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}).wait(ctx)
    failed = [r for r in run["results"] if r.get("error")]
    if failed or not run["results"]:
        return Verdict("p", "FAIL", [f"the ring job failed: {failed[:2] or run['rcs']}"])
    return checks.check_proxy(run["records"], world)


def run_world(run) -> int:
    return int(run["label"].split()[0])


def part_c(ctx: Ctx) -> Verdict:
    run = Job(ctx, "c-graph", "graph", 2, True).wait(ctx)
    r0 = next((r for r in run["results"] if r["rank"] == 0), None)
    if r0 is None or r0.get("error"):
        return Verdict("c", "FAIL", [f"the graph job failed: {(r0 or {}).get('error', run['rcs'])}"])
    v = checks.check_graphs(r0, run["records"])
    if not r0.get("result_ok"):
        v.status, v.lines = "FAIL", ["replayed results wrong", *v.lines]
    return v


# Part e's conditions: no plugin, then the plugin with each activation mask it can ask NCCL for
# (NCCL_EXPORTER_PROFILER_MASK, docs/plugin.md "The activation mask"): counts = Coll|P2p, gpu = +KernelCh
# (NCCL_EXPORTER_PROFILER_PROXY=0's mask), net = +ProxyOp|ProxyStep (the default)
COST_CONDITIONS = ("none", "counts", "gpu", "net")


def part_e(ctx: Ctx) -> Verdict:
    """Cost: the 2-rank job without the plugin and with each activation mask, in ABBA order
    (none counts gpu net net gpu counts none) while the part's time lasts, then the CPU benches."""
    rows: dict[str, list[float]] = {c: [] for c in COST_CONDITIONS}
    spreads, masks = [], {}
    dev = "?"
    longest = None  # s the slowest job took so far: another starts only if one more fits
    for cond in COST_CONDITIONS + COST_CONDITIONS[::-1]:
        if ctx.left() < 1.5 * (longest or 10.0) + 5:
            break
        t0 = time.monotonic()
        env = {"NCCL_EXPORTER_PROFILER_MASK": cond} if cond != "none" else None
        job = Job(ctx, f"e-{cond}-{len(rows[cond])}", "cost", 2, cond != "none", env, log=False)
        run = job.wait(ctx)
        longest = max(longest or 0.0, time.monotonic() - t0)
        r0 = next((r for r in run["results"] if r["rank"] == 0 and "p50_s" in r), None)
        if r0 is None:
            return Verdict("e", "FAIL", [f"the {cond} job failed: {run['results'] or run['rcs']}"])
        rows[cond].append(r0["p50_s"])
        dev = r0.get("device", dev)
        # the plugin's INFO line at its first init, in NCCL's debug file: the mask NCCL then had
        seen = sorted({m for f in job.dir.glob("nccl.*.log")
                       for m in re.findall(r"nccl-exporter profiler: v\d+, mask (0x[0-9a-f]+)", f.read_text())})
        if seen:
            masks[cond] = "/".join(seen)
        spreads.append(f"{cond}: p10 {r0['p10_s'] * 1e3:.3f} / p50 {r0['p50_s'] * 1e3:.3f} / "
                       f"p90 {r0['p90_s'] * 1e3:.3f} ms over {r0['iters']} iterations")
    asked = ", ".join(f"{c} (mask {masks.get(c, '?')})" for c in COST_CONDITIONS[1:])
    lines = [f"2 ranks on one {dev} (time-sliced: noisy), 1 MB AllReduce, median host time per iteration; "
             f"the plugin without its log (as under the agent) asking NCCL for {asked}",
             *checks.summarize_cost({c: v for c, v in rows.items() if v}), *spreads]
    for name, argv, limit in (
            ("plugin_cost", [sys.executable, str(REPO / "bench/plugin_cost.py"), "--no-agent", "--n", "50000",
                             "--reps", "3"], 40),
            ("training_loop", [sys.executable, str(REPO / "bench/training_loop.py"), "--conditions", "none,plugin",
                               "--reps", "2", "--iterations", "200"], 120)):
        if ctx.left() < 15:
            lines.append(f"{name}: not run (no time left)")
            continue
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=min(limit, ctx.left()), cwd=REPO)
            (ctx.work / f"e-{name}.out").write_text(p.stdout + p.stderr)
            tail = [l for l in (p.stdout + p.stderr).splitlines() if l.strip()][-8:]
            lines.append(f"{name} (rc {p.returncode}, {platform.node()}, {os.cpu_count()} CPUs):")
            lines += ["  " + l for l in tail]
        except subprocess.TimeoutExpired:
            lines.append(f"{name}: timed out")
    return Verdict("e", "INFO", lines)


def tracefs_append(path: Path, line: str) -> None:
    """One write with O_APPEND (Python's "a" mode seeks, which tracefs refuses)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def uprobe_facts(work: Path) -> str:
    """Can root attach a uprobe here? A tracefs uprobe on a tiny program, in a
    tracing instance of its own (nothing else's buffer is touched). 'ok' or why not."""
    tr = next((Path(p) for p in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
               if Path(p, "uprobe_events").exists()), None)
    if tr is None:
        subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"], capture_output=True)
        tr = Path("/sys/kernel/tracing") if Path("/sys/kernel/tracing/uprobe_events").exists() else None
    if tr is None:
        return "no tracefs with uprobe_events (kernel without CONFIG_UPROBE_EVENTS, or not mountable)"
    src = work / "probe_target.c"
    src.write_text("#include <stdio.h>\n#include <string.h>\n#include <stdint.h>\n"
                   "__attribute__((noinline)) int bench_gpu_target(int x) { return x + 1; }\n"
                   "int main(int c, char **v) {\n"
                   "  if (c > 1 && !strcmp(v[1], \"offset\")) {  /* file offset of the target */\n"
                   "    FILE *f = fopen(\"/proc/self/maps\", \"r\"); char l[512];"
                   " uintptr_t a = (uintptr_t)&bench_gpu_target;\n"
                   "    while (fgets(l, sizeof l, f)) { unsigned long s, e, o;"
                   " if (sscanf(l, \"%lx-%lx %*s %lx\", &s, &e, &o) == 3"
                   " && a >= s && a < e) { printf(\"0x%lx\\n\", a - s + o); return 0; } }\n    return 1; }\n"
                   "  volatile int s = 0; for (int i = 0; i < 5; i++) s += bench_gpu_target(i);"
                   " return s == 15 ? 0 : 2; }\n")
    exe = work / "probe_target"
    b = subprocess.run(["gcc", "-O0", "-o", str(exe), str(src)], capture_output=True, text=True)
    if b.returncode:
        return f"could not build the probe target: {b.stderr.strip()[:200]}"
    off = subprocess.run([str(exe), "offset"], capture_output=True, text=True).stdout.strip()
    inst = tr / "instances" / f"bench_gpu_{os.getpid()}"
    group = f"bench_gpu_{os.getpid()}"
    try:
        tracefs_append(tr / "uprobe_events", f"p:{group}/target {exe}:{off}\n")
    except OSError as e:
        return f"writing uprobe_events refused: {e.strerror}"
    try:
        inst.mkdir()
        (inst / "events" / group / "target" / "enable").write_text("1")
        subprocess.run([str(exe)], check=False)
        hits = (inst / "trace").read_text().count("target:")
        (inst / "events" / group / "target" / "enable").write_text("0")
        return "ok" if hits == 5 else f"the uprobe fired {hits} times for 5 calls"
    except OSError as e:
        return f"enabling the uprobe failed: {e.strerror}"
    finally:
        try:
            inst.rmdir()
        except OSError:
            pass
        try:
            tracefs_append(tr / "uprobe_events", f"-:{group}/target\n")
        except OSError:
            pass


def bpf_syscall_facts() -> str:
    """Can root create a BPF map (bpf(BPF_MAP_CREATE, array))? 'ok' or the errno."""
    nr = {"x86_64": 321, "aarch64": 280}.get(platform.machine())
    if nr is None:
        return f"unknown bpf syscall number on {platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 30)(2, 4, 8, 1)  # BPF_MAP_TYPE_ARRAY, key 4, value 8, 1 entry
    fd = libc.syscall(nr, 0, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd < 0:
        return f"bpf(BPF_MAP_CREATE) failed: {os.strerror(ctypes.get_errno())}"
    os.close(fd)
    return "ok"


def part_b(ctx: Ctx) -> Verdict:
    d = ctx.work / "b"
    d.mkdir()
    kernel = platform.release()
    facts = {"kernel": kernel, "btf": Path("/sys/kernel/btf/vmlinux").exists()}
    facts["uprobe"] = uprobe_facts(d)
    facts["bpf_syscall"] = bpf_syscall_facts()
    p = subprocess.run([sys.executable, "-c", "import bcc"], capture_output=True, text=True)
    facts["bcc"] = "ok" if p.returncode == 0 else \
        f"python module bcc missing ({(p.stderr.strip().splitlines() or ['?'])[-1][:120]}; Debian's python3-bpfcc)"
    hdr = Path(f"/lib/modules/{kernel}/build")
    facts["headers"] = "ok" if hdr.exists() or Path("/sys/kernel/kheaders.tar.xz").exists() else \
        f"no kernel headers ({hdr} and /sys/kernel/kheaders.tar.xz absent)"
    if facts["bcc"] != "ok":
        carried = bcc_from_debs(d)
        if carried is not None:
            facts["bcc"] = "ok (carried .debs)" if carried == "ok" else f"{facts['bcc']}; {carried}"
    p = subprocess.run([sys.executable, "-c", "import opentelemetry.sdk"], capture_output=True)
    (d / "facts.json").write_text(json.dumps(facts, indent=1))
    v = checks.check_agent_env(facts)
    v.lines.append(f"opentelemetry-sdk {'present' if p.returncode == 0 else 'absent'}")
    return v


def bcc_from_debs(work: Path) -> str | None:
    """Debian 12's BCC carried as .deb files (bench/gpu/debs/, ignored by git; see
    docs/plugin.md): unpacked under work/, then `import bcc` and one tiny BPF
    program compiled and loaded. None when no .deb is there, else 'ok' or why not."""
    debs = sorted((REPO / "bench" / "gpu" / "debs").glob("*.deb"))
    if not debs:
        return None
    root = work / "debroot"
    root.mkdir()
    for deb in debs:
        if shutil.which("dpkg-deb"):
            r = subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], capture_output=True, text=True)
        else:  # an ar archive holding data.tar.*
            tmp = work / f"ar-{deb.stem}"
            tmp.mkdir()
            r = subprocess.run(["sh", "-c", f"cd {tmp} && ar x {deb} && tar -xf data.tar.* -C {root}"],
                               capture_output=True, text=True)
        if r.returncode:
            return f"cannot unpack {deb.name}: {(r.stderr.strip().splitlines() or ['?'])[-1][:150]}"
    arch = f"{platform.machine()}-linux-gnu"
    env = dict(os.environ, PYTHONPATH=str(root / "usr/lib/python3/dist-packages"),
               LD_LIBRARY_PATH=":".join(str(p) for p in (root / "usr/lib" / arch,
                                                          root / "usr/lib" / arch / "llvm-14/lib")))
    prog = ("import bcc; b = bcc.BPF(text='int probe(void *ctx) { return 0; }'); "
            "b.attach_uprobe(name='c', sym='getpid', fn_name='probe'); print('loaded')")
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, env=env, timeout=120)
    (work / "bcc-from-debs.out").write_text(p.stdout + p.stderr)
    if "loaded" in p.stdout:
        return "ok"
    return "carried BCC: " + ((p.stderr.strip().splitlines() or ["no output"])[-1][:200])


PARTS = {"a": part_a, "d": part_d, "c": part_c, "e": part_e, "b": part_b, "p": part_p}
NEEDS_TORCH = {"c", "e"}


def pack(ctx: Ctx, part: str) -> None:
    """The part's logs into OUT/part-<x>.tar.gz (few files come back from a device run)."""
    items = [p for p in ctx.work.iterdir() if p.name.startswith(f"{part}-") or p.name == part]
    if not items:
        return
    with tarfile.open(ctx.out / f"part-{part}.tar.gz", "w:gz") as t:
        for p in items:
            t.add(p, arcname=p.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu/run.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench-gpu-out",
                    help="where the verdicts and the packed logs go (default $OUT, else ./bench-gpu-out)")
    ap.add_argument("--parts", default="adceb", help="parts to run, in this order (default adceb)")
    ap.add_argument("--budget-s", type=float, default=240, help="wall time for all parts (default 240)")
    ap.add_argument("--simulate", action="store_true",
                    help="no GPU: parts a and d's straggler on the simulator's GPU-like mode, part b's kernel "
                         "checks; c, e skipped")
    ap.add_argument("--proxy", action="store_true",
                    help="only part p (network time per peer: real ProxyOp/ProxyStep events on the Socket "
                         "transport, ring AllReduce bytes and phases; <= 60 s); the same as --parts p")
    a = ap.parse_args(argv)
    if a.proxy:
        a.parts = "p"
    if set(a.parts) - set(PARTS):
        ap.error(f"unknown part(s) {''.join(sorted(set(a.parts) - set(PARTS)))}: choose from adcebp")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    ctx = Ctx(out, work, a.budget_s, a.simulate)
    vfile = out / "verdicts.txt"
    vfile.write_text("")
    verdicts: list[Verdict] = []

    def record(v: Verdict) -> None:
        verdicts.append(v)
        with open(vfile, "a") as f:
            f.write(v.text() + "\n")
        print(v.text(), flush=True)

    try:
        ctx.plugin = build_plugin(work)
        if a.simulate:
            from exporter.simulator.build import build_library
            ctx.lib = build_library(work / "simlib")
    except Exception as e:  # noqa: BLE001 - any failure to build is the setup's verdict
        msg = getattr(e, "stderr", "") or str(e)
        record(Verdict("setup", "ERROR", [f"cannot build: {msg.strip()[:300]}"]))
        a.parts = ""
    for i, part in enumerate(a.parts):
        if a.simulate and part in NEEDS_TORCH:
            record(Verdict(part, "SKIP", ["needs torch on a GPU (--simulate); its checks are unit-tested"]))
            continue
        # this part's share of the time left: what earlier parts did not use is shared out
        left = ctx.t_end - time.monotonic()
        shares = sum(SHARES[p] for p in a.parts[i:] if not (a.simulate and p in NEEDS_TORCH))
        if left < MIN_PART_S:
            record(Verdict(part, "SKIP", [f"no time left ({max(0.0, left):.0f} s of --budget-s)"]))
            continue
        ctx.part_end = time.monotonic() + left * SHARES[part] / shares
        log(f"part {part}: {ctx.left():.0f} s")
        t0 = time.monotonic()
        try:
            v = PARTS[part](ctx)
            if time.monotonic() >= ctx.part_end and v.status == "PASS":
                v.status = "TIMEOUT"
        except Exception as e:  # noqa: BLE001 - a part's failure is its verdict; the next part runs
            (work / f"{part}-error.txt").write_text(traceback.format_exc())
            v = Verdict(part, "ERROR", [f"{type(e).__name__}: {e}"])
        v.lines.append(f"({time.monotonic() - t0:.0f} s)")
        record(v)
        pack(ctx, part)
    line = checks.final_line(verdicts)
    with open(vfile, "a") as f:
        f.write(line + "\n")
    print(line, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 1 if line.startswith("bench/gpu verdict: FAIL") else 0


if __name__ == "__main__":
    sys.exit(main())

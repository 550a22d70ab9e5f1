#!/usr/bin/env python3
"""What the NCCL probes add to one ncclAllReduce call, measured in one run.

Run as root from the repository root:

    .venv/bin/python bench/probe_overhead.py [--calls N] [--reps R] [--lib PATH]

Configurations, each timed by bench/driver.c (N calls in a tight loop,
CLOCK_MONOTONIC), R repetitions interleaved in a rotating order, median kept:

  bare     no probe on the library
  empty    one uprobe + uretprobe on ncclAllReduce whose BPF programs
           `return 0` (the floor: the cost of the breakpoint trap itself),
           attached as BCC's perf events
  empty-link  the same pair attached as uprobe_multi links, as the
           product's are (like with like: the kernel's dispatch to a link's
           program differs from a perf event's)
  entry-link  the empty entry program alone, as a link: what a return
           probe costs, (empty-link - entry-link)
  product  NcclProbes().attach(lib): the exporter's probe set (all functions)

Then the agent itself (`nccl-exporter run --nccl-lib LIB`) in a subprocess,
scraped once a second while the driver makes --agent-calls calls: its
user+system CPU time from /proc/<pid>/stat, per million calls, next to an
idle window of the same length (no calls, same scrapes).

Uprobes belong to a file (inode), not to a path: every configuration gets
its own private copy of the library in a temporary directory, so the probes
of one never fire in another, and calls made by other programs on this host
through the original library are not counted here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DRIVER_SRC = Path(__file__).resolve().parent / "driver.c"
REAL_NCCL = REPO / ".venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"
EXPORTER = REPO / ".venv/bin/nccl-exporter"
TARGET = "ncclAllReduce"
OP = "ALL_REDUCE"
TARGET_RATIO = 1.15

EMPTY_BPF = """
int empty_entry(struct pt_regs *ctx) { return 0; }
int empty_return(struct pt_regs *ctx) { return 0; }
"""


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- set-up -----------------------------------------------------------------

def pick_library(arg: str | None) -> tuple[Path, str]:
    """(library, driver mode): the real NCCL when installed, else the simulator."""
    if arg:
        lib = Path(arg).resolve()
        if not lib.is_file():
            raise BenchError(f"--lib {arg}: no such file")
        return lib, ("comm" if is_simulator(lib) else "null")
    if REAL_NCCL.is_file():
        return REAL_NCCL, "null"
    from exporter.simulator.build import build_library

    return build_library(), "comm"


def is_simulator(lib: Path) -> bool:
    """The simulated libnccl (small, reads NCCL_SIM_* settings)."""
    if lib.stat().st_size > 64 << 20:
        return False
    return b"NCCL_SIM_ADDR" in lib.read_bytes()


def build_driver(workdir: Path) -> Path:
    exe = workdir / "driver"
    cmd = ["gcc", "-O2", "-Wall", "-o", str(exe), str(DRIVER_SRC), "-ldl"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise BenchError("gcc not found (apt-get install gcc)") from None
    if proc.returncode != 0:
        raise BenchError(f"gcc failed on {DRIVER_SRC}:\n{proc.stderr}")
    return exe


def private_copy(lib: Path, workdir: Path, name: str) -> Path:
    """lib copied to workdir/name/libnccl.so.2: a file (inode) of its own."""
    d = workdir / name
    d.mkdir()
    dst = d / "libnccl.so.2"
    shutil.copyfile(lib, dst)
    os.chmod(dst, 0o755)
    return dst


PIN_CPU: int | None = None  # --cpu: the driver runs on this CPU only


def run_driver(driver: Path, lib: Path, calls: int, mode: str, timeout: float = 600) -> dict:
    """One driver run (pinned to PIN_CPU: unpinned, the per-call time is
    bimodal as the scheduler moves it); its result line as a dict."""
    env = dict(os.environ)
    env.pop("DRIVER_WAIT", None)
    env.pop("NCCL_SIM_TRUTH", None)  # the simulator would write a line per call
    pin = None if PIN_CPU is None else (lambda: os.sched_setaffinity(0, {PIN_CPU}))
    proc = subprocess.run([str(driver), str(lib), str(calls), mode], preexec_fn=pin,
                          capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise BenchError(f"driver failed (rc={proc.returncode}): {proc.stderr.strip()}")
    out = proc.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in out.split())
    return {"ns": float(fields["ns_per_call"]), "calls": int(fields["calls"]),
            "result": int(fields["result"])}


def function_address(lib: Path, function: str) -> int:
    from exporter.sources.nccl.elf import exported_functions

    exported = exported_functions(str(lib))
    addr = exported.get(function, exported.get("p" + function))
    if addr is None:
        raise BenchError(f"{lib} does not export {function}")
    return addr


def product_calls(probes, op_name: str = OP) -> tuple[int, int]:
    """(calls, errors) of op_name counted in the product's maps."""
    from exporter.sources.nccl.maps import NcclReader

    reader = NcclReader(probes)
    calls = sum(s.calls for s in reader.series() if s.op == op_name)
    errors = sum(n for (op, _result), n in reader.errors().items() if op == op_name)
    return calls, errors


# --- the agent ----------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def counted(text: str, op_name: str = OP) -> tuple[int, int]:
    """(calls, errors) of op_name in a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    from exporter.records import metrics

    calls = errors = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("op") != op_name:
                continue
            if s.name == metrics.COLLECTIVE_DURATION + "_count":
                calls += s.value
            elif s.name == metrics.CALL_ERRORS:
                errors += s.value
    return int(calls), int(errors)


class Scraper(threading.Thread):
    """GET /metrics once a second, as Prometheus would."""

    def __init__(self, url: str, period: float = 1.0):
        super().__init__(daemon=True)
        self.url, self.period = url, period
        self.stop = threading.Event()
        self.count = 0
        self.failures = 0

    def run(self):
        while not self.stop.wait(self.period):
            try:
                scrape(self.url)
                self.count += 1
            except OSError:
                self.failures += 1


class Agent:
    """`nccl-exporter run` in a subprocess, stopped (and waited for) on close."""

    def __init__(self, lib: Path, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.log = open(log_path, "w+")
        cmd = [str(EXPORTER), "run", "--listen", f"127.0.0.1:{self.port}",
               "--nccl-lib", str(lib), "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"the agent exited (rc={self.proc.returncode}):\n{self.output()}")
            self.log.flush()
            if "metrics at" in Path(self.log.name).read_text():
                scrape(self.url)
                return
            time.sleep(0.2)
        raise BenchError(f"the agent was not ready after {timeout:.0f} s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text()[-3000:]

    def signal_stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def close(self, timeout: float = 90) -> None:
        self.signal_stop()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log(f"agent pid {self.proc.pid} did not stop in {timeout:.0f} s: SIGKILL")
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# --- the benchmark ----------------------------------------------------------

def measure_probes(args, driver, libs, mode, product, empty_bpf, results, checks):
    """R interleaved repetitions of bare / empty / product."""
    order = ["bare", "empty", "empty-link", "entry-link", "product"]
    for rep in range(args.reps):
        k = rep % len(order)
        for config in order[k:] + order[:k]:
            before = product_calls(product) if config == "product" else None
            r = run_driver(driver, libs[config], args.calls, mode)
            results[config].append(r["ns"])
            if config == "product":
                after = product_calls(product)
                checks.append((rep, r["calls"], after[0] - before[0], after[1] - before[1], r["result"]))
        log(f"  rep {rep + 1}/{args.reps}: " + "  ".join(
            f"{c} {results[c][-1]:8.1f}" for c in order) + "  ns/call")
    for rep, made, seen, errors, result in checks:
        if seen != made:
            raise BenchError(
                f"the product's probes counted {seen} {TARGET} calls in repetition {rep + 1}, "
                f"the driver made {made}: the probes did not fire, nothing was measured")
        if result != 0 and errors != made:
            raise BenchError(f"repetition {rep + 1}: {errors} errors counted, {made} failing calls made")


def measure_agent(args, driver, lib, mode, workdir, agent_box):
    log(f"agent: starting nccl-exporter run on {lib}")
    agent = Agent(lib, workdir / "agent.log")
    agent_box.append(agent)
    agent.wait_ready()
    # Idle window: the same scrapes, no calls (what the agent costs anyway).
    scraper = Scraper(agent.url)
    scraper.start()
    c0, t0 = cpu_seconds(agent.proc.pid), time.monotonic()
    r = run_driver(driver, lib, args.agent_calls, mode)
    scrape(agent.url)
    text = scrape(agent.url)
    c1, t1 = cpu_seconds(agent.proc.pid), time.monotonic()
    busy_scrapes = scraper.count + 2
    scraper.stop.set()
    scraper.join()
    calls, errors = counted(text)
    log(f"agent: {r['calls']} calls in {t1 - t0:.1f} s, {c1 - c0:.3f} CPU s; idle window next")
    idle = Scraper(agent.url)
    idle.start()
    c2, t2 = cpu_seconds(agent.proc.pid), time.monotonic()
    time.sleep(t1 - t0)
    scrape(agent.url)
    scrape(agent.url)
    c3, t3 = cpu_seconds(agent.proc.pid), time.monotonic()
    idle.stop.set()
    idle.join()
    if calls != r["calls"]:
        raise BenchError(f"the agent counted {calls} {OP} calls, the driver made {r['calls']}: "
                         "its probes did not fire, nothing was measured")
    if r["result"] != 0 and errors != r["calls"]:
        raise BenchError(f"the agent counted {errors} {OP} errors, the driver made {r['calls']} failing calls")
    return {
        "calls": r["calls"], "counted": calls, "errors": errors, "ns": r["ns"],
        "wall": t1 - t0, "cpu": c1 - c0, "scrapes": busy_scrapes,
        "idle_wall": t3 - t2, "idle_cpu": c3 - c2, "idle_scrapes": idle.count + 2,
    }


def report(args, lib, mode, results, checks, agent):
    med = {c: statistics.median(v) for c, v in results.items()}
    lo = {c: min(v) for c, v in results.items()}
    hi = {c: max(v) for c, v in results.items()}
    a, b, c = med["bare"], med["empty"], med["product"]
    print()
    print(f"library: {lib} ({'1-rank communicator' if mode == 'comm' else 'NULL communicator: ncclInvalidArgument'})")
    print(f"{TARGET}: {args.calls} calls per run, median of {args.reps} interleaved runs "
          f"(min..max in brackets), driver {'not pinned' if PIN_CPU is None else f'pinned to CPU {PIN_CPU}'}")
    print()
    print(f"  {'configuration':<52} {'ns/call':>9} {'over bare':>10}   range")
    rows = [("(a) bare call", "bare"), ("(b) empty uprobe+uretprobe", "empty"),
            ("(b') the same, uprobe_multi links", "empty-link"),
            ("(b'') the empty entry link alone (no return probe)", "entry-link"), ("(c) product probes", "product")]
    for title, key in rows:
        print(f"  {title:<52} {med[key]:9.1f} {med[key] - a:10.1f}   [{lo[key]:.1f}..{hi[key]:.1f}]")
    ratio = c / b
    added = (c - a) / (b - a) if b > a else float("nan")
    print()
    print(f"  per-call time   (c)/(b)          = {ratio:.3f}   target <= {TARGET_RATIO:.2f}: "
          f"{'MET' if ratio <= TARGET_RATIO else 'MISSED'}")
    print(f"  per-call time   (c)/(b')         = {c / med['empty-link']:.3f}   (the empty pair as links)")
    print(f"  probe-added     (c-a)/(b-a)      = {added:.3f}")
    print(f"  BPF programs' own cost (c-b)     = {c - b:.1f} ns/call")
    print(f"  a return probe's cost (b')-(b'') = {med['empty-link'] - med['entry-link']:.1f} ns/call "
          "(what dropping the product's return probe would save, at most)")
    total = sum(made for _r, made, _s, _e, _res in checks)
    print(f"  calls counted by the product probes: {sum(s for _r, _m, s, _e, _res in checks)} "
          f"of {total} made (errors {sum(e for *_x, e, _res in checks)})")
    if agent:
        per_m = agent["cpu"] / agent["calls"] * 1e6
        idle_rate = agent["idle_cpu"] / agent["idle_wall"]
        busy_rate = agent["cpu"] / agent["wall"]
        extra = max(0.0, agent["cpu"] - idle_rate * agent["wall"]) / agent["calls"] * 1e6
        print()
        print(f"  agent (nccl-exporter run, scraped every 1 s), {agent['calls']} calls at "
              f"{agent['ns']:.0f} ns/call in {agent['wall']:.1f} s:")
        print(f"    counted by the agent: {agent['counted']} {OP} calls "
              f"({agent['errors']} errors) of {agent['calls']} made: OK")
        print(f"    CPU while calls ran : {agent['cpu']:.3f} s in {agent['wall']:.1f} s "
              f"({busy_rate * 100:.2f} % of a core, {agent['scrapes']} scrapes)")
        print(f"    CPU idle, same scrapes: {agent['idle_cpu']:.3f} s in {agent['idle_wall']:.1f} s "
              f"({idle_rate * 100:.2f} % of a core, {agent['idle_scrapes']} scrapes)")
        print(f"    CPU s per 1 M calls : {per_m:.3f} (all of it); "
              f"{extra:.3f} above the idle rate")
    print()
    print("summary")
    print(f"  {'bare ns/call':>14} {'empty ns/call':>14} {'empty-link ns':>14} {'product ns/call':>16} {'c/b':>7} "
          f"{'c/b_link':>9} {'(c-a)/(b-a)':>12} {'agent CPU s/1M':>15}")
    print(f"  {a:14.1f} {b:14.1f} {med['empty-link']:14.1f} {c:16.1f} {ratio:7.3f} {c / med['empty-link']:9.3f} "
          f"{added:12.3f} "
          f"{(agent['cpu'] / agent['calls'] * 1e6 if agent else float('nan')):15.3f}")
    return ratio


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200_000, help="calls per timed run (default 200000)")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions (default 7)")
    p.add_argument("--lib", help="libnccl.so.2 to use (default: the real NCCL in .venv, "
                                 "else the simulator)")
    p.add_argument("--agent-calls", type=int, default=0,
                   help="calls made while the agent runs (default 10 x --calls)")
    p.add_argument("--cpu", type=int, default=max(os.sched_getaffinity(0)),
                   help="CPU the driver is pinned to (default: the highest; -1: not pinned)")
    p.add_argument("--no-agent", action="store_true", help="skip the agent CPU measurement")
    args = p.parse_args(argv)
    if args.calls <= 0 or args.reps <= 0:
        p.error("--calls and --reps must be > 0")
    args.agent_calls = args.agent_calls or 10 * args.calls
    global PIN_CPU
    PIN_CPU = None if args.cpu < 0 else args.cpu
    if os.geteuid() != 0:
        log("probe_overhead: run as root (uprobes need CAP_BPF/CAP_PERFMON)")
        return 2

    # SIGTERM/SIGHUP unwind like Ctrl-C, through the clean-up below.
    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)

    workdir = Path(tempfile.mkdtemp(prefix="nccl-probe-bench."))
    product = empty_bpf = None
    empty_fds: list[int] = []  # the empty pair's uprobe_multi programs and links
    agent_box: list[Agent] = []
    rc = 1
    try:
        lib, mode = pick_library(args.lib)
        log(f"library {lib} (driver mode: {mode}); work dir {workdir}")
        driver = build_driver(workdir)
        libs = {name: private_copy(lib, workdir, name)
                for name in ("bare", "empty", "empty-link", "entry-link", "product", "agent")}
        first = run_driver(driver, libs["bare"], 1000, mode)
        log(f"driver check: {TARGET} -> result {first['result']}, {first['ns']:.1f} ns/call")

        from bcc import BPF

        from exporter.sources.nccl.probes import NcclProbes

        empty_bpf = BPF(text=EMPTY_BPF)
        addr = function_address(libs["empty"], TARGET)
        empty_bpf.attach_uprobe(name=str(libs["empty"]), addr=addr, fn_name="empty_entry")
        empty_bpf.attach_uretprobe(name=str(libs["empty"]), addr=addr, fn_name="empty_return")
        from exporter.sources import uprobe_multi
        from exporter.sources.nccl.elf import vaddrs_to_offsets

        offset = vaddrs_to_offsets(str(libs["empty-link"]), [function_address(libs["empty-link"], TARGET)])
        for fn, ret in (("empty_return", True), ("empty_entry", False)):
            prog = uprobe_multi.load(empty_bpf, fn)
            empty_fds.append(prog)
            empty_fds.append(uprobe_multi.attach(prog, str(libs["empty-link"]), offset, retprobe=ret))
        # What a return probe costs: the entry program alone, as a link.
        entry_offset = vaddrs_to_offsets(str(libs["entry-link"]), [function_address(libs["entry-link"], TARGET)])
        empty_fds.append(uprobe_multi.attach(empty_fds[-2], str(libs["entry-link"]), entry_offset, retprobe=False))
        product = NcclProbes()
        rep = product.attach(str(libs["product"]))
        if TARGET not in rep.attached:
            raise BenchError(f"the product did not attach {TARGET}: failed={rep.failed} missing={rep.missing}")
        log(f"product: {len(rep.attached)} functions probed ({len(rep.aliases)} aliases)")

        results = {"bare": [], "empty": [], "empty-link": [], "entry-link": [], "product": []}
        checks: list = []
        measure_probes(args, driver, libs, mode, product, empty_bpf, results, checks)
        agent = None if args.no_agent else measure_agent(args, driver, libs["agent"], mode, workdir, agent_box)
        report(args, lib, mode, results, checks, agent)
        rc = 0
    except BenchError as e:
        log(f"probe_overhead: FAILED: {e}")
        rc = 1
    except KeyboardInterrupt:
        log("probe_overhead: interrupted, cleaning up")
        rc = 130
    finally:
        # Detaching a uprobe takes ~0.3 s in the kernel: stop the agent and
        # detach ours at the same time.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for agent in agent_box:
            agent.signal_stop()
        if product is not None or empty_bpf is not None:
            log("cleaning up: detaching the probes (~0.3 s per probe in the kernel)")
        for fd in reversed(empty_fds):
            os.close(fd)
        for bpf_owner in (empty_bpf, product):
            if bpf_owner is None:
                continue
            try:
                if hasattr(bpf_owner, "close"):
                    bpf_owner.close()
                else:
                    bpf_owner.cleanup()
            except Exception as e:  # noqa: BLE001 - keep cleaning
                log(f"clean-up: {e}")
        for agent in agent_box:
            agent.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())

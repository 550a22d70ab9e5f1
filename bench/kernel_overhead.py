#!/usr/bin/env python3
"""What the kernel-side probes (tracepoints of bpf/nccl.c, tcp.c, sched.c)
cost the rest of the node, measured in one run.

Run as root from the repository root (under 2 minutes):

    .venv/bin/python bench/kernel_overhead.py [--seconds S] [--reps R]

The three programs (NcclProbes, TcpSource, SchedSource) are loaded once (no NCCL library attached: the
uprobes play no part here). Two workloads, a small C program (compiled here
with gcc) that forks a pair of processes:

  tcp   loopback TCP bulk transfer, 256 KiB writes         -> bytes/s
  pipe  1-byte ping-pong over two pipes (context switches)  -> round trips/s

each timed for S seconds in three conditions, R repetitions interleaved in a
rotating order, median kept:

  off       the program's tracepoints detached (loaded, not running)
  floor     empty programs (`return 0`) on the same tracepoints, raw where
            the product's are raw: what running any BPF program there costs
            on this kernel and CPU, the floor the product is measured against
  idle      the agent between jobs (`run --idle-detach`): no process
            traced, so the scheduler and socket tracepoints that run for
            every task are detached (set_hot(False)); the rest attached
  untraced  `run` as it ships, in a job's steady state (`--sched totals`:
            bpf/sched.c detached, the scheduler read from /proc; tcp_probe
            attached in its srtt windows only, `--srtt-sampling 250ms/5s`;
            the send/recv tracepoints that learn socket owners detached, as
            `--owner-window` leaves them once no new socket has appeared);
            the workload is NOT traced: the node's other traffic while a
            job runs
  traced    the same, both processes traced (trace_process), and the
            agent's /proc read of their threads (SchedTotals.poll) once a
            second meanwhile, as `run` does
  traced-window
            `traced` inside an owner window (a job's first seconds, and a
            few seconds after each connection it accepts): the send/recv
            tracepoints attached
  untraced-waits, traced-waits
            the same with `--sched waits`: bpf/sched.c's raw tracepoints at
            every context switch and wakeup (one bitmap test per event for
            untraced tasks; the full work for traced ones)

Ratios are condition / off (1.00 = no cost; < 1 slower). The machine may be
shared: look at the spread (min..max of the R runs) before believing a digit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.sources.bpf import set_tracepoint
from exporter.sources.schedstat import POLL_INTERVAL_S
from exporter.agent.config import Config

SRTT_SAMPLING = Config().srtt_sampling  # tcp_probe's window and period in `run` (its default)

WORKLOAD_C = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void go(pid_t child) {           /* pids out, then wait for a line */
  printf("%d %d\n", getpid(), child); fflush(stdout);
  char line[16];
  if (!fgets(line, sizeof line, stdin)) exit(2);
}

int main(int argc, char **argv) {
  if (argc < 3) return 2;
  double secs = atof(argv[2]);
  if (!strcmp(argv[1], "pipe")) {
    int a[2], b[2]; char c = 'x';
    if (pipe(a) || pipe(b)) return 1;
    pid_t pid = fork();
    if (pid == 0) {
      close(a[1]); close(b[0]);
      while (read(a[0], &c, 1) == 1) if (write(b[1], &c, 1) != 1) break;
      _exit(0);
    }
    close(a[0]); close(b[1]);
    go(pid);
    long n = 0; double t0 = now(), t = t0;
    for (;;) {
      if (write(a[1], &c, 1) != 1 || read(b[0], &c, 1) != 1) return 1;
      if ((++n & 255) == 0 && (t = now()) - t0 >= secs) break;
    }
    close(a[1]); waitpid(pid, NULL, 0);
    printf("%.1f\n", n / (t - t0));
    return 0;
  }
  /* tcp */
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t sl = sizeof sa;
  if (bind(lfd, (void *)&sa, sl) || listen(lfd, 1) || getsockname(lfd, (void *)&sa, &sl)) return 1;
  static char buf[256 * 1024];
  pid_t pid = fork();
  if (pid == 0) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, (void *)&sa, sizeof sa)) _exit(1);
    while (read(fd, buf, sizeof buf) > 0) {}
    _exit(0);
  }
  int fd = accept(lfd, NULL, NULL);
  if (fd < 0) return 1;
  go(pid);
  long bytes = 0; double t0 = now(), t = t0;
  for (;;) {
    ssize_t w = write(fd, buf, sizeof buf);
    if (w <= 0) return 1;
    bytes += w;
    if ((t = now()) - t0 >= secs) break;
  }
  close(fd); waitpid(pid, NULL, 0);
  printf("%.1f\n", bytes / (t - t0));
  return 0;
}
"""

CONDITIONS = ("off", "floor", "idle", "untraced", "traced", "traced-window", "untraced-waits", "traced-waits")
CPU = os.cpu_count() - 1
WORKLOADS = {"tcp": "bytes/s", "pipe": "round trips/s"}


def build(tmp: Path) -> Path:
    if shutil.which("gcc") is None:
        sys.exit("gcc is needed")
    src, exe = tmp / "kbench.c", tmp / "kbench"
    src.write_text(WORKLOAD_C)
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(src)], check=True)
    return exe


def _name(tp) -> str:
    return tp.decode() if isinstance(tp, bytes) else tp


class Switch:
    """Detach / re-attach every tracepoint (classic and raw) the loaded
    programs attached at load (set_tracepoint: idempotent, BCC's names)."""

    def __init__(self, programs):
        # (bpf, tracepoint ("cat:name", or a bare name: raw), function or None: BCC's)
        self.tps = [(p.bpf, _name(tp), None) for p in programs
                    for tp in [*p.bpf.tracepoint_fds, *p.bpf.raw_tracepoint_fds]]

    def set(self, on: bool) -> None:
        for bpf, tp, fn in self.tps:
            set_tracepoint(bpf, tp, on, fn)


class Floor:
    """Empty programs on the product's tracepoints, of the same kinds (loaded detached)."""

    def __init__(self, switch: Switch):
        from bcc import BPF

        # Not named tracepoint__*: BCC would attach those at load.
        self.bpf = BPF(text="".join(f"int floor{i}(void *ctx) {{ return 0; }}\n"
                                    for i in range(len(switch.tps))))
        self.switch = Switch([])
        self.switch.tps = [(self.bpf, tp, f"floor{i}") for i, (_, tp, _) in enumerate(switch.tps)]


def run_once(exe: Path, workload: str, seconds: float, probes, traced: bool, totals=None) -> float:
    # Both processes on one CPU: every round trip is two context switches,
    # and the spread from where the scheduler puts them is gone.
    p = subprocess.Popen(["taskset", "-c", str(CPU), str(exe), workload, str(seconds)],
                         stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in p.stdout.readline().split()]
    if traced:
        for pid in pids:
            probes.trace_process(pid, None)
    p.stdin.write("go\n")
    p.stdin.flush()
    if totals is not None:  # the agent's read of the traced threads, once a second
        while p.poll() is None:
            totals.poll()
            time.sleep(min(POLL_INTERVAL_S, seconds / 2))
    out, _ = p.communicate(timeout=seconds + 30)
    if p.returncode != 0:
        raise RuntimeError(f"{workload} workload failed (rc={p.returncode})")
    return float(out.split()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=0.5, help="per run (default 0.5)")
    ap.add_argument("--reps", type=int, default=15, help="runs per condition (default 15)")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("run as root (BPF)")
    from exporter.sources.nccl.probes import NcclProbes
    from exporter.sources.nccl.maps import NcclReader
    from exporter.sources.sched import SchedSource
    from exporter.sources.schedstat import SchedTotals
    from exporter.sources.tcp import TcpSource

    with tempfile.TemporaryDirectory(prefix="kbench-") as d:
        exe = build(Path(d))
        t = time.monotonic()
        probes = NcclProbes()
        tcp, sched = TcpSource(), SchedSource()
        programs = [probes, tcp, sched]
        t_load = time.monotonic() - t
        reader = NcclReader(probes)
        totals = SchedTotals(reader.traced_pids, reader.call_threads)
        sw = Switch(programs)
        floor = Floor(sw)
        print(f"programs loaded in {t_load:.1f} s; tracepoints: "
              + ", ".join(sorted(tp if ":" in tp else f"raw {tp}" for _, tp, _ in sw.tps)))
        results = {w: {c: [] for c in CONDITIONS} for w in WORKLOADS}
        n = len(CONDITIONS)
        try:
            for rep in range(a.reps):
                for w in WORKLOADS:
                    order = CONDITIONS[rep % n:] + CONDITIONS[:rep % n]
                    for cond in order:
                        attached = cond not in ("off", "floor")
                        sw.set(attached)
                        if attached:  # the HOT_TRACEPOINTS of each
                            tcp.set_hot(cond != "idle")
                            sched.set_hot(cond.endswith("-waits"))
                            tcp.srtt_duty(time.monotonic(), *SRTT_SAMPLING)  # as `run` does
                            for tp in tcp.OWNER_TRACEPOINTS:  # attached only in an owner window
                                set_tracepoint(tcp.bpf, tp, cond == "traced-window")
                        floor.switch.set(cond == "floor")
                        traced = cond.startswith("traced")
                        results[w][cond].append(run_once(exe, w, a.seconds, probes, traced,
                                                         totals if cond in ("traced", "traced-window") else None))
        finally:
            floor.switch.set(False)
            floor.bpf.cleanup()
            sw.set(True)
            for program in reversed(programs):
                program.close()

    print(f"\n{a.reps} runs x {a.seconds:g} s per condition, interleaved; median (min..max);"
          " ratio: median of each run over the `off` run of its round (1.000 = no cost)")
    for w, unit in WORKLOADS.items():
        for cond in CONDITIONS:
            vals = results[w][cond]
            ratio = statistics.median(v / o for v, o in zip(vals, results[w]["off"]))
            print(f"  {w:5s} {cond:14s} {statistics.median(vals):14.4g} {unit:14s} "
                  f"({min(vals):.4g}..{max(vals):.4g})  ratio {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

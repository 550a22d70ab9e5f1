"""Where the kernel side's time goes: run count and run time of each BPF
program a process holds, from the kernel's own statistics.

`sysctl kernel.bpf_stats_enabled=1` makes the kernel time every BPF program
run (two clock reads per run, so the figures include that); each program fd's
/proc/PID/fdinfo then carries run_time_ns and run_cnt. Names come from
`bpftool prog show` (Debian package bpftool, installed by `make deps`).
The entry cost of a uprobe (a trap) or a tracepoint is not in these figures,
only the programs' own instructions, helpers and map lookups.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


class BpfStats:
    """`with BpfStats():` turns the kernel's BPF run statistics on, and back to what they were."""

    def __enter__(self):
        self.was = STATS.read_text().strip()
        STATS.write_text("1")
        return self

    def __exit__(self, *exc):
        STATS.write_text(self.was)


def program_times(pid: int) -> dict[int, tuple[int, int]]:
    """prog id -> (run_time_ns, run_cnt) for each BPF program fd of process `pid`."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "bpf-prog" not in os.readlink(f"/proc/{pid}/fd/{fd}"):
                continue
            info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        d = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        out[int(d["prog_id"])] = (int(d.get("run_time_ns", 0)), int(d.get("run_cnt", 0)))
    return out


def program_names() -> dict[int, str]:
    """prog id -> name, from bpftool ({} without it)."""
    if not shutil.which("bpftool"):
        return {}
    res = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True)
    try:
        return {p["id"]: p.get("name", "?") for p in json.loads(res.stdout or "[]")}
    except (ValueError, KeyError, TypeError):
        return {}


def difference(before: dict, after: dict) -> dict[int, tuple[int, int]]:
    """Per program: (run_time_ns, run_cnt) between two program_times() snapshots."""
    return {pid: (t - before.get(pid, (0, 0))[0], n - before.get(pid, (0, 0))[1])
            for pid, (t, n) in after.items()}


def table(totals: dict[str, tuple[int, int]], per: float, per_name: str) -> list[str]:
    """Lines from program name -> (run_time_ns, run_cnt): each program that ran, most
    time first, its runs and µs per `per_name`."""
    rows = sorted(((t, n, name) for name, (t, n) in totals.items() if n), reverse=True)
    lines = [f"  {'program':40s} {'runs/' + per_name:>14s} {'ns/run':>8s} {'us/' + per_name:>10s}"]
    lines += [f"  {name[:40]:40s} {n / per:14.1f} {t / n:8.0f} {t / per / 1e3:10.2f}" for t, n, name in rows]
    total = sum(t for t, _, _ in rows)
    lines.append(f"  {'all programs':40s} {'':14s} {'':8s} {total / per / 1e3:10.2f}")
    return lines

"""The network namespaces under a simulated cluster: the `ip` commands, the
removal of namespaces whose creator is dead (cleanup_stale), and the steering
of each device's received packets to one CPU. The names are
``ncclsim-<creator pid>-<seq>-{sw,h<i>}`` (cluster.py says why)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

PREFIX = "ncclsim-"
NETNS_DIR = pathlib.Path("/run/netns")


def _run(argv: list[str], check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:  # noqa: A002 - subprocess.run's name
    p = subprocess.run(argv, capture_output=True, text=True, input=input)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {p.stderr.strip() or p.stdout.strip()} (rc={p.returncode})")
    return p


def _netns_list() -> list[str]:
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    p = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _kill_netns_procs(ns: str) -> None:
    for _ in range(3):
        pids = [p for p in _netns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _del_netns(ns: str) -> bool:
    _kill_netns_procs(ns)
    p = _run(["ip", "netns", "del", ns], check=False)
    return p.returncode == 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def cleanup_stale() -> list[str]:
    """Delete namespaces (and their processes) left by creators that are dead."""
    removed = []
    for ns in _netns_list():
        if not ns.startswith(PREFIX):
            continue
        try:
            pid = int(ns[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid() or _pid_alive(pid):
            continue
        if _del_netns(ns):
            removed.append(ns)
    return removed


def _cpu_mask(cpu: int) -> str:
    """One CPU as sysfs writes a CPU mask: hex, a comma every 32 bits."""
    h = format(1 << cpu, "x")
    h = h.zfill((len(h) + 7) // 8 * 8)
    return ",".join(h[i:i + 8] for i in range(0, len(h), 8))


def _steer_flows(ns: str, cpu_of: dict[str, int]) -> None:
    """Keep TCP flows in order across the veth hops: each device's received
    packets on one CPU (RPS), as a NIC's interrupts are bound to one.

    A veth delivers a packet on the backlog of the CPU that sent it, and a
    flow's segments leave from two CPUs (the sending thread, and the softirq
    that processes the peer's ACKs): unsteered, a flow arrives reordered, TCP
    takes the reordering for loss, and on this 2-vCPU VM 10-25 % of the
    simulator's 8 MB AllReduces stalled 50-250 ms in spurious fast
    retransmits (bench/README.md, "Proxy accounting"); a test's retransmit
    counts held hundreds nobody injected. Host i's device (and
    the switch port it sends into) is steered to CPU i mod ncpu, where
    bench/proxy_cost.py pins rank i; by flow hash instead, which CPU a flow
    landed on varied from job to job and so did the bus bandwidth. Kernels
    without RPS have no rps_cpus file: nothing to do."""
    ncpu = os.cpu_count() or 1
    script = "; ".join(f'f=/sys/class/net/{dev}/queues/rx-0/rps_cpus; [ -e $f ] && echo {_cpu_mask(cpu % ncpu)} > $f'
                       for dev, cpu in cpu_of.items())
    _run(["ip", "netns", "exec", ns, "sh", "-c", script + "; true"])

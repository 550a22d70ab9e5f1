"""What every fault of the benchmark shares (docs/benchmark.md, "Faults"):
the Fault interface, the waits, the duty cycle of SIGSTOP/SIGCONT, where a
stopped rank is, and the two ways a fault reaches the job (the simulator's
GPU-like mode, the agent's own /metrics).

A fault's inject() returns at once (a background thread keeps a duty cycle
going); clear() undoes it and is safe to call twice. The ground truth is
written by the harness BEFORE inject() runs."""

from __future__ import annotations

import os
import random
import signal
import threading
from dataclasses import dataclass

SLEEP_SYSCALLS = {35, 230}  # x86_64 nanosleep, clock_nanosleep: Python's time.sleep, the ranks' compute
# x86_64 poll, ppoll, sendto, recvfrom, sendmsg, recvmsg: the simulated socket transport's waits inside a
# collective (exporter/simulator/nccl_sim/bootstrap.c, netsteps.c). A rank stopped elsewhere than in its
# sleep may be in Python between two calls, not inside one.
TRANSPORT_SYSCALLS = {7, 271, 44, 45, 46, 47}
FUTEX = 202  # x86_64 futex: a pthread_cond_wait, where the GPU-like mode's idle threads wait

# How long after the onset a culprit may still be named (a later answer is a miss), from the
# goals, not from any run: a slowed rank or link twice its 30 s p90 goal; a hang, a rank that
# never joins or dies its 90 s goal; a healthy control long enough for every 15 s window and
# `for:` to have seen it twice, and 90 s where the control itself lasts (a 45 s pause, a 70 s
# collective).
WAIT_SLOW_S = 60
WAIT_HANG_S = 90
WAIT_HEALTHY_S = 60
WAIT_HEALTHY_LONG_S = 90


def send_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def in_sleep(pid: int, inside: bool = False) -> bool | None:
    """Whether a (stopped) rank's main thread was in its compute sleep, i.e.
    between collectives: its /proc/PID/syscall is nanosleep. inside: whether
    it was in the transport's wait inside an NCCL call instead (poll, ppoll,
    a socket send or receive). None if gone."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            nr = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return nr.lstrip("-").isdigit() and int(nr) in (TRANSPORT_SYSCALLS if inside else SLEEP_SYSCALLS)


def gpu_idle(pid: int) -> bool | None:
    """Whether a (stopped) rank in the simulator's GPU-like mode had nothing on its "GPU": its
    stream and proxy threads ("NCCL Stream N", "NCCL Proxy N": exporter/simulator/nccl_sim/gpu.c,
    p2p.c) all waiting on their condition variables. A real GPU finishes the kernels it was given
    while the host process is stopped; the simulated one is a thread, stopped with it. None if gone."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if not f.read().startswith(("NCCL Stream", "NCCL Proxy")):
                    continue
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                if f.read().split()[0] != str(FUTEX):
                    return False
    except FileNotFoundError:
        return None if not os.path.exists(f"/proc/{pid}") else False  # a thread gone: ask again
    except (OSError, IndexError):
        return None
    return True


class DutyCycle:
    """SIGSTOP / SIGCONT a set of processes: stopped `stop_s` of every `period_s`
    (random phase); with `pick`, a new random member of `pids` each period."""

    def __init__(self, pids: list[int], stop_s: float, period_s: float, pick: bool = False, seed: int = 0):
        self.pids, self.stop_s, self.period_s, self.pick = pids, stop_s, period_s, pick
        self.rng = random.Random(seed)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self.done.is_set():
            pids = [self.rng.choice(self.pids)] if self.pick else self.pids
            stop = self.rng.uniform(0, self.stop_s) if self.pick else self.stop_s
            for p in pids:
                send_signal(p, signal.SIGSTOP)
            self.done.wait(stop)
            for p in pids:
                send_signal(p, signal.SIGCONT)
            self.done.wait(max(0.0, self.period_s - stop))

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()
        for p in self.pids:
            send_signal(p, signal.SIGCONT)


@dataclass
class Fault:
    """name: as in the truth file; cause: what a detector should say; wait_s:
    how long after the onset a culprit may still be named; healthy: a control
    (no culprit); culprit: "rank", "link" or None."""
    name: str
    cause: str | None
    wait_s: float
    culprit: str | None = "rank"
    healthy: bool = False

    def job_env(self, work) -> dict:
        """More environment for every rank of the job (work: this run's own folder)."""
        return {}

    def inject(self, ctx, rank: int) -> dict:  # -> extra truth fields
        raise NotImplementedError

    def clear(self, ctx) -> None:
        pass


def gpu_job_env() -> dict:
    """The simulator's GPU-like mode with the profiler plugin (docs/simulator.md): a call returns
    once enqueued, the "GPU" runs it, the plugin reports its GPU time and network waits."""
    from exporter.sources.plugin.build import build_plugin
    return {"NCCL_SIM_GPU": "1", "NCCL_PROFILER_PLUGIN": str(build_plugin())}


def agent_samples(url: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every sample the agent at `url` serves now."""
    from prometheus_client.parser import text_string_to_metric_families

    from bench.faults.procs import get
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(get(url).decode())
            for s in f.samples]


class FaultsFile:
    """The simulated job's NCCL_SIM_FAULTS_FILE (docs/simulator.md): one line `var=VALUE`,
    written whole then renamed, so a rank never reads half of it; "" switches it off."""

    def __init__(self, work, var: str):
        work.mkdir(parents=True, exist_ok=True)
        self.path, self.var = work / "faults", var
        self.set("")

    def set(self, value: str) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{self.var}={value}\n")
        os.replace(tmp, self.path)

    def env(self) -> dict:
        return {"NCCL_SIM_FAULTS_FILE": str(self.path)}

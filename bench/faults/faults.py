"""The faults the benchmark injects (docs/benchmark.md, "Faults"), and the
registry of every fault and healthy control (bench/faults/healthy.py). Each
is real on this machine: signals to the rank's process, nftables loss on a
link, the simulator's faults file switched mid-job."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

from bench.faults.base import (
    WAIT_HANG_S,
    WAIT_SLOW_S,
    DutyCycle,
    Fault,
    FaultsFile,
    send_signal,
    gpu_idle,
    gpu_job_env,
    in_sleep,
)
from bench.faults.healthy import AgentRestart, Checkpoint, Jitter, LongCollective


class Straggler(Fault):
    """1. Compute straggler: the rank is SIGSTOPped 40 ms of every 100 ms from
    outside (a CPU throttled to 60 %, as a cgroup's cpu.max would)."""

    def __init__(self, wait_s=WAIT_SLOW_S):
        super().__init__("straggler", "late_arrival", wait_s)
        self.cycle = None

    def inject(self, ctx, rank):
        self.cycle = DutyCycle([ctx.pids[rank]], 0.04, 0.1).start()
        return {"mechanism": "SIGSTOP 40 ms of every 100 ms"}

    def clear(self, ctx):
        if self.cycle:
            self.cycle.stop()


class LossyLink(Fault):
    """3. Lossy link: 10 % of the packets on their way INTO the rank's host
    dropped on the wire (nftables in the cluster's switch, the receiver's
    port): one direction of its links."""

    def __init__(self, wait_s=WAIT_SLOW_S, percent=10):
        super().__init__("lossy_link", "lossy_link", wait_s, culprit="link")
        self.percent = percent
        self.index = None

    def inject(self, ctx, rank):
        self.index = rank
        ctx.cluster.set_loss(rank, self.percent, into_only=True)
        return {"mechanism": f"nftables: {self.percent} % of packets into host {rank} dropped",
                "link": {"to": ctx.cluster.hosts[rank].addr}}

    def clear(self, ctx):
        if self.index is not None:
            ctx.cluster.clear_loss(self.index)
            self.index = None


# The CPU hog of CpuStarvation: a child process at SCHED_FIFO priority 1 on
# one CPU, spinning SPIN_S of every PERIOD_S; the kernel kills it if the
# harness dies (PR_SET_PDEATHSIG), so no hog outlives the benchmark.
HOG = r"""
import ctypes, os, sys, time
ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != int(sys.argv[4]):
    sys.exit(0)                                # the harness already gone
cpu, spin, period = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
os.sched_setaffinity(0, {cpu})
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
while True:
    t = time.monotonic()
    while time.monotonic() - t < spin:
        pass
    time.sleep(period - spin)
"""


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


class CpuStarvation(Fault):
    """4. CPU starvation of one rank's threads: every thread of the rank's
    process pinned to one CPU (sched_setaffinity), and on that CPU a
    SCHED_FIFO hog (a child process) that spins 50 ms of every 100 ms: a
    real-time task outranks every normal one, so the rank's threads wait
    runnable while it spins (a noisy neighbour, an IRQ thread, a misplaced
    real-time process). Cleared: the hog killed, the rank's CPUs restored."""

    def __init__(self, wait_s=WAIT_SLOW_S, spin_s=0.05, period_s=0.1):
        super().__init__("cpu_starvation", "cpu_starvation", wait_s)
        self.spin_s, self.period_s = spin_s, period_s
        self.hog: subprocess.Popen | None = None
        self.pid, self.mask = None, None

    def inject(self, ctx, rank):
        self.pid = pid = ctx.pids[rank]
        self.mask = os.sched_getaffinity(pid)
        cpu = random.choice(sorted(self.mask))
        for tid in _threads(pid):
            try:
                os.sched_setaffinity(tid, {cpu})
            except OSError:
                pass  # a thread that just ended
        self.hog = subprocess.Popen([sys.executable, "-c", HOG, str(cpu), str(self.spin_s), str(self.period_s),
                                     str(os.getpid())], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while os.sched_getscheduler(self.hog.pid) != os.SCHED_FIFO:  # the fault is real, or the run fails
            if self.hog.poll() is not None or time.monotonic() > deadline:
                self.clear(ctx)
                raise RuntimeError("the CPU hog did not run at SCHED_FIFO (needs CAP_SYS_NICE and real-time "
                                   "runtime in its cgroup)")
            time.sleep(0.01)
        return {"mechanism": f"rank pinned to CPU {cpu} with a SCHED_FIFO hog spinning "
                             f"{self.spin_s * 1000:.0f} ms of every {self.period_s * 1000:.0f} ms",
                "cpu": cpu, "hog_pid": self.hog.pid}

    def clear(self, ctx):
        if self.hog is not None:
            self.hog.kill()
            self.hog.wait()
            self.hog = None
        if self.pid and self.mask:
            for tid in _threads(self.pid):
                try:
                    os.sched_setaffinity(tid, self.mask)
                except OSError:
                    pass
            self.pid = None


class GpuStraggler(Fault):
    """2. GPU straggler, in the simulator's GPU-like mode with the profiler
    plugin: the rank's "GPU" produces each network step's data 5 ms late
    (NCCL_SIM_SLOW_GPU, docs/simulator.md), switched on mid-job through the
    simulator's NCCL_SIM_FAULTS_FILE (written whole, then renamed)."""

    DELAY_US = 5000

    def __init__(self, wait_s=WAIT_SLOW_S):
        super().__init__("gpu_straggler", "gpu_straggler", wait_s)
        self.file = None

    VAR = "NCCL_SIM_SLOW_GPU"

    def job_env(self, work):
        self.file = FaultsFile(work, self.VAR)
        return {**gpu_job_env(), **self.file.env()}

    def inject(self, ctx, rank):
        # the last field: only the job's communicator of every rank (the ranks are communicator
        # ranks: without it the train workload's 2-rank communicators would slow another rank)
        self.file.set(f"{rank}:{self.DELAY_US}:{len(ctx.pids)}")
        return {"mechanism": f"NCCL_SIM_SLOW_GPU={rank}:{self.DELAY_US}:{len(ctx.pids)} (each network step's "
                             f"data {self.DELAY_US // 1000} ms late) in the GPU-like mode"}

    def clear(self, ctx):
        if self.file is not None:
            self.file.set("")


class GpuSlowLink(GpuStraggler):
    """3b. Slow link in the GPU-like mode with the plugin: the data of the
    rank before the culprit in the ring (collectives.c: rank r sends to r + 1)
    leaves 5 ms late per network step on the link into the culprit
    (NCCL_SIM_SLOW_LINK=FROM:TO:US, docs/simulator.md), switched on mid-job
    through NCCL_SIM_FAULTS_FILE. The sender's send_wait and the culprit's
    recv_wait grow; the culprit is the link into the rank's host (its
    receiving end), as for lossy_link. 5 ms: the GPU straggler's delay, so
    the two faults differ only in where the data waits."""

    def __init__(self, wait_s=WAIT_SLOW_S):
        Fault.__init__(self, "gpu_slow_link", "slow_link", wait_s, culprit="link")
        self.file = None

    VAR = "NCCL_SIM_SLOW_LINK"

    @staticmethod
    def sender(rank: int, nranks: int) -> int:
        """The rank whose data to `rank` is slowed: its predecessor in the ring."""
        return (rank - 1) % nranks

    def inject(self, ctx, rank):
        n = len(ctx.pids)
        sender = self.sender(rank, n)
        self.file.set(f"{sender}:{rank}:{self.DELAY_US}:{n}")  # only the communicator of every rank
        return {"mechanism": f"NCCL_SIM_SLOW_LINK={sender}:{rank}:{self.DELAY_US}:{n} (rank {sender}'s data to "
                             f"rank {rank} leaves {self.DELAY_US // 1000} ms late per step) in the GPU-like mode"}


class Desync(Fault):
    """7. Desync: the rank's program calls ncclBroadcast where its peers call
    ncclAllReduce (NCCL_SIM_DESYNC=RANK in the simulator's NCCL_SIM_FAULTS_FILE,
    read by the `train` workload at each iteration; docs/simulator.md,
    "Desync"). Every rank then waits inside its call: the job hangs.
    count: instead, the rank calls ncclAllReduce with a count one ring loop
    longer (NCCL_SIM_DESYNC_COUNT=RANK), the ring's steps framed as NCCL's
    (NCCL_SIM_RING_FRAMES=1). Its peers return from the loop they share with
    wrong data and go on, as a training job's do (NCCL_SIM_NO_CHECK: the
    workload checks no result), while it waits for its second loop's steps:
    the job hangs, that rank one AllReduce behind."""

    def __init__(self, wait_s=WAIT_HANG_S, count=False):
        super().__init__("desync_count" if count else "desync", "desync", wait_s)
        self.var = "NCCL_SIM_DESYNC_COUNT" if count else "NCCL_SIM_DESYNC"
        self.file = None

    def job_env(self, work):
        self.file = FaultsFile(work, self.var)
        count = {"NCCL_SIM_NO_CHECK": "1", "NCCL_SIM_RING_FRAMES": "1"} if self.name == "desync_count" else {}
        return {**self.file.env(), **count}

    def inject(self, ctx, rank):
        self.file.set(str(rank))
        what = ("ncclAllReduce with a count one ring loop longer than the other ranks'"
                if self.name == "desync_count" else "ncclBroadcast where the other ranks call ncclAllReduce")
        return {"mechanism": f"{self.var}={rank}: {what}"}

    def clear(self, ctx):
        if self.file is not None:
            self.file.set("")


class Stopped(Fault):
    """5. A rank that never joins (stopped between collectives: in its compute
    sleep), or 6. one stuck inside a collective: SIGSTOP, retried (SIGCONT,
    a random few ms, SIGSTOP) until /proc/PID/syscall says where it stopped.
    gpu: the job in the GPU-like mode with the plugin, where the peers' calls
    return once enqueued and their wait is on the "GPU" (the rank never joins
    only: inside a call of that mode the host does not wait). There the stop
    also waits until the rank's own "GPU" is idle: its stream is a thread
    that SIGSTOP stops too, where a real GPU would finish its last kernel
    (two early runs stopped one mid-kernel: every rank then had an operation
    in flight, and none was missing)."""

    def __init__(self, inside: bool, wait_s=WAIT_HANG_S, gpu: bool = False):
        super().__init__(("gpu_" if gpu else "") + ("stopped_inside" if inside else "stopped_between"),
                         "stopped_inside" if inside else "not_joined", wait_s)
        self.inside, self.gpu = inside, gpu
        self.pid = None

    def job_env(self, work):
        return gpu_job_env() if self.gpu else {}

    def inject(self, ctx, rank):
        self.pid = pid = ctx.pids[rank]
        for attempt in range(1, 500):
            deadline = time.monotonic() + 0.5
            while self.inside and in_sleep(pid, True) is False and time.monotonic() < deadline:
                time.sleep(0.0005)  # inside: stop it once it waits in the transport (cheaper than blind tries)
            send_signal(pid, signal.SIGSTOP)
            time.sleep(0.02)
            where = in_sleep(pid, self.inside)
            if where and self.gpu and not self.inside:
                where = gpu_idle(pid)
            if where is None or where:
                return {"mechanism": "SIGSTOP " + ("inside a collective" if self.inside else "between collectives"),
                        "attempts": attempt}
            send_signal(pid, signal.SIGCONT)
            time.sleep(random.uniform(0.001, 0.02))
        raise RuntimeError(f"rank {rank} never stopped {'inside' if self.inside else 'between'} collectives")

    def clear(self, ctx):
        if self.pid:
            send_signal(self.pid, signal.SIGCONT)


class Killed(Fault):
    """8. A rank that dies: SIGKILL."""

    def __init__(self, wait_s=WAIT_HANG_S):
        super().__init__("killed", "died", wait_s)

    def inject(self, ctx, rank):
        send_signal(ctx.pids[rank], signal.SIGKILL)
        return {"mechanism": "SIGKILL"}


# name -> a new instance (a fault keeps its state between inject and clear)
FAULTS = {
    "straggler": Straggler,
    "lossy_link": LossyLink,
    "stopped_between": lambda: Stopped(inside=False),
    "stopped_inside": lambda: Stopped(inside=True),
    "gpu_stopped_between": lambda: Stopped(inside=False, gpu=True),
    "killed": Killed,
    "cpu_starvation": CpuStarvation,
    "gpu_straggler": GpuStraggler,
    "gpu_slow_link": GpuSlowLink,
    "desync": Desync,
    "desync_count": lambda: Desync(count=True),
    "healthy_jitter": Jitter,
    "healthy_checkpoint": Checkpoint,
    "healthy_gpu_checkpoint": lambda: Checkpoint(gpu=True),
    "healthy_agent_restart": AgentRestart,
    "healthy_long_collective": LongCollective,
}

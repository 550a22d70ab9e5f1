"""The benchmark's healthy controls (docs/benchmark.md, "Faults"): a job that
misbehaves in ways that are no fault, where any culprit named is a false
alarm."""

from __future__ import annotations

import signal
import threading
import time

from bench.faults.base import (
    WAIT_HEALTHY_LONG_S,
    WAIT_HEALTHY_S,
    DutyCycle,
    Fault,
    FaultsFile,
    send_signal,
    agent_samples,
    gpu_job_env,
)


class Jitter(Fault):
    """Healthy control: random per-call jitter: every 100 ms a random rank is
    SIGSTOPped for a random 0-40 ms (each is as often late as the others)."""

    def __init__(self, wait_s=WAIT_HEALTHY_S):
        super().__init__("healthy_jitter", None, wait_s, culprit=None, healthy=True)
        self.cycle = None

    def inject(self, ctx, rank):
        self.cycle = DutyCycle(ctx.pids, 0.04, 0.1, pick=True, seed=int(time.time())).start()
        return {"mechanism": "SIGSTOP a random rank 0-40 ms every 100 ms"}

    def clear(self, ctx):
        if self.cycle:
            self.cycle.stop()


class Checkpoint(Fault):
    """Healthy control: every rank paused 45 s at once (a checkpoint), SIGSTOP
    and SIGCONT of all at the same instant. gpu: the job in the GPU-like mode
    with the plugin, where the pause also stops network steps mid-way (their
    waits end after it with the pause in them)."""

    def __init__(self, wait_s=WAIT_HEALTHY_LONG_S, gpu: bool = False):
        super().__init__("healthy_gpu_checkpoint" if gpu else "healthy_checkpoint", None, wait_s,
                         culprit=None, healthy=True)
        self.timer, self.gpu = None, gpu

    def job_env(self, work):
        return gpu_job_env() if self.gpu else {}

    def inject(self, ctx, rank):
        for p in ctx.pids:
            send_signal(p, signal.SIGSTOP)
        self.timer = threading.Timer(45, self.clear, args=(ctx,))
        self.timer.start()
        return {"mechanism": "SIGSTOP every rank for 45 s"}

    def clear(self, ctx):
        if self.timer:
            self.timer.cancel()
        for p in ctx.pids:
            send_signal(p, signal.SIGCONT)


class LongCollective(Fault):
    """Healthy control: one legitimately long collective. Every rank stays 70 s
    inside the same AllReduce of the job's 4-rank communicator, after its data
    moved (the simulator's NCCL_SIM_LONG_COLLECTIVE, through the job's
    NCCL_SIM_FAULTS_FILE): longer than `hang`'s and NcclRankNotJoined's 60 s,
    every rank in it, none late. The AllReduce is the one 150 calls after the
    latest the agent counted (~4 s ahead); a run in which no call of the job
    lasted 30 s fails: it would be a control that controlled nothing."""

    LONG_MS = 70_000
    AHEAD = 150

    def __init__(self, wait_s=WAIT_HEALTHY_LONG_S):
        super().__init__("healthy_long_collective", None, wait_s, culprit=None, healthy=True)
        self.file = None
        self.comm = None

    def job_env(self, work):
        self.file = FaultsFile(work, "NCCL_SIM_LONG_COLLECTIVE")
        return self.file.env()

    def inject(self, ctx, rank):
        samples = agent_samples(ctx.agent.metrics)
        pids = {str(p) for p in ctx.pids}
        self.comm = next(lab["comm"] for name, lab, _ in samples if name == "nccl_communicator_info"
                         and lab["pid"] in pids and lab["nranks"] == str(len(ctx.pids)))
        seq = int(max(v for name, lab, v in samples if name == "nccl_collective_last_seq"
                      and lab["comm"] == self.comm and lab["op"] == "ALL_REDUCE")) + 1 + self.AHEAD
        self.file.set(f"{len(ctx.pids)}:{seq}:{self.LONG_MS}")
        return {"mechanism": f"every rank {self.LONG_MS // 1000} s inside AllReduce #{seq} of the "
                             f"{len(ctx.pids)}-rank communicator (NCCL_SIM_LONG_COLLECTIVE)", "seq": seq}

    def clear(self, ctx):
        if self.comm is None:
            return
        self.comm, comm = None, self.comm
        # calls of the communicator over 30 s, per rank, from the agent's duration histogram
        over: dict[str, float] = {}
        samples = agent_samples(ctx.agent.metrics)   # one scrape: buckets and counts of the same instant
        for name, lab, v in samples:
            if name == "nccl_collective_duration_seconds_bucket" and lab["comm"] == comm \
                    and lab["op"] == "ALL_REDUCE" and lab["le"] != "+Inf" and float(lab["le"]) >= 30:
                over[lab["rank"]] = min(over.get(lab["rank"], v), v)
        total = {lab["rank"]: v for name, lab, v in samples
                 if name == "nccl_collective_duration_seconds_count" and lab["comm"] == comm
                 and lab["op"] == "ALL_REDUCE"}
        long_calls = {r: total[r] - over.get(r, total[r]) for r in total}
        if not long_calls or min(long_calls.values()) < 1:
            raise RuntimeError(f"the long collective did not happen: calls over 30 s per rank {long_calls}")


class AgentRestart(Fault):
    """Healthy control: the agent restarted mid-job (its counters restart at 0)."""

    def __init__(self, wait_s=WAIT_HEALTHY_S):
        super().__init__("healthy_agent_restart", None, wait_s, culprit=None, healthy=True)

    def inject(self, ctx, rank):
        ctx.restart_agent()
        return {"mechanism": "agent stopped (SIGINT) and started again"}

"""The simulator's NCCL_SIM_FAULTS_FILE (docs/simulator.md): a fault switched on
and off while the job runs, as bench/faults switches on its GPU straggler. Two
GPU-like ranks on loopback with the profiler plugin; each network step's own
record (NCCL_SIM_GPU_STEP_TRUTH) says how long it waited for its GPU's data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from exporter.simulator.build import build_library
from exporter.sources.plugin.build import build_plugin

from conftest import REPO

DELAY_US = 3000


def send_steps(path) -> list[int]:
    """SendGPUWait of each send step, µs, in order (proxyStep truth lines: t0 posted, t1 data produced)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        if '"proxyStep"' in line:
            s = json.loads(line)
            if s["direction"] == "send":
                out.append((s["t1"] - s["t0"]) // 1000)
    return out


@pytest.mark.slow  # ~20 s of a running job
def test_slow_gpu_switched_on_and_off_mid_job(tmp_path):
    lib, plugin = build_library(tmp_path / "lib"), build_plugin()
    faults = tmp_path / "faults"
    faults.write_text("NCCL_SIM_SLOW_GPU=\n")
    (tmp_path / "rdv").mkdir()
    env = dict(os.environ, NCCL_SIM_GPU="1", NCCL_PROFILER_PLUGIN=str(plugin), NCCL_SIM_GPU_STEP_TRUTH="1",
               NCCL_SIM_GPU_LATE_EVERY="0", NCCL_SIM_FAULTS_FILE=str(faults))
    truth = [tmp_path / f"rank{r}.jsonl" for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-m", "exporter.simulator.rank", "--lib", str(lib), "--rank", str(r),
                               "--nranks", "2", "--rendezvous", str(tmp_path / "rdv"), "--workload", "gpu",
                               "--iterations", "400", "--count", "65536", "--compute-delay-ms", "10",
                               "--sync-every", "1", "--truth", str(truth[r])],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in (0, 1)]
    try:
        def wait_steps(n, slow=False):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                steps = send_steps(truth[1])
                if sum(1 for us in steps if us >= DELAY_US or not slow) >= n:
                    return len(steps)
                assert all(p.poll() is None for p in procs), "a rank ended before the fault was switched"
                time.sleep(0.05)
            raise AssertionError(f"rank 1 made no {n} {'slow ' if slow else ''}send steps in 60 s")

        tmp = faults.with_suffix(".tmp")
        # a communicator size this job's has not (the optional NRANKS field): nothing slows
        tmp.write_text(f"NCCL_SIM_SLOW_GPU=1:{DELAY_US}:4\n")
        os.replace(tmp, faults)
        on_at = wait_steps(wait_steps(20) + 40)
        tmp.write_text(f"NCCL_SIM_SLOW_GPU=1:{DELAY_US}:2\n")
        os.replace(tmp, faults)
        off_at = wait_steps(20, slow=True)
        faults.write_text("NCCL_SIM_SLOW_GPU=\n")
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out.decode()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    steps0, steps1 = send_steps(truth[0]), send_steps(truth[1])
    assert all(us < DELAY_US for us in steps1[:on_at]), "slow before the file said so (or on another comm size)"
    assert sum(us >= DELAY_US for us in steps1[on_at:off_at]) >= 20
    # read again within 100 ms: the last steps (after the switch off) are fast again
    assert steps1[-10:] and all(us < DELAY_US for us in steps1[-10:]), steps1[-10:]
    assert all(us < DELAY_US for us in steps0), "only rank 1's GPU is late"


def test_one_long_collective_on_every_rank(tmp_path):
    """NCCL_SIM_LONG_COLLECTIVE (host mode): AllReduce #5 of the 2-rank communicator stays
    inside the call 1 s on both ranks, the others do not; the faults file's line wins over
    the environment's (#2)."""
    lib = build_library(tmp_path / "lib")
    faults = tmp_path / "faults"
    faults.write_text("NCCL_SIM_LONG_COLLECTIVE=2:5:1000\n")
    (tmp_path / "rdv").mkdir()
    env = dict(os.environ, NCCL_SIM_FAULTS_FILE=str(faults), NCCL_SIM_LONG_COLLECTIVE="2:2:1000")
    truth = [tmp_path / f"rank{r}.jsonl" for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-m", "exporter.simulator.rank", "--lib", str(lib), "--rank", str(r),
                               "--nranks", "2", "--rendezvous", str(tmp_path / "rdv"), "--workload", "allreduce",
                               "--iterations", "8", "--count", "64", "--truth", str(truth[r])],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=60)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    for t in truth:
        ms = [(c["end_mono_ns"] - c["start_mono_ns"]) / 1e6 for c in map(json.loads, t.read_text().splitlines())
              if c["op"] == "ALL_REDUCE"]
        assert len(ms) == 8 and 1000 <= ms[5] < 2000, ms
        assert max(ms[:5] + ms[6:]) < 500, ms

"""The simulator's desync faults (docs/simulator.md, "Desync"), switched on mid-job in
NCCL_SIM_FAULTS_FILE and read by the `train` workload at each iteration:

- NCCL_SIM_DESYNC=RANK: that rank calls ncclBroadcast where its peers call
  ncclAllReduce; every rank then waits inside its call (the job hangs, as NCCL's
  ranks wait for steps their peers never post), none returns an error or a result;
- NCCL_SIM_DESYNC_COUNT=RANK[:COUNT]: that rank calls ncclAllReduce with another
  count, by default one ring loop longer. With NCCL_SIM_RING_FRAMES=1 (set here) the
  ranks finish the loops they share, step by step (each ring step is one frame,
  whatever its size, as NCCL matches steps by counters): with a count of as many
  loops every rank returns, with wrong data; with one more loop the peers return
  with wrong data (the workload's result check catches it) and, when nothing
  checks (NCCL_SIM_NO_CHECK, a training job), go on to their next calls while that
  rank waits for the steps of its second loop: the job hangs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from exporter.simulator.build import build_library

from conftest import REPO


def run_job(tmp_path, fault: str, env: dict) -> tuple[list, list[str]]:
    """4 ranks of `train` for 5 s; `fault` (NAME=VALUE) written to the faults file after 2 s.
    The ranks' return codes once all have ended, or 7 s after the fault (None: still
    running, then killed), and outputs."""
    lib = build_library(tmp_path / "lib")
    faults = tmp_path / "faults"
    faults.write_text(fault.split("=")[0] + "=\n")
    (tmp_path / "rdv").mkdir()
    env = {**os.environ, "NCCL_SIM_FAULTS_FILE": str(faults), "NCCL_SIM_RING_FRAMES": "1", **env}
    procs = [subprocess.Popen([sys.executable, "-m", "exporter.simulator.rank", "--lib", str(lib), "--rank", str(r),
                               "--nranks", "4", "--rendezvous", str(tmp_path / "rdv"), "--workload", "train",
                               "--iterations", "100000000", "--duration-s", "5", "--count", "1024",
                               "--compute-delay-ms", "5"],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(4)]
    try:
        time.sleep(2)
        assert all(p.poll() is None for p in procs), "a rank ended before the fault"
        tmp = faults.with_suffix(".tmp")
        tmp.write_text(fault + "\n")
        os.replace(tmp, faults)
        # Without the fault the job ends by itself after 5 s: a rank still running
        # 7 s after the fault is held by it.
        deadline = time.monotonic() + 7
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return codes, [p.communicate(timeout=30)[0].decode() for p in procs]


@pytest.mark.slow  # up to ~10 s of a running job
def test_desync_hangs_every_rank(tmp_path):
    codes, outs = run_job(tmp_path, "NCCL_SIM_DESYNC=2", {})
    assert codes == [None] * 4, f"a rank returned from the desynced calls: {codes}"
    assert "rank 2: iteration" in outs[2] and "ncclBroadcast instead of ncclAllReduce" in outs[2], outs[2][-500:]
    assert not any("FAIL" in o for o in outs), [o[-300:] for o in outs]


@pytest.mark.slow  # up to ~10 s of a running job
@pytest.mark.parametrize("frames", ["1", "0"])
def test_a_count_of_as_many_loops_returns_wrong_data_everywhere(tmp_path, frames):
    """2048 elements where the peers have 1024: one loop on every rank, which all
    complete step by step with framed steps; on the default byte stream rank 2 waits
    for bytes never sent and gets ncclRemoteError when its peers exit."""
    codes, outs = run_job(tmp_path, "NCCL_SIM_DESYNC_COUNT=2:2048", {"NCCL_SIM_NO_CHECK": "",
                                                                     "NCCL_SIM_RING_FRAMES": frames})
    if frames == "1":
        assert codes[2] not in (None, 0) and "the desync returned" in outs[2], outs[2][-500:]
    else:
        assert codes[2] not in (None, 0) and "remote process exited" in outs[2], outs[2][-500:]
    for r in (0, 1, 3):
        assert codes[r] not in (None, 0) and "wrong result in ncclAllReduce" in outs[r], (r, codes, outs[r][-300:])


@pytest.mark.slow  # up to ~10 s of a running job
def test_a_longer_count_returns_wrong_data_to_the_peers(tmp_path):
    """The loop every rank has is completed by all: the peers return, with wrong data."""
    codes, outs = run_job(tmp_path, "NCCL_SIM_DESYNC_COUNT=2", {"NCCL_SIM_NO_CHECK": ""})
    assert "ncclAllReduce of 2098176 elements where its peers' have 1024" in outs[2], outs[2][-500:]
    for r in (0, 1, 3):
        assert codes[r] not in (None, 0) and "wrong result in ncclAllReduce" in outs[r], (r, codes, outs[r][-300:])


@pytest.mark.slow  # up to ~10 s of a running job
def test_a_longer_count_hangs_a_job_that_checks_nothing(tmp_path):
    codes, outs = run_job(tmp_path, "NCCL_SIM_DESYNC_COUNT=2", {"NCCL_SIM_NO_CHECK": "1"})
    assert codes == [None] * 4, f"a rank returned: {codes}"
    assert "ncclAllReduce of 2098176 elements where its peers' have 1024" in outs[2], outs[2][-500:]
    assert not any("FAIL" in o for o in outs[:2] + outs[3:]), [o[-300:] for o in outs]


def test_desync_count_reads_rank_and_count(monkeypatch):
    """RANK: one ring loop longer (NCCL_SIM_RING_CHUNK bytes per rank, float32); RANK:COUNT: that count."""
    from exporter.simulator.faults import desync_count
    monkeypatch.delenv("NCCL_SIM_FAULTS_FILE", raising=False)
    monkeypatch.setenv("NCCL_SIM_DESYNC_COUNT", "2")
    monkeypatch.setenv("NCCL_SIM_RING_CHUNK", "4096")
    assert (desync_count(2, 4, 1024), desync_count(1, 4, 1024)) == (1024 + 4 * 1024, None)
    monkeypatch.setenv("NCCL_SIM_DESYNC_COUNT", "2:2048")
    assert desync_count(2, 4, 1024) == 2048
    monkeypatch.setenv("NCCL_SIM_DESYNC_COUNT", "")
    assert desync_count(2, 4, 1024) is None


def test_the_ring_chunk_default_is_the_simulated_libraries():
    """faults.py's loop length must be the one collectives.c loops over."""
    from exporter.simulator.faults import RING_CHUNK_DEFAULT
    src = (REPO / "exporter/simulator/nccl_sim/collectives.c").read_text()
    m = re.search(r"#define RING_CHUNK_DEFAULT \((\d+) << (\d+)\)", src)
    assert m and int(m[1]) << int(m[2]) == RING_CHUNK_DEFAULT

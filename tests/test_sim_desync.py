"""The simulator's desync fault (docs/simulator.md, "Desync"): NCCL_SIM_DESYNC=RANK in
NCCL_SIM_FAULTS_FILE, written mid-job, makes that rank of the `train` workload call
ncclBroadcast where its peers call ncclAllReduce; every rank then waits inside its
call (the job hangs, as NCCL's ranks wait for steps their peers never post), none
returns an error or a result."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from exporter.simulator.build import build_library

from conftest import REPO


@pytest.mark.slow  # ~15 s of a running job
def test_desync_hangs_every_rank(tmp_path):
    lib = build_library(tmp_path / "lib")
    faults = tmp_path / "faults"
    faults.write_text("NCCL_SIM_DESYNC=\n")
    (tmp_path / "rdv").mkdir()
    env = dict(os.environ, NCCL_SIM_FAULTS_FILE=str(faults))
    procs = [subprocess.Popen([sys.executable, "-m", "exporter.simulator.rank", "--lib", str(lib), "--rank", str(r),
                               "--nranks", "4", "--rendezvous", str(tmp_path / "rdv"), "--workload", "train",
                               "--iterations", "100000000", "--duration-s", "6", "--count", "1024",
                               "--compute-delay-ms", "5"],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(4)]
    try:
        time.sleep(2)
        assert all(p.poll() is None for p in procs), "a rank ended before the fault"
        tmp = faults.with_suffix(".tmp")
        tmp.write_text("NCCL_SIM_DESYNC=2\n")
        os.replace(tmp, faults)
        # Without the fault the job ends by itself after 6 s; with it no rank ends.
        time.sleep(9)
        assert [p.poll() for p in procs] == [None] * 4, "a rank returned from the desynced calls"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [p.communicate(timeout=30)[0].decode() for p in procs]
    assert "rank 2: iteration" in outs[2] and "ncclBroadcast instead of ncclAllReduce" in outs[2], outs[2][-500:]
    assert not any("FAIL" in o for o in outs), [o[-300:] for o in outs]

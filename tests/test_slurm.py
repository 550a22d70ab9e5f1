"""deploy/slurm/nccl-exporter-task-prolog.sh in a real one-node Slurm
(Debian's slurmctld and slurmd, started here with a private configuration
and stopped after the module): every task of a job gets NCCL_PROFILER_PLUGIN,
and the simulated NCCL in such a task loads the plugin (docs/deploy.md, "Slurm")."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time

import pytest

from exporter.simulator.build import build_library
from exporter.sources.plugin.build import build_plugin

from conftest import REPO, free_port
pytestmark = pytest.mark.require_root
PROLOG = REPO / "deploy" / "slurm" / "nccl-exporter-task-prolog.sh"


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    for exe in ("slurmctld", "slurmd", "srun", "sinfo"):
        if shutil.which(exe) is None:
            pytest.fail(f"{exe} missing: `make deps` installs slurmctld, slurmd and slurm-client")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    host = socket.gethostname()
    conf = d / "slurm.conf"
    conf.write_text(f"""\
ClusterName=ncclexp
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
TaskProlog={PROLOG}
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=5 State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen([exe, "-D", "-f", str(conf)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env) for exe in ("slurmctld", "slurmd")]
    try:
        deadline = time.monotonic() + 60
        while True:
            p = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env)
            if p.stdout.strip() == "idle":
                break
            if time.monotonic() > deadline or any(x.poll() is not None for x in daemons):
                logs = "".join((d / f).read_text()[-1500:] for f in ("slurmctld.log", "slurmd.log")
                               if (d / f).exists())
                pytest.fail(f"one-node Slurm did not come up: {p.stdout!r} {p.stderr!r}\n{logs}")
            time.sleep(0.5)
        yield env
    finally:
        for x in reversed(daemons):
            stop(x)


def srun(env: dict, *args: str, **extra: str) -> list[str]:
    p = subprocess.run(["srun", "-N1", *args], capture_output=True, text=True, timeout=120,
                       env={**env, **extra}, cwd="/tmp")
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout.splitlines()


SHOW = ["sh", "-c", 'echo "task=$SLURM_PROCID plugin=${NCCL_PROFILER_PLUGIN:-unset}"']


def test_every_task_gets_the_plugin(slurm, tmp_path):
    plugin = build_plugin()
    env = {k: v for k, v in slurm.items() if k != "NCCL_PROFILER_PLUGIN"}
    out = srun(env, "-n2", *SHOW, NCCL_EXPORTER_PLUGIN_FILE=str(plugin))
    assert sorted(out) == [f"task=0 plugin={plugin}", f"task=1 plugin={plugin}"]


def test_a_jobs_own_setting_is_kept_and_a_missing_plugin_is_not_named(slurm):
    env = {k: v for k, v in slurm.items() if k != "NCCL_PROFILER_PLUGIN"}
    assert srun(env, "-n1", *SHOW, NCCL_PROFILER_PLUGIN="none",
                NCCL_EXPORTER_PLUGIN_FILE=str(build_plugin())) == ["task=0 plugin=none"]
    assert srun(env, "-n1", *SHOW, NCCL_EXPORTER_PLUGIN_FILE="/nonexistent/plugin.so") == ["task=0 plugin=unset"]


def test_nccl_in_a_task_loads_the_plugin(slurm, tmp_path):
    """A task that sets nothing itself: the simulated NCCL (GPU-like mode)
    loads the plugin the prolog named and its AllReduces come out."""
    harness = tmp_path / "sim_harness"
    subprocess.run(["gcc", "-O2", "-pthread", "-o", str(harness), str(REPO / "tests/plugin/sim_harness.c"), "-ldl"],
                   check=True)
    log = tmp_path / "plugin-%p.log"
    env = {k: v for k, v in slurm.items() if not k.startswith("NCCL_")}
    out = srun(env, "-n1", str(harness), str(build_library()), "2", "4",
               NCCL_SIM_GPU="1", NCCL_EXPORTER_PLUGIN_FILE=str(build_plugin()),
               NCCL_EXPORTER_PROFILER_LOG=str(log))
    assert out and out[0].startswith("ok "), out
    (written,) = tmp_path.glob("plugin-*.log")
    done = [line for line in written.read_text().splitlines() if "event=done" in line]
    assert len(done) == 8 and all(re.search(r"\bop=AllReduce\b", line) for line in done)

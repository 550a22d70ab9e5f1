import os
import socket
import subprocess
import sys


from exporter.sources import identity


def _fake_proc(tmp_path, env: dict, pid=42, cmdline=None):
    d = tmp_path / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    if cmdline is not None:
        (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in cmdline))
    return str(tmp_path)


def test_node_name_precedence(monkeypatch):
    monkeypatch.delenv("NCCL_EXPORTER_NODE", raising=False)
    assert identity.node_name() == socket.gethostname()
    monkeypatch.setenv("NCCL_EXPORTER_NODE", "env-node")
    assert identity.node_name() == "env-node"
    assert identity.node_name(config_value="cfg-node") == "cfg-node"
    assert identity.node_name("cli-node", "cfg-node") == "cli-node"
    assert identity.node_name("", "") == "env-node"  # empty means unset
    monkeypatch.setenv("NCCL_EXPORTER_NODE", "")
    assert identity.node_name() == socket.gethostname()


def test_torchrun(tmp_path):
    proc = _fake_proc(tmp_path, {"PATH": "/bin", "RANK": "5", "LOCAL_RANK": "1",
                                 "WORLD_SIZE": "16", "GROUP_RANK": "2",
                                 "TORCHELASTIC_RUN_ID": "abc"})
    assert identity.launcher_identity(42, proc=proc) == {
        "launcher": "torchrun", "rank": 5, "local_rank": 1, "world_size": 16, "group_rank": 2}


def test_slurm(tmp_path):
    proc = _fake_proc(tmp_path, {"SLURM_PROCID": "7", "SLURM_LOCALID": "3",
                                 "SLURM_NTASKS": "8", "SLURM_NODEID": "1", "SLURM_JOB_ID": "99"})
    assert identity.launcher_identity(42, proc=proc) == {
        "launcher": "slurm", "rank": 7, "local_rank": 3, "world_size": 8, "group_rank": 1}


def test_openmpi_and_mpich(tmp_path):
    proc = _fake_proc(tmp_path, {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                                 "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert identity.launcher_identity(42, proc=proc) == {
        "launcher": "mpi", "rank": 3, "local_rank": 1, "world_size": 4, "group_rank": None}
    proc = _fake_proc(tmp_path / "b", {"PMI_RANK": "2", "PMI_SIZE": "6"})
    assert identity.launcher_identity(42, proc=proc) == {
        "launcher": "mpi", "rank": 2, "local_rank": None, "world_size": 6, "group_rank": None}


def test_precedence_torchrun_over_slurm_over_mpi(tmp_path):
    env = {"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "10",
           "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert identity.launcher_identity(42, proc=_fake_proc(tmp_path / "a", env))["launcher"] == "slurm"
    env.update({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})
    got = identity.launcher_identity(42, proc=_fake_proc(tmp_path / "b", env))
    assert got["launcher"] == "torchrun" and got["world_size"] == 4 and got["group_rank"] is None


def test_no_launcher_and_bad_values(tmp_path):
    assert identity.launcher_identity(42, proc=_fake_proc(tmp_path / "a", {"HOME": "/root"})) == {
        "launcher": "", "rank": None, "local_rank": None, "world_size": None, "group_rank": None}
    got = identity.launcher_identity(42, proc=_fake_proc(tmp_path / "b", {"RANK": "x1", "WORLD_SIZE": ""}))
    assert got["launcher"] == "torchrun" and got["rank"] is None and got["world_size"] is None


def test_vanished_process(tmp_path):
    empty = {"launcher": "", "rank": None, "local_rank": None, "world_size": None, "group_rank": None}
    assert identity.launcher_identity(123456789, proc=str(tmp_path)) == empty
    assert identity.launcher_identity(2**22 + 7) == empty  # above pid_max: never exists
    assert identity.process_command(123456789, proc=str(tmp_path)) == ""


def test_real_process():
    env = {**os.environ, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}
    code = "import sys; print(flush=True); sys.stdin.read()"
    p = subprocess.Popen([sys.executable, "-c", code, "arg"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    p.stdout.readline()  # started: its environ is in place (not mid-exec)
    try:
        got = identity.launcher_identity(p.pid)
        assert (got["launcher"], got["rank"], got["world_size"]) == ("torchrun", 3, 4)
        assert identity.process_command(p.pid) == f"{sys.executable} -c {code} arg"
    finally:
        p.stdin.close()
        p.wait()


def test_process_command_truncated(tmp_path):
    proc = _fake_proc(tmp_path, {}, cmdline=["python", "train.py", "--x=" + "a" * 500])
    cmd = identity.process_command(42, proc=proc)
    assert len(cmd) == 200 and cmd.startswith("python train.py --x=aaa")

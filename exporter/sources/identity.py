"""Who is this node, and which rank of which launcher is a traced process."""

from __future__ import annotations

import os
import socket

__all__ = ["node_name", "launcher_identity", "process_command", "read_environ"]

NODE_ENV = "NCCL_EXPORTER_NODE"
COMMAND_MAX = 200

# launcher -> field -> environment variables, first present wins.
# Order of the dict is the precedence: torchrun > slurm > mpi.
_LAUNCHERS: dict[str, dict[str, tuple[str, ...]]] = {
    "torchrun": {
        "rank": ("RANK",),
        "local_rank": ("LOCAL_RANK",),
        "world_size": ("WORLD_SIZE",),
        "group_rank": ("GROUP_RANK",),
    },
    "slurm": {
        "rank": ("SLURM_PROCID",),
        "local_rank": ("SLURM_LOCALID",),
        "world_size": ("SLURM_NTASKS",),
        "group_rank": ("SLURM_NODEID",),
    },
    "mpi": {
        # Open MPI, then MPICH/Intel MPI (PMI), then PMIx (Open MPI 5).
        "rank": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"),
        "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
        "world_size": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
        "group_rank": (),
    },
}

# A launcher counts as present when any of these is in the environment.
_DETECT = {
    "torchrun": ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "GROUP_RANK"),
    "slurm": ("SLURM_PROCID",),
    "mpi": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"),
}

_FIELDS = ("rank", "local_rank", "world_size", "group_rank")


def node_name(cli_value: str | None = None, config_value: str | None = None) -> str:
    """--node > config file > $NCCL_EXPORTER_NODE > hostname (empty values skipped)."""
    for v in (cli_value, config_value, os.environ.get(NODE_ENV)):
        if v and v.strip():
            return v.strip()
    return socket.gethostname()


def read_environ(pid: int | str, proc: str = "/proc") -> dict[str, str] | None:
    """The initial environment of a process, or None when it cannot be read."""
    try:
        with open(os.path.join(proc, str(pid), "environ"), "rb") as f:
            data = f.read()
    except OSError:
        return None
    env = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


def launcher_identity(pid: int | str, proc: str = "/proc") -> dict:
    """{"launcher", "rank", "local_rank", "world_size", "group_rank"} of a process.

    launcher is "torchrun", "slurm", "mpi" or ""; the others are ints or None.
    torchrun wins over Slurm over MPI when several are present. A vanished or
    unreadable process gives launcher "" and all None; never raises.
    """
    out: dict = {"launcher": "", **{k: None for k in _FIELDS}}
    env = read_environ(pid, proc)
    if not env:
        return out
    for launcher, fields in _LAUNCHERS.items():
        if not any(v in env for v in _DETECT[launcher]):
            continue
        out["launcher"] = launcher
        for field, names in fields.items():
            out[field] = next((_int(env[n]) for n in names if n in env), None)
        break
    return out


def process_command(pid: int | str, proc: str = "/proc") -> str:
    """The command line, space-joined and cut to 200 characters ("" if gone)."""
    base = os.path.join(proc, str(pid))
    try:
        with open(os.path.join(base, "cmdline"), "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    cmd = " ".join(a.decode("utf-8", "replace") for a in raw.split(b"\0") if a)
    if not cmd:
        try:  # kernel thread or zombie: fall back to the short name
            with open(os.path.join(base, "comm"), "rb") as f:
                cmd = f"[{f.read().decode('utf-8', 'replace').strip()}]"
        except OSError:
            return ""
    return cmd[:COMMAND_MAX]

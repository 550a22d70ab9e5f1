"""Faults of the simulated job's own program (docs/simulator.md, "Desync"): read by the
rank's workload, switched on mid-job through NCCL_SIM_FAULTS_FILE like the simulated
libnccl's own faults (NCCL_SIM_SLOW_GPU, NCCL_SIM_SLOW_LINK)."""

from __future__ import annotations

import os
import pathlib


def fault_value(name: str) -> str:
    """NAME's value: the NCCL_SIM_FAULTS_FILE line NAME=VALUE, else the environment's; ""."""
    value = os.environ.get(name, "")
    path = os.environ.get("NCCL_SIM_FAULTS_FILE")
    if path:
        try:
            for line in pathlib.Path(path).read_text().splitlines():
                if line.startswith(name + "="):
                    value = line.split("=", 1)[1]
        except OSError:
            pass
    return value.strip()


def desync_due(rank: int) -> bool:
    """NCCL_SIM_DESYNC=RANK: that rank's `train` workload calls ncclBroadcast where its
    peers call ncclAllReduce (a program whose ranks take different paths)."""
    v = fault_value("NCCL_SIM_DESYNC")
    return v.isdigit() and int(v) == rank

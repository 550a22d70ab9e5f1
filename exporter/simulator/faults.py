"""Faults of the simulated job's own program (docs/simulator.md, "Desync"): read by the
rank's workload, switched on mid-job through NCCL_SIM_FAULTS_FILE like the simulated
libnccl's own faults (NCCL_SIM_SLOW_GPU, NCCL_SIM_SLOW_LINK)."""

from __future__ import annotations

import ctypes
import os
import pathlib

from exporter.simulator.numerics import FLOAT32, SUM


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


RING_CHUNK_DEFAULT = 2 << 20  # bytes per rank and ring loop, as exporter/simulator/nccl_sim/collectives.c


def desync_count(rank: int, nranks: int, count: int, itemsize: int = 4) -> int | None:
    """NCCL_SIM_DESYNC_COUNT=RANK[:COUNT]: that rank's `train` workload calls ncclAllReduce
    with COUNT elements where its peers use `count`; without COUNT, a count one ring loop
    longer (NCCL_SIM_RING_CHUNK bytes per rank and loop, as the simulated libnccl reads
    it), so that it waits inside the call for steps its peers never post. None for the
    other ranks, or when the fault is off."""
    v = fault_value("NCCL_SIM_DESYNC_COUNT")
    who, _, other = v.partition(":")
    if not (who.isdigit() and int(who) == rank):
        return None
    if other.isdigit():
        return int(other)
    chunk = int(os.environ.get("NCCL_SIM_RING_CHUNK") or RING_CHUNK_DEFAULT)
    return count + nranks * max(1, chunk // itemsize)


def desync_call(rank: int, nranks: int, count: int, sb, rb) -> tuple[str, tuple] | None:
    """The call a desync fault makes rank's `train` workload call instead of its float32
    sum ncclAllReduce of `count` elements from sb to rb: (what it is, the NCCL function's
    name and arguments before its communicator and stream); None when no fault is on."""
    if desync_due(rank):
        return "ncclBroadcast instead of ncclAllReduce", ("ncclBroadcast", sb, rb, count, FLOAT32, int(rank == 0))
    big = desync_count(rank, nranks, count)
    if big is not None:
        buf = ctypes.create_string_buffer(big * 4)
        return (f"ncclAllReduce of {big} elements where its peers' have {count}",
                ("ncclAllReduce", buf, buf, big, FLOAT32, SUM))
    return None

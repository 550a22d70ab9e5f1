"""Ground truth written by libnccl.so.2 (one JSON line per outermost call)."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable

from exporter.records.contract import COLLECTIVE_OPS as _COLLECTIVE_OPS

COLLECTIVE_OPS = frozenset(_COLLECTIVE_OPS.values())


def _files(paths_or_dir) -> list[pathlib.Path]:
    if isinstance(paths_or_dir, (str, os.PathLike)):
        paths_or_dir = [paths_or_dir]
    out: list[pathlib.Path] = []
    for p in paths_or_dir:
        p = pathlib.Path(p)
        if p.is_dir():
            out.extend(sorted(x for x in p.iterdir() if x.is_file() and x.suffix in (".jsonl", ".json", ".truth")))
        elif p.exists():
            out.append(p)
    return out


def load_truth(paths_or_dir) -> list[dict]:
    """Parse truth files (a file, a directory of *.jsonl, or a list of them).

    Records are sorted by start_mono_ns. A torn last line (a rank killed
    mid-write) is skipped.
    """
    recs: list[dict] = []
    for f in _files(paths_or_dir):
        with open(f, "r", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    recs.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    recs.sort(key=lambda r: (r.get("start_mono_ns", 0), r.get("pid", 0), r.get("tid", 0)))
    return recs


def calls(records: Iterable[dict], op: str | None = None, fn: str | None = None) -> list[dict]:
    """Collective / point-to-point records, optionally filtered by op or fn."""
    return [r for r in records if r.get("op") in COLLECTIVE_OPS
            and (op is None or r["op"] == op) and (fn is None or r["fn"] == fn)]


def lifecycle(records: Iterable[dict], op: str | None = None, fn: str | None = None) -> list[dict]:
    """Everything that is not a collective: init, split, destroy, group, queries
    (not the GPU-like mode's own records: see gpu_kernels / gpu_events)."""
    return [r for r in records if r.get("op") not in COLLECTIVE_OPS and r.get("op") not in GPU_OPS
            and (op is None or r["op"] == op) and (fn is None or r["fn"] == fn)]


# Records only the GPU-like mode (NCCL_SIM_GPU=1) writes.
GPU_OPS = frozenset({"GPU_KERNEL", "GPU_STALL", "GPU_COMM_READY", "PROFILER_INIT", "PROFILER_FINALIZE",
                     "PROXY_STEP"})


def gpu_kernels(records: Iterable[dict], op: str | None = None, state: str | None = "done") -> list[dict]:
    """The GPU-like mode's per-operation truth, one record per collective / p2p op
    run on a communicator's stream: `coll_op` (ALL_REDUCE, SEND, ...), `seq`
    (coll: NCCL seqNumber per comm and op; p2p: order per comm, peer and op),
    `comm_hash` (NCCL's commHash, hex), `enqueue_mono_ns` (host enqueue),
    `gpu_start_mono_ns` / `gpu_stop_mono_ns` (CLOCK_MONOTONIC; also start/end_mono_ns),
    `gpu_start_timer` / `gpu_stop_timer` (the simulated GPU timer NCCL hands the
    plugin), `nchannels`, `late` (KernelCh starts delivered after the kernel
    ended), `profiled` (a Coll/P2p handle existed), `state` (done, error,
    purged by abort, skipped after an error). state=None: every state."""
    return [r for r in records if r.get("op") == "GPU_KERNEL"
            and (op is None or r.get("coll_op") == op) and (state is None or r.get("state") == state)]


def gpu_events(records: Iterable[dict], op: str) -> list[dict]:
    """The GPU-like mode's other records: GPU_COMM_READY (a communicator and its
    comm_hash), PROFILER_INIT / PROFILER_FINALIZE (plugin iface, mask, callback
    counts), GPU_STALL (a stalled stream)."""
    return [r for r in records if r.get("op") == op]


def gpu_duration_ns(rec: dict) -> int:
    return rec["gpu_stop_mono_ns"] - rec["gpu_start_mono_ns"]


def duration_ns(rec: dict) -> int:
    return rec["end_mono_ns"] - rec["start_mono_ns"]


# The phases of a network step, per direction (records.contract.NETWORK_PHASES).
_PHASES = {"send": ("send_gpu_wait", "send_peer_wait", "send_wait"),
           "recv": ("recv_wait", "recv_flush_wait", "recv_gpu_wait")}


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def network_waits(records: Iterable[dict]) -> dict[tuple, dict]:
    """The GPU-like mode's per-step truth (NCCL_SIM_GPU_STEP_TRUTH=1: one
    PROXY_STEP record per network step: t0, t1, t2 = when it entered its
    direction's three phases, t_stop, trans_size) summed as the profiler
    plugin sums it: per (comm_hash, rank, peer, direction) -> {"bytes": ...,
    "ops": operations, "wall_ns": {phase: ns}, "step_ns": {phase: ns}}, wall
    time being, per operation, the time with at least one step in the phase."""
    per_op: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("op") == "PROXY_STEP":
            key = (r["comm_hash"], r["rank"], r["peer"], r["direction"], r["coll_kind"], r["seq"])
            per_op.setdefault(key, []).append(r)
    out: dict[tuple, dict] = {}
    for (comm, rank, peer, direction, _kind, _seq), steps in per_op.items():
        o = out.setdefault((comm, rank, peer, direction), {
            "bytes": 0, "ops": 0, "wall_ns": dict.fromkeys(_PHASES[direction], 0),
            "step_ns": dict.fromkeys(_PHASES[direction], 0)})
        o["ops"] += 1
        o["bytes"] += sum(s["trans_size"] for s in steps)
        for i, phase in enumerate(_PHASES[direction]):
            iv = [(s[f"t{i}"], s[f"t{i + 1}"] if i < 2 else s["t_stop"]) for s in steps]
            o["wall_ns"][phase] += _union_ns(iv)
            o["step_ns"][phase] += sum(b - a for a, b in iv)
    return out

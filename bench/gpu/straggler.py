"""Part d's GPU straggler: one rank's GPU busy before each AllReduce
(bench/gpu/workload.py `straggler`; on the simulator, NCCL_SIM_SLOW_GPU),
judged by the product's own reading of the profiler plugin's per-peer network
waits (exporter/offline/analysis/network.py: what `explain` and `stragglers
--links` conclude). The plugin's logging-mode lines become the two recording
tables the agent fills from the same figures (gpu_intervals, nccl_peer_waits),
in memory.

What it checks against real NCCL is the simulator's GPU-straggler habit
(docs/simulator.md, NCCL_SIM_SLOW_GPU): a rank whose kernel starts late makes
its own proxy wait for its GPU (send_gpu_wait) and its receiver wait for its
data (recv_wait), not for the network (send_wait). Standard library and the
exporter package only (no torch): it runs where bench/gpu runs.
"""

from __future__ import annotations

import sqlite3

from bench.gpu.checks import Verdict

NODE = "gpu"  # every rank of the check runs on the one machine


def to_recording(records: list[dict]) -> sqlite3.Connection:
    """The plugin's `done` records and `peer_wait` lines as gpu_intervals and
    nccl_peer_waits rows (docs/schema.md), in an in-memory recording."""
    from exporter.records.contract import NETWORK_PHASES
    from exporter.sinks.recording import schema

    conn = sqlite3.connect(":memory:")
    schema.migrate(conn)
    done = {(r["pid"], r["id"]): r for r in records if r.get("event") == "done" and "id" in r}
    with conn:
        for r in done.values():
            if int(r.get("gpu_ns", 0)) > 0:
                conn.execute(schema.INSERT["gpu"], (
                    int(r["pid"]), r["comm"].removeprefix("0x"), r["op"], int(r["seq"]), r["kind"], int(r["rank"]),
                    None if r.get("peer", "-1") == "-1" else int(r["peer"]), int(r["enqueue_mono_ns"]),
                    int(r["gpu_start_mono_ns"]), int(r["gpu_ns"]), NODE, int(r["bytes"])))
        for w in records:
            op = done.get((w.get("pid"), w.get("id"))) if w.get("event") == "peer_wait" else None
            if op is None:
                continue
            # bytes: counted in one phase a direction (docs/schema.md, nccl_peer_waits.bytes)
            counted = "send_wait" if w["direction"] == "send" else "recv_flush_wait"
            for phase in NETWORK_PHASES[w["direction"]]:
                conn.execute(schema.INSERT["peer_waits"], (
                    int(w["pid"]), w["comm"].removeprefix("0x"), w["op"], int(w["seq"]), op["kind"], int(w["rank"]),
                    None if w["peer"] == "other" else int(w["peer"]), w["direction"], phase,
                    int(w[f"{phase}_wall_ns"]), int(w[f"{phase}_step_ns"]),
                    int(w["bytes"]) if phase == counted else 0, NODE))
    return conn


def check(records: list[dict], straggler: int, world: int, busy: str) -> Verdict:
    """PASS when the analysis names rank `straggler` a GPU straggler first; FAIL with
    every link's figures otherwise (a difference between NCCL and the simulator)."""
    from exporter.offline.analysis import network
    from exporter.sinks.recording.read import Recording

    links = network.load(Recording(to_recording(records)))
    judged = network.judge(links)
    ops = max((lk.operations for lk in links), default=0)
    head = (f"rank {straggler} of {world} busy {busy} on its GPU before each AllReduce: "
            f"{ops} operations with network waits")
    figures = [f"rank {lk.receiver} \u2190 rank {lk.sender}: recv_wait {lk.recv_wait_ns / 1e6:.1f} ms, the sender's "
               f"send_gpu_wait {lk.send_gpu_wait_ns / 1e6:.1f} ms and send_wait {lk.send_wait_ns / 1e6:.1f} ms "
               f"(over {lk.operations} operations; {lk.verdict or 'no verdict'})" for lk in links]
    if not links:
        return Verdict("straggler", "FAIL", [f"{head}: no network waits in the plugin's log "
                                             "(no ProxyOp/ProxyStep events?)"])
    top = judged[0] if judged else None
    if top is not None and top.verdict == network.GPU_STRAGGLER and top.sender == straggler:
        return Verdict("straggler", "PASS", [f"{head}; named: {network.headline(top)}", *figures])
    named = f"the analysis says {top.verdict} {top.sender} \u2192 {top.receiver}" if top else "no verdict"
    return Verdict("straggler", "FAIL", [f"{head}; {named}, not a GPU straggler at rank {straggler}", *figures])

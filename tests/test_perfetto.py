"""`nccl-exporter export perfetto`: the JSON trace parsed back (json module) and checked.

Input: synthetic per-node recordings (tests/test_merge.py: real schema, one
rank per node, node clocks shifted by known offsets, rank 2 always 5 ms
late), merged. A real simulator recording is exported in tests/test_analysis.py.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.test_merge import NODES, REPO, SHIFT, synth
from exporter.offline.fleet import merge


def cli(*args):
    return subprocess.run([sys.executable, "-m", "exporter", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("perfetto")
    files = [synth(tmp / f"n{r}.db", r, shift=SHIFT[r]) for r in range(NODES)]
    out = tmp / "m.db"
    merge.merge(str(out), [str(f) for f in files])
    return out


def export(db, tmp_path, *extra) -> dict:
    out = tmp_path / "trace.json"
    p = cli("export", "perfetto", db, "-o", out, *extra)
    assert p.returncode == 0, p.stderr
    return json.loads(out.read_text())


def test_tracks_slices_flows_instants(merged, tmp_path):
    trace = export(merged, tmp_path)
    ev = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(procs.values()) == [f"node{r}" for r in range(NODES)]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    ranks = {k: v for k, v in threads.items() if "proxy" not in v}
    assert sorted(ranks.values()) == [f"rank {r} (pid {1000 + r})" for r in range(NODES)]
    track_of_rank = {int(v.split()[1]): k for k, v in ranks.items()}
    for r, (pid, _tid) in track_of_rank.items():
        assert procs[pid] == f"node{r}"  # each rank's thread is in its node's process

    conn = sqlite3.connect(merged)
    n_calls = conn.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0]
    n_tcp = conn.execute("SELECT COUNT(*) FROM tcp_events").fetchone()[0]
    n_sched = conn.execute("SELECT COUNT(*) FROM sched_events").fetchone()[0]
    conn.close()
    slices = [e for e in ev if e["ph"] == "X" and e["cat"] == "call"]
    assert len(slices) == n_calls == 200 * NODES
    assert all(e["name"] == "ALL_REDUCE" and {"comm", "seq", "bytes", "duration_ms"} <= set(e["args"])
               for e in slices)
    # per rank track: slices in time order, not overlapping
    per_track = defaultdict(list)
    for e in slices:
        per_track[(e["pid"], e["tid"])].append(e)
    for track, ss in per_track.items():
        assert [s["ts"] for s in ss] == sorted(s["ts"] for s in ss)
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(ss, ss[1:])), track

    # flows: one per collective, through every rank, in arrival order, ending on the straggler (rank 2)
    flows = defaultdict(list)
    for e in ev:
        if e["ph"] in "stf" and e.get("cat") == "collective":
            flows[e["id"]].append(e)
    assert len(flows) == 200
    straggler_track = track_of_rank[2]
    for chain in flows.values():
        assert [e["ph"] for e in chain] == ["s"] + ["t"] * (NODES - 2) + ["f"]
        assert [e["ts"] for e in chain] == sorted(e["ts"] for e in chain)
        assert (chain[-1]["pid"], chain[-1]["tid"]) == straggler_track
        assert len({(e["pid"], e["tid"]) for e in chain}) == NODES
        # each flow point lies on a slice of its track (bound to it)
        for e in chain:
            assert any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in per_track[(e["pid"], e["tid"])])

    # retransmits: instants on the owning rank's track
    inst = [e for e in ev if e["ph"] == "i"]
    assert len(inst) == n_tcp
    for e in inst:
        r = int(e["args"]["link"].split(".")[3].split(":")[0]) - 1  # saddr 10.0.0.(rank+1)
        assert (e["pid"], e["tid"]) == track_of_rank[r] and e["s"] == "t"
    # run-queue waits of the caller: slices on the rank's thread
    waits = [e for e in ev if e["ph"] == "X" and e["cat"] == "sched"]
    assert len(waits) == n_sched and all((w["pid"], w["tid"]) in ranks for w in waits)


def test_aligned_collective_ends_together_raw_do_not(merged, tmp_path):
    def spread(trace):
        ends = defaultdict(list)
        for e in trace["traceEvents"]:
            if e["ph"] == "X" and e["cat"] == "call":
                ends[e["args"]["seq"]].append(e["ts"] + e["dur"])
        return max(max(v) - min(v) for v in ends.values())

    aligned = export(merged, tmp_path)
    assert aligned["metadata"]["aligned"] and spread(aligned) < 1000  # µs: ends within 1 ms
    assert abs(aligned["metadata"]["clock_offsets_ns"]["node1"] - SHIFT[1]) < 1_000_000
    raw = export(merged, tmp_path, "--no-align")
    assert not raw["metadata"]["aligned"] and spread(raw) > 90_000  # node1 +50 ms, node2 -50 ms


def test_bad_input_is_one_line(tmp_path, merged):
    p = cli("export", "perfetto", tmp_path / "missing.db", "-o", tmp_path / "x.json")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no such file" in p.stderr
    p = cli("export", "perfetto", merged, "-o", tmp_path / "no" / "dir" / "x.json")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr

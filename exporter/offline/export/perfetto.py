"""A recording as a timeline: the Chrome/Perfetto JSON trace format.

`nccl-exporter export perfetto IN.db -o job.json`, then open it in
https://ui.perfetto.dev (or chrome://tracing). Layout (docs/fleet.md):

- one process per node (pid = the node's index, named after the node);
- one thread per rank (a traced process: tid = its index, named
  "rank R (pid P)", sorted by rank) holding a slice per NCCL call
  (name = op; args: comm, seq, rank, nranks, bytes, count, host duration,
  the caller's run-queue wait) and, nested inside, the caller thread's
  run-queue waits ("runq wait"; they nest: a thread cannot wait for a CPU
  across the start or end of its own call);
- the same process's other threads' waits (NCCL proxy threads, others) on a
  second thread, "rank R proxy/other threads" (they overlap the calls);
- retransmits and resets as instant events on the socket owner's rank;
- a flow linking the slices of one collective (comm, op, seq) across ranks,
  in arrival order: the arrow ends on the last arriver.

Times are microseconds from the first event (`metadata.origin_ns` is its
wall-clock ns), each node's clock corrected by its offset (skew.py; stored
by `merge` or estimated); `align=False` keeps the raw clocks. Events are
written one per line as they are read: memory stays bounded by the flows'
index (one small tuple per collective call).
"""

from __future__ import annotations

import json
from collections import defaultdict

from exporter.offline.analysis import skew
from exporter.offline.analysis.skew import SYNC_OPS
from exporter.sinks.recording.read import Recording

_SYNC = frozenset(SYNC_OPS)


json_string = json.encoder.encode_basestring_ascii  # C: a JSON string literal


def json_value(v) -> str:
    """A JSON literal for an int, a str or None (the hot paths format lines themselves)."""
    if v is None:
        return "null"
    if isinstance(v, str):
        return json_string(v)
    return str(v)


class _Writer:
    def __init__(self, out):
        self.out = out
        self.first = True
        self.count = 0
        self.out.write('{"displayTimeUnit": "ms", "traceEvents": [\n')

    def event(self, ev: dict) -> None:
        self.raw(json.dumps(ev, separators=(",", ":")))

    def raw(self, line: str) -> None:
        """One event already formatted as JSON."""
        self.out.write(line if self.first else ",\n" + line)
        self.first = False
        self.count += 1

    def close(self, metadata: dict) -> None:
        self.out.write("\n], \"metadata\": " + json.dumps(metadata) + "}\n")


def export(rec: Recording, out, align: bool = True) -> dict:
    """Write the trace to the text stream `out`; returns counts of what was written."""
    offsets = skew.offsets(rec, align)
    tables = ("nccl_events", "tcp_events", "sched_events")
    starts = [t - offsets[node] for table in tables for node, t in rec.first_times(table).items()]
    origin = min(starts, default=None) or 0

    # Tracks: a process per node, a thread per traced process (rank).
    nodes = sorted({n for t in tables for n in rec.nodes(t)})
    node_pid = {n: i + 1 for i, n in enumerate(nodes)}
    ranks = rec.process_ranks()
    tids: dict[tuple, int] = {}

    w = _Writer(out)

    def track(node, pid) -> tuple[int, int]:
        key = (node, pid)
        tid = tids.get(key)
        if tid is None:
            tid = tids[key] = 2 * len(tids) + 1
            r = ranks.get(key)
            label = f"rank {r}" if r is not None else "rank ?"
            w.event({"ph": "M", "name": "thread_name", "pid": node_pid[node], "tid": tid,
                     "args": {"name": f"{label} (pid {pid})"}})
            w.event({"ph": "M", "name": "thread_name", "pid": node_pid[node], "tid": tid + 1,
                     "args": {"name": f"{label} proxy/other threads"}})
            sort = (r if r is not None else 1 << 20) * 2
            w.event({"ph": "M", "name": "thread_sort_index", "pid": node_pid[node], "tid": tid,
                     "args": {"sort_index": sort}})
            w.event({"ph": "M", "name": "thread_sort_index", "pid": node_pid[node], "tid": tid + 1,
                     "args": {"sort_index": sort + 1}})
        return node_pid[node], tid

    for n, p in node_pid.items():
        w.event({"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}})
        w.event({"ph": "M", "name": "process_sort_index", "pid": p, "args": {"sort_index": p}})

    counts = {"slices": 0, "runq_slices": 0, "instants": 0, "flows": 0}
    raw = w.raw
    flows: dict[tuple, list] = defaultdict(list)
    for (ts, dur, op, rank, nranks, comm, seq, count, nbytes, node, pid, tid, kind, rq, _) in rec.calls():
        p, t = track(node, pid)
        start = ts - offsets[node] - origin
        raw(f'{{"ph":"X","name":{json_string(op)},"cat":{json_string(kind)},"pid":{p},"tid":{t},'
            f'"ts":{start / 1000:.3f},"dur":{dur / 1000:.3f},'
            f'"args":{{"comm":{json_value(comm)},"seq":{json_value(seq)},"rank":{json_value(rank)},'
            f'"nranks":{json_value(nranks)},"bytes":{json_value(nbytes)},"count":{json_value(count)},'
            f'"duration_ms":{dur / 1e6:.6f},'
            f'"thread":{tid}' + ("}}" if rq is None else f',"runq_wait_ms":{rq / 1e6:.6f}}}}}'))
        counts["slices"] += 1
        if op in _SYNC and seq is not None and comm and comm != "unknown":
            flows[(comm, op, seq)].append((start, p, t))

    flow_id = 0
    for key, arr in flows.items():
        if len(arr) < 2:
            continue
        arr.sort()
        flow_id += 1
        name = json_string(f"{key[1]} #{key[2]}")
        last = len(arr) - 1
        for i, (start, p, t) in enumerate(arr):
            # "f" binds to the enclosing slice (the last arriver's call): "bp":"e"
            ph = '"s"' if i == 0 else ('"f","bp":"e"' if i == last else '"t"')
            raw(f'{{"ph":{ph},"id":{flow_id},"name":{name},"cat":"collective","pid":{p},"tid":{t},'
                f'"ts":{start / 1000:.3f}}}')
        counts["flows"] += 1
    del flows

    for ts, dur, node, pid, tid, th, comm_name in rec.waits():
        p, t = track(node, pid)
        raw(f'{{"ph":"X","name":"runq wait","cat":"sched","pid":{p},"tid":{t if th == "caller" else t + 1},'
            f'"ts":{(ts - offsets[node] - origin) / 1000:.3f},"dur":{dur / 1000:.3f},'
            f'"args":{{"thread":{json_value(th)},'
            f'"tid":{json_value(tid)},"comm":{json_value(comm_name)},"wait_ms":{dur / 1e6:.6f}}}}}')
        counts["runq_slices"] += 1

    for ts, event, node, pid, saddr, sport, daddr, dport, state in rec.tcp_events():
        p, t = track(node, pid)
        raw(f'{{"ph":"i","s":"t","name":{json_string(event.replace("tcp_", "").replace("_skb", ""))},"cat":"tcp",'
            f'"pid":{p},"tid":{t},"ts":{(ts - offsets[node] - origin) / 1000:.3f},'
            f'"args":{{"link":{json_string(f"{saddr}:{sport}→{daddr}:{dport}")},"state":{json_value(state)},"event":{json_value(event)}}}}}')
        counts["instants"] += 1

    w.close({"origin_ns": origin, "aligned": bool(align),
             "clock_offsets_ns": {n: offsets[n] for n in nodes}, "source": "nccl-exporter", **counts})
    counts["events"] = w.count
    return counts

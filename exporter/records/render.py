"""The one renderer of records as fields: the recording's rows, `trace`'s
JSON and text lines, and span attributes all come from here, so a field has
one name and one format everywhere (the column names of docs/schema.md).

A `Renderer` memoizes the formatting of repeated values (communicator
hashes, stream pointers): the recorder renders 200k events a second.
"""

from __future__ import annotations

import time

from exporter.records import contract
from exporter.records.events import (
    AF_INET6,
    TCP_STATES,
    CallEvent,
    SchedEvent,
    SchedInterval,
    TcpEvent,
    format_comm,
)

# Field order of each table; the recording's INSERTs use these (schema.py).
NCCL_FIELDS = ("timestamp_ns", "duration_ns", "op", "rank", "nranks", "comm_id_hash",
               "nccl_comm_hash", "seq", "count", "bytes", "datatype", "red_op", "peer", "root",
               "stream", "result", "pid", "tid", "node", "kind", "runq_wait_ns", "proxy_runq_wait_ns")
TCP_FIELDS = ("timestamp_ns", "event", "family", "saddr", "daddr", "sport", "dport", "state",
              "seq", "pid", "tid", "rank", "node")
SCHED_FIELDS = ("timestamp_ns", "pid", "tid", "event", "duration_ns", "node", "rank", "thread",
                "comm", "cpu", "op")
SCHED_INTERVAL_FIELDS = ("timestamp_ns", "interval_ns", "pid", "thread", "runq_wait_ns", "switch_ins", "node",
                         "rank")
FIELDS = {"nccl": NCCL_FIELDS, "tcp": TCP_FIELDS, "sched": SCHED_FIELDS, "sched_interval": SCHED_INTERVAL_FIELDS}

_LIFECYCLE_NAMES = frozenset(contract.LIFECYCLE_OPS.values())
_DATATYPES = {code: name for code, (name, _size) in contract.NCCL_DATATYPES.items()}


def _opt_text(v):
    return None if v is None else str(v)


class Renderer:
    """Records -> field tuples in FIELDS order (None: not applicable)."""

    def __init__(self, node: str = ""):
        self.node = node
        self._hash: dict[int, str] = {}
        self._hex: dict[int, str] = {}

    def comm(self, h: int) -> str:
        s = self._hash.get(h)
        if s is None:
            if len(self._hash) > 65536:
                self._hash.clear()
            s = self._hash[h] = format_comm(h)
        return s

    def hexa(self, v: int) -> str:
        s = self._hex.get(v)
        if s is None:
            if len(self._hex) > 4096:
                self._hex.clear()
            s = self._hex[v] = hex(v)
        return s

    def call(self, e: CallEvent) -> tuple:
        dt, rop = e.datatype, e.red_op
        return (
            e.start_real_ns, e.end_ns - e.start_ns, e.op, e.rank, e.nranks,
            self.comm(e.comm), self.comm(e.nccl_comm_hash), e.seq, e.count, e.bytes,
            (_DATATYPES.get(dt) or contract.datatype_name(dt)) if dt >= 0 else None,
            contract.redop_name(rop) if rop >= 0 else None,
            e.peer if e.peer >= 0 else None, e.root if e.root >= 0 else None,
            self.hexa(e.stream), contract.NCCL_RESULTS.get(e.result) or contract.result_name(e.result),
            e.pid, e.tid, self.node,
            "lifecycle" if e.kind == contract.EVENT_LIFECYCLE or e.op in _LIFECYCLE_NAMES else "call",
            e.runq_wait_ns, e.proxy_wait_ns,
        )

    def tcp(self, e, rank=None) -> tuple:
        """A TcpEvent, or a dict with TCP_FIELDS keys (pre-rendered rows, tests, benches)."""
        if isinstance(e, dict):
            family = e.get("family")
            if family in (2, 10):
                family = "ipv6" if family == 10 else "ipv4"
            return (
                e["timestamp_ns"], e["event"], family, _opt_text(e.get("saddr")), _opt_text(e.get("daddr")),
                e.get("sport"), e.get("dport"), _opt_text(e.get("state")), e.get("seq") or None,
                e.get("pid") or None, e.get("tid") or None, e.get("rank", rank), self.node,
            )
        return (
            e.timestamp_real_ns, e.event, "ipv6" if e.family == AF_INET6 else "ipv4", e.saddr, e.daddr,
            e.sport, e.dport, TCP_STATES.get(e.state, str(e.state)), e.seq or None,
            e.pid or None, e.tid or None, rank, self.node,
        )

    def sched(self, e, rank=None) -> tuple:
        if isinstance(e, dict):
            return (e["timestamp_ns"], e["pid"], e.get("tid"), e["event"], e["duration_ns"], self.node,
                    rank, e.get("thread"), e.get("comm"), e.get("cpu"), e.get("op"))
        return (e.timestamp_real_ns, e.pid, e.tid, "runq_wait", e.duration_ns, self.node,
                rank, e.thread, e.thread_name, e.cpu, e.op or None)

    def sched_interval(self, e, rank=None) -> tuple:
        return (e.timestamp_real_ns, e.interval_ns, e.pid, e.thread, e.runq_wait_ns, e.switch_ins, self.node, rank)

    def row(self, event, rank=None) -> tuple[str, tuple | None]:
        """('nccl' | 'tcp' | 'sched' | 'sched_interval', fields) for a record; ('', None) for anything else."""
        what = table_of(event)
        if what == "nccl":
            return what, self.call(event)
        if what == "tcp":
            return what, self.tcp(event, rank)
        if what == "sched":
            return what, self.sched(event, rank)
        if what == "sched_interval":
            return what, self.sched_interval(event, rank)
        return "", None

    def as_dict(self, event, rank=None) -> dict:
        what, fields = self.row(event, rank)
        return dict(zip(FIELDS[what], fields)) if what else {}


def table_of(event) -> str:
    """Which table a record (or a pre-rendered dict) belongs to; '' for none."""
    if isinstance(event, CallEvent):
        return "nccl"
    if isinstance(event, TcpEvent):
        return "tcp"
    if isinstance(event, SchedEvent):
        return "sched"
    if isinstance(event, SchedInterval):
        return "sched_interval"
    if isinstance(event, dict):
        name = str(event.get("event", ""))
        if name.startswith("tcp_"):
            return "tcp"
        if "duration_ns" in event and "pid" in event and name:
            return "sched"
    return ""


_plain = Renderer()


def as_dict(event, node: str = "") -> dict:
    """A record as {field: value}, the recording's column names."""
    r = _plain if not node else Renderer(node)
    return r.as_dict(event)


def text(event) -> str:
    """One line for `trace`'s text output."""
    d = as_dict(event)
    ts = d.get("timestamp_ns") or 0
    stamp = time.strftime("%H:%M:%S", time.localtime(ts / 1e9)) + f".{(ts % 1_000_000_000) // 1000:06d}"
    if not isinstance(event, CallEvent):
        rest = " ".join(f"{k}={v}" for k, v in d.items() if k not in ("timestamp_ns", "node") and v is not None)
        return f"{stamp} {rest}"
    parts = [stamp, f"pid={d['pid']}", f"tid={d['tid']}", f"{d['op']:<22}",
             f"comm={d['comm_id_hash']}", f"rank={d['rank']}/{d['nranks']}"]
    if d["op"] in contract.COLLECTIVE_OPS.values():
        parts += [f"count={d['count']}", d["datatype"] or "", f"bytes={d['bytes']}"]
        if d["red_op"]:
            parts.append(d["red_op"])
        if d["root"] is not None:
            parts.append(f"root={d['root']}")
        if d["peer"] is not None:
            parts.append(f"peer={d['peer']}")
        parts.append(f"seq={d['seq']}")
    parts += [f"{d['duration_ns'] / 1e6:.3f}ms", d["result"]]
    return " ".join(parts)


def gpu_span_attributes(event) -> dict:
    """OTLP span attributes of a GpuCall, under span_attributes' names where
    the field is the same (nccl.comm_id_hash, the `comm` label, is NCCL's
    commHash, as on host spans), and nccl.clock = "gpu"."""
    out = {
        "nccl.op": event.op, "nccl.clock": "gpu", "nccl.comm_id_hash": _plain.comm(event.comm),
        "nccl.nccl_comm_hash": _plain.comm(event.comm),
        "nccl.seq": event.seq, "nccl.rank": event.rank,
        "nccl.nranks": event.nranks, "nccl.bytes": event.bytes, "nccl.kind": event.kind,
        "nccl.gpu_duration_ns": event.duration_ns,
        "process.pid": event.pid, "thread.id": event.tid,
    }
    if event.peer >= 0:
        out["nccl.peer"] = event.peer
    if event.enqueue_ns:
        out["nccl.enqueue_to_gpu_start_ns"] = event.start_ns - event.enqueue_ns
    top = top_network_wait(event.peer_waits)
    if top is not None:
        peer, direction, phase, wall_ns, share = top
        out.update({"nccl.network.peer": "other" if peer < 0 else peer, "nccl.network.direction": direction,
                    "nccl.network.phase": phase, "nccl.network.wait_ns": wall_ns,
                    "nccl.network.wait_share": round(share, 4)})
    return out


def top_network_wait(peer_waits) -> tuple | None:
    """The (peer, direction, phase) whose wall wait was longest in one
    operation's network figures, as (peer, direction, phase, wall_ns, share):
    share = its wall wait / the wall wait summed over every peer, direction and
    phase of the operation. None without figures (or all zero)."""
    best, total = None, 0
    for w in peer_waits:
        for phase, ns in zip(contract.NETWORK_PHASES[w.direction], w.wall_ns):
            total += ns
            if ns and (best is None or ns > best[3]):
                best = (w.peer, w.direction, phase, ns)
    if best is None or not total:
        return None
    return (*best, best[3] / total)


def span_attributes(event: CallEvent) -> dict:
    """OTLP span attributes of a call: its fields under 'nccl.' (None omitted),
    and the process/thread under the OpenTelemetry conventions' names."""
    d = as_dict(event)
    out = {f"nccl.{k}": v for k, v in d.items()
           if v is not None and k not in ("pid", "tid", "node", "timestamp_ns", "duration_ns")}
    out["process.pid"] = d["pid"]
    out["thread.id"] = d["tid"]
    return out

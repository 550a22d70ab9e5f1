"""Clock skew between nodes, estimated from the recording itself.

The ranks of one synchronous collective (same communicator, op and sequence
number) leave it within a short time of each other: the last rank's data
arrives and every rank's call returns. So, for two nodes A and B that took
part in the same collectives, `end_A - end_B` is their clock offset plus a
small, symmetric noise; the median over many collectives is a robust
estimate of the offset.

Method (docs/fleet.md):

- one end per (collective, node): the median of that node's ranks' call ends
  (host ends: `timestamp_ns + duration_ns`; calls block in the recorded
  libraries, so host ends are synchronised. GPU-interval ends would be used
  where a recording had them; none has yet, and `method` says which);
- at most MAX_COLLECTIVES per communicator and op: above that, every k-th
  sequence number (a fleet's merge need not read every call);
- the reference node is the one in the most collectives (ties: name order);
- each node's offset is the median of its differences to the reference over
  the collectives both took part in; a node sharing no collective with the
  reference is reached through nodes already estimated (breadth first),
  adding the medians along the way;
- causal bounds: no rank leaves a synchronous collective before every rank
  has arrived, so `node - reference` lies in [max(start_n - end_ref),
  min(end_n - start_ref)] over the collectives (`lower_ns`, `upper_ns`). Ends
  are not exactly simultaneous (in a ring the last chunk reaches the ranks one
  after another, and a lossy or starved rank's ends lag by a ms or more), so
  the more precise of the two is taken (`method` says which): where the
  bounds are narrower than 2 residuals of the ends, their middle; else the
  median of the ends, moved to the nearest bound if it falls outside (with
  one rank always last only one bound is tight, the other may be tens of ms
  away);
- `residual_ns`: the median absolute deviation of the differences around
  their median (how well the ends agree), `collectives`: how many were used.

An aligned timestamp is `timestamp_ns - offset_ns` of its node. Offsets are
stored by `merge` in the `clock_skew` table; readers use that table when it
is there, else estimate.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from exporter.records import contract
from exporter.sinks.recording.read import CLOCK_SKEW_COLUMNS, Recording, is_local_comm

# Collectives every rank of a communicator takes part in (not SEND/RECV).
# Synchronous collectives only: not point-to-point, not one-sided (put/signal/wait).
SYNC_OPS = tuple(op for op in contract.COLLECTIVE_OPS.values()
                 if op not in ("SEND", "RECV", "PUT_SIGNAL", "SIGNAL", "WAIT_SIGNAL"))
MIN_COLLECTIVES = 3
MAX_COLLECTIVES = 500  # per (comm, op): more are sampled by sequence number (every k-th)


@dataclass
class NodeOffset:
    node: str
    offset_ns: int          # node clock - reference clock
    reference: str
    collectives: int        # collectives compared (0: the reference itself, or not estimable)
    residual_ns: int        # median |difference - offset|
    method: str             # 'host call ends[...]' | 'causal bounds (...)' | 'reference' | 'none: ...'
    lower_ns: int | None = None   # causal bounds of the offset (None: unbounded)
    upper_ns: int | None = None

    def row(self) -> tuple:
        return (self.node, self.offset_ns, self.reference, self.collectives, self.residual_ns, self.method,
                self.lower_ns, self.upper_ns)


COLUMNS = CLOCK_SKEW_COLUMNS


def _ends(rec: Recording) -> dict[tuple, dict[str, tuple]]:
    """(comm, op, seq) -> node -> (median end, first end, last start) of its ranks' calls."""
    per: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    # Per communicator and op, at most MAX_COLLECTIVES sequence numbers (every k-th): served by the
    # (comm_id_hash, op, seq) index where there is one.
    for comm, op in rec.comm_ops():
        if is_local_comm(comm) or op not in SYNC_OPS:
            continue  # no job-wide id: its seq does not name one collective across processes
        seqs = rec.seq_range(comm, op)
        if seqs is None:
            continue
        lo, hi = seqs
        stride = max(1, -(-(hi - lo + 1) // MAX_COLLECTIVES))
        for seq, node, start, end in rec.calls_at(comm, op, list(range(lo, hi + 1, stride))):
            per[(comm, op, seq)][node].append((start, end))
    out = {}
    for key, nodes in per.items():
        if len(nodes) >= 2:
            out[key] = {n: (int(statistics.median(e for _, e in v)), min(e for _, e in v), max(s for s, _ in v))
                        for n, v in nodes.items()}
    return out


def _pair(ends, base: str, node: str):
    """node - base from the collectives both took part in: (estimate, count, residual, lower, upper, how)."""
    diffs, upper, lower = [], None, None
    for per_node in ends.values():
        b, n = per_node.get(base), per_node.get(node)
        if b is None or n is None:
            continue
        diffs.append(n[0] - b[0])
        # No rank leaves a synchronous collective before every rank has arrived:
        # end_n - o_n >= start_b - o_b  and  end_b - o_b >= start_n - o_n.
        u, lo = n[1] - b[2], -(b[1] - n[2])
        upper = u if upper is None else min(upper, u)
        lower = lo if lower is None else max(lower, lo)
    if len(diffs) < MIN_COLLECTIVES:
        return None
    est = statistics.median(diffs)
    resid = statistics.median(abs(x - est) for x in diffs)
    how = "host call ends"
    if lower > upper:
        how = "host call ends (causal bounds inconsistent: clock stepped or not synchronous)"
    elif upper - lower <= 2 * resid:
        # The bounds pin the offset closer than the ends agree (a ring's order, a lossy or
        # starved rank's late ends): their middle.
        est = (lower + upper) / 2
        how = "causal bounds (narrower than the host call ends' spread)"
    elif max(est - upper, lower - est) >= (upper - lower) / 2:
        # The ends' median lies outside the bounds by half their width or more: the ends
        # are off by at least what the bounds' middle can be (a starved rank's late
        # returns); any point they suggest is no better than the middle.
        est = (lower + upper) / 2
        how = "causal bounds (the host call ends' median is far outside them)"
    elif not lower <= est <= upper:
        # The ends' median broke causality by a little (e.g. one rank always last: one
        # tight bound, the other far): the true offset is near the tight bound.
        est = min(max(est, lower), upper)
        how = "host call ends, moved to the nearest causal bound"
    return int(round(est)), len(diffs), int(round(resid)), lower, upper, how


def estimate(rec: Recording) -> dict[str, NodeOffset]:
    """Per-node offsets against a reference node (see the module's text)."""
    nodes = rec.nodes()
    if len(nodes) <= 1:
        return {n: NodeOffset(n, 0, n, 0, 0, "reference", 0, 0) for n in nodes}
    ends = _ends(rec)
    count: dict[str, int] = defaultdict(int)
    for per_node in ends.values():
        for n in per_node:
            count[n] += 1
    ref = min(nodes, key=lambda n: (-count.get(n, 0), n))
    out = {ref: NodeOffset(ref, 0, ref, count.get(ref, 0), 0, "reference", 0, 0)}
    frontier = [ref]
    while frontier:
        nxt = []
        for base in frontier:
            b = out[base]
            for n in nodes:
                if n in out:
                    continue
                got = _pair(ends, base, n)
                if got is None:
                    continue
                est, k, resid, lo, up, how = got
                via = "" if base == ref else f" (through {base})"
                out[n] = NodeOffset(n, est + b.offset_ns, ref, k, resid, how + via,
                                    None if b.lower_ns is None else lo + b.lower_ns,
                                    None if b.upper_ns is None else up + b.upper_ns)
                nxt.append(n)
        frontier = nxt
    for n in nodes:
        if n not in out:
            out[n] = NodeOffset(n, 0, ref, 0, 0,
                                f"none: fewer than {MIN_COLLECTIVES} collectives shared with the others")
    return out


def stored(rec: Recording) -> dict[str, NodeOffset]:
    """The offsets `merge` stored (clock_skew table); {} if none."""
    return {r[0]: NodeOffset(*r) for r in rec.clock_skew()}


def offsets(rec: Recording, align: bool = True) -> dict[str, int]:
    """node -> offset_ns to subtract (all 0 when not aligning): stored, else estimated."""
    if not align:
        return defaultdict(int)
    found = stored(rec) or estimate(rec)
    out: dict[str, int] = defaultdict(int)
    out.update({n: o.offset_ns for n, o in found.items()})
    return out

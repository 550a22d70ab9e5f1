"""A hang in words: the one-line verdict and the evidence lines of `hang`'s
text output, and the Answer that carries both (its JSON form included)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from exporter.offline.analysis.hang.fetch import Read
from exporter.offline.analysis.hang.model import Call, Hang, Missing

def op_name(op: str) -> str:
    """ALL_REDUCE -> AllReduce (NCCL's own spelling of its collectives)."""
    return "".join(p.capitalize() for p in op.split("_")) or "?"


def short(comm: str) -> str:
    return comm[:8] + "…" if len(comm) == 16 and all(ch in "0123456789abcdef" for ch in comm) else comm


def call_name(op: str, seq: int | None) -> str:
    return f"{op_name(op)} #{seq}" if seq is not None else op_name(op)


def ranks_text(ranks: list[int]) -> str:
    """[1, 2, 3, 5] -> 'ranks 1–3, 5'; [0] -> 'rank 0'."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(f"{rs[i]}–{rs[j]}" if j >= i + 2 else ", ".join(map(str, rs[i:j + 1])))
        i = j + 1
    return "ranks " + ", ".join(parts)


def _ago(s: float) -> str:
    return "at an unknown time" if math.isnan(s) else f"{s:.1f} s ago"


def missing_text(h: Hang, m: Missing, first: bool) -> str:
    where = f" on {m.node or m.gone_from}" if (m.node or m.gone_from) else ""
    head = f"rank {m.rank}{where} never entered it" if first else f"rank {m.rank}{where}"
    parts = []
    if m.last_of_op is not None:
        seq, ago = m.last_of_op
        parts.append(f"its last {op_name(h.op)} #{seq} returned {_ago(ago)}")
    elif m.last is not None:
        parts.append(f"it made no {op_name(h.op)} on this communicator; its last call here, "
                     f"{call_name(m.last[0], m.last[1])}, returned {m.last[2]:.1f} s ago")
    else:
        parts.append("no call of it on this communicator was seen")
    for c, rank2 in m.elsewhere:
        parts.append(f"it is now in {call_name(c.op, c.seq)} on comm {short(c.comm)} (as rank {rank2}, "
                     f"for {c.age_s:.1f} s)")
    if m.gone_from:
        parts.append(f"its process is gone (the agent on {m.gone_from} counted its calls but lists no live "
                     f"communicator of it: it exited or crashed)")
    elif m.node is None:
        parts.append("no agent read shows its process (on a node not given with --metrics, or gone)")
    return head + ": " + ", ".join(parts)


def verdict(h: Hang) -> str:
    size = f"{h.nranks} ranks" if h.nranks else "size unknown"
    head = f"comm {short(h.comm)} ({size}): "
    on_gpu = " on their GPUs (the host calls returned at enqueue)" if all(c.gpu for c in h.waiting) else ""
    wait = (f"{ranks_text([c.rank for c in h.waiting])} waiting in {call_name(h.op, h.seq)}{on_gpu} "
            f"for {h.age_s:.1f} s")
    parts = [wait]
    if h.desync:
        by: dict[tuple[str, int | None], list[Call]] = defaultdict(list)
        for c in h.desync:
            by[(c.op, c.seq)].append(c)
        for (op, seq), cs in sorted(by.items(), key=lambda kv: kv[1][0].rank):
            if (op, seq) == (h.op, h.seq):  # the same call with another size: a wrong count
                for c in cs:
                    parts.append(f"desync: {ranks_text([c.rank])} in {call_name(op, seq)} with another count "
                                 f"({c.nbytes:.0f} bytes vs {h.nbytes:.0f}; for {c.age_s:.1f} s)")
                continue
            parts.append(f"desync: {ranks_text([c.rank for c in cs])} in {call_name(op, seq)} instead "
                         f"(for {max(c.age_s for c in cs):.1f} s)")
    if h.stopped:
        where = {"it" if (c.op, c.seq) == (h.op, h.seq) else call_name(c.op, c.seq) for c in h.stopped}
        parts.append(f"{ranks_text([c.rank for c in h.stopped])} "
                     f"({', '.join(c.node for c in h.stopped[:3])}) stopped inside {', '.join(sorted(where))}: "
                     f"its calling thread is stopped (SIGSTOP, a debugger), the others wait for it")
    for i, m in enumerate(h.missing):
        parts.append(missing_text(h, m, i == 0))
    if h.unseen:
        parts.append(f"{ranks_text(h.unseen)} not seen by the agents read (on other nodes: give "
                     f"every node's agent with --metrics)")
    if h.comm == "unknown" or h.comm.startswith("local-"):
        parts.append("which rank did not join cannot be told: the communicator was made before the agent "
                     "started, so each of its ranks has its own local id (start the agent before the job; "
                     "docs/communicators.md)")
    elif not h.desync and not h.missing and not h.unseen and not h.stopped:
        if h.unknown_members:
            parts.append("which ranks did not join is unknown: the communicator's size is not known "
                         "(its init was not seen; read every node's agent with --metrics)")
        else:
            parts.append("every rank entered it and it does not complete: a peer stuck inside NCCL or "
                         "a broken link (retransmits, resets)")
    return head + "; ".join(parts)


def evidence(h: Hang, others: list[Hang], r: Read, threshold_s: float) -> list[str]:
    lines = []
    w = ", ".join(f"{c.rank} on {c.node} ({c.age_s:.1f} s)" for c in h.waiting[:8])
    more = f" (+{len(h.waiting) - 8} more)" if len(h.waiting) > 8 else ""
    lines.append(f"waiting in {call_name(h.op, h.seq)} on comm {h.comm}: rank {w}{more}")
    if h.previous is not None:
        seq, ago = h.previous
        if any(c.gpu for c in h.waiting):
            lines.append(f"the latest {op_name(h.op)} enqueued on this communicator was #{seq}, {ago:.1f} s ago "
                         f"(its host call returned)")
        else:
            lines.append(f"the latest {op_name(h.op)} returned on this communicator was #{seq}, {ago:.1f} s ago: "
                         f"nothing of it has completed since")
    for m in h.missing[:2]:
        who = f"rank {m.rank}" + (f" (pid {m.pid} on {m.node})" if m.pid else "")
        facts = []
        if m.last is not None:
            facts.append(f"last call on this communicator {call_name(m.last[0], m.last[1])}, "
                         f"returned {m.last[2]:.1f} s ago")
        facts.append("process alive (its communicators are live)" if m.pid else
                     "process gone" if m.gone_from else "process not seen")
        facts.append(m.threads or "its threads' recent state unknown (no scheduler series)")
        lines.append(f"{who}: " + "; ".join(facts))
    if len(h.missing) > 2:
        lines.append(f"{len(h.missing) - 2} more ranks never entered it: "
                     f"{ranks_text([m.rank for m in h.missing[2:]])}")
    if others:
        lines.append(f"{len(others)} other communicator(s) with a call in flight >= {threshold_s:g} s: "
                     + ", ".join(f"{short(o.comm)} ({call_name(o.op, o.seq)}, {o.age_s:.1f} s)"
                                 for o in others[:3]))
    return lines[:4] + [read_summary(r)]


def read_summary(r: Read) -> str:
    s = f"read {len(r.answered)} agent(s): {', '.join(r.answered) or 'none'}"
    if r.errors:
        s += f"; not read: {'; '.join(r.errors)}"
    return s


@dataclass
class Answer:
    verdict: str
    evidence: list[str]
    hung: bool
    hangs: list[Hang]
    oldest_s: float
    in_flight: list[dict]
    answered: int = 0       # agents read

    def as_dict(self) -> dict:
        return {
            "verdict": self.verdict, "evidence": self.evidence, "hung": self.hung,
            "oldest_s": self.oldest_s, "in_flight": self.in_flight,
            "hangs": [{"comm": h.comm, "nranks": h.nranks, "op": h.op, "seq": h.seq, "age_s": h.age_s,
                       "waiting_ranks": [c.rank for c in h.waiting],
                       "bytes": h.nbytes,
                       "desync": [{"rank": c.rank, "op": c.op, "seq": c.seq, "age_s": c.age_s,
                                   "bytes": c.nbytes} for c in h.desync],
                       "unseen_ranks": h.unseen,
                       "stopped": [{"rank": c.rank, "node": c.node, "age_s": c.age_s} for c in h.stopped],
                       "missing": [{"rank": m.rank, "node": m.node or m.gone_from, "pid": m.pid,
                                    "alive": bool(m.pid), 
                                    "last": ({"op": m.last[0], "seq": m.last[1], "ago_s": m.last[2]}
                                             if m.last else None),
                                    "elsewhere": [{"comm": c.comm, "op": c.op, "seq": c.seq,
                                                   "rank": r2, "age_s": c.age_s}
                                                  for c, r2 in m.elsewhere],
                                    "threads": m.threads} for m in h.missing]}
                      for h in self.hangs],
        }

"""Ranks of a communicator first seen mid-job, aligned by their call sequence.

A recording made by an agent that attached after the job began has calls on
communicators it did not see created: `comm_id_hash` is `local-<pid>-<n>`
(one per process: docs/communicators.md) or `unknown` (before the agent
named it), and each rank's `seq` counts from the agent's attach, not from
the communicator's start. Which calls of different processes are one
collective is then found from the calls themselves (docs/fleet.md,
"Recordings that began mid-job"):

- a stream is one process's synchronous collective calls on one such
  communicator, in time order (its `unknown` calls join its only local
  communicator);
- every rank of a communicator makes the same sequence: same op order,
  counts and sizes; and the calls of one synchronous collective end at
  nearly the same moment on every rank (the last rank's data completes
  them all);
- so a stream is matched to the reference stream (the longest) at the index
  offset where every op and size agree and the median difference of the
  call ends is smallest, and below half the reference's median spacing
  between calls (else the offset is ambiguous and the stream is left out).
  Streams that match no reference start a group of their own (another
  communicator).

Each group becomes one communicator, labelled `<reference>~aligned`, whose
collectives are numbered by the reference's call index.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

MAX_OFFSET = 64          # call-index offsets tried between two streams
SAMPLE = 200             # calls of a stream compared at each offset
MIN_MATCH = 0.95         # share of compared calls whose op and size must agree


@dataclass
class Loose:
    """One call on a communicator without a job-wide id."""
    comm: str
    op: str
    rank: int
    node: str
    pid: int
    bytes: int | None
    start: int      # aligned ns
    end: int        # aligned ns
    row: tuple      # whatever the caller needs to build its arrival


def is_local(comm: str | None) -> bool:
    return not comm or comm == "unknown" or comm.startswith("local-")


def _streams(calls: list[Loose]) -> dict[tuple, list[Loose]]:
    by: dict[tuple, list[Loose]] = defaultdict(list)
    for c in calls:
        by[(c.node, c.pid, c.comm)].append(c)
    # A process's `unknown` calls (before the agent named the communicator)
    # belong to its only local communicator, when it has one.
    for (node, pid, comm) in [k for k in by if k[2] in ("unknown", "")]:
        mine = [k for k in by if k[0] == node and k[1] == pid and k[2] not in ("unknown", "")]
        if len(mine) == 1:
            by[mine[0]] += by.pop((node, pid, comm))
    for s in by.values():
        s.sort(key=lambda c: c.start)
    return by


def _offset(s: list[Loose], ref: list[Loose], spacing: float) -> int | None:
    """The index offset k (s[i] is ref[i + k]) where the sequences agree and the ends
    are closest, or None."""
    best = None
    n = min(len(s), SAMPLE)
    for k in range(-MAX_OFFSET, MAX_OFFSET + 1):
        pairs = [(s[i], ref[i + k]) for i in range(n) if 0 <= i + k < len(ref)]
        if len(pairs) < min(n, 3):
            continue
        same = sum(1 for a, b in pairs if a.op == b.op and a.bytes == b.bytes)
        if same < MIN_MATCH * len(pairs):
            continue
        diff = statistics.median(abs(a.end - b.end) for a, b in pairs)
        if best is None or diff < best[0]:
            best = (diff, k)
    if best is None or best[0] >= spacing / 2:
        return None
    return best[1]


def align(calls: list[Loose], launcher_rank: dict | None = None) -> list[tuple[str, str, int, int, Loose]]:
    """[(communicator label, op, index, rank, call)] of the calls that could be
    aligned. rank: the row's rank (the launcher's, where the communicator was
    its process's only one), else the process's launcher rank
    (launcher_rank[(node, pid)], from the recording's processes table),
    else the stream's position in its group."""
    launcher_rank = launcher_rank or {}
    streams = sorted(_streams(calls).items(), key=lambda kv: (-len(kv[1]), kv[0]))
    groups: list[tuple[list[Loose], list[tuple[tuple, list[Loose], int]]]] = []
    for key, s in streams:
        if len(s) < 2:
            continue
        for ref, members in groups:
            gaps = [b.start - a.start for a, b in zip(ref, ref[1:])]
            k = _offset(s, ref, statistics.median(gaps) if gaps else 0)
            if k is not None and all(m[0][:2] != key[:2] for m in members):
                members.append((key, s, k))
                break
        else:
            groups.append((s, [(key, s, 0)]))
    out = []
    for _ref, members in groups:
        if len(members) < 2:
            continue
        label = f"{members[0][0][2]}~aligned"
        for pos, (_key, s, k) in enumerate(sorted(members, key=lambda m: (m[1][0].rank, m[0]))):
            for i, c in enumerate(s):
                rank = c.rank if c.rank >= 0 else launcher_rank.get((c.node, c.pid))
                out.append((label, c.op, i + k, pos if rank is None else rank, c))
    return out

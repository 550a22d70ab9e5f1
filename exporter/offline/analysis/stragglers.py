"""Who arrives last at synchronous collectives, and what was happening to it.

A collective is one (comm_id_hash, op, seq): the same call on every rank of
the communicator. In a synchronous collective the rank that arrives LAST
makes the others wait, and its own call is SHORT: so a rank's arrival is its
call's start (`timestamp_ns`, aligned for clock skew, skew.py), never its
duration.

Definitions (docs/fleet.md):

- arrival: the call's start, minus its node's clock offset;
- lag of a collective: last arrival - median arrival of its ranks (the time
  the typical rank waited for the last one; the median is not moved by one
  early rank, as the first arrival would be);
- a rank's window for one collective: from the end of its caller thread's
  previous NCCL call to the end of this one (its compute before arriving plus
  the call itself; a thread's windows tile its timeline, so nothing is
  counted twice). Without a previous call: the call itself;
- retransmits in a window: tcp_events `tcp_retransmit_skb` on sockets owned
  by the rank's process (same node and pid);
- run-queue waits in a window: sched_events of the rank's process's caller
  and NCCL proxy threads that became runnable in it (the summed wait); when
  the recording has no sched_events, its sched_intervals (`--sched totals`:
  each ~1 s interval's wait spread evenly over it, the share that falls in
  the window: an estimate, `runq_estimated`); with neither, the calls' own
  `runq_wait_ns`.

Only collectives seen on at least two ranks are counted; `complete` says
whether every rank of the communicator was in the recording (a single node's
recording of a multi-node job sees only its own ranks: merge first).
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from exporter.offline.analysis import align as midjob
from exporter.offline.analysis import skew
from exporter.offline.analysis.skew import SYNC_OPS
from exporter.sinks.recording.read import Recording


@dataclass(slots=True)
class Arrival:
    rank: int
    node: str
    pid: int
    tid: int
    start: int          # aligned ns
    end: int            # aligned ns
    window_start: int   # aligned ns
    raw_start: int
    raw_window: tuple   # (start, end) on the node's own clock: tcp/sched rows are on it
    bytes: int | None
    runq_in_call: int | None
    retransmits: int = 0
    runq_wait_ns: int = 0
    runq_measured: bool = True  # False: recorded without scheduler waits
    runq_estimated: bool = False  # spread from --sched totals' ~1 s intervals (sched_intervals)
    links: dict | None = None  # link -> retransmits in the window


@dataclass
class Collective:
    comm: str
    op: str
    seq: int
    nranks: int
    arrivals: list[Arrival]   # by arrival time

    @property
    def last(self) -> Arrival:
        return self.arrivals[-1]

    @property
    def median_arrival(self) -> float:
        return statistics.median(a.start for a in self.arrivals)

    @property
    def lag_ns(self) -> int:
        return int(self.last.start - self.median_arrival)

    @property
    def spread_ns(self) -> int:
        return self.last.start - self.arrivals[0].start

    @property
    def complete(self) -> bool:
        return len({a.rank for a in self.arrivals}) >= self.nranks > 0


@dataclass
class RankStats:
    comm: str
    op: str
    rank: int
    node: str
    pid: int
    collectives: int = 0
    arrivals: int = 0       # ranks that arrived, summed over its collectives
    last: int = 0
    lags_when_last: list = field(default_factory=list)
    offsets: list = field(default_factory=list)      # own arrival - median arrival, every collective
    retransmits: int = 0
    retransmits_when_last: int = 0
    runq_wait_ns: int = 0
    runq_wait_when_last_ns: int = 0
    runq_measured: bool = True
    runq_estimated: bool = False
    links_when_last: dict = field(default_factory=lambda: defaultdict(int))
    durations: list = field(default_factory=list)

    @property
    def last_share(self) -> float:
        return self.last / self.collectives if self.collectives else 0.0

    @property
    def chance_last(self) -> float:
        """How often it would be last by chance: one over the ranks arriving in its collectives
        (fewer than the communicator's where a rank is missing from them)."""
        return self.collectives / self.arrivals if self.arrivals else 1.0

    @property
    def median_lag_ns(self) -> int:
        return int(statistics.median(self.lags_when_last)) if self.lags_when_last else 0

    @property
    def median_offset_ns(self) -> int:
        return int(statistics.median(self.offsets)) if self.offsets else 0


class _Series:
    """Sorted (timestamp, value) per key, with prefix sums: sums over windows in O(log n)."""

    def __init__(self):
        self._raw: dict = defaultdict(list)
        self._ready: dict = {}

    def add(self, key, ts, value=1, tag=None):
        self._raw[key].append((ts, value, tag))

    def _get(self, key):
        s = self._ready.get(key)
        if s is None:
            rows = sorted(self._raw.get(key, ()), key=lambda r: r[0])
            ts = [r[0] for r in rows]
            cum = [0]
            for r in rows:
                cum.append(cum[-1] + r[1])
            s = self._ready[key] = (ts, cum, [r[2] for r in rows])
        return s

    def window(self, key, lo, hi) -> tuple[int, int, int]:
        """(sum, first index, end index) of the rows with lo <= ts <= hi."""
        ts, cum, _ = self._get(key)
        i, j = bisect.bisect_left(ts, lo), bisect.bisect_right(ts, hi)
        return cum[j] - cum[i], i, j

    def tags(self, key, i, j):
        return self._get(key)[2][i:j]


class _Spread:
    """Per key, amounts each spread evenly over an interval [start, start + length]:
    the share of them that falls in a window (O(log n) plus the intervals it touches)."""

    def __init__(self):
        self._raw: dict = defaultdict(list)
        self._ready: dict = {}

    def add(self, key, start, length, amount):
        self._raw[key].append((start, max(length, 1), amount))

    def window(self, key, lo, hi) -> float:
        ready = self._ready.get(key)
        if ready is None:
            rows = sorted(self._raw.get(key, ()))
            ready = self._ready[key] = ([r[0] for r in rows], rows, max((r[1] for r in rows), default=0))
        starts, rows, longest = ready
        total = 0.0
        for i in range(bisect.bisect_left(starts, lo - longest), bisect.bisect_right(starts, hi)):
            start, length, amount = rows[i]
            overlap = min(hi, start + length) - max(lo, start)
            if overlap > 0:
                total += amount * overlap / length
        return total


def load(rec: Recording, align: bool = True, comm: str | None = None,
         op: str | None = None) -> tuple[list[Collective], dict[str, int]]:
    """The collectives of a recording, each rank's arrival and window evidence."""
    offsets = skew.offsets(rec, align)
    groups: dict[tuple, list[Arrival]] = defaultdict(list)
    nranks_of: dict[tuple, int] = {}
    loose: list[midjob.Loose] = []
    # Every call of each caller thread, with the previous call's end (the window start).
    for call in rec.calls(kind="call", previous_end=True, order=""):
        c, o, seq, rank, nranks, node = call.comm, call.op, call.seq, call.rank, call.nranks, call.node
        if o not in SYNC_OPS or seq is None:
            continue
        local = midjob.is_local(c)
        if (comm and not local and not c.startswith(comm)) or (op and o != op):
            continue
        pid, tid, ts, nbytes, rq, prev_end = call.pid, call.tid, call.timestamp_ns, call.bytes, \
            call.runq_wait_ns, call.previous_end_ns
        off = offsets[node]
        end = ts + call.duration_ns
        wstart = prev_end if prev_end is not None and prev_end <= ts else ts
        if local:  # a communicator first seen mid-job: aligned by call sequence below
            loose.append(midjob.Loose(c or "unknown", o, -1 if rank is None else rank, node, pid, nbytes,
                                     ts - off, end - off, (tid, wstart, end, ts, rq, off)))
            continue
        groups[(c, o, seq)].append(Arrival(rank, node, pid, tid, ts - off, end - off, wstart - off, ts,
                                           (wstart, end), nbytes, rq))
        nranks_of[(c, o, seq)] = max(nranks_of.get((c, o, seq), 0), nranks or 0)
    members: dict[str, set] = defaultdict(set)
    launcher = rec.launcher_ranks() if loose else {}
    for label, o, index, rank, lc in midjob.align(loose, launcher):
        if comm and not label.startswith(comm):
            continue
        tid, wstart, end, ts, rq, off = lc.row
        groups[(label, o, index)].append(Arrival(rank, lc.node, lc.pid, tid, lc.start, lc.end, wstart - off,
                                                 ts, (wstart, end), lc.bytes, rq))
        members[label].add((lc.node, lc.pid))
    for key in groups:
        if key[0] in members:
            nranks_of[key] = len(members[key[0]])
    collectives = []
    for key, arr in groups.items():
        if len(arr) < 2:
            continue
        arr.sort(key=lambda a: (a.start, a.rank))
        collectives.append(Collective(key[0], key[1], key[2], nranks_of[key], arr))
    collectives.sort(key=lambda c: (c.arrivals[0].start, c.comm, c.op, c.seq))
    _evidence(rec, collectives)
    return collectives, offsets


def _evidence(rec: Recording, collectives: list[Collective]) -> None:
    """Fill each arrival's retransmits and run-queue waits in its window."""
    tcp = _Series()
    for e in rec.tcp_events("tcp_retransmit_skb", order=""):
        tcp.add((e.node, e.pid), e.timestamp_ns, 1, f"{e.saddr}\u2192{e.daddr}")
    waits = _Series()
    have_sched = False
    for w in rec.waits(threads=("caller", "proxy"), order=""):
        waits.add((w.node, w.pid), w.timestamp_ns, w.duration_ns)
        have_sched = True
    spread = _Spread()
    # recorded with --sched totals (meta sched, schema 10 on): no row is no wait
    have_intervals = not have_sched and rec.meta().get("sched") == "totals"
    if not have_sched:
        for iv in rec.wait_intervals(threads=("caller", "proxy"), order=""):
            spread.add((iv.node, iv.pid), iv.timestamp_ns, iv.interval_ns, iv.runq_wait_ns)
            have_intervals = True
    for c in collectives:
        for a in c.arrivals:
            key = (a.node, a.pid)
            lo, hi = a.raw_window
            n, i, j = tcp.window(key, lo, hi)
            a.retransmits = n
            if n:
                a.links = {}
                for link in tcp.tags(key, i, j):
                    a.links[link] = a.links.get(link, 0) + 1
            if have_sched:
                a.runq_wait_ns = waits.window(key, lo, hi)[0]
            elif have_intervals:
                a.runq_wait_ns = round(spread.window(key, lo, hi))
                a.runq_estimated = True
            else:
                a.runq_wait_ns = a.runq_in_call or 0
                a.runq_measured = a.runq_in_call is not None


def what_there_is(rec: Recording) -> str:
    """The synchronous collectives a recording holds, by op and communicator, in one line
    (what a --op/--comm that matched nothing could have been)."""
    rows = rec.calls_by_comm(SYNC_OPS)
    if not rows:
        return "it holds no synchronous collective call"
    shown = ", ".join(f"{op} on {comm} ({n} calls)" for op, comm, n in rows[:6])
    return f"it holds {shown}" + (f" and {len(rows) - 6} more" if len(rows) > 6 else "")


def per_rank(collectives: list[Collective]) -> list[RankStats]:
    """Per (comm, op, rank): how often last, median lag when last, evidence in its windows."""
    complete = [c for c in collectives if c.complete]
    use = complete or collectives
    stats: dict[tuple, RankStats] = {}
    for c in use:
        med = c.median_arrival
        last = c.last
        lag = c.lag_ns
        for a in c.arrivals:
            s = stats.get((c.comm, c.op, a.rank))
            if s is None:
                s = stats[(c.comm, c.op, a.rank)] = RankStats(c.comm, c.op, a.rank, a.node, a.pid)
            s.collectives += 1
            s.arrivals += len(c.arrivals)
            s.offsets.append(a.start - med)
            s.retransmits += a.retransmits
            s.runq_wait_ns += a.runq_wait_ns
            s.runq_measured = s.runq_measured and a.runq_measured
            s.runq_estimated = s.runq_estimated or a.runq_estimated
            s.durations.append(a.end - a.start)
            if a is last:
                s.last += 1
                s.lags_when_last.append(lag)
                s.retransmits_when_last += a.retransmits
                s.runq_wait_when_last_ns += a.runq_wait_ns
                for link, n in (a.links or {}).items():
                    s.links_when_last[link] += n
    return sorted(stats.values(), key=lambda s: (s.comm, s.op, s.rank))


def worst_first(stats: list[RankStats]) -> list[RankStats]:
    """The (comm, op) with most ranks, then most collectives, first; in each, the rank most
    often last first."""
    most: dict[tuple, int] = defaultdict(int)
    ranks: dict[tuple, int] = defaultdict(int)
    for s in stats:
        most[(s.comm, s.op)] = max(most[(s.comm, s.op)], s.collectives)
        ranks[(s.comm, s.op)] += 1
    return sorted(stats, key=lambda s: (-ranks[(s.comm, s.op)], -most[(s.comm, s.op)], s.comm, s.op,
                                        -s.last, s.rank))


RANK_COLUMNS = ["comm", "op", "rank", "node", "pid", "collectives", "last", "last_pct", "median_lag_ms",
                "median_arrival_ms", "retransmits", "retransmits_when_last", "runq_wait_ms",
                "runq_wait_when_last_ms"]


def rank_rows(stats: list[RankStats]) -> list[tuple]:
    return [(s.comm, s.op, s.rank, s.node, s.pid, s.collectives, s.last, round(100 * s.last_share, 1),
             round(s.median_lag_ns / 1e6, 3), round(s.median_offset_ns / 1e6, 3), s.retransmits,
             s.retransmits_when_last, *((round(s.runq_wait_ns / 1e6, 3), round(s.runq_wait_when_last_ns / 1e6, 3))
                                        if s.runq_measured else (None, None)))
            for s in stats]


COLLECTIVE_COLUMNS = ["comm", "op", "seq", "ranks", "complete", "first_arrival_ns", "last_rank", "last_node",
                      "lag_ms", "spread_ms", "arrivals_ms"]


def collective_rows(collectives: list[Collective]) -> list[tuple]:
    out = []
    for c in collectives:
        first = c.arrivals[0].start
        arrivals = " ".join(f"r{a.rank}:+{(a.start - first) / 1e6:.3f}"
                            for a in sorted(c.arrivals, key=lambda a: a.rank))
        out.append((c.comm, c.op, c.seq, len(c.arrivals), int(c.complete), first, c.last.rank, c.last.node,
                    round(c.lag_ns / 1e6, 3), round(c.spread_ns / 1e6, 3), arrivals))
    return out

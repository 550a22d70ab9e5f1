"""Which rank never joined: the hang verdict of `nccl-exporter hang` and MCP `hang_status`.

Read from one or more agents' /metrics (each agent knows its own node):

- members of each communicator: `nccl_communicator_info` (rank, nranks, pid);
- the calls in flight: `nccl_inflight_oldest_seconds` (op, comm, rank, age);
- where each rank is in each (comm, op) sequence: `nccl_collective_last_seq`
  (its latest returned call; the call in flight is that + 1) and
  `nccl_collective_last_return_timestamp_seconds`;
- its threads over the last second: `nccl_offcpu_seconds_total` and
  `nccl_runqueue_delay_seconds_sum` of two reads `interval` apart.

A communicator is hung when a call on it has been in flight for at least the
threshold. Its ranks are then grouped by the (op, seq) they are in; the group
of most ranks is the one waiting, ranks in another (op, seq) of the same
communicator are desynchronised, and member ranks in none never entered it.
What each missing rank was last seen doing is said from the same series.
docs/alerts.md ("NcclRankMissing") is the same logic in PromQL.
"""

from __future__ import annotations

import math
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from exporter.records import contract, metrics

DEFAULT_THRESHOLD_S = 60.0
READ_TIMEOUT_S = 10.0
INTERVAL_S = 1.0        # between the two reads that give the threads' recent state
MAX_BYTES = 64 << 20    # of one /metrics page


class HangInputError(ValueError):
    """A bad URL or threshold: one line for the user."""


def default_url() -> str:
    return f"http://127.0.0.1:{contract.DEFAULT_PORT}/metrics"


def check_url(url) -> str:
    u = urllib.parse.urlsplit(url if isinstance(url, str) else "")
    if u.scheme not in ("http", "https") or not u.hostname:
        raise HangInputError(f"an http(s) URL of an agent's /metrics is needed, e.g. "
                             f"http://gpu-017:{contract.DEFAULT_PORT}/metrics, not {url!r}")
    return url


def check_threshold(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise HangInputError(f"threshold: seconds >= 0, not {value!r}")
    return float(value)


# --- reading the agents ----------------------------------------------------------------

WANTED = {metrics.COMMUNICATOR_INFO, metrics.INFLIGHT_OLDEST, metrics.COLLECTIVE_LAST_SEQ,
          metrics.COLLECTIVE_LAST_RETURN, metrics.OFFCPU, metrics.RUNQUEUE_DELAY + "_sum"}


@dataclass
class Read:
    """The samples of interest of one read of several agents."""
    at: float                                   # unix time of the read
    samples: list[tuple[str, dict, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)   # "URL: why"
    answered: list[str] = field(default_factory=list)


def read(urls: list[str], timeout: float = READ_TIMEOUT_S) -> Read:
    from prometheus_client.parser import text_string_to_metric_families

    out = Read(at=time.time())
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                text = r.read(MAX_BYTES).decode("utf-8", "replace")
        except (OSError, ValueError) as e:
            out.errors.append(f"{url}: {getattr(e, 'reason', None) or e}")
            continue
        try:
            got = [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text)
                   for s in fam.samples if s.name in WANTED]
        except ValueError as e:
            out.errors.append(f"{url}: not a Prometheus exposition ({e})")
            continue
        out.samples += got
        out.answered.append(url)
    return out


# --- the model -----------------------------------------------------------------------

@dataclass(frozen=True)
class Where:
    node: str
    pid: str


@dataclass
class Call:
    comm: str
    op: str
    rank: int
    node: str
    age_s: float
    seq: int | None      # None: this rank's earlier calls of this op are unknown


@dataclass
class Missing:
    rank: int
    node: str | None
    pid: str | None
    last: tuple[str, int, float] | None           # (op, seq, seconds ago) on this communicator
    last_of_op: tuple[int, float] | None          # (seq, seconds ago) of the hung op
    elsewhere: list[tuple[Call, int]]             # calls it is in on other communicators (call, rank there)
    threads: str | None                           # its threads over the last interval, in words
    gone_from: str | None = None                  # the node whose agent counted its calls but lists
                                                  # no live communicator of it: its process exited


@dataclass
class Hang:
    comm: str
    nranks: int | None
    op: str
    seq: int | None
    waiting: list[Call]
    desync: list[Call]                            # member ranks in another (op, seq) of this comm
    missing: list[Missing]
    unknown_members: bool                         # the communicator's size is not known
    unseen: list[int] = field(default_factory=list)  # members no agent read knows anything of
    previous: tuple[int, float] | None = None     # (seq, seconds ago) of the op's latest return on it

    @property
    def age_s(self) -> float:
        return max(c.age_s for c in self.waiting)


class Model:
    def __init__(self, first: Read, second: Read | None = None):
        self.now = (second or first).at
        last = second or first
        self.info: dict[tuple[str, int], Where] = {}            # (comm, rank) -> process
        self.nranks: dict[str, int] = {}
        self.proc_comms: dict[Where, list[tuple[str, int]]] = defaultdict(list)
        self.launcher_rank: dict[Where, str] = {}
        self.inflight: list[tuple[str, str, int, str, float]] = []   # comm, op, rank, node, age
        self.last_seq: dict[tuple[str, str, int], int] = {}
        self.last_ret: dict[tuple[str, str, int], float] = {}
        self.series_node: dict[tuple[str, int], str] = {}   # (comm, rank) -> node of its call series
        for name, lab, v in last.samples:
            rank = _int(lab.get("rank"))
            comm = lab.get("comm", "")
            if name == metrics.COMMUNICATOR_INFO and rank is not None:
                w = Where(lab.get("node", ""), lab.get("pid", ""))
                self.info[(comm, rank)] = w
                self.proc_comms[w].append((comm, rank))
                if lab.get("launcher_rank"):
                    self.launcher_rank[w] = lab["launcher_rank"]
                n = _int(lab.get("nranks"))
                if n is not None:
                    self.nranks[comm] = max(self.nranks.get(comm, 0), n)
            elif name == metrics.INFLIGHT_OLDEST and rank is not None:
                self.inflight.append((comm, lab.get("op", ""), rank, lab.get("node", ""), v))
            elif name == metrics.COLLECTIVE_LAST_SEQ and rank is not None:
                k = (comm, lab.get("op", ""), rank)
                self.last_seq[k] = max(self.last_seq.get(k, -1), int(v))
                self.series_node[(comm, rank)] = lab.get("node", "")
            elif name == metrics.COLLECTIVE_LAST_RETURN and rank is not None:
                k = (comm, lab.get("op", ""), rank)
                self.last_ret[k] = max(self.last_ret.get(k, 0.0), v)
        # Threads: (node, process rank label, thread kind) -> (off-CPU s, run-queue s) moved.
        self.threads: dict[tuple[str, str, str], tuple[float, float]] = {}
        self.interval = (second.at - first.at) if second else 0.0
        if second:
            before = _sched(first)
            for k, (off, runq) in _sched(second).items():
                if k in before:
                    self.threads[k] = (off - before[k][0], runq - before[k][1])

    def seq_in_flight(self, comm: str, op: str, rank: int) -> int | None:
        last = self.last_seq.get((comm, op, rank))
        return None if last is None else last + 1

    def call(self, comm, op, rank, node, age) -> Call:
        return Call(comm, op, rank, node, age, self.seq_in_flight(comm, op, rank))

    def process_rank(self, w: Where) -> str | None:
        """The `rank` label of the scheduler series of a process: its launcher
        rank, else its rank in its largest communicator (exporter/sources/processes.py)."""
        if w in self.launcher_rank:
            return self.launcher_rank[w]
        mine = self.proc_comms.get(w) or []
        if not mine:
            return None
        comm, rank = max(mine, key=lambda cr: self.nranks.get(cr[0], 0))
        return str(rank)

    def threads_of(self, w: Where) -> str | None:
        if not self.interval:
            return None
        r = self.process_rank(w)
        got = {kind: v for (node, rank, kind), v in self.threads.items() if node == w.node and rank == r}
        if not got:
            return None
        off, runq = got.get("caller", (0.0, 0.0))
        proxy_runq = got.get("proxy", (0.0, 0.0))[1]
        iv = self.interval
        if runq + proxy_runq >= 0.2 * iv:
            state = "starved of CPU"
        elif off >= 0.8 * iv:
            state = "asleep or blocked outside NCCL (I/O, a lock, a sleep, a debugger)"
        else:
            state = "running (computing outside NCCL)"
        return (f"its calling thread was off-CPU {off:.2f} s of the last {iv:.1f} s and waited "
                f"{runq * 1e3:.0f} ms for a CPU (NCCL's proxy threads {proxy_runq * 1e3:.0f} ms): {state}")

    # --- the verdicts -----------------------------------------------------------------

    def hangs(self, threshold_s: float) -> list[Hang]:
        by_comm: dict[str, list[Call]] = defaultdict(list)
        for comm, op, rank, node, age in self.inflight:
            by_comm[comm].append(self.call(comm, op, rank, node, age))
        out = []
        for comm, calls in by_comm.items():
            if max(c.age_s for c in calls) < threshold_s or comm in ("overflow",):
                continue
            groups: dict[tuple[str, int | None], list[Call]] = defaultdict(list)
            for c in calls:
                groups[(c.op, c.seq)].append(c)
            (op, seq), waiting = max(groups.items(), key=lambda kv: (len(kv[1]), max(c.age_s for c in kv[1])))
            desync = [c for k, g in groups.items() if k != (op, seq) for c in g]
            n = self.nranks.get(comm)
            if comm == "unknown" or comm.startswith("local-"):
                # Made before the agent started: each rank has its own id here, so the
                # communicator's other ranks cannot be found (docs/communicators.md).
                out.append(Hang(comm, n, op, seq, sorted(waiting, key=lambda c: c.rank),
                                sorted(desync, key=lambda c: c.rank), [], unknown_members=True))
                continue
            seen = {c.rank for c in calls} | {r for (cm, r) in self.info if cm == comm}
            members = set(range(n)) if n else seen
            in_flight = {c.rank for c in calls}
            known = seen | {r for (cm, _o, r) in self.last_seq if cm == comm}
            missing = [self.missing(comm, op, r) for r in sorted((members - in_flight) & known)]
            unseen = sorted(members - in_flight - known)
            done = [(self.last_seq.get((cm, o, r), -1), t) for (cm, o, r), t in self.last_ret.items()
                    if cm == comm and o == op]
            previous = None
            if done:
                sq, t = max(done, key=lambda x: x[1])
                previous = (sq, max(0.0, self.now - t))
            out.append(Hang(comm, n, op, seq, sorted(waiting, key=lambda c: c.rank),
                            sorted(desync, key=lambda c: c.rank), missing, unknown_members=not n,
                            unseen=unseen, previous=previous))
        out.sort(key=lambda h: -h.age_s)
        return out

    def missing(self, comm: str, op: str, rank: int) -> Missing:
        w = self.info.get((comm, rank))
        mine = [(o, self.last_seq.get((comm, o, rank), -1), t)
                for (cm, o, r), t in self.last_ret.items() if cm == comm and r == rank]
        last = None
        if mine:
            o, s, t = max(mine, key=lambda x: x[2])
            last = (o, s, max(0.0, self.now - t))
        last_of_op = None
        if (comm, op, rank) in self.last_seq:
            t = self.last_ret.get((comm, op, rank))
            last_of_op = (self.last_seq[(comm, op, rank)], max(0.0, self.now - t) if t else math.nan)
        elsewhere = []
        if w is not None:
            for comm2, rank2 in self.proc_comms.get(w, []):
                if comm2 == comm:
                    continue
                for cm, o, r, node, age in self.inflight:
                    if cm == comm2 and r == rank2:
                        elsewhere.append((self.call(cm, o, r, node, age), rank2))
        gone = self.series_node.get((comm, rank)) if w is None else None
        return Missing(rank, w.node if w else None, w.pid if w else None, last, last_of_op,
                       elsewhere, self.threads_of(w) if w else None, gone_from=gone)


def _sched(r: Read) -> dict[tuple[str, str, str], tuple[float, float]]:
    out: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, lab, v in r.samples:
        k = (lab.get("node", ""), lab.get("rank", ""), lab.get("thread", ""))
        if name == metrics.OFFCPU:
            out[k][0] += v
        elif name == metrics.RUNQUEUE_DELAY + "_sum":
            out[k][1] += v
    return {k: (a, b) for k, (a, b) in out.items()}


def _int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


# --- words ----------------------------------------------------------------------------

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
    wait = (f"{ranks_text([c.rank for c in h.waiting])} waiting in {call_name(h.op, h.seq)} "
            f"for {h.age_s:.1f} s")
    parts = [wait]
    if h.desync:
        by: dict[tuple[str, int | None], list[Call]] = defaultdict(list)
        for c in h.desync:
            by[(c.op, c.seq)].append(c)
        for (op, seq), cs in sorted(by.items(), key=lambda kv: kv[1][0].rank):
            parts.append(f"desync: {ranks_text([c.rank for c in cs])} in {call_name(op, seq)} instead "
                         f"(for {max(c.age_s for c in cs):.1f} s)")
    for i, m in enumerate(h.missing):
        parts.append(missing_text(h, m, i == 0))
    if h.unseen:
        parts.append(f"{ranks_text(h.unseen)} not seen by the agents read (on other nodes: give "
                     f"every node's agent with --metrics)")
    if h.comm == "unknown" or h.comm.startswith("local-"):
        parts.append("which rank did not join cannot be told: the communicator was made before the agent "
                     "started, so each of its ranks has its own local id (start the agent before the job; "
                     "docs/communicators.md)")
    elif not h.desync and not h.missing and not h.unseen:
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
                       "desync": [{"rank": c.rank, "op": c.op, "seq": c.seq, "age_s": c.age_s}
                                  for c in h.desync],
                       "unseen_ranks": h.unseen,
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


def analyse(first: Read, second: Read | None, threshold_s: float) -> Answer:
    model = Model(first, second)
    last = second or first
    calls = sorted(({"node": n, "op": o, "comm": c, "rank": r, "oldest_s": a}
                    for c, o, r, n, a in model.inflight), key=lambda d: -d["oldest_s"])
    oldest = calls[0]["oldest_s"] if calls else 0.0
    hangs = model.hangs(threshold_s)
    if hangs:
        h = hangs[0]
        return Answer(verdict(h), evidence(h, hangs[1:], last, threshold_s), True, hangs, oldest, calls,
                      len(last.answered))
    if not last.answered:
        v = "no agent answered: " + "; ".join(last.errors)
    elif calls:
        v = f"not hung: the oldest NCCL call in flight is {oldest:.3f} s old (threshold {threshold_s:g} s)"
    else:
        v = f"not hung: no NCCL call in flight ({metrics.INFLIGHT_OLDEST} absent)"
    return Answer(v, [read_summary(last)], False, [], oldest, calls, len(last.answered))


def hang_status(urls: list[str], threshold_s: float = DEFAULT_THRESHOLD_S,
                interval_s: float = INTERVAL_S, timeout: float = READ_TIMEOUT_S) -> Answer:
    """Two reads of every agent `interval_s` apart (the second only when the
    first shows a hang: the threads' recent state), then the verdict."""
    urls = [check_url(u) for u in urls]
    threshold_s = check_threshold(threshold_s)
    first = read(urls, timeout)
    second = None
    if interval_s > 0 and first.answered and Model(first).hangs(threshold_s):
        time.sleep(interval_s)
        second = read(urls, timeout)
        if not second.answered:
            second = None
    return analyse(first, second, threshold_s)

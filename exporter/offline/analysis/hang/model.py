"""The model of a hang: who is in which (op, seq) on which communicator, and
what the ranks that never entered it were last seen doing (the package's
docstring says how the verdict is reached)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from exporter.offline.analysis.hang.fetch import Read
from exporter.records import metrics

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
    stopped: bool = False  # its calling thread is stopped (nccl_inflight_stopped_seconds)
    gpu: bool = False      # in flight on its GPU only: the host call returned at enqueue
    nbytes: float | None = None  # its size (nccl_inflight_bytes); None: not exported


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
    desync: list[Call]                            # member ranks in another (op, seq) of this comm, or
                                                  # in the same one with another size than most
    missing: list[Missing]
    unknown_members: bool                         # the communicator's size is not known
    unseen: list[int] = field(default_factory=list)  # members no agent read knows anything of
    previous: tuple[int, float] | None = None     # (seq, seconds ago) of the op's latest return on it
    stopped: list[Call] = field(default_factory=list)  # in it with their threads stopped, while
                                                       # others wait in it running: the culprits

    nbytes: float | None = None                   # the size most waiting ranks called it with

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
        self.gpu_inflight: dict[tuple[str, str, int], tuple[str, float]] = {}  # (comm, op, rank) -> node, age
        self._calls: list[Call] | None = None
        self.last_seq: dict[tuple[str, str, int], int] = {}
        self.last_ret: dict[tuple[str, str, int], float] = {}
        self.series_node: dict[tuple[str, int], str] = {}   # (comm, rank) -> node of its call series
        self.stopped: set[tuple[str, str, int]] = set()     # (comm, op, rank) whose caller is stopped
        self.nbytes: dict[tuple[str, str, int], float] = {}  # (comm, op, rank) -> in-flight call's size
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
            elif name == metrics.GPU_INFLIGHT_OLDEST and rank is not None:
                k = (comm, lab.get("op", ""), rank)   # queued or running: the rank joined it
                self.gpu_inflight[k] = (lab.get("node", ""), max(v, self.gpu_inflight.get(k, ("", 0.0))[1]))
            elif name == metrics.INFLIGHT_BYTES and rank is not None:
                self.nbytes[(comm, lab.get("op", ""), rank)] = v
            elif name == metrics.INFLIGHT_STOPPED and rank is not None:
                self.stopped.add((comm, lab.get("op", ""), rank))
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
        return Call(comm, op, rank, node, age, self.seq_in_flight(comm, op, rank),
                    stopped=(comm, op, rank) in self.stopped, nbytes=self.nbytes.get((comm, op, rank)))

    def calls(self) -> list[Call]:
        """Every call in flight: inside NCCL on the host, or on the GPU only (the profiler
        plugin's nccl_gpu_inflight_oldest_seconds, queued or running). On a GPU the host
        call returns once enqueued, so a GPU-side hang has nothing in flight on the host:
        its seq is then the rank's latest returned call of the op, the one enqueued."""
        if self._calls is None:
            self._calls = [self.call(*t) for t in self.inflight]
            on_host = {(c.comm, c.op, c.rank) for c in self._calls}
            for (comm, op, rank), (node, age) in self.gpu_inflight.items():
                if (comm, op, rank) not in on_host:
                    self._calls.append(Call(comm, op, rank, node, age, self.last_seq.get((comm, op, rank)),
                                            gpu=True))
        return self._calls

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
        for c in self.calls():
            by_comm[c.comm].append(c)
        out = []
        for comm, calls in by_comm.items():
            if max(c.age_s for c in calls) < threshold_s or comm in ("overflow",):
                continue
            groups: dict[tuple[str, int | None], list[Call]] = defaultdict(list)
            for c in calls:
                groups[(c.op, c.seq)].append(c)
            (op, seq), waiting = max(groups.items(), key=lambda kv: (len(kv[1]), max(c.age_s for c in kv[1])))
            desync = [c for k, g in groups.items() if k != (op, seq) for c in g]
            # Same op, same seq, another count: desync too, named against the size most
            # of them called it with (a tie names no one).
            size = _majority([c.nbytes for c in waiting if c.nbytes is not None])
            if size is not None:
                desync += [c for c in waiting if c.nbytes is not None and c.nbytes != size]
                waiting = [c for c in waiting if c.nbytes is None or c.nbytes == size]
            # A rank whose calling thread is stopped is stuck where it was stopped: late in a
            # collective, a seq behind peers that finished their part of it. Stopped, no desync.
            behind = [c for c in desync if c.stopped]
            desync = [c for c in desync if not c.stopped]
            n = self.nranks.get(comm)
            if comm == "unknown" or comm.startswith("local-"):
                # Made before the agent started: each rank has its own id here, so the
                # communicator's other ranks cannot be found (docs/communicators.md).
                out.append(Hang(comm, n, op, seq, sorted(waiting, key=lambda c: c.rank),
                                sorted(desync, key=lambda c: c.rank), [], unknown_members=True, nbytes=size))
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
            # stopped ranks are the culprits only while a peer waits for them, running: in the
            # call, or (its peers there got their data and returned) in their next collective on
            # another communicator of its process. A pause of every rank at once stops them all.
            peer_runs = any(not c.stopped for c in waiting)
            stopped = [c for c in waiting + behind
                       if c.stopped and (peer_runs or self.waited_for_elsewhere(c, threshold_s))]
            out.append(Hang(comm, n, op, seq, sorted(waiting, key=lambda c: c.rank),
                            sorted(desync, key=lambda c: c.rank), missing, unknown_members=not n,
                            unseen=unseen, previous=previous, stopped=sorted(stopped, key=lambda c: c.rank),
                            nbytes=size))
        out.sort(key=lambda h: -h.age_s)
        return out

    def waited_for_elsewhere(self, c: Call, min_age_s: float) -> bool:
        """Whether a call on another communicator of c's process has been in flight min_age_s
        (hang's threshold; NcclRankStopped's 10 s), its thread running (that alert's second
        condition)."""
        w = self.info.get((c.comm, c.rank))
        others = {cm for cm, _r in self.proc_comms.get(w, []) if cm != c.comm} if w else set()
        return any(o.comm in others and not o.stopped and o.age_s >= min_age_s for o in self.calls())

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
                for c in self.calls():
                    if c.comm == comm2 and c.rank == rank2:
                        elsewhere.append((c, rank2))
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


def _majority(values: list[float]) -> float | None:
    """The value more than half of `values` have, if their values differ; else None."""
    if len(set(values)) < 2:
        return None
    best = max(set(values), key=values.count)
    return best if 2 * values.count(best) > len(values) else None


def _int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None

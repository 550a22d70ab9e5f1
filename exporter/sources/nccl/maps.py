"""The reader of bpf/nccl.c: its maps and ring buffer as records (exporter/records/events.py).
Everything downstream consumes these records and never touches BCC. Reading never writes
kernel state; `forget_dead_processes` is for the agent's loop."""

from __future__ import annotations

import time
from dataclasses import dataclass

from exporter.records import contract
from exporter.records.events import CallEvent, Communicator, InflightCall, Series, local_comm_hash
from exporter.sources.base import Source
from exporter.sources.processes import alive_checker, thread_stopped
from exporter.sources.bpf import ClockOffset, forget_dead
from exporter.sources.nccl.exits import ExitLog

NAMING_INTERVAL_S = 1.0  # tick: communicators of a job that began before the agent are named this often
STOPPED_AFTER_NS = 1_000_000_000  # a caller's thread state is read once its call is in flight this long


@dataclass(frozen=True)
class AsyncState:
    """A communicator's async error state, as its last ncclCommGetAsyncError saw it."""

    pid: int
    comm_ptr: int     # the ncclComm_t pointer in that process
    comm: int         # 0: unknown to the agent
    nccl_comm_hash: int
    rank: int
    nranks: int
    result: str       # ncclResult_t name (ncclInProgress is normal for non-blocking comms)
    polls: int        # successful polls
    changes: int      # times the result changed
    changed_ns: int   # CLOCK_MONOTONIC of the last change
    last_ns: int      # CLOCK_MONOTONIC of the last poll


class NcclReader(Source):
    """Reads bpf/nccl.c's maps; decodes its ring buffer's call records.
    on_series_freed(slots): told of the series slots prune freed (the slow-call
    policy forgets their thresholds: agent/slow.py)."""

    def __init__(self, probes, clock: ClockOffset | None = None):
        self.probes = probes  # an NcclProbes (exporter/sources/nccl/probes.py)
        self.bpf = probes.bpf
        self.clock = clock or ClockOffset()
        # series key -> (calls, monotonic time it was last active): expire_series
        self._activity: dict[tuple, tuple[int, float]] = {}
        # Calls begun from this CLOCK_MONOTONIC ns on have their waits measured (bpf/sched.c
        # set up); None: never (`--sched totals`). Others carry None (NULL), never 0 or a part.
        self.waits_from_ns: int | None = 0
        self._local_next: dict[int, int] = {}   # pid -> local communicator ids given
        self._local: dict[tuple[int, int], tuple[int, int, int]] = {}  # (pid, ptr) -> hash, rank, nranks
        self._pending: set[tuple[int, int]] = set()  # named, not yet in the kernel's map
        self.identity = None                    # pid -> launcher identity (the ProcessTable's)
        self.announced = None                   # () -> the profiler plugin's PluginComm list
        self._announced: dict[int, list] = {}   # pid -> its announced communicators, this turn
        self._tgids: dict[int, int] = {}        # thread id -> process id
        self.on_series_freed = None
        self._next_naming = 0.0
        self.exit_log = ExitLog()  # ranks whose process ended holding a communicator

    # --- the agent's loop (sources/base.py) ----------------------------------

    def tick(self, now: float) -> None:
        if now >= self._next_naming:
            self._next_naming = now + NAMING_INTERVAL_S
            with self.lock:  # communicators of a job that began before the agent
                self.name_unknown_comms()

    def prune(self, ttl: float, rank_label) -> None:
        # exits first: the communicators of a process that just ended are still in the map
        self.exit_log.collect(self.probes["process_exits"], self.communicators(), self.clock)
        self.exit_log.expire(ttl)
        self.forget_dead_processes()
        self.forget_local_names(alive_checker())
        freed = self.expire_series(ttl)
        if freed and self.on_series_freed is not None:
            self.on_series_freed(freed)

    def losses(self) -> dict[str, int]:
        return {"kernel_nccl_events": self.counter("EVENTS_LOST")}

    def series(self) -> list[Series]:
        """Every series in the kernel: those of series_index, the lifecycle
        series (one per op) and the overflow series (comm
        contract.SERIES_OVERFLOW_COMM, one per collective op) that counted calls."""
        out = []
        stats = self.probes["series_stats"]
        for k, slot in self.probes["series_index"].items():
            v = stats[stats.Key(slot.value)]
            if v.key.op != k.op or v.key.comm_hash != k.comm_hash:
                continue  # being recycled by expire_series right now
            out.append(
                Series(
                    op=contract.op_name(k.op),
                    comm=k.comm_hash,
                    rank=k.rank,
                    nranks=k.nranks,
                    calls=v.calls,
                    bytes=v.bytes,
                    sum_ns=v.sum_ns,
                    buckets=tuple(v.buckets),
                    slot=slot.value,
                    last_ns=v.last_ns,
                    next_seq=v.next_seq,
                )
            )
        # Fixed slots past the capacity: a collective op's overflow series, a
        # lifecycle op's one series.
        capacity = self.probes.series_capacity
        lifecycle = contract.OP_CODES["GET_UNIQUE_ID"]
        for op in range(contract.OP_COUNT):
            v = stats[stats.Key(capacity + op)]
            if v.calls:
                out.append(Series(op=contract.op_name(op),
                                  comm=contract.SERIES_OVERFLOW_COMM if op < lifecycle else 0,
                                  rank=-1, nranks=-1, calls=v.calls, bytes=v.bytes, sum_ns=v.sum_ns,
                                  buckets=tuple(v.buckets), slot=capacity + op))
        return out

    def expire_series(self, ttl: float, now: float | None = None, proc: str = "/proc") -> list[int]:
        """Delete the series of ended communicators from the kernel maps and
        free their slots; returns the freed slots. A collective series is
        active while its communicator is in `communicators` for a living
        process, or its call count moves; `ttl` seconds after it was last
        active it goes (Prometheus marks it stale). Lifecycle series (one per
        op) stay. For the agent's loop; never called by a scrape.

        Recycling is safe for the kernel side: a slot's key is cleared before
        the slot is pushed back on `series_free`, and a thread's cached slot is
        used only while the slot's key is still its series (bpf/nccl.c)."""
        now = time.monotonic() if now is None else now
        is_alive = alive_checker(proc)
        live_comms = {c.comm for c in self.communicators() if is_alive(c.pid)}
        index = self.probes["series_index"]
        stats = self.probes["series_stats"]
        seen, expired = {}, []
        for k, slot in list(index.items()):
            if k.op >= contract.OP_CODES["GET_UNIQUE_ID"]:
                continue
            key = (k.comm_hash, k.rank, k.nranks, k.op, k.pid)
            calls = stats[stats.Key(slot.value)].calls
            before = self._activity.get(key)
            if before is None or before[0] != calls or (k.comm_hash and k.comm_hash in live_comms):
                seen[key] = (calls, now)
            elif now - before[1] >= ttl:
                expired.append((k, slot.value))
                continue
            else:
                seen[key] = before
        self._activity = seen  # keys no longer in the map are forgotten
        if not expired:
            return []
        for k, _slot in expired:
            try:
                del index[k]
            except KeyError:
                pass
        gen = self.probes["comm_generation"]  # threads drop their cached slots
        gen[gen.Key(0)] = gen.Leaf(gen[gen.Key(0)].value + 1)
        threshold = self.probes["series_threshold"]
        free = self.probes["series_free"]
        slots = []
        for _k, slot in expired:
            stats[stats.Key(slot)] = stats.Leaf()  # key, counts and buckets: zero
            threshold[threshold.Key(slot)] = threshold.Leaf(0)
            free.push(free.Leaf(slot))
            slots.append(slot)
        return slots

    def errors(self) -> dict[tuple[str, str], int]:
        """Failed calls by (op, result name): call_errors_fast holds NCCL's own
        results (slot op * ERROR_RESULTS + result), call_errors any other."""
        out: dict[tuple[str, str], int] = {}
        for slot, n in self.probes["call_errors_fast"].items_lookup_batch():  # plain ints
            if n:
                op, result = divmod(slot, contract.ERROR_RESULTS)
                out[(contract.op_name(op), contract.result_name(result))] = n
        for k, v in self.probes["call_errors"].items():
            key = (contract.op_name(k.op), contract.result_name(k.result))
            out[key] = out.get(key, 0) + v.value
        return out

    def communicators(self) -> list[Communicator]:
        """The kernel's communicators; comm is the `comm` label (NCCL's
        commHash where known, bpf/traced.h comm_label). The BPF structs keep
        their C names: comm (the pointer: comm_ptr here), comm_hash, nccl_hash."""
        return [Communicator(pid=k.tgid, comm_ptr=k.comm, comm=v.nccl_hash or v.comm_hash,
                             nccl_comm_hash=v.nccl_hash, rank=v.rank, nranks=v.nranks)
                for k, v in self.probes["communicators"].items()]

    def exits(self) -> list:
        """Ranks whose process ended holding a communicator (exits.py), for the series TTL."""
        return self.exit_log.exits()

    def async_errors(self) -> list[AsyncState]:
        """The last ncclCommGetAsyncError result of every polled communicator."""
        return [
            AsyncState(pid=k.tgid, comm_ptr=k.comm, comm=v.comm_hash, nccl_comm_hash=v.nccl_hash,
                       rank=v.rank, nranks=v.nranks, result=contract.result_name(v.result),
                       polls=v.polls, changes=v.changes, changed_ns=v.changed_ns, last_ns=v.last_ns)
            for k, v in self.probes["async_errors"].items()
        ]

    def forget_dead_processes(self, proc: str = "/proc") -> int:
        """Drop communicators of processes that are gone; returns how many.
        Also the traced_processes and proxy_wait entries of processes that are
        gone: the kernel deletes them at the process's exit, but user space may
        add a process again after that (it learns a short job's processes from
        events it reads after they exited)."""
        n = forget_dead(self.probes["communicators"], proc)
        for name in ("async_errors", "traced_processes", "proxy_wait"):
            forget_dead(self.probes[name], proc)
        return n

    def _call_slots(self) -> list:
        """(thread id, struct call) of every thread's call slot: its
        inflight_fast slot (owner: the thread id, 0 = free) or its `inflight`
        entry (bpf/traced.h)."""
        slots = [(v.owner, v) for _, v in self.probes["inflight_fast"].items_lookup_batch() if v.owner]
        return slots + [(k.value, v) for k, v in self.probes["inflight"].items()]

    def inflight(self) -> list[InflightCall]:
        """The calls in progress, from the threads' call slots; `comm` is the label (bpf/traced.h
        comm_label). op 0: the thread's slot is idle; start 0: being filled."""
        now = time.monotonic_ns()
        return [InflightCall(tid=tid, op=contract.op_name(v.op), comm=v.nccl_hash or v.comm_hash, rank=v.rank,
                             nranks=v.nranks, start_ns=v.start_ns,
                             stopped=now - v.start_ns > STOPPED_AFTER_NS and thread_stopped(tid),
                             nbytes=v.count * contract.datatype_size(v.datatype))
                for tid, v in self._call_slots() if v.op and v.start_ns]

    def name_unknown_comms(self, proc: str = "/proc") -> int:
        """Give every communicator the agent did not see created (it attached
        mid-job) a local id, comm="local-<pid>-<n>", and add it to the
        kernel's `communicators` map so that later calls on it are labelled
        with it (docs/communicators.md, "Communicators made before the
        agent"). Pointers come from the call events (every call while
        recording: `decode_event` names them at once) and from the threads'
        call slots, which keep the communicator each thread used last
        (`cached_comm`; `cached_hash` 0: unknown), read once per loop turn.
        Returns how many were written. For the agent's loop."""
        self._announced = {}
        if self.announced is not None:
            for a in self.announced():
                self._announced.setdefault(a.pid, []).append(a)
        for tid, v in self._call_slots():
            ptr = v.cached_comm
            if not ptr or v.cached_hash or v.cached_gen == (1 << 64) - 1:
                continue
            tgid = self._tgid(tid, proc)
            if tgid and (tgid, ptr) not in self._local:
                self._name(tgid, ptr)
        if not self._pending:
            return 0
        table = self.probes["communicators"]
        written = 0
        for (tgid, ptr) in sorted(self._pending):
            h, rank, nranks = self._local[(tgid, ptr)]
            now = table.get(table.Key(tgid, 0, ptr))
            if now is not None and now.nccl_hash:
                continue  # the profiler plugin named it meanwhile (bpf/plugin.c bind_call)
            leaf = table.Leaf()
            leaf.comm_hash, leaf.rank, leaf.nranks = h, rank, nranks
            if h >> 40 != contract.LOCAL_COMM_TAG:
                leaf.nccl_hash = h  # NCCL's, from the plugin (own id = NCCL's: a later record may correct it)
            try:
                table[table.Key(tgid, 0, ptr)] = leaf
                written += 1
            except Exception:  # noqa: BLE001 - map full: the calls stay "unknown" in the kernel's series
                pass
        self._pending.clear()
        if written:
            gen = self.probes["comm_generation"]  # threads re-read their cached identity
            gen[gen.Key(0)] = gen.Leaf(gen[gen.Key(0)].value + 1)
        return written

    def _name(self, tgid: int, ptr: int) -> tuple[int, int, int] | None:
        """The local id (and rank, nranks) of an unknown communicator, given on first sight.
        Where the profiler plugin announced exactly one live communicator for
        the process, that is it: NCCL's commHash, rank and size. Else, where it
        is the process's only communicator (no other known or named one), its
        rank and size are the launcher's (RANK/WORLD_SIZE,
        SLURM_PROCID/SLURM_NTASKS, ...); else unknown (-1)."""
        known = {k.comm for k in self.probes["communicators"].keys() if k.tgid == tgid}
        if ptr in known:
            return None
        only = self._announced.get(tgid, [])
        if len(only) == 1 and only[0].nranks > 0:
            a = only[0]
            self._local[(tgid, ptr)] = got = (a.comm, a.rank, a.nranks)
            self._pending.add((tgid, ptr))
            return got
        n = self._local_next.get(tgid, 0) + 1
        if n > 0xFFFF:
            return None
        self._local_next[tgid] = n
        rank = nranks = -1
        if n == 1 and not known and self.identity is not None:
            who = self.identity(tgid) or {}
            if who.get("rank") is not None and who.get("world_size") is not None:
                rank, nranks = int(who["rank"]), int(who["world_size"])
        elif n == 2:
            # No longer the process's only communicator: which one is the world is
            # unknown, so the first loses the launcher's rank and size too.
            for key, (h, r, _nr) in list(self._local.items()):
                if key[0] == tgid and r >= 0 and h >> 40 == contract.LOCAL_COMM_TAG:
                    self._local[key] = (h, -1, -1)
                    self._pending.add(key)
        self._local[(tgid, ptr)] = got = (local_comm_hash(tgid, n), rank, nranks)
        self._pending.add((tgid, ptr))
        return got

    def _tgid(self, tid: int, proc: str) -> int:
        tgid = self._tgids.get(tid)
        if tgid is None:
            try:
                with open(f"{proc}/{tid}/status") as f:
                    tgid = next(int(line.split()[1]) for line in f if line.startswith("Tgid:"))
            except (OSError, StopIteration, ValueError, IndexError):
                return 0
            if len(self._tgids) > 65536:
                self._tgids.clear()
            self._tgids[tid] = tgid
        return tgid

    def forget_local_names(self, alive) -> None:
        """Drop the local names of processes that are gone."""
        for pid in [p for p in self._local_next if not alive(p)]:
            del self._local_next[pid]
        for key in [k for k in self._local if not alive(k[0])]:
            del self._local[key]
            self._pending.discard(key)
        self._tgids = {t: p for t, p in self._tgids.items() if alive(p)}

    def traced_pids(self) -> list[int]:
        """Processes the kernel side traces (`traced_processes`)."""
        return [k.value for k in self.probes["traced_processes"].keys()]

    def call_threads(self) -> set[int]:
        """Threads that hold an NCCL call slot (have called NCCL): the `caller` kind."""
        return {tid for tid, _ in self._call_slots()}

    def counters(self) -> dict[str, int]:
        return {name: self.counter(name) for name in contract.COUNTERS}

    def counter(self, name: str) -> int:
        """One slot of the shared `counters` array (contract.COUNTERS)."""
        table = self.probes["counters"]
        return table[table.Key(contract.COUNTERS[name])].value

    def decode_event(self, data) -> CallEvent:
        e = self.probes["events"].event(data)
        comm, rank, nranks = e.comm_hash, e.rank, e.nranks
        measured = self.waits_from_ns is not None and e.start_ns >= self.waits_from_ns
        if not comm and e.comm and e.kind == contract.EVENT_CALL:
            # A communicator made before the agent: its local id from this call on.
            named = self._local.get((e.pid, e.comm)) or self._name(e.pid, e.comm)
            if named:
                comm, rank, nranks = named
        return CallEvent(
            kind=e.kind,
            op=contract.op_name(e.op),
            pid=e.pid,
            tid=e.tid,
            start_ns=e.start_ns,
            end_ns=e.end_ns,
            start_real_ns=self.clock.to_realtime(e.start_ns),
            comm_ptr=e.comm,
            comm=comm,
            nccl_comm_hash=e.nccl_hash,
            seq=e.seq,
            rank=rank,
            nranks=nranks,
            count=e.count,
            bytes=e.bytes,
            datatype=e.datatype,
            red_op=e.red_op,
            root=e.root,
            peer=e.peer,
            stream=e.stream,
            result=e.result,
            color=e.color,
            runq_wait_ns=e.runq_wait_ns if measured else None,
            proxy_wait_ns=e.proxy_wait_ns if measured else None,
        )

    def on_event(self, callback) -> None:
        """Call `callback(CallEvent)` for each event, from poll()."""
        self.probes.open_ring("events", self.decode_event, callback)

    def poll(self, timeout_ms: int) -> None:
        self.probes.poll(timeout_ms)

"""The reader of bpf/nccl.c: its maps and ring buffer as records
(exporter/records/events.py).

Everything downstream (Prometheus collector, trace printer, span builder,
recorder) consumes these records and never touches BCC. Reading never
writes kernel state; `forget_dead_processes` is for the agent's loop.
"""

from __future__ import annotations

from exporter.records import contract
from exporter.records.events import CallEvent, Communicator, InflightCall, Series
from exporter.sources.bpf import ClockOffset, forget_dead
from exporter.sources.nccl.probes import MAP_CAPACITY


class NcclReader:
    """Reads bpf/nccl.c's maps; decodes its ring buffer's call records."""

    def __init__(self, probes, clock: ClockOffset | None = None):
        self.probes = probes  # an NcclProbes (exporter/sources/nccl/probes.py)
        self.bpf = probes.bpf
        self.clock = clock or ClockOffset()

    def series(self) -> list[Series]:
        out = []
        stats = self.probes["series_stats"]
        for k, slot in self.probes["series_index"].items():
            v = stats[stats.Key(slot.value)]
            out.append(
                Series(
                    op=contract.op_name(k.op),
                    comm_hash=k.comm_hash,
                    rank=k.rank,
                    nranks=k.nranks,
                    calls=v.calls,
                    bytes=v.bytes,
                    sum_ns=v.sum_ns,
                    buckets=tuple(v.buckets),
                    slot=slot.value,
                )
            )
        return out

    def errors(self) -> dict[tuple[str, str], int]:
        return {
            (contract.op_name(k.op), contract.result_name(k.result)): v.value
            for k, v in self.probes["call_errors"].items()
        }

    def communicators(self) -> list[Communicator]:
        return [
            Communicator(
                pid=k.tgid,
                handle=k.comm,
                comm_hash=v.comm_hash,
                nccl_hash=v.nccl_hash,
                rank=v.rank,
                nranks=v.nranks,
            )
            for k, v in self.probes["communicators"].items()
        ]

    def forget_dead_processes(self, proc: str = "/proc") -> int:
        """Drop communicators of processes that are gone; returns how many."""
        return forget_dead(self.probes["communicators"], proc)

    def inflight(self) -> list[InflightCall]:
        return [
            InflightCall(
                tid=k.value,
                op=contract.op_name(v.op),
                comm_hash=v.comm_hash,
                rank=v.rank,
                nranks=v.nranks,
                start_ns=v.start_ns,
            )
            for k, v in self.probes["inflight"].items()
            if v.op and v.start_ns  # op 0: the thread's slot is idle; start 0: being filled
        ]

    def counters(self) -> dict[str, int]:
        table = self.probes["counters"]
        return {name: table[table.Key(slot)].value for name, slot in contract.COUNTERS.items()}

    def fill(self) -> dict[str, tuple[int, int]]:
        """map name -> (entries, capacity)."""
        out = {}
        for name, cap in MAP_CAPACITY.items():
            try:
                out[name] = (sum(1 for _ in self.bpf[name].keys()), cap)
            except KeyError:  # a probe file that is not part of this build
                continue
        return out

    def decode_event(self, data) -> CallEvent:
        e = self.probes["events"].event(data)
        return CallEvent(
            kind=e.kind,
            op=contract.op_name(e.op),
            pid=e.pid,
            tid=e.tid,
            start_ns=e.start_ns,
            end_ns=e.end_ns,
            start_real_ns=self.clock.to_realtime(e.start_ns),
            comm=e.comm,
            comm_hash=e.comm_hash,
            nccl_hash=e.nccl_hash,
            seq=e.seq,
            rank=e.rank,
            nranks=e.nranks,
            count=e.count,
            bytes=e.bytes,
            datatype=e.datatype,
            red_op=e.red_op,
            root=e.root,
            peer=e.peer,
            stream=e.stream,
            result=e.result,
            color=e.color,
            runq_wait_ns=e.runq_wait_ns,
            proxy_wait_ns=e.proxy_wait_ns,
        )

    def on_event(self, callback) -> None:
        """Call `callback(CallEvent)` for each event, from poll()."""
        self.probes.open_ring("events", self.decode_event, callback)

    def poll(self, timeout_ms: int) -> None:
        self.probes.poll(timeout_ms)

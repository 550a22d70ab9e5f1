"""The NCCL call surface: bpf/nccl.c compiled with BCC and attached to libraries.

One `NcclProbes` per agent. `attach(path)` puts a uprobe and a uretprobe on
every public NCCL function the library exports, once per address: `ncclX` is
a weak alias of `pncclX`, and two probes on one address would count every
call twice.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from exporter.records import contract
from exporter.sources.bpf import Program, set_tracepoint
from exporter.sources.nccl.elf import exported_functions


def entry_stub(op: str, layout: str) -> str:
    return f"enter_{op.lower()}_{layout}"


def generated_stubs() -> str:
    """One uprobe entry function per (op, argument layout) of the contract."""
    stubs = sorted({(op, layout) for op, layout in contract.NCCL_FUNCTIONS.values()})
    return "".join(
        f"int {entry_stub(op, layout)}(struct pt_regs *ctx) "
        f"{{ return enter_{layout}(ctx, OP_{op}); }}\n"
        for op, layout in stubs
    )


# Capacity of each map this program owns, for nccl_exporter_map_capacity.
MAP_CAPACITY = {
    "series_index": contract.MAX_SERIES,
    "communicators": contract.MAX_COMMS,
    "inflight": contract.MAX_THREADS,
    "call_errors": contract.MAX_ERRORS,
    "traced_processes": contract.MAX_PROCESSES,
    "async_errors": contract.MAX_COMMS,
}


@dataclass
class AttachReport:
    """What happened when one library was attached."""

    path: str
    attached: dict[str, str] = field(default_factory=dict)  # function -> op
    aliases: dict[str, str] = field(default_factory=dict)   # function -> the one probed at its address
    missing: list[str] = field(default_factory=list)        # not exported by this library
    failed: dict[str, str] = field(default_factory=dict)    # function -> error


GETPGID = "syscalls:sys_enter_getpgid"  # bpf/nccl.c's door for trace_threads()


class NcclProbes(Program):
    """bpf/nccl.c compiled, and the libraries it is attached to. It owns the
    maps shared with the other programs (bpf/traced.h): load it first."""

    def __init__(self, extra_cflags: tuple[str, ...] = (), series_capacity: int | None = None):
        """series_capacity: how many (op, comm, rank, nranks) series the kernel
        holds at once (default contract.MAX_SERIES); more are counted in one
        overflow series per op. The duration histogram layout is the one
        selected in exporter.records.histogram when this is made."""
        capacity = int(series_capacity or contract.MAX_SERIES)
        if not 1 <= capacity <= 1 << 20:
            raise ValueError(f"series capacity {capacity}: between 1 and {1 << 20}")
        self.series_capacity = capacity
        super().__init__("nccl", extra_source=generated_stubs(),
                         extra_cflags=(f"-DSERIES_CAPACITY={capacity}", *extra_cflags))
        MAP_CAPACITY["series_index"] = capacity
        self.reports: list[AttachReport] = []
        self._attached_files: set[tuple[int, int]] = set()
        free = self["series_free"]
        for slot in range(capacity):
            free.push(free.Leaf(slot))
        me = self["agent_tgid"]
        me[me.Key(0)] = me.Leaf(os.getpid())
        # Attached only while trace_process() asks (see trace_threads): a
        # syscall tracepoint sends every syscall of every task on the node
        # through the kernel's slow syscall path while it is attached.
        set_tracepoint(self.bpf, GETPGID, False)
        self._getpgid_lock = threading.Lock()
        # Load (verify) every uprobe program now instead of at the first attach:
        # a library mapped later is attached in the time its perf events take.
        from bcc import BPF

        for fn in sorted({entry_stub(op, layout) for op, layout in contract.NCCL_FUNCTIONS.values()}):
            self.bpf.load_func(fn, BPF.KPROBE)
        self.bpf.load_func("on_return", BPF.KPROBE)

    def attach(self, path: str) -> AttachReport | None:
        """Probe every public NCCL function of `path`; None if already done."""
        st = os.stat(path)
        file_id = (st.st_dev, st.st_ino)
        if file_id in self._attached_files:
            return None
        exported = exported_functions(path)
        report = AttachReport(path=path)
        by_address: dict[int, str] = {}
        for function, (op, layout) in contract.NCCL_FUNCTIONS.items():
            address = exported.get(function, exported.get("p" + function))
            if address is None:
                report.missing.append(function)
                continue
            if address in by_address:
                report.aliases[function] = by_address[address]
                continue
            by_address[address] = function
            try:
                # The return probe first: a call that enters once the entry probe
                # is attached must find its return probe there too (a call with
                # no return seen is recovered only at the thread's next call).
                self.bpf.attach_uretprobe(name=path, addr=address, fn_name="on_return")
                self.bpf.attach_uprobe(name=path, addr=address, fn_name=entry_stub(op, layout))
            except Exception as e:
                report.failed[function] = str(e)
                continue
            report.attached[function] = op
        self._attached_files.add(file_id)
        self.reports.append(report)
        return report

    # --- settings written into the kernel ---------------------------------

    def set_record_all(self, on: bool) -> None:
        cfg = self["event_config"]
        cfg[cfg.Key(contract.OP_COUNT)] = cfg.Leaf(1 if on else 0)

    def set_slow_threshold(self, op: str, threshold_ns: int) -> None:
        cfg = self["event_config"]
        cfg[cfg.Key(contract.OP_CODES[op])] = cfg.Leaf(int(threshold_ns))

    def trace_process(self, pid: int, rank: int | None, proc: str = "/proc") -> None:
        """Trace a process (it uses NCCL) and its existing threads; rank None: unknown."""
        table = self["traced_processes"]
        table[table.Key(pid)] = table.Leaf(-1 if rank is None else int(rank))
        try:
            tids = [int(t) for t in os.listdir(f"{proc}/{pid}/task")]
        except OSError:
            tids = [pid]
        self.trace_threads(tids)
        gen = self["comm_generation"]  # threads re-read their cached identity
        gen[gen.Key(0)] = gen.Leaf(gen[gen.Key(0)].value + 1)

    def trace_threads(self, tids) -> None:
        """Set threads' traced_threads bits. Not a read-modify-write of the
        map: getpgid(tid) from this process enters bpf/nccl.c's
        sys_enter_getpgid program, which sets the bit atomically, as the
        kernel's own fork/exit updates do (no update of theirs is lost).
        That tracepoint is attached for these calls only."""
        with self._getpgid_lock:
            set_tracepoint(self.bpf, GETPGID, True)
            try:
                for tid in tids:
                    try:
                        os.getpgid(tid)
                    except OSError:  # the thread is gone (the bit is set all the same)
                        pass
            finally:
                set_tracepoint(self.bpf, GETPGID, False)

    def close(self) -> None:
        """Detach everything. Removing a uprobe waits for an RCU grace period
        (~0.2 s on 6.x kernels); done one by one, 64 probes take ~15 s, so
        they are closed in parallel and the grace periods overlap."""
        names = list(self.bpf.uprobe_fds)
        if names:
            with ThreadPoolExecutor(max_workers=min(32, len(names))) as pool:
                list(pool.map(self._detach_quietly, names))
        super().close()

    def _detach_quietly(self, name) -> None:
        try:
            self.bpf.detach_uprobe_event(name)
        except Exception:  # already gone; cleanup() retries what is left
            pass

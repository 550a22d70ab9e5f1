"""The NCCL call surface: bpf/nccl.c compiled with BCC and attached to libraries.

One `NcclProbes` per agent. `attach(path)` puts a uprobe and a uretprobe on
every public NCCL function the library exports, once per address: `ncclX` is
a weak alias of `pncclX`, and two probes on one address would count every
call twice. The probes of one file are two uprobe_multi links (the entry
program, each offset's cookie naming its op and argument layout, and the
return program: sources/uprobe_multi.py), made in milliseconds and let go
in one grace period; on kernels without them (before 6.6), one BCC perf
event per probe, with an entry program per op and layout.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from exporter.records import contract
from exporter.sources.base import Source
from exporter.sources.bpf import Program, set_tracepoint
from exporter.sources import uprobe_multi
from exporter.sources.nccl.elf import exported_functions, vaddrs_to_offsets

log = logging.getLogger("nccl_exporter")


def entry_stub(op: str, layout: str) -> str:
    return f"enter_{op.lower()}_{layout}"


LAYOUTS = sorted({layout for _op, layout in contract.NCCL_FUNCTIONS.values()})


def cookie(op: str, layout: str) -> int:
    """The uprobe_multi link's cookie of a function's entry probe: its op
    code (low 32 bits) and argument layout (high 32 bits), which
    `on_entry` (generated_entry) reads with bpf_get_attach_cookie."""
    return LAYOUTS.index(layout) << 32 | contract.OP_CODES[op]


def generated_entry() -> str:
    """The one entry program of the uprobe_multi links: every public function
    enters it, and its cookie says which op and argument layout (each
    layout's code is compiled once: ~40 % of the compile of one program per
    op and layout, which start-up waited for)."""
    cases = "".join(f"    case {i}: return enter_{layout}(ctx, op);\n" for i, layout in enumerate(LAYOUTS))
    return ("int on_entry(struct pt_regs *ctx) {\n"
            "    u64 cookie = bpf_get_attach_cookie(ctx);\n"
            "    u32 op = (u32)cookie;\n"
            "    switch (cookie >> 32) {\n" + cases + "    }\n    return 0;\n}\n")


def generated_stubs() -> str:
    """One uprobe entry function per (op, argument layout) of the contract:
    BCC's perf events (kernels without uprobe_multi links) carry no cookie."""
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


class NcclProbes(Program, Source):
    """bpf/nccl.c compiled, and the libraries it is attached to. It owns the
    maps shared with the other programs (bpf/traced.h): load it first."""

    def tracing(self) -> bool:
        """Whether the kernel side traces a process now (`traced_processes`)."""
        return next(iter(self["traced_processes"].keys()), None) is not None

    def __init__(self, extra_cflags: tuple[str, ...] = (), series_capacity: int | None = None,
                 links: bool | None = None):
        """series_capacity: how many (op, comm, rank, nranks) series the kernel
        holds at once (default contract.MAX_SERIES); more are counted in one
        overflow series per op. The duration histogram layout is the one
        selected in exporter.records.histogram when this is made. links:
        uprobe_multi links (one entry program, cookies) or BCC's perf events
        (one entry program per op and layout); None: links where the kernel
        has them (uprobe_multi.supported)."""
        capacity = int(series_capacity or contract.MAX_SERIES)
        if not 1 <= capacity <= 1 << 20:
            raise ValueError(f"series capacity {capacity}: between 1 and {1 << 20}")
        self.series_capacity = capacity
        self._multi_ok = uprobe_multi.supported() if links is None else links
        super().__init__("nccl", extra_source=generated_entry() if self._multi_ok else generated_stubs(),
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
        self._getpgid_detach: threading.Thread | None = None
        self._multi_progs: dict[str, int] = {}  # program -> fd loaded for uprobe_multi links
        self._links: list[int] = []  # uprobe_multi link fds (closing one detaches it)
        # Load (verify) the uprobe programs now instead of at the first attach:
        # a library mapped later is attached in the time its links take.
        if self._multi_ok:
            for fn in ("on_return", "on_entry"):
                self._multi_prog(fn)
        else:
            from bcc import BPF

            programs = sorted({entry_stub(op, layout) for op, layout in contract.NCCL_FUNCTIONS.values()})
            for fn in ("on_return", *programs):
                self.bpf.load_func(fn, BPF.KPROBE)

    def attach(self, path: str) -> AttachReport | None:
        """Probe every public NCCL function of `path`; None if already done."""
        st = os.stat(path)
        file_id = (st.st_dev, st.st_ino)
        if file_id in self._attached_files:
            return None
        exported = exported_functions(path)
        report = AttachReport(path=path)
        by_address: dict[int, str] = {}
        for function, (_op, _layout) in contract.NCCL_FUNCTIONS.items():
            address = exported.get(function, exported.get("p" + function))
            if address is None:
                report.missing.append(function)
                continue
            if address in by_address:
                report.aliases[function] = by_address[address]
                continue
            by_address[address] = function
        if self._multi_ok:
            self._attach_links(path, by_address, report)
        else:
            self._attach_perf_events(path, by_address, report)
        self._attached_files.add(file_id)
        self.reports.append(report)
        return report

    @property
    def link_fds(self) -> tuple[int, ...]:
        """The uprobe_multi links made so far (their /proc/PID/fdinfo lists
        each one's kind and file offsets)."""
        return tuple(self._links)

    @property
    def uses_links(self) -> bool:
        """Libraries are attached with uprobe_multi links (no BCC state changes)."""
        return self._multi_ok

    def _attach_links(self, path: str, by_address: dict[int, str], report: AttachReport) -> None:
        """All probes of `path` as two uprobe_multi links: the return
        program's first (a call entering once an entry probe is there must
        find its return probe too), then the entry program's, each offset
        with its function's cookie. Where the kernel refuses, nothing stays
        attached and every function is in report.failed (/-/ready says so)."""
        if not by_address:
            return
        offsets = vaddrs_to_offsets(path, list(by_address))
        cookies = [cookie(*contract.NCCL_FUNCTIONS[function]) for function in by_address.values()]
        made = []
        try:
            made.append(uprobe_multi.attach(self._multi_prog("on_return"), path, offsets, retprobe=True))
            made.append(uprobe_multi.attach(self._multi_prog("on_entry"), path, offsets, cookies=cookies))
        except OSError as e:
            for fd in made:
                os.close(fd)
            for function in by_address.values():
                report.failed[function] = str(e)
            return
        self._links.extend(made)
        for function in by_address.values():
            report.attached[function] = contract.NCCL_FUNCTIONS[function][0]

    def _multi_prog(self, name: str) -> int:
        fd = self._multi_progs.get(name)
        if fd is None:
            fd = self._multi_progs[name] = uprobe_multi.load(self.bpf, name)
        return fd

    def _attach_perf_events(self, path: str, by_address: dict[int, str], report: AttachReport) -> None:
        """One BCC perf event per probe (kernels without uprobe_multi links)."""
        for address, function in by_address.items():
            op, layout = contract.NCCL_FUNCTIONS[function]
            try:
                # The return probe first: a call that enters once the entry probe
                # is attached must find its return probe there too (a call with
                # no return seen is recovered only at the thread's next call).
                self.bpf.attach_uretprobe(name=path, addr=address, fn_name="on_return")
                self.bpf.attach_uprobe(name=path, addr=address, fn_name=entry_stub(op, layout))
            except Exception as e:  # noqa: BLE001 - one function's failure is in the report; the others attach
                report.failed[function] = str(e)
                continue
            report.attached[function] = op

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
                self._detach_getpgid()

    def _detach_getpgid(self) -> None:
        """Detach the getpgid tracepoint from another thread: the detach waits
        for RCU grace periods (~0.1 s), which the agent's loop, tracing a new
        process, must not wait for while another process maps a libnccl and
        calls it 100 ms later (tests/test_loader.py)."""
        def detach() -> None:
            with self._getpgid_lock:
                set_tracepoint(self.bpf, GETPGID, False)

        self._getpgid_detach = threading.Thread(target=detach, name="nccl-getpgid-detach", daemon=True)
        self._getpgid_detach.start()

    def close(self) -> None:
        """Detach everything. A uprobe_multi link lets go of all its probes
        in one grace period; a perf event's removal waits for its own
        (~0.1 s on 6.x kernels), so those are closed in parallel and the
        grace periods overlap."""
        if self._getpgid_detach is not None:
            self._getpgid_detach.join()
        names = list(self.bpf.uprobe_fds)
        closes = [*(lambda fd=fd: os.close(fd) for fd in self._links),
                  *(lambda name=name: self._detach_quietly(name) for name in names)]
        if closes:
            with ThreadPoolExecutor(max_workers=min(32, len(closes))) as pool:
                list(pool.map(lambda close: close(), closes))
        for fd in self._multi_progs.values():
            os.close(fd)
        self._links, self._multi_progs = [], {}
        super().close()

    def _detach_quietly(self, name) -> None:
        try:
            self.bpf.detach_uprobe_event(name)
        except Exception:  # noqa: BLE001 - already gone; cleanup() retries what is left
            pass

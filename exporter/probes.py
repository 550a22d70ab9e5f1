"""The NCCL probe set: compile bpf/nccl.c with BCC and attach it to libraries.

One `NcclProbes` per agent. `attach(path)` puts a uprobe and a uretprobe on
every public NCCL function the library exports, once per address: `ncclX` is
a weak alias of `pncclX`, and two probes on one address would count every
call twice.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import contract, histogram
from .elf import exported_functions

# Map sizes: the bounds on what the kernel side can hold (and so on the
# cardinality of what is exported). A full map is counted, never fatal.
MAX_SERIES = 2048      # (op, comm, rank, nranks) series: series_index / series_stats
MAX_COMMS = 4096       # live communicators, all processes
MAX_THREADS = 16384    # threads inside an NCCL call at one time
MAX_ERRORS = 512       # (op, result) pairs
MAX_PROCESSES = 4096   # processes with a known launcher rank
EVENT_PAGES = 256      # ring buffer: 1 MiB
MAX_SOCKETS = 65536    # sock_owner: sockets of traced processes (bpf/tcp.c)
MAX_LINKS = 4096       # tcp_links: (family, saddr, daddr, port, owner) series
TCP_EVENT_PAGES = 64   # tcp_events ring buffer: 256 KiB
MAX_SCHED_THREADS = 65536  # thread_sched: scheduler state of traced threads (bpf/sched.c)
SCHED_EVENT_PAGES = 256  # sched_events ring buffer (run-queue waits, recordings only): 1 MiB

# Slots of the `counters` array map.
COUNTERS = {
    "STATS_FULL": 0,
    "COMMS_FULL": 1,
    "INFLIGHT_FULL": 2,
    "ERRORS_FULL": 3,
    "EVENTS_LOST": 4,
    "SOCKETS_FULL": 5,
    "LINKS_FULL": 6,
    "TCP_EVENTS_LOST": 7,
    "SCHED_FULL": 8,
    "SCHED_EVENTS_LOST": 9,
}
COUNTER_SLOTS = 16

OP_COUNT = 32  # op codes are < 32; event_config[OP_COUNT] = record every call

# The BPF program is these files, in this order, compiled as one (they share
# maps: traced_processes, traced_threads, inflight).
BPF_SOURCES = ("nccl.c", "tcp.c", "sched.c")


def pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 4194304  # the 64-bit kernel's ceiling

MAP_CAPACITY = {
    "series_index": MAX_SERIES,
    "communicators": MAX_COMMS,
    "inflight": MAX_THREADS,
    "call_errors": MAX_ERRORS,
    "traced_processes": MAX_PROCESSES,
    "sock_owner": MAX_SOCKETS,
    "tcp_links": MAX_LINKS,
    "tcp_srtt": MAX_LINKS,
    "thread_sched": MAX_SCHED_THREADS,
    "sched_stats": MAX_PROCESSES * 3,
}


def bpf_source_dir() -> Path:
    """bpf/ beside the package (editable install), or shipped inside it."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "bpf", here / "bpf"):
        if (candidate / "nccl.c").is_file():
            return candidate
    raise FileNotFoundError(f"bpf/nccl.c not found next to {here}")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral port range (net.ipv4.ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = f.read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def tracepoint_has_field(system: str, event: str, field: str) -> bool:
    """Read the tracepoint's format instead of assuming a kernel version."""
    for root in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        try:
            with open(f"{root}/events/{system}/{event}/format") as f:
                return any(f" {field};" in line for line in f if "field:" in line)
        except OSError:
            continue
    return False


def entry_stub(op: str, layout: str) -> str:
    return f"enter_{op.lower()}_{layout}"


def generated_header() -> str:
    """#defines and entry stubs that tie bpf/nccl.c to exporter/contract.py."""
    lines = [f"#define OP_{name} {code}" for code, name in contract.OPS.items()]
    lines += [
        f"#define OP_COUNT {OP_COUNT}",
        f"#define MAX_SERIES {MAX_SERIES}",
        f"#define MAX_COMMS {MAX_COMMS}",
        f"#define MAX_THREADS {MAX_THREADS}",
        f"#define MAX_ERRORS {MAX_ERRORS}",
        f"#define MAX_PROCESSES {MAX_PROCESSES}",
        f"#define EVENT_PAGES {EVENT_PAGES}",
        f"#define HIST_MIN_LOG2 {histogram.MIN_LOG2}",
        f"#define HIST_MAX_LOG2 {histogram.MAX_LOG2}",
        f"#define HIST_SUB_BITS {histogram.SUB_BITS}",
        f"#define HIST_SUB {histogram.SUB}",
        f"#define SPLIT_TAG 0x{_split_tag():016x}ULL",
        f"#define CNT_SLOTS {COUNTER_SLOTS}",
        f"#define PID_WORDS {(pid_max() + 63) // 64}",
        f"#define MAX_SOCKETS {MAX_SOCKETS}",
        f"#define MAX_LINKS {MAX_LINKS}",
        f"#define TCP_EVENT_PAGES {TCP_EVENT_PAGES}",
        f"#define MAX_SCHED_THREADS {MAX_SCHED_THREADS}",
        f"#define SCHED_EVENT_PAGES {SCHED_EVENT_PAGES}",
        f"#define EPHEMERAL_PORT_LO {ephemeral_ports()[0]}",
        f"#define EPHEMERAL_PORT_HI {ephemeral_ports()[1]}",
        f"#define HAVE_RETRANSMIT_ERR {int(tracepoint_has_field('tcp', 'tcp_retransmit_skb', 'err'))}",
    ]
    lines += [f"#define CNT_{name} {slot}" for name, slot in COUNTERS.items()]
    return "\n".join(lines) + "\n"


def generated_stubs() -> str:
    stubs = sorted({(op, layout) for op, layout in contract.NCCL_FUNCTIONS.values()})
    return "".join(
        f"int {entry_stub(op, layout)}(struct pt_regs *ctx) "
        f"{{ return enter_{layout}(ctx, OP_{op}); }}\n"
        for op, layout in stubs
    )


def _split_tag() -> int:
    from .hashing import SPLIT_TAG

    return SPLIT_TAG


@dataclass
class AttachReport:
    """What happened when one library was attached."""

    path: str
    attached: dict[str, str] = field(default_factory=dict)  # function -> op
    aliases: dict[str, str] = field(default_factory=dict)   # function -> the one probed at its address
    missing: list[str] = field(default_factory=list)        # not exported by this library
    failed: dict[str, str] = field(default_factory=dict)    # function -> error


class ProbeError(RuntimeError):
    """The probe set could not be compiled or loaded."""


class NcclProbes:
    """The compiled BPF program and the libraries it is attached to."""

    def __init__(self, extra_cflags: tuple[str, ...] = ()):
        try:
            from bcc import BPF
        except ImportError as e:  # pragma: no cover - depends on the host
            raise ProbeError(
                "the bcc module is not importable: install python3-bpfcc (make deps)"
            ) from e
        src = bpf_source_dir()
        source = generated_header()
        for name in BPF_SOURCES:
            if (src / name).is_file():
                source += f'#line 1 "{name}"\n' + (src / name).read_text()
        source += generated_stubs()
        try:
            self.bpf = BPF(text=source, cflags=["-Wno-unused-function", *extra_cflags])
        except Exception as e:
            raise ProbeError(f"could not load the NCCL probes: {e}") from e
        self.reports: list[AttachReport] = []
        self._attached_files: set[tuple[int, int]] = set()

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
                self.bpf.attach_uprobe(name=path, addr=address, fn_name=entry_stub(op, layout))
                self.bpf.attach_uretprobe(name=path, addr=address, fn_name="on_return")
            except Exception as e:
                report.failed[function] = str(e)
                continue
            report.attached[function] = op
        self._attached_files.add(file_id)
        self.reports.append(report)
        return report

    # --- settings written into the kernel ---------------------------------

    def set_record_all(self, on: bool) -> None:
        cfg = self.bpf["event_config"]
        cfg[cfg.Key(OP_COUNT)] = cfg.Leaf(1 if on else 0)

    def set_runq_event_min(self, min_wait_ns: int) -> None:
        """Run-queue waits of traced threads at least this long become sched events; 0: none."""
        cfg = self.bpf["sched_config"]
        cfg[cfg.Key(0)] = cfg.Leaf(int(min_wait_ns))

    def set_slow_threshold(self, op: str, threshold_ns: int) -> None:
        cfg = self.bpf["event_config"]
        cfg[cfg.Key(contract.OP_CODES[op])] = cfg.Leaf(int(threshold_ns))

    def trace_process(self, pid: int, rank: int | None, proc: str = "/proc") -> None:
        """Trace a process (it uses NCCL) and its existing threads; rank None: unknown."""
        table = self.bpf["traced_processes"]
        table[table.Key(pid)] = table.Leaf(-1 if rank is None else int(rank))
        bits = self.bpf["traced_threads"]
        try:
            tids = [int(t) for t in os.listdir(f"{proc}/{pid}/task")]
        except OSError:
            tids = [pid]
        for tid in tids:
            key = bits.Key(tid // 64)
            bits[key] = bits.Leaf(bits[key].value | (1 << (tid % 64)))
        gen = self.bpf["comm_generation"]  # threads re-read their cached identity
        gen[gen.Key(0)] = gen.Leaf(gen[gen.Key(0)].value + 1)

    def recursion_misses(self) -> dict[str, int]:
        """Per program: hits the kernel skipped because another BPF program was
        already running on that CPU (a softirq retransmit that interrupts a
        scheduler probe, say). Those events are not counted anywhere else."""
        out = {}
        for name, fn in list(self.bpf.funcs.items()):
            try:
                with open(f"/proc/self/fdinfo/{fn.fd}") as f:
                    for line in f:
                        if line.startswith("recursion_misses:"):
                            out[name.decode()] = int(line.split()[1])
            except OSError:
                continue
        return out

    def close(self) -> None:
        """Detach everything. Removing a uprobe waits for an RCU grace period
        (~0.2 s on 6.x kernels); done one by one, 64 probes take ~15 s, so
        they are closed in parallel and the grace periods overlap."""
        names = list(self.bpf.uprobe_fds)
        if names:
            with ThreadPoolExecutor(max_workers=min(32, len(names))) as pool:
                list(pool.map(self._detach_quietly, names))
        self.bpf.cleanup()

    def _detach_quietly(self, name) -> None:
        try:
            self.bpf.detach_uprobe_event(name)
        except Exception:  # already gone; cleanup() retries what is left
            pass

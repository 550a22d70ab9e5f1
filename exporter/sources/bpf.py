"""Loading one BPF program of bpf/ with BCC, and what every source shares.

Each program (bpf/nccl.c, bpf/tcp.c, bpf/sched.c) is compiled on its own,
after a header generated here from exporter/records/contract.py and
records/histogram.py, so op codes, map sizes, counter slots, record kinds
and histogram layouts have one definition. The
maps several programs use are declared once in bpf/traced.h and owned by
bpf/nccl.c (see there); so nccl.c is loaded first.
"""

from __future__ import annotations

import re
import select
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from exporter.records import contract, histogram
from exporter.sources.teardown import Teardown as Teardown  # re-exported: its old home


SHARED_HEADER = "traced.h"


class ProbeError(RuntimeError):
    """A BPF program could not be compiled or loaded (one line)."""


def bpf_source_dir() -> Path:
    """bpf/ at the top of the repository (editable install), or the copy
    shipped inside the package as exporter/_bpf (wheel)."""
    here = Path(__file__).resolve()
    repo = here.parents[2] / "bpf"
    if (repo / "traced.h").is_file():
        return repo
    shipped = here.parents[1] / "_bpf"
    if (shipped / "traced.h").is_file():
        return shipped
    raise ProbeError(f"the BPF sources (bpf/*.c) are missing: neither {repo} nor {shipped} exists; "
                     "reinstall nccl-exporter")


def pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 4194304  # the 64-bit kernel's ceiling


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral port range (net.ipv4.ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = f.read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def tracepoint_has_field(system: str, event: str, name: str) -> bool:
    """Read the tracepoint's format instead of assuming a kernel version."""
    for root in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        try:
            with open(f"{root}/events/{system}/{event}/format") as f:
                return any(f" {name};" in line for line in f if "field:" in line)
        except OSError:
            continue
    return False


def generated_header() -> str:
    """#defines that tie bpf/*.c to exporter/records/contract.py."""
    from exporter.sources.nccl.hashing import SPLIT_TAG

    c = contract
    lines = [f"#define OP_{name} {code}" for code, name in c.OPS.items()]
    lines += [f"#define CNT_{name} {slot}" for name, slot in c.COUNTERS.items()]
    lines += [f"#define TCP_EV_{c.TCP_EVENT_MACROS[k]} {k}" for k in c.TCP_EVENTS]
    lines += [f"#define SCHED_KIND_{name.upper()} {k}" for k, name in c.THREAD_KINDS.items()]
    lines += [f"#define LOADER_EV_{name} {k}" for k, name in c.LOADER_EVENTS.items()]
    lo, hi = ephemeral_ports()
    values = {
        "OP_COUNT": c.OP_COUNT, "MAX_SERIES": c.MAX_SERIES, "MAX_COMMS": c.MAX_COMMS,
        "MAX_THREADS": c.MAX_THREADS, "FAST_THREADS": c.FAST_THREADS,
        "MAX_ERRORS": c.MAX_ERRORS, "ERROR_RESULTS": c.ERROR_RESULTS,
        "MAX_PROCESSES": c.MAX_PROCESSES, "EVENT_PAGES": c.EVENT_PAGES,
        "EVENT_CALL": c.EVENT_CALL, "EVENT_LIFECYCLE": c.EVENT_LIFECYCLE,
        "SPLIT_TAG": f"0x{SPLIT_TAG:016x}ULL", "CNT_SLOTS": c.COUNTER_SLOTS,
        "PID_WORDS": (pid_max() + 63) // 64, "MAX_SOCKETS": c.MAX_SOCKETS,
        "MAX_LINKS": c.MAX_LINKS, "TCP_EVENT_PAGES": c.TCP_EVENT_PAGES,
        "SRTT_SAMPLE_NS": c.SRTT_SAMPLE_NS, "SCHED_KINDS": len(c.THREAD_KINDS),
        "MAX_SCHED_THREADS": c.MAX_SCHED_THREADS, "SCHED_EVENT_PAGES": c.SCHED_EVENT_PAGES,
        "EPHEMERAL_PORT_LO": lo, "EPHEMERAL_PORT_HI": hi,
        "HAVE_RETRANSMIT_ERR": int(tracepoint_has_field("tcp", "tcp_retransmit_skb", "err")),
    }
    for layout in histogram.LAYOUTS:  # HIST_*, RUNQ_*, SRTT_*: bpf/histogram.h
        values.update(layout.c_defines())
    lines += [f"#define {k} {v}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


OWNER = "nccl"  # the program that owns (exports) the maps of bpf/traced.h


def shared_maps(header: str) -> tuple[str, ...]:
    """The maps bpf/traced.h declares with SHARED_TABLE (the owner exports them)."""
    return tuple(re.findall(r"^SHARED_TABLE\((?:[^,()]+,){3}\s*(\w+)\s*,", header, re.M))


# BCC's compile (clang and LLVM in-process) is not thread-safe: two at once
# crash the process. The agent compiles on one thread; this makes it so.
_COMPILING = threading.Lock()

_owners_loaded = 0
# BCC keeps the name of an exported map for the life of the process, even
# after its program is closed: an owner loaded again in the same process
# (tests, benches) exports its maps under new names, <name>_g<generation>,
# and its dependents are compiled against those.
_generation = -1


class Program:
    """One compiled BPF program of bpf/ (`name`.c) and its BCC object."""

    def __init__(self, name: str, extra_source: str = "", extra_cflags: tuple[str, ...] = ()):
        global _owners_loaded, _generation
        program = (bpf_source_dir() / f"{name}.c").read_text()
        if name == OWNER:
            _generation += 1
        elif f'#include "{SHARED_HEADER}"' in program and not _owners_loaded:
            raise ProbeError(f"bpf/{name}.c needs bpf/{OWNER}.c loaded first: it owns the traced "
                             "processes and threads, and without it nothing is traced, so this "
                             "source would report nothing")
        try:
            from bcc import BPF
        except ImportError as e:  # pragma: no cover - depends on the host
            raise ProbeError("the bcc module is not importable: install python3-bpfcc (make deps)") from e
        src = bpf_source_dir()
        # One text, not #includes: BCC rewrites map accesses and generates the
        # TRACEPOINT_PROBE argument structs in the main file only, so the
        # shared header is pasted where the program includes it.
        header = f'#line 1 "bpf/{SHARED_HEADER}"\n' + (src / SHARED_HEADER).read_text()
        program = program.replace(f'#include "{SHARED_HEADER}"\n', header + f'#line 1 "bpf/{name}.c"\n', 1)
        text = generated_header() + f'#line 1 "bpf/{name}.c"\n' + program + extra_source
        self.renamed = {}
        if _generation > 0:  # every shared map, or a dependent finds the closed one's name
            shared = shared_maps(header)
            self.renamed = {m: f"{m}_g{_generation}" for m in shared}
            text = re.sub(r"\b(" + "|".join(shared) + r")\b", lambda m: self.renamed[m.group(1)], text)
        self.name = name
        try:
            # -I: traced.h includes bpf/histogram.h (no maps: a plain #include).
            # -g0: no BTF or line info, ~0.2 s less of each start's compile
            # (docs/architecture.md, "Start-up and attach order").
            with _COMPILING:
                self.bpf = BPF(text=text, cflags=["-Wno-unused-function", "-g0", f"-I{src}", *extra_cflags])
        except Exception as e:
            raise ProbeError(f"could not load bpf/{name}.c: {e}") from e
        self.ring_fds: list[int] = []  # the ring buffer maps opened by open_ring
        self._owner = name == OWNER
        if self._owner:
            _owners_loaded += 1

    def __getitem__(self, table: str):
        return self.bpf[self.renamed.get(table, table)]

    # Tracepoints of this program that fire for every task or packet on the
    # node ("category:name", or a bare name for a raw tracepoint): the ones
    # set_hot(False) detaches while no process is traced.
    HOT_TRACEPOINTS: tuple[str, ...] = ()
    hot = True  # BCC attaches every tracepoint program at load

    def set_hot(self, on: bool) -> None:
        """Attach (on) or detach the HOT_TRACEPOINTS, whose programs stay
        loaded and their maps kept. Idempotent."""
        for tp in self.HOT_TRACEPOINTS:
            set_tracepoint(self.bpf, tp, on)
        self.hot = on

    def entries(self, table: str) -> int:
        return sum(1 for _ in self[table].keys())

    def open_ring(self, table: str, decode, callback) -> None:
        """Deliver `callback(decode(data))` for each record of ring buffer `table`, from poll()."""

        def raw(_ctx, data, _size):
            callback(decode(data))

        self.bpf[table].open_ring_buffer(raw)
        self.ring_fds.append(self[table].map_fd)

    def poll(self, timeout_ms: int) -> None:
        """Deliver this program's ring buffer records, waiting up to timeout_ms."""
        if self.ring_fds:
            self.bpf.ring_buffer_poll(timeout_ms)
        elif timeout_ms > 0:
            time.sleep(timeout_ms / 1000)

    def consume(self) -> None:
        """Deliver what this program's ring buffers hold, without waiting."""
        if self.ring_fds:
            self.bpf.ring_buffer_consume()

    def recursion_misses(self) -> dict[str, int]:
        """Per BPF function: hits the kernel skipped because another BPF program
        was already running on that CPU (a softirq retransmit that interrupts a
        scheduler probe, say). Those events are not counted anywhere else."""
        out = {}
        for fname, fn in list(self.bpf.funcs.items()):
            try:
                with open(f"/proc/self/fdinfo/{fn.fd}") as f:
                    for line in f:
                        if line.startswith("recursion_misses:"):
                            out[fname.decode()] = int(line.split()[1])
            except OSError:
                continue
        return out

    def close(self) -> None:
        global _owners_loaded
        if self._owner:
            self._owner = False
            _owners_loaded -= 1
        self.bpf.cleanup()


def set_tracepoint(bpf, tp: str, on: bool, fn_name: str | None = None) -> None:
    """Attach (on) or detach one tracepoint of a BCC object, idempotently:
    "category:name" for a classic one, a bare name for a raw one. The
    function is BCC's own for a TRACEPOINT_PROBE (tracepoint__CAT__NAME) or
    RAW_TRACEPOINT_PROBE (raw_tracepoint__NAME) unless fn_name says."""
    cat, _, name = tp.rpartition(":")
    key = tp.encode()
    attached = key in (bpf.tracepoint_fds if cat else bpf.raw_tracepoint_fds)
    if on and not attached:
        fn = (fn_name or (f"tracepoint__{cat}__{name}" if cat else f"raw_tracepoint__{name}")).encode()
        if cat:
            bpf.attach_tracepoint(tp=key, fn_name=fn)
        else:
            bpf.attach_raw_tracepoint(tp=key, fn_name=fn)
    elif not on and attached:
        if cat:
            bpf.detach_tracepoint(tp=key)
        else:
            bpf.detach_raw_tracepoint(tp=key)


class RingWaiter:
    """Waits on the ring buffers of several programs at once (each BPF object
    of BCC polls only its own): epoll on the ring buffer maps' fds, which
    become readable when a record is submitted, then each program consumes."""

    def __init__(self):
        self._epoll = select.epoll()
        self._fds: set[int] = set()
        self.programs: list[Program] = []

    def add(self, program: "Program") -> None:
        """Watch a program's ring buffers (call after its open_ring calls)."""
        self.programs.append(program)
        for fd in program.ring_fds:
            if fd not in self._fds:
                self._epoll.register(fd, select.EPOLLIN)
                self._fds.add(fd)

    def wait(self, timeout_ms: int) -> None:
        """Deliver every program's records, waiting up to timeout_ms for the first."""
        if timeout_ms > 0 and self._fds:
            try:
                self._epoll.poll(timeout_ms / 1000)
            except InterruptedError:
                pass
        elif timeout_ms > 0:
            time.sleep(timeout_ms / 1000)
        for program in self.programs:
            program.consume()

    def close(self) -> None:
        self._epoll.close()


def forget_dead(table, proc: str = "/proc") -> int:
    """Delete the entries of a map keyed by a process id -- a struct with
    `tgid`, or the pid itself -- whose process is gone; returns how many."""
    import os

    def pid(k) -> int:
        return k.tgid if hasattr(k, "tgid") else k.value

    dead = [k for k in table.keys() if not os.path.exists(f"{proc}/{pid(k)}")]
    for k in dead:
        try:
            del table[k]
        except KeyError:
            pass
    return len(dead)


@dataclass
class ClockOffset:
    """CLOCK_REALTIME - CLOCK_MONOTONIC, sampled with the narrowest window:
    turns the kernel's bpf_ktime_get_ns() stamps into wall-clock time."""

    offset_ns: int = field(default=0)

    def __post_init__(self):
        self.refresh()

    def refresh(self) -> None:
        best = None
        for _ in range(5):
            m0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            r = time.clock_gettime_ns(time.CLOCK_REALTIME)
            m1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            if best is None or m1 - m0 < best[0]:
                best = (m1 - m0, r - (m0 + m1) // 2)
        self.offset_ns = best[1]

    def to_realtime(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.offset_ns

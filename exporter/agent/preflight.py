"""`nccl-exporter check`: can this host run the agent? One line per check.

Every path is a keyword argument with the real default, so tests can point
a check at a fake tracefs or a missing headers directory.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, TextIO

from exporter.sources.nccl import libfind

__all__ = ["Check", "run_checks", "main", "bpf_map_create_works", "plugin_library", "check_plugin",
           "CAPABILITIES", "required_capabilities", "missing_capabilities"]

TRACEFS_ROOTS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
# Every classic tracepoint bpf/*.c attaches (TRACEPOINT_PROBE): a missing one fails
# the load. tests/test_preflight.py reads the BPF files and keeps this list complete.
TRACEPOINTS = (
    # bpf/nccl.c: process lifecycle (a rank's exit and the signal it died of, NcclRankDied;
    # a traced process's new threads are traced; getpgid: the agent asking the kernel to
    # trace a thread made before it attached, attached only while it asks)
    "sched/sched_process_exit", "sched/sched_process_fork", "signal/signal_deliver",
    "syscalls/sys_enter_getpgid",
    # bpf/loader.c: a new program that may map libnccl (library discovery)
    "sched/sched_process_exec",
    # bpf/tcp.c: retransmits, resets, RTT samples, and which process owns a socket
    "tcp/tcp_retransmit_skb", "tcp/tcp_send_reset", "tcp/tcp_receive_reset", "tcp/tcp_probe",
    "tcp/tcp_destroy_sock", "sock/inet_sock_set_state", "sock/sock_send_length", "sock/sock_recv_length",
)

# The capabilities `run` needs, and what fails without each: the one list
# the DaemonSet, the systemd unit, `check`, `run` and the docs agree on
# (tests/test_deploy.py compares them). Measured on kernel 6.18
# (docs/deploy.md, "Capabilities, and why"): CAP_SYS_ADMIN is needed to
# attach uprobes, and it includes CAP_BPF and CAP_PERFMON (the kernel's
# bpf_capable() and perfmon_capable() accept it), so those two add nothing.
CAPABILITIES: dict[str, tuple[int, str]] = {
    "SYS_ADMIN": (21, "load the BPF programs and attach the uprobes and tracepoints"),
    "SYS_PTRACE": (19, "reach other users' processes' files through /proc/<pid>/root (a libnccl "
                       "inside a container, its service-account namespace)"),
    "DAC_READ_SEARCH": (2, "read other users' /proc/<pid>/environ (launcher rank, pod name; the file "
                           "is 0400) and open a libnccl in a directory its owner alone may enter"),
}
# Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK: raising it needs this
# (or a raised limit: the systemd unit's LimitMEMLOCK=infinity).
MEMLOCK_CAPABILITY = ("SYS_RESOURCE", 24, "raise RLIMIT_MEMLOCK for the BPF maps (kernels before 5.11)")


def required_capabilities(release: str | None = None) -> dict[str, tuple[int, str]]:
    """CAPABILITIES, plus SYS_RESOURCE on kernels before 5.11."""
    release = release or os.uname().release
    caps = dict(CAPABILITIES)
    try:
        major, minor = (int(x) for x in release.split(".")[:2])
    except ValueError:
        return caps
    if (major, minor) < (5, 11):
        name, bit, why = MEMLOCK_CAPABILITY
        caps[name] = (bit, why)
    return caps


def missing_capabilities(status_path: str = "/proc/self/status",
                         release: str | None = None) -> list[tuple[str, str]]:
    """[(CAP_NAME, what fails)] of required_capabilities() not in this process's
    effective set (root in a container often has fewer than it thinks)."""
    eff = _cap_eff(status_path)
    if eff is None:
        return []  # no /proc status: cannot tell, the kernel will say
    return [(f"CAP_{name}", why) for name, (bit, why) in required_capabilities(release).items()
            if not eff >> bit & 1]

SYS_bpf = 321  # x86_64
BPF_MAP_CREATE = 0
BPF_MAP_TYPE_ARRAY = 2


@dataclass
class Check:
    name: str
    ok: bool
    required: bool
    detail: str


def _cap_eff(status_path: str) -> int | None:
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_privileges(euid: int | None = None, status_path: str = "/proc/self/status",
                     release: str | None = None) -> Check:
    """Every capability of required_capabilities() is effective, whatever the uid."""
    euid = os.geteuid() if euid is None else euid
    who = "root" if euid == 0 else f"uid {euid}"
    missing = missing_capabilities(status_path, release)
    names = " ".join(f"CAP_{n}" for n in required_capabilities(release))
    if not missing:
        return Check("privileges", True, True, f"{who} with {names}")
    return Check("privileges", False, True,
                 f"{who} lacks {', '.join(f'{cap} ({why})' for cap, why in missing)} — grant {names} "
                 f"(DaemonSet securityContext, systemd AmbientCapabilities; docs/deploy.md), or run as "
                 f"root with all capabilities")


def bpf_map_create_works() -> tuple[bool, str]:
    """Create and close a one-entry BPF array map with the raw bpf(2) syscall."""
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 32)()  # union bpf_attr prefix; the rest stays zero
    attr[0] = BPF_MAP_TYPE_ARRAY
    attr[1] = 4  # key_size
    attr[2] = 8  # value_size
    attr[3] = 1  # max_entries
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(ctypes.c_long(SYS_bpf), ctypes.c_int(BPF_MAP_CREATE),
                      ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
    if fd < 0:
        err = ctypes.get_errno()
        return False, f"bpf(BPF_MAP_CREATE) failed: {os.strerror(err)} (errno {err})"
    os.close(fd)
    return True, "bpf(BPF_MAP_CREATE) of an array map works"


def check_bpf_syscall(probe: Callable[[], tuple[bool, str]] = bpf_map_create_works) -> Check:
    try:
        ok, detail = probe()
    except Exception as e:  # noqa: BLE001 - ctypes trouble: report, do not crash the check
        ok, detail = False, f"bpf syscall probe crashed: {e}"
    if not ok:
        detail += (" — needs CAP_SYS_ADMIN (or CAP_BPF); check kernel.unprivileged_bpf_disabled, "
                   "seccomp (containers: the runtime's default profile allows bpf() with CAP_SYS_ADMIN; "
                   "docs/deploy.md) and CONFIG_BPF_SYSCALL")
    return Check("bpf syscall", ok, True, detail)


def _tracefs_root(roots: Iterable[str]) -> str | None:
    for root in roots:
        if os.path.isdir(os.path.join(root, "events")):
            return root
    return None


def check_tracefs(roots: Iterable[str] = TRACEFS_ROOTS) -> Check:
    roots = tuple(roots)
    root = _tracefs_root(roots)
    if root:
        return Check("tracefs", True, True, root)
    return Check("tracefs", False, True,
                 f"no events/ under {' or '.join(roots)} — mount it: "
                 f"'mount -t tracefs nodev /sys/kernel/tracing' (or run 'make deps')")


def check_uprobes(roots: Iterable[str] = TRACEFS_ROOTS) -> Check:
    root = _tracefs_root(roots)
    if root is None:
        return Check("uprobes", False, True, "tracefs not mounted — fix tracefs first")
    path = os.path.join(root, "uprobe_events")
    if os.path.exists(path):
        return Check("uprobes", True, True, path)
    return Check("uprobes", False, True,
                 f"{path} missing — the kernel lacks CONFIG_UPROBE_EVENTS; "
                 f"use a kernel built with uprobe support")


def check_tracepoints(roots: Iterable[str] = TRACEFS_ROOTS,
                      tracepoints: Iterable[str] = TRACEPOINTS) -> Check:
    tracepoints = tuple(tracepoints)
    root = _tracefs_root(roots)
    if root is None:
        return Check("tracepoints", False, True, "tracefs not mounted — fix tracefs first")
    missing = [tp for tp in tracepoints if not os.path.isdir(os.path.join(root, "events", tp))]
    if not missing:
        groups = sorted({tp.split("/")[0] for tp in tracepoints})
        return Check("tracepoints", True, True, f"all {len(tracepoints)} present ({', '.join(groups)})")
    return Check("tracepoints", False, True,
                 f"missing {', '.join(missing)} under {root}/events — "
                 f"the kernel lacks these tracepoints (needs CONFIG_TRACEPOINTS, a newer kernel)")


def check_btf(path: str = "/sys/kernel/btf/vmlinux") -> Check:
    if os.path.exists(path):
        return Check("btf", True, False, path)
    return Check("btf", False, False,
                 f"{path} missing — optional (BCC uses kernel headers); "
                 f"kernels with CONFIG_DEBUG_INFO_BTF=y provide it")


def check_schedstat(proc: str = "/proc") -> Check:
    """`run --sched totals` reads each thread's schedstat (CONFIG_SCHED_INFO)."""
    from exporter.sources.schedstat import read_schedstat

    path = f"{proc}/self/schedstat"
    if read_schedstat(path) is not None:
        return Check("schedstat", True, False, path)
    return Check("schedstat", False, False,
                 f"{path} missing (a kernel without CONFIG_SCHED_INFO): `run` shows no run-queue "
                 "or off-CPU time unless started with --sched waits")


def check_kernel_headers(modules_root: str = "/lib/modules", release: str | None = None,
                         bcc_kernel_source: str | None = None) -> Check:
    release = release or os.uname().release
    if bcc_kernel_source is None:
        bcc_kernel_source = os.environ.get("BCC_KERNEL_SOURCE", "")
    if bcc_kernel_source:  # BCC compiles against this tree instead (the image's fallback)
        if os.path.isdir(os.path.join(bcc_kernel_source, "include")):
            return Check("kernel headers", True, True, f"{bcc_kernel_source} (BCC_KERNEL_SOURCE)")
        return Check("kernel headers", False, True,
                     f"BCC_KERNEL_SOURCE={bcc_kernel_source} has no include/ — unset it or point it at "
                     "a kernel header tree")
    build = os.path.join(modules_root, release, "build")
    if os.path.isdir(os.path.join(build, "include")):
        target = os.path.realpath(build)
        return Check("kernel headers", True, True,
                     build if target == build else f"{build} -> {target}")
    what = f"{build} missing" if not os.path.lexists(build) else f"{build}/include missing"
    return Check("kernel headers", False, True,
                 f"{what} — run 'make deps' (installs linux-headers-amd64 and links them)")


def check_bcc(module: str = "bcc") -> Check:
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - ImportError, or OSError when libbcc.so is missing
        return Check("bcc module", False, True,
                     f"import {module} failed: {e} — run 'make deps venv' (Debian python3-bpfcc, "
                     f"linked into .venv; never 'pip install bcc', that is another project)")
    where = os.path.dirname(getattr(mod, "__file__", "") or "") or "?"
    version = getattr(mod, "__version__", "")
    return Check("bcc module", True, True, f"{where}{' ' + version if version else ''}")


def check_nccl(nccl_libs: Iterable[str] = (), proc: str = "/proc") -> Check:
    nccl_libs = tuple(nccl_libs)
    try:
        explicit = libfind.find_libraries(nccl_libs)
    except libfind.LibraryError as e:
        # The user named it: a bad path is an error `run` would refuse too.
        return Check("nccl libraries", False, True, str(e))
    try:
        mapped = libfind.mapped_nccl_libraries(proc)
    except Exception as e:  # noqa: BLE001 - never let discovery break the report
        mapped = []
        scan_err = f" (scan failed: {e})"
    else:
        scan_err = ""
    libs = {lib.key: lib for lib in explicit}
    for lib in mapped:
        libs.setdefault(lib.key, lib).pids |= lib.pids
    if not libs:
        return Check("nccl libraries", False, False,
                     f"none mapped now; run will attach when a job loads libnccl{scan_err}")
    parts = []
    for lib in libs.values():
        n = len(lib.pids)
        parts.append(f"{lib.path} ({n} process{'es' if n != 1 else ''})" if n else lib.path)
    return Check("nccl libraries", True, False, "; ".join(parts) + scan_err)


# --- the NCCL profiler plugin (GPU time; docs/plugin.md) ------------------------------

# Interface versions with GPU timers, newest first: NCCL probes them in this order.
PLUGIN_INTERFACES = ("ncclProfiler_v7", "ncclProfiler_v6", "ncclProfiler_v5", "ncclProfiler_v4")
_PLUGIN_HINT = "run 'nccl-exporter plugin-path' (builds it; needs gcc)"


def plugin_library() -> str:
    """Where the built plugin is (or would be), without building it."""
    from exporter.sources.plugin import build
    return str(build.default_outdir() / build.LIB_NAME)


def _dlopen(path: str):
    """ctypes handle of the library (RTLD_LOCAL: nothing leaks into this
    process's symbol namespace), or raises OSError with dlerror's text."""
    return ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOW)


def _stale_note(path: str) -> str:
    """' (older than its sources: ...)' when a source file is newer, else ''."""
    try:
        from exporter.sources.plugin import build
        newest = max(f.stat().st_mtime for f in build._sources(build.source_dir()))
        if os.stat(path).st_mtime < newest:
            return f" (older than its sources: {_PLUGIN_HINT} to rebuild)"
    except Exception:  # noqa: BLE001 - no sources (installed elsewhere): nothing to compare
        pass
    return ""


def check_plugin(path: str | None = None) -> list[Check]:
    """Three facts, one line each (all optional: without the plugin the agent
    runs on host time): is the plugin built, does it load (dlopen), which
    interface versions it exports (dlsym of ncclProfiler_v7 .. v4)."""
    if path is None:
        try:
            path = plugin_library()
        except Exception as e:  # noqa: BLE001 - sources missing in an odd install: report, do not crash
            return [Check("plugin build", False, False, f"cannot locate the profiler plugin: {e}"),
                    Check("plugin load", False, False, "not built"),
                    Check("plugin ifaces", False, False, "not built")]
    if not os.path.isfile(path):
        return [Check("plugin build", False, False,
                      f"{path} missing — GPU time off (host time only); {_PLUGIN_HINT}"),
                Check("plugin load", False, False, "not built"),
                Check("plugin ifaces", False, False, "not built")]
    built = Check("plugin build", True, False, path + _stale_note(path))
    try:
        lib = _dlopen(path)
    except OSError as e:
        return [built, Check("plugin load", False, False, f"dlopen failed: {e} — rebuild: {_PLUGIN_HINT}"),
                Check("plugin ifaces", False, False, "unknown: the library does not load")]
    loaded = Check("plugin load", True, False, "dlopen ok")
    found = []
    for name in PLUGIN_INTERFACES:
        try:
            ctypes.c_void_p.in_dll(lib, name)
        except ValueError:  # dlsym: undefined symbol
            continue
        found.append(name.rsplit("_", 1)[1])
    if found:
        ifaces = Check("plugin ifaces", True, False,
                       f"{', '.join(found)} (NCCL uses the newest one it knows)")
    else:
        ifaces = Check("plugin ifaces", False, False,
                       f"exports none of {', '.join(PLUGIN_INTERFACES)} — not an NCCL profiler plugin "
                       f"with GPU timers; {_PLUGIN_HINT}")
    return [built, loaded, ifaces]


def run_checks(
    nccl_libs: Iterable[str] = (),
    *,
    tracefs_roots: Iterable[str] = TRACEFS_ROOTS,
    modules_root: str = "/lib/modules",
    kernel_release: str | None = None,
    btf_path: str = "/sys/kernel/btf/vmlinux",
    status_path: str = "/proc/self/status",
    euid: int | None = None,
    proc: str = "/proc",
    bcc_module: str = "bcc",
    bpf_probe: Callable[[], tuple[bool, str]] = bpf_map_create_works,
    plugin_path: str | None = None,
    bcc_kernel_source: str | None = None,
) -> list[Check]:
    tracefs_roots = tuple(tracefs_roots)
    return [
        check_privileges(euid, status_path, kernel_release),
        check_bpf_syscall(bpf_probe),
        check_tracefs(tracefs_roots),
        check_uprobes(tracefs_roots),
        check_tracepoints(tracefs_roots),
        check_btf(btf_path),
        check_schedstat(proc),
        check_kernel_headers(modules_root, kernel_release, bcc_kernel_source),
        check_bcc(bcc_module),
        check_nccl(nccl_libs, proc),
        *check_plugin(plugin_path),
    ]


def render(checks: list[Check]) -> list[str]:
    width = max(len(c.name) for c in checks) + 2
    lines = []
    for c in checks:
        status = "ok" if c.ok else ("FAIL" if c.required else "warn")
        lines.append(f"{status:<6}{c.name:<{width}}{c.detail}")
    failed = [c.name for c in checks if c.required and not c.ok]
    warned = [c.name for c in checks if not c.required and not c.ok]
    if failed:
        lines.append(f"{len(failed)} required check{'s' if len(failed) != 1 else ''} failed: "
                     f"{', '.join(failed)} — nccl-exporter cannot run here")
    else:
        extra = f" ({len(warned)} optional not met: {', '.join(warned)})" if warned else ""
        lines.append(f"all required checks passed{extra} — ready to run")
    return lines


def main(nccl_libs: Iterable[str] = (), out: TextIO = sys.stdout, **kwargs) -> int:
    """Print one line per check and a summary; 0 only if all required checks pass."""
    checks = run_checks(nccl_libs, **kwargs)
    for line in render(checks):
        print(line, file=out)
    return 0 if all(c.ok for c in checks if c.required) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Many uprobes on one file in one system call: the kernel's uprobe_multi
link (BPF_LINK_CREATE with BPF_TRACE_UPROBE_MULTI, Linux 6.6+), which BCC
0.26 does not offer, made with the bpf(2) system call directly.

Why not BCC's one perf event per probe (attach_uprobe):
- attaching: each probe is a perf_event_open of its own; 90 of them on a
  libnccl take 120-250 ms on a loaded 2-vCPU node, longer than a job waits
  between mapping libnccl and its first call (bench/attach_latency.py).
- letting go: closing each of those perf events waits for its own RCU
  grace periods (uprobe_unregister_sync, kernel/events/uprobes.c), one after
  another: ~0.1 s a probe, seconds for a library. Closing a link unregisters
  all its uprobes and then waits once (bpf_uprobe_multi_link_release,
  kernel/trace/bpf_trace.c).
A program attached this way must be loaded with expected_attach_type
BPF_TRACE_UPROBE_MULTI (`load`; it cannot then be attached by a perf
event); where the kernel refuses to load it or to make a link, the caller
(sources/nccl/probes.py) keeps BCC's perf events.
"""

from __future__ import annotations

import ctypes
import os

BPF_LINK_CREATE = 28  # enum bpf_cmd
BPF_TRACE_UPROBE_MULTI = 48  # enum bpf_attach_type
BPF_F_UPROBE_MULTI_RETURN = 1
_SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _UprobeMultiAttr(ctypes.Structure):
    """union bpf_attr, the link_create member with its uprobe_multi part
    (include/uapi/linux/bpf.h); padded to 64 bytes, the rest zero."""

    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("path", ctypes.c_uint64),
        ("offsets", ctypes.c_uint64),
        ("ref_ctr_offsets", ctypes.c_uint64),
        ("cookies", ctypes.c_uint64),
        ("cnt", ctypes.c_uint32),
        ("multi_flags", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
    ]


class LinkError(OSError):
    pass


class _ProgLoadAttr(ctypes.Structure):
    """union bpf_attr, the BPF_PROG_LOAD member up to expected_attach_type."""

    _fields_ = [
        ("prog_type", ctypes.c_uint32),
        ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64),
        ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_uint64),
        ("kern_version", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32),
        ("prog_name", ctypes.c_char * 16),
        ("prog_ifindex", ctypes.c_uint32),
        ("expected_attach_type", ctypes.c_uint32),
    ]


BPF_PROG_LOAD = 5
BPF_PROG_TYPE_KPROBE = 2


def _bpf(cmd: int, attr) -> int:
    if _SYS_BPF is None:
        raise LinkError(0, f"uprobe_multi links: no bpf(2) number known for {os.uname().machine}")
    r = _libc.syscall(_SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if r < 0:
        err = ctypes.get_errno()
        raise LinkError(err, os.strerror(err))
    return int(r)


def load(bpf, name: str) -> int:
    """Load BCC-compiled function `name` of BPF module `bpf` (its bytecode,
    map fds already in place) as a kprobe-type program for uprobe_multi
    links; returns the program fd (the caller closes it). BCC's own
    load_func cannot set expected_attach_type for this program type."""
    from bcc import lib

    fname = name.encode()
    start = lib.bpf_function_start(bpf.module, fname)
    if not start:
        raise LinkError(0, f"no BPF function {name}")
    size = lib.bpf_function_size(bpf.module, fname)
    license_text = ctypes.create_string_buffer(lib.bpf_module_license(bpf.module))
    log = ctypes.create_string_buffer(1 << 16)
    attr = _ProgLoadAttr(prog_type=BPF_PROG_TYPE_KPROBE, insn_cnt=size // 8, insns=start,
                         license=ctypes.addressof(license_text), kern_version=lib.bpf_module_kern_version(bpf.module),
                         prog_name=fname[:15], expected_attach_type=BPF_TRACE_UPROBE_MULTI)
    try:
        return _bpf(BPF_PROG_LOAD, attr)
    except LinkError as e:  # once more, for the verifier's words
        attr.log_level, attr.log_size, attr.log_buf = 1, len(log), ctypes.addressof(log)
        try:
            return _bpf(BPF_PROG_LOAD, attr)
        except LinkError:
            raise LinkError(e.errno, f"loading {name}: {e.strerror}: "
                            f"{log.value.decode(errors='replace').strip().splitlines()[-1:]}") from None


def supported() -> bool:
    """Whether this kernel loads programs for uprobe_multi links (6.6+): a
    program of two instructions (r0 = 0; exit), loaded and closed."""
    insns = (ctypes.c_uint64 * 2)(0x00000000000000B7, 0x0000000000000095)  # BPF_MOV64_IMM r0, 0; BPF_EXIT
    license_text = ctypes.create_string_buffer(b"GPL")
    attr = _ProgLoadAttr(prog_type=BPF_PROG_TYPE_KPROBE, insn_cnt=2, insns=ctypes.addressof(insns),
                         license=ctypes.addressof(license_text), prog_name=b"nccl_exp_check",
                         expected_attach_type=BPF_TRACE_UPROBE_MULTI)
    try:
        fd = _bpf(BPF_PROG_LOAD, attr)
    except LinkError:
        return False
    os.close(fd)
    return True


def attach(prog_fd: int, path: str, offsets: list[int], retprobe: bool = False,
           cookies: list[int] | None = None) -> int:
    """A uprobe_multi link of program `prog_fd` at these file offsets of
    `path`, in every process, each with its cookie (bpf_get_attach_cookie
    in the program; None: 0); returns the link's fd (closing it detaches)."""
    cpath = ctypes.create_string_buffer(os.fsencode(path))
    offs = (ctypes.c_uint64 * len(offsets))(*offsets)
    cks = (ctypes.c_uint64 * len(offsets))(*cookies) if cookies is not None else None
    attr = _UprobeMultiAttr(prog_fd=prog_fd, attach_type=BPF_TRACE_UPROBE_MULTI,
                            path=ctypes.addressof(cpath), offsets=ctypes.addressof(offs),
                            cookies=ctypes.addressof(cks) if cks is not None else 0,
                            cnt=len(offsets), multi_flags=BPF_F_UPROBE_MULTI_RETURN if retprobe else 0)
    try:
        return _bpf(BPF_LINK_CREATE, attr)
    except LinkError as e:
        raise LinkError(e.errno, f"uprobe_multi link on {path}: {e.strerror}") from None

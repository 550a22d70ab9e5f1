"""The running kernel's own description of a raw tracepoint's arguments.

A raw tracepoint hands its BPF program the tracepoint's C arguments
(TP_PROTO) as ctx->args[]. Their order has changed before (sched_switch
gained prev_state as its last argument in Linux 5.18), and the build host's
headers are not the running kernel's, so the sources that use raw
tracepoints check the prototype here before loading: the kernel's BTF
(/sys/kernel/btf/vmlinux) has, for every tracepoint X, a typedef
`btf_trace_X` = pointer to `void (void *, <the arguments>)`.

Only the BTF type and string sections are read (format: the kernel's
Documentation/bpf/btf.rst); nothing here touches struct layouts.
"""

from __future__ import annotations

import struct

VMLINUX = "/sys/kernel/btf/vmlinux"

# BTF kinds and the bytes that follow each 12-byte type header (btf.rst).
_INT, _PTR, _ARRAY, _STRUCT, _UNION, _ENUM, _FWD, _TYPEDEF, _VOLATILE, _CONST, _RESTRICT = range(1, 12)
_FUNC, _FUNC_PROTO, _VAR, _DATASEC, _FLOAT, _DECL_TAG, _TYPE_TAG, _ENUM64 = range(12, 20)
_QUALIFIERS = (_VOLATILE, _CONST, _RESTRICT, _TYPE_TAG)


def _tail(kind: int, vlen: int) -> int:
    return {_INT: 4, _ARRAY: 12, _STRUCT: 12 * vlen, _UNION: 12 * vlen, _ENUM: 8 * vlen,
            _FUNC_PROTO: 8 * vlen, _VAR: 4, _DATASEC: 12 * vlen, _DECL_TAG: 4,
            _ENUM64: 12 * vlen}.get(kind, 0)


class Btf:
    """Types of one BTF blob: (kind, name, type-or-size, params) by id."""

    def __init__(self, data: bytes):
        magic, _ver, _flags, hdr_len, type_off, type_len, str_off, _str_len = \
            struct.unpack_from("<HBBIIIII", data, 0)
        if magic != 0xEB9F:
            raise ValueError("not BTF (bad magic)")
        self._data, self._strings = data, hdr_len + str_off
        self.types: list[tuple | None] = [None]  # id 0 is void
        pos, end = hdr_len + type_off, hdr_len + type_off + type_len
        while pos < end:
            name_off, info, size_or_type = struct.unpack_from("<III", data, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            params = ()
            if kind == _FUNC_PROTO:
                params = tuple(struct.unpack_from("<II", data, pos + 12 + 8 * i)[1] for i in range(vlen))
            self.types.append((kind, name_off, size_or_type, params))
            pos += 12 + _tail(kind, vlen)

    def name(self, off: int) -> str:
        start = self._strings + off
        return self._data[start:self._data.index(b"\0", start)].decode()

    def type_name(self, tid: int) -> str:
        """C-ish spelling: 'bool', 'unsigned int', 'struct task_struct *'."""
        if tid == 0:
            return "void"
        kind, name_off, ref, _ = self.types[tid]
        if kind == _PTR:
            return self.type_name(ref).rstrip() + " *"
        if kind in _QUALIFIERS:
            return self.type_name(ref)
        prefix = {_STRUCT: "struct ", _UNION: "union ", _ENUM: "enum ", _ENUM64: "enum "}.get(kind, "")
        return prefix + self.name(name_off)

    def tracepoint_args(self, tracepoints: list[str]) -> dict[str, list[str] | None]:
        """{tracepoint: its argument types (without the leading void *), or
        None when the kernel does not describe it}."""
        wanted = {"btf_trace_" + tp: tp for tp in tracepoints}
        out: dict[str, list[str] | None] = dict.fromkeys(tracepoints)
        for kind, name_off, ref, _ in self.types[1:]:
            if kind != _TYPEDEF or (tp := wanted.get(self.name(name_off))) is None:
                continue
            ptr = self.types[ref]
            proto = self.types[ptr[2]] if ptr and ptr[0] == _PTR else None
            if proto and proto[0] == _FUNC_PROTO:
                out[tp] = [self.type_name(t) for t in proto[3][1:]]
        return out


def tracepoint_args(tracepoints: list[str], path: str = VMLINUX) -> dict[str, list[str] | None] | None:
    """{tracepoint: argument types or None}, or None when the kernel has no BTF."""
    try:
        with open(path, "rb") as f:
            btf = Btf(f.read())
    except (OSError, ValueError, struct.error):
        return None
    return btf.tracepoint_args(tracepoints)

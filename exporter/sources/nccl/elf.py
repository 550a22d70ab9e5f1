"""Minimal ELF64 little-endian reader: exported functions and address mapping.

Reads only the ELF header, the program/section header tables and the
.dynsym/.dynstr sections (plus .gnu.version when present), so it is fast
even on a 470 MB libnccl.so: a handful of seeks and a few hundred KB read.
"""

from __future__ import annotations

import os
import struct

__all__ = ["ElfError", "is_elf", "exported_functions", "vaddr_to_offset", "runs_here"]

ELF_MAGIC = b"\x7fELF"
ELFCLASS64 = 2
ELFDATA2LSB = 1

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")  # 64 bytes
_PHDR = struct.Struct("<IIQQQQQQ")  # 56 bytes
_SHDR = struct.Struct("<IIQQQQIIQQ")  # 64 bytes
_SYM = struct.Struct("<IBBHQQ")  # 24 bytes

PT_LOAD = 1
SHT_DYNSYM = 11
SHT_GNU_VERSYM = 0x6FFFFFFF
SHN_UNDEF = 0
STT_FUNC = 2
STT_GNU_IFUNC = 10
STB_GLOBAL = 1
STB_WEAK = 2
VERSYM_HIDDEN = 0x8000


class ElfError(Exception):
    """The file is not a readable ELF64 little-endian object, or is truncated."""


class _Elf:
    """An open ELF64 LE file with its headers parsed. Use as a context manager."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            self.f = open(self.path, "rb")
        except OSError as e:
            raise ElfError(f"{self.path}: cannot open: {e.strerror or e}") from None
        try:
            self.size = os.fstat(self.f.fileno()).st_size
            self._read_header()
        except BaseException:
            self.f.close()
            raise

    def __enter__(self) -> "_Elf":
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()

    def _read(self, offset: int, size: int, what: str) -> bytes:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ElfError(
                f"{self.path}: truncated ELF file: {what} at offset {offset}+{size} "
                f"is past the end of the file ({self.size} bytes)"
            )
        self.f.seek(offset)
        data = self.f.read(size)
        if len(data) != size:
            raise ElfError(f"{self.path}: truncated ELF file: short read of {what}")
        return data

    def _read_header(self) -> None:
        head = self.f.read(_EHDR.size)
        if len(head) < 4 or head[:4] != ELF_MAGIC:
            raise ElfError(f"{self.path}: not an ELF file")
        if len(head) < _EHDR.size:
            raise ElfError(f"{self.path}: truncated ELF file: header is {len(head)} bytes")
        (ident, _type, self.machine, _version, _entry, phoff, shoff, _flags, _ehsize,
         phentsize, phnum, shentsize, shnum, _shstrndx) = _EHDR.unpack(head)
        if ident[4] != ELFCLASS64 or ident[5] != ELFDATA2LSB:
            raise ElfError(
                f"{self.path}: unsupported ELF file: only ELF64 little-endian is supported "
                f"(class={ident[4]}, data={ident[5]})"
            )
        self.phoff, self.phnum, self.phentsize = phoff, phnum, phentsize
        self.shoff, self.shnum, self.shentsize = shoff, shnum, shentsize
        if phnum and phentsize < _PHDR.size:
            raise ElfError(f"{self.path}: bad ELF file: e_phentsize={phentsize}")
        if shoff and shentsize < _SHDR.size:
            raise ElfError(f"{self.path}: bad ELF file: e_shentsize={shentsize}")

    def program_headers(self) -> list[tuple]:
        if not self.phnum:
            return []
        raw = self._read(self.phoff, self.phnum * self.phentsize, "program headers")
        return [_PHDR.unpack_from(raw, i * self.phentsize) for i in range(self.phnum)]

    def section_headers(self) -> list[tuple]:
        if not self.shoff:
            return []
        shnum = self.shnum
        if shnum == 0:
            # Extended numbering: the real count is sh_size of section 0.
            first = _SHDR.unpack(self._read(self.shoff, _SHDR.size, "section header 0"))
            shnum = first[5]
        raw = self._read(self.shoff, shnum * self.shentsize, "section headers")
        return [_SHDR.unpack_from(raw, i * self.shentsize) for i in range(shnum)]


def is_elf(path: str | os.PathLike) -> bool:
    """True when `path` is a readable file starting with the ELF magic (any class)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == ELF_MAGIC
    except OSError:
        return False


# e_machine of the code this host runs (elf.h: EM_X86_64, EM_AARCH64)
_HOST_MACHINE = {"x86_64": 62, "aarch64": 183}.get(os.uname().machine)


def runs_here(path: str | os.PathLike) -> bool:
    """Whether the ELF file is code for this host's CPU. A process may map
    another architecture's library (qemu-user maps its guest's): a uprobe
    writes an x86 int3 into the file's page cache, which corrupts the other
    architecture's instruction there for every process that maps the file."""
    try:
        with _Elf(path) as e:
            return _HOST_MACHINE is None or e.machine == _HOST_MACHINE
    except ElfError:
        return False


def exported_functions(path: str | os.PathLike) -> dict[str, int]:
    """Defined function symbols of .dynsym -> st_value (virtual address).

    Counts STT_FUNC and STT_GNU_IFUNC symbols with GLOBAL or WEAK binding
    and st_shndx != SHN_UNDEF. Aliases (e.g. a weak `foo` aliasing `pfoo`)
    appear under each name with the same address. When a name has several
    versions (glibc), the default (non-hidden) version wins.
    A file without .dynsym (static executable) yields {}.
    """
    with _Elf(path) as elf:
        sections = elf.section_headers()
        dynsym_idx = next((i for i, s in enumerate(sections) if s[1] == SHT_DYNSYM), None)
        if dynsym_idx is None:
            return {}
        _n, _t, _fl, _a, sym_off, sym_size, link, _i, _al, entsize = sections[dynsym_idx]
        if link >= len(sections):
            raise ElfError(f"{elf.path}: bad ELF file: .dynsym links to section {link}")
        entsize = entsize or _SYM.size
        if entsize < _SYM.size:
            raise ElfError(f"{elf.path}: bad ELF file: .dynsym entry size {entsize}")
        count = sym_size // entsize
        syms = elf._read(sym_off, count * entsize, ".dynsym")
        str_sec = sections[link]
        strtab = elf._read(str_sec[4], str_sec[5], ".dynstr")

        versym = None
        for s in sections:
            if s[1] == SHT_GNU_VERSYM and s[5] >= 2 * count:
                versym = elf._read(s[4], 2 * count, ".gnu.version")
                break

    out: dict[str, int] = {}
    hidden_names: set[str] = set()
    unpack = _SYM.unpack_from
    for i in range(1, count):  # entry 0 is the null symbol
        st_name, st_info, _other, st_shndx, st_value, _size = unpack(syms, i * entsize)
        if st_shndx == SHN_UNDEF:
            continue
        if (st_info & 0xF) not in (STT_FUNC, STT_GNU_IFUNC):
            continue
        if (st_info >> 4) not in (STB_GLOBAL, STB_WEAK):
            continue
        end = strtab.find(b"\0", st_name)
        if end < 0:
            end = len(strtab)
        name = strtab[st_name:end].decode("utf-8", "replace")
        if not name:
            continue
        hidden = bool(versym) and bool(
            int.from_bytes(versym[2 * i:2 * i + 2], "little") & VERSYM_HIDDEN
        )
        if name in out:
            # Prefer the default version over hidden (old) versions.
            if hidden or name not in hidden_names:
                continue
        out[name] = st_value
        if hidden:
            hidden_names.add(name)
        else:
            hidden_names.discard(name)
    return out


def vaddr_to_offset(path: str | os.PathLike, vaddr: int) -> int:
    """File offset of virtual address `vaddr`, via the PT_LOAD program headers."""
    return vaddrs_to_offsets(path, [vaddr])[0]


def vaddrs_to_offsets(path: str | os.PathLike, vaddrs: list[int]) -> list[int]:
    """File offsets of virtual addresses (the program headers read once)."""
    with _Elf(path) as elf:
        loads = [(p_vaddr, p_filesz, p_offset) for p_type, _f, p_offset, p_vaddr, _p, p_filesz, _m, _a
                 in elf.program_headers() if p_type == PT_LOAD]
    out = []
    for vaddr in vaddrs:
        hit = next((vaddr - v + o for v, size, o in loads if v <= vaddr < v + size), None)
        if hit is None:
            raise ElfError(f"{os.fspath(path)}: address {vaddr:#x} is not in any PT_LOAD segment")
        out.append(hit)
    return out

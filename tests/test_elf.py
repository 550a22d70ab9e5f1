import os
import subprocess

import pytest

from exporter.sources.nccl import elf


def _libc_path() -> str:
    """The libc.so.6 this test process has mapped (no hard-coded path)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.rstrip("\n").split(None, 5)[-1]
            if os.path.basename(path).startswith("libc.so"):
                return path
    pytest.skip("libc.so.6 not mapped by this process")


def _nm_functions(path) -> dict[str, int]:
    """Defined dynamic functions according to binutils' nm (T/W/i types)."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)],
                         capture_output=True, text=True, check=True).stdout
    funcs = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in ("T", "W", "i"):
            name = parts[2].split("@")[0]
            funcs.setdefault(name, int(parts[0], 16))
    return funcs


def test_is_elf(fake_nccl_lib, tmp_path):
    assert elf.is_elf(fake_nccl_lib)
    assert elf.is_elf(_libc_path())
    text = tmp_path / "notes.txt"
    text.write_text("hello, not an ELF file\n")
    assert not elf.is_elf(text)
    assert not elf.is_elf(tmp_path / "does-not-exist")
    assert not elf.is_elf(tmp_path)  # a directory


def test_weak_alias_shares_address(fake_nccl_lib):
    funcs = elf.exported_functions(fake_nccl_lib)
    assert funcs["ncclAllReduce"] == funcs["pncclAllReduce"] != 0
    assert funcs["ncclGroupStart"] == funcs["pncclGroupStart"]
    assert "uses_helper" in funcs


def test_only_defined_global_functions(fake_nccl_lib):
    funcs = elf.exported_functions(fake_nccl_lib)
    assert "nccl_internal_counter" not in funcs  # object
    assert "helper" not in funcs  # static
    assert "hidden_fn" not in funcs  # hidden visibility: not in .dynsym
    assert "getppid" not in funcs  # undefined here (st_shndx == 0)


def test_matches_nm(fake_nccl_lib):
    assert elf.exported_functions(fake_nccl_lib) == _nm_functions(fake_nccl_lib)


def test_libc(tmp_path):
    libc = _libc_path()
    funcs = elf.exported_functions(libc)
    assert len(funcs) > 1000
    for name in ("malloc", "free", "open", "memcpy", "strlen"):
        assert name in funcs, name
    # memcpy has several versions in glibc; the default (@@) one wins.
    out = subprocess.run(["objdump", "-T", libc], capture_output=True, text=True).stdout
    default = [l for l in out.splitlines() if l.endswith(" memcpy") and "(GLIBC" not in l]
    if default:
        assert funcs["memcpy"] == int(default[0].split()[0], 16)


def test_vaddr_to_offset(fake_nccl_lib):
    funcs = elf.exported_functions(fake_nccl_lib)
    off = elf.vaddr_to_offset(fake_nccl_lib, funcs["pncclAllReduce"])
    assert 0 < off < os.path.getsize(fake_nccl_lib)
    with pytest.raises(elf.ElfError, match="not in any PT_LOAD"):
        elf.vaddr_to_offset(fake_nccl_lib, 1 << 40)


def test_not_elf_raises(tmp_path):
    text = tmp_path / "libnccl.so.2"
    text.write_text("this is a text file that merely has a library's name\n")
    with pytest.raises(elf.ElfError, match="not an ELF file"):
        elf.exported_functions(text)
    with pytest.raises(elf.ElfError, match="cannot open"):
        elf.exported_functions(tmp_path / "missing.so")


def test_truncated_raises(fake_nccl_lib, tmp_path):
    data = fake_nccl_lib.read_bytes()
    short = tmp_path / "short.so"
    short.write_bytes(data[:40])  # magic, but the header is cut
    with pytest.raises(elf.ElfError, match="truncated"):
        elf.exported_functions(short)
    cut = tmp_path / "cut.so"
    cut.write_bytes(data[: len(data) // 2])  # section headers live at the end
    with pytest.raises(elf.ElfError, match="truncated"):
        elf.exported_functions(cut)


def test_elf32_rejected(tmp_path):
    f = tmp_path / "elf32.so"
    f.write_bytes(b"\x7fELF\x01\x01\x01" + b"\0" * 57)
    with pytest.raises(elf.ElfError, match="ELF64 little-endian"):
        elf.exported_functions(f)


def _wheel_nccl():
    """libnccl.so.2 from the nvidia-nccl-cu12 wheel (`make nccl-wheel`), if installed."""
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(base, "nccl", "lib", "libnccl.so.2")
        if os.path.exists(path):
            return path
    pytest.skip("nvidia-nccl-cu12 wheel not installed (make nccl-wheel)")


def test_real_nccl_library_exports_contract_functions():
    import time
    from exporter.records.contract import NCCL_FUNCTIONS

    path = _wheel_nccl()
    t = time.perf_counter()
    funcs = elf.exported_functions(path)
    assert time.perf_counter() - t < 2.0  # headers + .dynsym only, not 470 MB
    for name in NCCL_FUNCTIONS:
        assert name in funcs, name
        assert funcs["p" + name] == funcs[name], f"p{name} is not an alias of {name}"
        assert elf.vaddr_to_offset(path, funcs[name]) > 0

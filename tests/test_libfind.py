import os
import subprocess
import sys
import threading
import time

import pytest

from exporter.sources.nccl import libfind

LOADER = r"""
import ctypes, sys
libs = [ctypes.CDLL(p) for p in sys.argv[1:]]
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def load_libs():
    """Start a process that dlopen()s the given libraries and waits."""
    procs = []

    def start(*paths):
        p = subprocess.Popen([sys.executable, "-c", LOADER, *map(str, paths)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stdin.close()
        p.wait(timeout=10)


def _by_inode(libs):
    return {lib.inode: lib for lib in libs}


def test_finds_libnccl_by_name(fake_nccl_lib, load_libs):
    p1 = load_libs(fake_nccl_lib)
    p2 = load_libs(fake_nccl_lib)
    st = os.stat(fake_nccl_lib)
    libs = [l for l in libfind.mapped_nccl_libraries() if l.inode == st.st_ino]
    assert len(libs) == 1, "one Library per distinct file"
    lib = libs[0]
    assert lib.path == str(fake_nccl_lib)
    assert (lib.dev, lib.inode) == (st.st_dev, st.st_ino)
    assert {p1.pid, p2.pid} <= lib.pids


def test_finds_statically_linked_nccl(static_nccl_lib, plain_lib, load_libs):
    p = load_libs(static_nccl_lib, plain_lib)
    found = _by_inode(libfind.mapped_nccl_libraries())
    assert os.stat(static_nccl_lib).st_ino in found
    assert p.pid in found[os.stat(static_nccl_lib).st_ino].pids
    assert os.stat(plain_lib).st_ino not in found


def test_fake_proc_vanished_and_odd_lines(tmp_path, fake_nccl_lib, plain_lib):
    proc = tmp_path / "proc"
    (proc / "self" / "ns").mkdir(parents=True)
    os.symlink("mnt:[1]", proc / "self" / "ns" / "mnt")
    st = os.stat(fake_nccl_lib)
    for pid in (100, 101):
        (proc / str(pid) / "ns").mkdir(parents=True)
        os.symlink("mnt:[1]", proc / str(pid) / "ns" / "mnt")
        (proc / str(pid) / "maps").write_text(
            "00400000-00401000 r-xp 00000000 00:00 0 [vdso]\n"
            "7f0000000000-7f0000001000 rw-p 00000000 00:00 0 \n"
            f"7f0000001000-7f0000002000 r--p 00000000 fd:01 {st.st_ino} {fake_nccl_lib}\n"
            f"7f0000002000-7f0000003000 r-xp 00001000 fd:01 {st.st_ino} {fake_nccl_lib}\n"
            f"7f0000004000-7f0000005000 r-xp 00000000 fd:01 9 {plain_lib}\n"
            "7f0000006000-7f0000007000 r-xp 00000000 fd:01 12 /gone/libnccl.so.2\n"
            "garbage\n"
        )
    (proc / "102").mkdir()  # vanished: no maps file
    (proc / "sys").mkdir()  # not a pid
    libs = libfind.mapped_nccl_libraries(proc=str(proc))
    assert len(libs) == 1
    assert libs[0].path == str(fake_nccl_lib) and libs[0].pids == {100, 101}


def test_other_mount_namespace_uses_proc_root(tmp_path, fake_nccl_lib):
    proc = tmp_path / "proc"
    (proc / "self" / "ns").mkdir(parents=True)
    os.symlink("mnt:[1]", proc / "self" / "ns" / "mnt")
    (proc / "200" / "ns").mkdir(parents=True)
    os.symlink("mnt:[2]", proc / "200" / "ns" / "mnt")
    # The container's root is a directory holding the library at /opt/libnccl.so.2.
    root = proc / "200" / "root"
    (root / "opt").mkdir(parents=True)
    os.link(fake_nccl_lib, root / "opt" / "libnccl.so.2")
    st = os.stat(fake_nccl_lib)
    (proc / "200" / "maps").write_text(
        f"7f0000002000-7f0000003000 r-xp 00001000 fd:01 {st.st_ino} /opt/libnccl.so.2\n")
    [lib] = libfind.mapped_nccl_libraries(proc=str(proc))
    assert lib.path == str(root / "opt" / "libnccl.so.2")
    assert lib.inode == st.st_ino and lib.pids == {200}


def test_find_libraries(fake_nccl_lib, static_nccl_lib, plain_lib, tmp_path):
    libs = libfind.find_libraries([str(fake_nccl_lib), str(static_nccl_lib), str(fake_nccl_lib)])
    assert [l.path for l in libs] == [str(fake_nccl_lib), str(static_nccl_lib)]
    link = tmp_path / "libnccl.so"
    link.symlink_to(fake_nccl_lib)
    [lib] = libfind.find_libraries([str(link)])
    assert lib.path == str(fake_nccl_lib)


@pytest.mark.parametrize("kind", ["missing", "text", "plain", "dir"])
def test_find_libraries_rejects(kind, plain_lib, tmp_path):
    path = {
        "missing": tmp_path / "nope.so",
        "text": tmp_path / "libnccl.so.2",
        "plain": plain_lib,
        "dir": tmp_path,
    }[kind]
    if kind == "text":
        path.write_text("not elf")
    with pytest.raises(libfind.LibraryError) as e:
        libfind.find_libraries([str(path)])
    msg = str(e.value)
    assert "\n" not in msg and str(path).split("/")[-1] in msg
    if kind == "plain":
        assert "is not an NCCL library: no ncclAllReduce" in msg


def test_watcher_reports_each_file_once(fake_nccl_lib, static_nccl_lib, load_libs):
    seen = []
    got = threading.Event()

    def cb(lib):
        seen.append(lib)
        got.set()

    w = libfind.LibraryWatcher(cb, interval=0.05, extra_paths=[str(static_nccl_lib)])
    with w:
        deadline = time.monotonic() + 5  # a /proc scan takes longer on a loaded machine
        while time.monotonic() < deadline and not any(l.path == str(static_nccl_lib) for l in seen):
            time.sleep(0.05)
        time.sleep(0.2)  # a few more scans: still reported once
        assert [l.path for l in seen if l.path == str(static_nccl_lib)] == [str(static_nccl_lib)]
        before = len(seen)
        p = load_libs(fake_nccl_lib)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(l.path == str(fake_nccl_lib) for l in seen):
            time.sleep(0.02)
        load_libs(fake_nccl_lib)  # a second process: same file, no new callback
        time.sleep(0.3)
    assert not w._thread.is_alive()
    paths = [l.path for l in seen]
    assert paths.count(str(fake_nccl_lib)) == 1
    assert paths.count(str(static_nccl_lib)) == 1
    assert len(seen) >= before + 1
    lib = next(l for l in w.libraries if l.path == str(fake_nccl_lib))
    assert p.pid in lib.pids


def test_watcher_survives_callback_error(fake_nccl_lib, load_libs):
    p = load_libs(fake_nccl_lib)
    calls = []

    def cb(lib):
        calls.append(lib)
        raise RuntimeError("boom")

    w = libfind.LibraryWatcher(cb, interval=0.05)
    new = w.scan_once()
    assert any(l.path == str(fake_nccl_lib) and p.pid in l.pids for l in new)
    # not reported again; a library another test's process maps meanwhile may be (the scan is the host's)
    again = w.scan_once()
    assert not [l for l in again if l.path == str(fake_nccl_lib) and p.pid in l.pids], again


def test_nccl_version_from_the_banner(tmp_path, plain_lib):
    """The version NCCL prints at init, read from the file (not run)."""
    from conftest import REAL_NCCL_LIB
    from exporter.simulator.build import build_library

    assert libfind.nccl_version(str(build_library())) == "2.32.3"  # the simulator's banner
    if REAL_NCCL_LIB:
        assert libfind.nccl_version(REAL_NCCL_LIB) == "2.32.3"  # "NCCL version 2.32.3+cuda12.9"
    assert libfind.nccl_version(str(plain_lib)) == ""  # no banner
    assert libfind.nccl_version(str(tmp_path / "missing.so")) == ""
    f = tmp_path / "libnccl.so.2"
    f.write_bytes(b"\0" * 100 + b"NCCL version x" + b"NCCL version 2.27.7+cuda12.8\0")
    assert libfind.nccl_version(str(f)) == "2.27.7"

"""The loader source (bpf/loader.c): a process mapping a library is reported
at once, from a uprobe on the dynamic loader, so a new libnccl is attached as
a reaction to being mapped, not by a rescan timer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import require_root

CHILD = """
import ctypes, sys, time
time.sleep(0.3)
ctypes.CDLL(sys.argv[1])
print("loaded", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def loader():
    require_root()
    from exporter.sources.loader import LoaderSource

    src = LoaderSource()
    yield src
    src.close()


def test_loader_files_are_found_and_probed_once(loader):
    from exporter.sources.loader import is_loader, mapped_loaders

    assert is_loader("/lib64/ld-linux-x86-64.so.2") and is_loader("/lib/ld-musl-x86_64.so.1")
    assert not is_loader("/usr/lib/libnccl.so.2")
    mine = mapped_loaders([os.getpid()])
    assert mine, "this Python process maps a dynamic loader"
    loader.attach_loaders([os.getpid()])
    assert set(mine) <= set(loader.probed)
    assert loader.attach_loaders([os.getpid()]) == []  # once per file


def test_a_dlopen_is_reported_with_its_pid_and_the_library_found(loader, tmp_path):
    from exporter.simulator.build import build_library
    from exporter.sources.bpf import RingWaiter
    from exporter.sources.nccl.libfind import ProcessScanner

    lib = tmp_path / "libnccl.so.2"
    shutil.copy(build_library(), lib)  # a file no process has mapped
    loader.attach_loaders()
    events = []
    loader.on_event(events.append)
    waiter = RingWaiter()
    waiter.add(loader)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(lib)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        found = []
        deadline = time.monotonic() + 10
        while not found and time.monotonic() < deadline:
            waiter.wait(100)
            pids = {e.pid for e in events if e.kind == "LINK_MAP"}
            if child.pid in pids:
                found = [l for l in ProcessScanner().scan([child.pid]) if os.path.samefile(l.path, lib)]
        assert found, "the dlopen of a new libnccl was not reported"
        assert child.stdout.readline().strip() == "loaded"
        assert child.pid in found[0].pids
        assert loader.lost() == 0
    finally:
        child.stdin.close()
        child.wait()
        waiter.close()

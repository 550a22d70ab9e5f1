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


CHILD = """
import ctypes, sys, time
time.sleep(0.3)
ctypes.CDLL(sys.argv[1])
print("loaded", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def loader(bpf):
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


@pytest.mark.skipif(not (shutil.which("qemu-aarch64") and shutil.which("aarch64-linux-gnu-gcc")),
                    reason="qemu-user and gcc-aarch64-linux-gnu missing (make deps)")
def test_an_emulated_process_loader_is_never_probed(loader, tmp_path):
    """qemu-user maps its guest's ld-linux-aarch64.so.1 like any file: an x86 uprobe's int3
    written into it made every aarch64 program under emulation die of SIGILL at start."""
    src, exe = tmp_path / "hello.c", tmp_path / "hello"
    src.write_text('#include <stdio.h>\nint main(void) { getchar(); puts("hello"); return 0; }\n')
    subprocess.run(["aarch64-linux-gnu-gcc", "-o", str(exe), str(src)], check=True)
    run = ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", str(exe)]

    def seen():
        return [p for p in [*loader.failed, *loader.probed.values()] if "aarch64" in p]

    child = subprocess.Popen(run, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not seen() and time.monotonic() < deadline:
            loader.attach_loaders([child.pid])   # what an exec event makes the agent do
            time.sleep(0.05)
        out, _ = child.communicate("\n", timeout=30)
        assert child.returncode == 0 and out == "hello\n"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert seen(), "the guest's loader never showed in the emulator's maps"
    assert not any("aarch64" in p for p in loader.probed.values()), loader.probed
    p = subprocess.run(run, input="\n", capture_output=True, text=True, timeout=30)   # the file is intact
    assert p.returncode == 0 and p.stdout == "hello\n", p.stderr


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


JOB = """
import ctypes, sys, time
from ctypes import c_int, c_size_t, c_void_p, byref
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
L = ctypes.CDLL(sys.argv[1])           # libnccl is mapped here ...
time.sleep(float(sys.argv[2]))         # ... and the first call comes this much later
uid = UniqueId()
assert L.ncclGetUniqueId(byref(uid)) == 0
comm = c_void_p()
L.ncclCommInitRank.argtypes = [ctypes.POINTER(c_void_p), c_int, UniqueId, c_int]
assert L.ncclCommInitRank(byref(comm), 1, uid, 0) == 0
buf = (ctypes.c_float * 16)()
L.ncclAllReduce.argtypes = [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
for _ in range(int(sys.argv[3])):
    assert L.ncclAllReduce(buf, buf, 16, 7, 0, comm, None) == 0
L.ncclCommDestroy(comm)
print("done", flush=True)
"""


def test_a_job_calling_100ms_after_loading_libnccl_is_counted_from_its_first_call(tmp_path, launch_exporter,
                                                                                   simulator_lib):
    """Default discovery (no --nccl-lib): a library file no process had mapped
    is attached as a reaction to its mapping, before a first call 100 ms later,
    in every one of 5 trials (attaching is a few uprobe_multi links, not 90
    perf events: sources/uprobe_multi.py; bench/attach_latency.py --jobs
    repeats it 20 times)."""
    from conftest import sample_value

    calls, trials = 50, 5
    with launch_exporter("--node", "t", "--log-level", "info") as exporter:
        for attempt in range(trials):  # fresh files: every one counted from its first call
            lib = tmp_path / f"job{attempt}" / "libnccl.so.2"
            lib.parent.mkdir()
            shutil.copy(simulator_lib, lib)
            out = subprocess.run([sys.executable, "-c", JOB, str(lib), "0.1", str(calls)],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0 and "done" in out.stdout, out.stderr
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            samples = exporter.samples()
            got = sample_value(samples, "nccl_lifecycle_duration_seconds_count", op="GET_UNIQUE_ID")
            if got == trials:
                break
            time.sleep(0.2)
        assert got == trials, exporter.output()
        total = sum(s.value for s in samples if s.name == "nccl_collective_duration_seconds_count"
                    and s.labels.get("op") == "ALL_REDUCE")
        assert total == trials * calls, exporter.output()
        assert "falls back" not in exporter.output()

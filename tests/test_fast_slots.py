"""The array fast paths of bpf/nccl.c, each with a hash behind it.

Each thread's NCCL call slot (bpf/traced.h): the inflight_fast slot at its
thread id's low bits when free, else an entry in the `inflight` hash.

Real uprobes on a private copy of the simulator's library, called through
ctypes from threads of this process: one thread holds a fast slot while a
second thread, made to have a thread id with the same low bits, calls too and
must get a hash entry. Every call is counted once, the in-flight reader sees
the calls of both kinds of slot, and each slot is freed when its thread exits.

Failed calls by (op, result): NCCL's results in call_errors_fast, any other
value in the call_errors hash; a small library of the test's own returns the
result it is asked for.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading

import pytest

from exporter.records import contract
from exporter.simulator.build import build_library
from exporter.sources.nccl.probes import NcclProbes
from exporter.sources.nccl.reader import NcclReader

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for BPF")

CALLS = 50  # AllReduce calls per thread
FLOAT32, SUM = 7, 0


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]  # passed by value to ncclCommInitRank


def typed(lib):
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
    lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return lib


class Caller(threading.Thread):
    """A thread that makes a 1-rank communicator and CALLS AllReduces on it,
    then stays alive (its slot owned) until `release` is set."""

    def __init__(self, lib, release: threading.Event):
        super().__init__(daemon=True)
        self.lib, self.release = lib, release
        self.ready, self.tid, self.error = threading.Event(), 0, None

    def run(self):
        try:
            self.tid = threading.get_native_id()
            uid, comm = UniqueId(), ctypes.c_void_p()
            assert self.lib.ncclGetUniqueId(ctypes.byref(uid)) == 0
            assert self.lib.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0
            buf = (ctypes.c_float * 4)()
            for _ in range(CALLS):
                assert self.lib.ncclAllReduce(buf, buf, 4, FLOAT32, SUM, comm, None) == 0
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.ready.set()
        self.release.wait(60)


def thread_with_low_bits(low: int, tries: int = 20000) -> None:
    """Burn thread ids (short-lived threads) until the next one made will have
    `low` in its low bits of FAST_THREADS; raises if it never comes."""
    mask = contract.FAST_THREADS - 1
    for _ in range(tries):
        got = []
        t = threading.Thread(target=lambda: got.append(threading.get_native_id()))
        t.start()
        t.join()
        if (got[0] + 1) & mask == low:
            return
    raise AssertionError("no thread id with the wanted low bits came")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    lib_path = tmp_path_factory.mktemp("slots") / "libnccl.so.2"
    shutil.copy(build_library(), lib_path)  # uprobes on this file only: no other test counts here
    probes = NcclProbes()
    try:
        probes.attach(str(lib_path))
        yield probes, NcclReader(probes), typed(ctypes.CDLL(str(lib_path)))
    finally:
        probes.close()


def slots(probes) -> tuple[dict[int, int], set[int]]:
    """(fast slot index -> owner thread id, for owned slots; thread ids in the hash)."""
    fast = {k.value: v.owner for k, v in probes["inflight_fast"].items() if v.owner}
    return fast, {k.value for k in probes["inflight"].keys()}


def test_a_thread_whose_fast_slot_is_taken_uses_the_hash(traced):
    probes, reader, lib = traced
    mask = contract.FAST_THREADS - 1
    release_a, release_b = threading.Event(), threading.Event()
    a = Caller(lib, release_a)
    a.start()
    assert a.ready.wait(60) and a.error is None, a.error
    thread_with_low_bits(a.tid & mask)
    b = Caller(lib, release_b)
    b.start()
    assert b.ready.wait(60) and b.error is None, b.error
    try:
        assert b.tid != a.tid and b.tid & mask == a.tid & mask, "the thread id came taken meanwhile"
        fast, hashed = slots(probes)
        assert fast.get(a.tid & mask) == a.tid, fast
        assert b.tid in hashed and a.tid not in hashed, hashed
        # every call counted once, on each thread's own 1-rank communicator
        counts = sorted(s.calls for s in reader.series() if s.op == "ALL_REDUCE" and s.nranks == 1)
        assert counts == [CALLS, CALLS], counts
        assert not [c for c in reader.inflight() if c.tid in (a.tid, b.tid)]  # both idle
    finally:
        release_b.set()
        b.join(10)
    fast, hashed = slots(probes)
    assert b.tid not in hashed and fast.get(a.tid & mask) == a.tid  # B's entry went at its exit
    release_a.set()
    a.join(10)
    fast, hashed = slots(probes)
    assert a.tid & mask not in fast, fast  # A's slot is free for the next thread with those bits
    # a new thread takes a free fast slot, not a hash entry
    release_c = threading.Event()
    c = Caller(lib, release_c)
    c.start()
    assert c.ready.wait(60) and c.error is None, c.error
    fast, hashed = slots(probes)
    release_c.set()
    c.join(10)
    assert fast.get(c.tid & mask) == c.tid and c.tid not in hashed, (fast, hashed)


FAKE_C = r"""
/* ncclAllReduce returning whatever `count` says: the result codes under test. */
int ncclAllReduce(const void *s, void *r, unsigned long count, int dt, int op, void *comm, void *stream) {
    return (int)count;
}
"""


def test_errors_of_nccl_results_and_of_any_other_value(tmp_path):
    src, lib_path = tmp_path / "fake.c", tmp_path / "libnccl.so.2"
    src.write_text(FAKE_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib_path), str(src)], check=True)
    probes = NcclProbes()
    try:
        probes.attach(str(lib_path))
        lib = ctypes.CDLL(str(lib_path))
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        made = {4: 3, 6: 2, 0: 5, 42: 2, -1: 1}  # result -> calls (0: success, no error)
        for result, n in made.items():
            for _ in range(n):
                assert lib.ncclAllReduce(None, None, result & 0xFFFFFFFF, FLOAT32, SUM, None, None) == result
        reader = NcclReader(probes)
        assert reader.errors() == {("ALL_REDUCE", contract.result_name(r)): n for r, n in made.items() if r}
        # NCCL's results took the array, the others the hash
        hashed = {(k.op, k.result): v.value for k, v in probes["call_errors"].items()}
        assert hashed == {(contract.OP_CODES["ALL_REDUCE"], 42): 2, (contract.OP_CODES["ALL_REDUCE"], -1): 1}
        assert sum(s.calls for s in reader.series() if s.op == "ALL_REDUCE") == sum(made.values())
    finally:
        probes.close()

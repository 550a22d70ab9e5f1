"""The array fast paths of bpf/nccl.c, each with a hash behind it.

Each thread's NCCL call slot (bpf/traced.h): the inflight_fast slot at its
thread id's low bits when free, else an entry in the `inflight` hash.
Real uprobes on a private copy of the simulator's library, called through
ctypes by threads of a child process: one thread holds a fast slot while a
second thread, made to have a thread id with the same low bits, calls too and
must get a hash entry. Every call is counted once, the in-flight reader sees
the calls of both kinds of slot, and each slot is freed when its thread exits.

Failed calls by (op, result): NCCL's results in call_errors_fast, any other
value in the call_errors hash; a small library of the test's own returns the
result it is asked for.

The calls are made in child processes, never in the test process: a process
that maps a libnccl is a traced NCCL process to every agent started later in
the suite.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from exporter.records import contract
from exporter.sources.nccl.probes import NcclProbes
from exporter.sources.nccl.maps import NcclReader

pytestmark = pytest.mark.usefixtures("bpf")  # markers, root and the heavy lock: conftest

CALLS = 50  # AllReduce calls per thread

# Child: `python -c CHILD LIB FAST_THREADS`. Each caller thread makes a 1-rank
# communicator and CALLS AllReduces, prints "<name> <tid>", and stays alive
# (its slot owned) until the parent sends its name on stdin; the child then
# prints "<name> gone". B is started once a thread id with A's low bits is next.
CHILD = r"""
import ctypes, sys, threading
CALLS = %d
lib = ctypes.CDLL(sys.argv[1])
mask = int(sys.argv[2]) - 1

class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]  # passed by value to ncclCommInitRank

lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                              ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
releases, done = {}, {}

def caller(name):
    uid, comm = UniqueId(), ctypes.c_void_p()
    assert lib.ncclGetUniqueId(ctypes.byref(uid)) == 0
    assert lib.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0
    buf = (ctypes.c_float * 4)()
    for _ in range(CALLS):
        assert lib.ncclAllReduce(buf, buf, 4, 7, 0, comm, None) == 0  # float32, sum
    print(name, threading.get_native_id(), flush=True)
    releases[name].wait()

def start(name):
    releases[name] = threading.Event()
    t = done[name] = threading.Thread(target=caller, args=(name,))
    t.start()

def burn_until(low):
    for _ in range(20000):
        got = []
        t = threading.Thread(target=lambda: got.append(threading.get_native_id()))
        t.start(); t.join()
        if (got[0] + 1) & mask == low:
            return
    sys.exit("no thread id with the wanted low bits came")

start("A")
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "burn":
        burn_until(int(cmd[1]))
        print("burnt", flush=True)
    elif cmd[0] == "start":
        start(cmd[1])
    else:
        releases[cmd[0]].set(); done[cmd[0]].join()
        print(cmd[0], "gone", flush=True)
""" % CALLS


class Child:
    def __init__(self, lib):
        self.p = subprocess.Popen([sys.executable, "-c", CHILD, str(lib), str(contract.FAST_THREADS)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def say(self, line: str) -> list[str]:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.read()

    def read(self) -> list[str]:
        out = self.p.stdout.readline().split()
        assert out, f"the child ended: rc {self.p.wait()}"
        return out

    def close(self):
        self.p.stdin.close()
        self.p.kill()
        self.p.wait()


@pytest.fixture(scope="module")
def traced(tmp_path_factory, simulator_lib):
    lib_path = tmp_path_factory.mktemp("slots") / "libnccl.so.2"
    shutil.copy(simulator_lib, lib_path)  # uprobes on this file only: no other test counts here
    probes = NcclProbes()
    try:
        probes.attach(str(lib_path))
        yield probes, NcclReader(probes), lib_path
    finally:
        probes.close()


def slots(probes) -> tuple[dict[int, int], set[int]]:
    """(fast slot index -> owner thread id, for owned slots; thread ids in the hash)."""
    fast = {k.value: v.owner for k, v in probes["inflight_fast"].items() if v.owner}
    return fast, {k.value for k in probes["inflight"].keys()}


def test_a_thread_whose_fast_slot_is_taken_uses_the_hash(traced):
    probes, reader, lib = traced
    mask = contract.FAST_THREADS - 1
    child = Child(lib)
    try:
        name, a = child.read()
        a = int(a)
        assert name == "A"
        assert child.say(f"burn {a & mask}") == ["burnt"]
        name, b = child.say("start B")
        b = int(b)
        assert b != a and b & mask == a & mask, "the thread id came taken meanwhile"
        fast, hashed = slots(probes)
        assert fast.get(a & mask) == a, fast
        assert b in hashed and a not in hashed, hashed
        # every call counted once, on each thread's own 1-rank communicator
        counts = sorted(s.calls for s in reader.series() if s.op == "ALL_REDUCE" and s.nranks == 1)
        assert counts == [CALLS, CALLS], counts
        assert not [c for c in reader.inflight() if c.tid in (a, b)]  # both idle
        assert child.say("B") == ["B", "gone"]
        fast, hashed = slots(probes)
        assert b not in hashed and fast.get(a & mask) == a  # B's entry went at its exit
        assert child.say("A") == ["A", "gone"]
        fast, hashed = slots(probes)
        assert a & mask not in fast, fast  # A's slot is free for the next thread with those bits
        name, c = child.say("start C")  # a new thread takes a free fast slot, not a hash entry
        c = int(c)
        fast, hashed = slots(probes)
        assert fast.get(c & mask) == c and c not in hashed, (fast, hashed)
        assert child.say("C") == ["C", "gone"]
    finally:
        child.close()


FAKE_C = r"""
/* ncclAllReduce returning whatever `count` says: the result codes under test. */
int ncclAllReduce(const void *s, void *r, unsigned long count, int dt, int op, void *comm, void *stream) {
    return (int)count;
}
"""

CALL_FAKE = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                              ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
for result, n in json.loads(sys.argv[2]):
    for _ in range(n):
        assert lib.ncclAllReduce(None, None, result & 0xFFFFFFFF, 7, 0, None, None) == result
"""


def test_errors_of_nccl_results_and_of_any_other_value(tmp_path):
    src, lib_path = tmp_path / "fake.c", tmp_path / "libnccl.so.2"
    src.write_text(FAKE_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib_path), str(src)], check=True)
    probes = NcclProbes()
    try:
        probes.attach(str(lib_path))
        made = {4: 3, 6: 2, 0: 5, 42: 2, -1: 1}  # result -> calls (0: success, no error)
        subprocess.run([sys.executable, "-c", CALL_FAKE, str(lib_path), json.dumps(list(made.items()))], check=True)
        reader = NcclReader(probes)
        assert reader.errors() == {("ALL_REDUCE", contract.result_name(r)): n for r, n in made.items() if r}
        # NCCL's results took the array, the others the hash
        hashed = {(k.op, k.result): v.value for k, v in probes["call_errors"].items()}
        assert hashed == {(contract.OP_CODES["ALL_REDUCE"], 42): 2, (contract.OP_CODES["ALL_REDUCE"], -1): 1}
        assert sum(s.calls for s in reader.series() if s.op == "ALL_REDUCE") == sum(made.values())
    finally:
        probes.close()

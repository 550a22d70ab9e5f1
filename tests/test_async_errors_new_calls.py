"""NCCL 2.28-2.32 calls (docs/metrics.md, "NCCL 2.28–2.32 calls"): ncclCommGetAsyncError's state per
communicator, the fault-tolerance lifecycle, one-sided and registration calls.

- On the simulator: three ranks, one killed; the survivors' next call on the
  dead peer fails and their ncclCommGetAsyncError polls report ncclRemoteError,
  kept per (communicator, rank) in the kernel and exported as
  nccl_communicator_async_error{result="ncclRemoteError"}, polls counted in the
  kernel (no event per poll).
- On the real NCCL 2.32.3 wheel (no GPU): every new function attaches, and
  calls on a NULL communicator (ncclInvalidArgument) decode and break nothing.
  The calls are made in a child process: a crash there cannot take the test down.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from exporter.records import contract, metrics
from conftest import parse_metrics, sample_value

pytestmark = pytest.mark.slow

NEW_FUNCTIONS = [
    "ncclCommGetAsyncError", "ncclCommShrink", "ncclCommGrow", "ncclCommRevoke", "ncclCommSuspend",
    "ncclCommResume", "ncclCommRegister", "ncclCommDeregister", "ncclCommWindowRegister",
    "ncclCommWindowDeregister", "ncclPutSignal", "ncclSignal", "ncclWaitSignal",
]

# One simulated rank: init, one AllReduce, poll; rank `victim` exits; the others
# receive from it (EOF: ncclRemoteError) and poll ncclCommGetAsyncError POLLS times.
RANK_PY = r"""
import ctypes, os, sys, time
lib_path, rank, nranks, rdv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
victim, polls = int(sys.argv[5]), int(sys.argv[6])
lib = ctypes.CDLL(lib_path)
class Uid(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
c_p, c_i, c_sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
time.sleep(float(os.environ.get("START_DELAY", "0")))
uid = Uid()
path = os.path.join(rdv, "uid")
if rank == 0:
    assert lib.ncclGetUniqueId(ctypes.byref(uid)) == 0
    with open(path + ".tmp", "wb") as f:
        f.write(ctypes.string_at(ctypes.addressof(uid), 128))
    os.rename(path + ".tmp", path)
else:
    while not os.path.exists(path):
        time.sleep(0.01)
    ctypes.memmove(ctypes.addressof(uid), open(path, "rb").read(), 128)
comm = c_p()
lib.ncclCommInitRank.argtypes = [ctypes.POINTER(c_p), c_i, Uid, c_i]
assert lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank) == 0
buf = (ctypes.c_float * 16)(*([1.0] * 16))
lib.ncclAllReduce.argtypes = [c_p, c_p, c_sz, c_i, c_i, c_p, c_p]
assert lib.ncclAllReduce(buf, buf, 16, 7, 0, comm, None) == 0
err = ctypes.c_int(-1)
lib.ncclCommGetAsyncError.argtypes = [c_p, ctypes.POINTER(c_i)]
assert lib.ncclCommGetAsyncError(comm, ctypes.byref(err)) == 0 and err.value == 0
open(os.path.join(rdv, f"ok.{rank}"), "w").close()
while not all(os.path.exists(os.path.join(rdv, f"ok.{r}")) for r in range(nranks)):
    time.sleep(0.01)
if rank == victim:
    os._exit(0)   # its sockets close: the peers see EOF
time.sleep(0.3)
lib.ncclRecv.argtypes = [c_p, c_sz, c_i, c_i, c_p, c_p]
rc = lib.ncclRecv(buf, 16, 7, victim, comm, None)
for _ in range(polls):
    assert lib.ncclCommGetAsyncError(comm, ctypes.byref(err)) == 0
print(f"rank {rank}: recv {rc} async {err.value}", flush=True)
# Drop the dead rank: the survivors make a communicator without it.
child = c_p()
excl = (c_i * 1)(victim)
lib.ncclCommShrink.argtypes = [c_p, ctypes.POINTER(c_i), c_i, ctypes.POINTER(c_p), c_p, c_i]
assert lib.ncclCommShrink(comm, excl, 1, ctypes.byref(child), None, 0) == 0
assert lib.ncclAllReduce(buf, buf, 16, 7, 0, child, None) == 0
assert lib.ncclCommGetAsyncError(child, ctypes.byref(err)) == 0 and err.value == 0
open(os.path.join(rdv, f"child.{rank}"), "w").write(str(child.value))
open(os.path.join(rdv, f"done.{rank}"), "w").close()
while not os.path.exists(os.path.join(rdv, "exit")):
    time.sleep(0.05)
"""


def _bcc_or_skip():
    try:
        import bcc  # noqa: F401
    except ImportError:
        pytest.skip("the bcc module is not importable (make deps venv)")


def _collect(reader, probes) -> list:
    from prometheus_client import CollectorRegistry, generate_latest

    from exporter.sinks.prometheus import Collector, NcclCollector
    from exporter.sources.processes import ProcessTable

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector("test-node", ProcessTable(probes), [NcclCollector(reader)]))
    return parse_metrics(generate_latest(registry).decode())


def test_contract_covers_the_new_functions():
    for fn in NEW_FUNCTIONS:
        assert fn in contract.NCCL_FUNCTIONS, fn
    assert max(contract.OPS) < contract.OP_COUNT
    assert contract.OP_COUNT & (contract.OP_COUNT - 1) == 0  # bpf/nccl.c masks with OP_COUNT - 1
    for op in ("PUT_SIGNAL", "SIGNAL", "WAIT_SIGNAL"):
        assert op in contract.COLLECTIVE_OPS.values()


def test_async_error_after_a_peer_dies_on_the_simulator(tmp_path, bpf, netns):
    _bcc_or_skip()
    from exporter.simulator.build import build_library
    from exporter.sources.nccl.probes import NcclProbes
    from exporter.sources.nccl.maps import NcclReader

    lib = str(build_library(tmp_path / "sim"))
    rdv = tmp_path / "rdv"
    rdv.mkdir()
    probes = NcclProbes()
    procs = []
    try:
        report = probes.attach(lib)
        assert "ncclCommGetAsyncError" in report.attached or "ncclCommGetAsyncError" in report.aliases
        reader = NcclReader(probes)
        nranks, victim, polls = 3, 1, 200
        script = tmp_path / "rank.py"
        script.write_text(RANK_PY)
        procs = [subprocess.Popen([sys.executable, str(script), lib, str(r), str(nranks), str(rdv),
                                   str(victim), str(polls)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for r in range(nranks)]
        pids = {r: p.pid for r, p in enumerate(procs)}
        deadline = time.monotonic() + 60
        survivors = [r for r in range(nranks) if r != victim]
        while not all((rdv / f"done.{r}").exists() for r in survivors):
            assert time.monotonic() < deadline, [p.poll() for p in procs]
            for r, p in enumerate(procs):
                if r != victim and p.poll() is not None:
                    pytest.fail(f"rank {r} exited: {p.stdout.read()}")
            time.sleep(0.05)
        assert procs[victim].wait(10) == 0

        states = {a.pid: a for a in reader.async_errors() if a.nranks == nranks}  # the parents
        for r in survivors:
            a = states[pids[r]]
            assert a.result == "ncclRemoteError", a
            assert a.rank == r and a.nranks == nranks
            assert a.comm != 0
            assert a.polls == 1 + polls  # the healthy poll, then the ones after the error
            assert a.changes == 1
            assert a.last_ns >= a.changed_ns > 0
        # The polls are counted in one lifecycle series, not sent as events.
        calls = sum(s.calls for s in reader.series() if s.op == "COMM_GET_ASYNC_ERROR")
        assert calls >= nranks + len(survivors) * polls

        samples = _collect(reader, probes)
        comm = [f"{states[pids[survivors[0]]].comm:016x}"]
        for r in survivors:
            assert sample_value(samples, metrics.COMMUNICATOR_ASYNC_ERROR, node="test-node", comm=comm[0],
                                rank=str(r), result="ncclRemoteError") == 1
            assert sample_value(samples, metrics.COMMUNICATOR_ASYNC_ERROR, comm=comm[0], rank=str(r),
                                result="ncclSuccess") is None
            assert sample_value(samples, metrics.COMMUNICATOR_ASYNC_POLLS, comm=comm[0],
                                rank=str(r)) == 1 + polls
        # The dead rank's state is not shown, and the agent's loop forgets it.
        assert sample_value(samples, metrics.COMMUNICATOR_ASYNC_ERROR, comm=comm[0], rank=str(victim),
                            result="ncclSuccess") is None
        # ncclCommShrink: a child equal on every survivor, ranks renumbered.
        from exporter.sources.nccl import hashing
        parent = states[pids[0]]
        want_hash = hashing.shrink_nccl_comm_hash(parent.nccl_comm_hash)  # the `comm` label
        for new_rank, r in enumerate(survivors):
            handle = int((rdv / f"child.{r}").read_text())
            child = [c for c in reader.communicators() if c.pid == pids[r] and c.comm_ptr == handle]
            assert len(child) == 1, reader.communicators()
            assert child[0].comm == want_hash
            assert (child[0].rank, child[0].nranks) == (new_rank, nranks - 1)
            assert child[0].nccl_comm_hash == want_hash
            # The child polls healthy while the parent stays in error.
            assert states[pids[r]].result == "ncclRemoteError"
            kids = [a for a in reader.async_errors() if a.pid == pids[r] and a.comm_ptr == handle]
            assert kids[0].result == "ncclSuccess" and kids[0].comm == want_hash
            assert kids[0].rank == new_rank
        assert sum(s.calls for s in reader.series() if s.op == "COMM_SHRINK") == len(survivors)
        child_ar = [s for s in reader.series() if s.op == "ALL_REDUCE" and s.comm == want_hash]
        assert sorted((s.rank, s.nranks, s.calls) for s in child_ar) == [(0, 2, 1), (1, 2, 1)]
        samples = _collect(reader, probes)
        child_label = hashing.format_hash(want_hash)
        assert sample_value(samples, metrics.COMMUNICATOR_ASYNC_ERROR, comm=child_label, rank="1",
                            result="ncclSuccess") == 1
        reader.forget_dead_processes()
        assert pids[victim] not in {a.pid for a in reader.async_errors()}
        assert reader.counters().get("ASYNC_FULL", 0) == 0
    finally:
        (rdv / "exit").touch()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        probes.close()


# Calls on the real wheel with a NULL communicator (no GPU here).
REAL_PY = r"""
import ctypes, sys
from ctypes import c_void_p as P, c_int as I, c_size_t as S, c_uint as U, byref, POINTER
lib = ctypes.CDLL(sys.argv[1])
def call(name, types, *args):
    f = getattr(lib, name); f.argtypes = types; f.restype = I
    print(name, f(*args), flush=True)
err = I(-7)
call("ncclCommGetAsyncError", [P, POINTER(I)], None, byref(err))
print("asyncError", err.value, flush=True)
# (localbuff, count, datatype, peer, peerWin, peerWinOffset, sigIdx, ctx, flags, comm, stream)
call("ncclPutSignal", [P, S, I, I, P, S, I, I, U, P, P], None, 33, 7, 3, None, 0, 1, 0, 0, None, 0xCAFE)
call("ncclSignal", [I, I, I, U, P, P], 4, 0, 0, 0, None, 0xBEEF)
call("ncclWaitSignal", [I, P, P, P], 2, None, None, 0xD00D)
call("ncclCommRevoke", [P, I], None, 0)
call("ncclCommSuspend", [P, I], None, 1)
call("ncclCommResume", [P], None)
# (ncclCommShrink(NULL, ...) is not called: NCCL 2.32.3 dereferences the NULL
# communicator there (SIGSEGV, with or without probes).
"""


def test_real_wheel_attaches_and_decodes_null_comm_calls(tmp_path, bpf, real_nccl):
    lib = real_nccl
    _bcc_or_skip()
    from exporter.sources.nccl.elf import exported_functions
    from exporter.sources.nccl.probes import NcclProbes
    from exporter.sources.nccl.maps import NcclReader

    exported = exported_functions(lib)
    assert all(fn in exported for fn in NEW_FUNCTIONS), "NCCL 2.32.3 exports them all"
    probes = NcclProbes()
    try:
        report = probes.attach(lib)
        assert report.missing == [] and report.failed == {}
        for fn in NEW_FUNCTIONS:
            assert fn in report.attached or fn in report.aliases, fn
        probes.set_record_all(True)
        reader = NcclReader(probes)
        events = []
        reader.on_event(events.append)
        script = tmp_path / "real.py"
        script.write_text(REAL_PY)
        child = subprocess.Popen([sys.executable, str(script), lib], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        stdout, stderr = child.communicate(timeout=120)
        out = dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)
        for _ in range(20):
            reader.poll(50)
        mine = [e for e in events if e.pid == child.pid
                and e.op in ("PUT_SIGNAL", "SIGNAL", "WAIT_SIGNAL", "COMM_GET_ASYNC_ERROR",
                             "COMM_REVOKE", "COMM_SUSPEND", "COMM_RESUME")]
        by_op = {}
        for e in mine:
            by_op.setdefault(e.op, []).append(e)
        assert child.returncode == 0, stdout + stderr
        assert int(out["ncclCommGetAsyncError"]) == 4  # ncclInvalidArgument on NULL
        assert int(out["asyncError"]) == -7  # not written: nothing to read at the return
        # A failed poll leaves no async state and is counted as an error.
        assert not [a for a in reader.async_errors() if a.comm_ptr == 0]
        assert reader.errors()[("COMM_GET_ASYNC_ERROR", "ncclInvalidArgument")] >= 1
        # Decoding: stack arguments of ncclPutSignal (comm, stream are args 10, 11).
        ps = by_op["PUT_SIGNAL"][-1]
        assert (ps.count, ps.datatype, ps.peer, ps.stream, ps.comm_ptr) == (33, 7, 3, 0xCAFE, 0)
        assert ps.bytes == 33 * 4 and ps.result == int(out["ncclPutSignal"])
        sg = by_op["SIGNAL"][-1]
        assert (sg.peer, sg.stream, sg.comm_ptr, sg.bytes) == (4, 0xBEEF, 0, 0)
        ws = by_op["WAIT_SIGNAL"][-1]
        assert (ws.count, ws.stream, ws.comm_ptr, ws.bytes) == (2, 0xD00D, 0, 0)
        for op, fn in (("COMM_REVOKE", "ncclCommRevoke"), ("COMM_SUSPEND", "ncclCommSuspend"),
                       ("COMM_RESUME", "ncclCommResume")):
            e = by_op[op][-1]
            assert e.result == int(out[fn]), (op, e)
        assert not [c for c in reader.communicators() if c.comm_ptr == 0]
        assert reader.counters()["EVENTS_LOST"] == 0
        samples = _collect(reader, probes)
        assert sample_value(samples, metrics.CALL_ERRORS, op="COMM_GET_ASYNC_ERROR",
                            result="ncclInvalidArgument") >= 1
        # No state for a failed poll: nothing is exported (the family is empty).
        assert not [s for s in samples if s.name == metrics.COMMUNICATOR_ASYNC_ERROR
                    and s.labels.get("comm") == "unknown" and s.labels.get("result") == "ncclSuccess"]
    finally:
        probes.close()

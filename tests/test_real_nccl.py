"""The probes against the REAL libnccl.so.2 (NCCL 2.32.3 wheel), in this process.

No GPU is needed: every call below fails inside NCCL (a CUDA error, or
ncclInvalidArgument on a NULL communicator), but it enters and returns through
the public entry points, so the uprobes see the real ABI -- argument
registers, stack arguments, the 128-byte ncclUniqueId passed by value, the
result code -- and the library's own internal calls (ncclBcast -> ncclBroadcast).

Note: every process mapping this file fires these probes; events are filtered
by our pid, and the map checks assume no other process calls collectives on
the wheel's library at the same moment.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
import time
from ctypes import POINTER, byref, c_char, c_int, c_size_t, c_void_p

import pytest

from exporter.records import contract, metrics
from exporter.sources.nccl import hashing
from exporter.sources.nccl.elf import exported_functions, vaddrs_to_offsets
from conftest import parse_metrics, sample_value

pytestmark = pytest.mark.slow

NCCL_SUCCESS = 0
NCCL_INVALID_ARGUMENT = 4
FLOAT32, FLOAT64, INT32, INT8 = 7, 8, 2, 0
SUM, MAX = 0, 2


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", c_char * hashing.UNIQUE_ID_BYTES)]


def _perf_event_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "perf_event" in os.readlink(f"/proc/self/fd/{fd}"):
                n += 1
        except OSError:
            pass
    return n


class Traced:
    """One probe set on the real library, and every call of this module made once."""

    def __init__(self, lib_path: str, links: bool):
        from exporter.sources.nccl.maps import NcclReader
        from exporter.sources.nccl.probes import NcclProbes

        self.lib_path = lib_path
        self.pid = os.getpid()
        self.tid = threading.get_native_id()
        self.probes = NcclProbes(links=links)
        try:
            fds_before = _perf_event_fds()
            self.report = self.probes.attach(lib_path)
            self.perf_fds_added = _perf_event_fds() - fds_before
            self.probes.set_record_all(True)
            self.reader = NcclReader(self.probes)
            self.events = []
            self.reader.on_event(self._on_event)
        except BaseException:
            self.probes.close()
            raise
        self.lib = ctypes.CDLL(lib_path)
        self.results: dict[str, int] = {}  # what ctypes got
        self.by_call: dict[str, list] = {}  # events recorded during that call

    def _on_event(self, event) -> None:
        if event.pid == self.pid:
            self.events.append(event)

    def call(self, name: str, fn, argtypes, *args, expect_events: int = 1) -> int:
        fn.argtypes = argtypes
        fn.restype = c_int
        self.reader.poll(0)
        first = len(self.events)
        rc = fn(*args)
        deadline = time.monotonic() + 5
        while len(self.events) - first < expect_events and time.monotonic() < deadline:
            self.reader.poll(50)
        self.reader.poll(50)  # anything more (there should be nothing)
        self.results[name] = rc
        self.by_call[name] = self.events[first:]
        return rc

    def run_all(self) -> None:
        lib = self.lib
        self.uid = UniqueId()
        self.call("ncclGetUniqueId", lib.ncclGetUniqueId, [POINTER(UniqueId)], byref(self.uid))
        # All 128 bytes: `.internal` would stop at the first NUL.
        self.uid_bytes = ctypes.string_at(ctypes.addressof(self.uid), hashing.UNIQUE_ID_BYTES)
        self.comm = c_void_p()
        # The id by value: a MEMORY-class argument copied to the stack (sp+8 at entry).
        self.call("ncclCommInitRank", lib.ncclCommInitRank,
                  [POINTER(c_void_p), c_int, UniqueId, c_int], byref(self.comm), 2, self.uid, 1)
        # (sendbuff, recvbuff, count, datatype, op, comm, stream)
        self.call("ncclAllReduce", lib.ncclAllReduce,
                  [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
                  None, None, 1000, FLOAT32, SUM, None, 0x1234)
        # (sendbuff, recvbuff, count, datatype, op, root, comm, stream): root in r9,
        # comm and stream on the stack.
        self.call("ncclReduce", lib.ncclReduce,
                  [c_void_p, c_void_p, c_size_t, c_int, c_int, c_int, c_void_p, c_void_p],
                  None, None, 77, FLOAT64, MAX, 3, None, 0xABC0)
        # (buff, count, datatype, peer, comm, stream)
        p2p = [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
        self.call("ncclSend", lib.ncclSend, p2p, None, 12, INT32, 5, None, 0x5E4D)
        self.call("ncclRecv", lib.ncclRecv, p2p, None, 13, INT8, 6, None, 0x4ECF)
        # (buff, count, datatype, root, comm, stream); calls ncclBroadcast inside.
        self.call("ncclBcast", lib.ncclBcast, [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
                  None, 10, FLOAT32, 1, None, 0xB0CA)

    def only_event(self, name: str):
        events = self.by_call[name]
        assert len(events) == 1, f"{name}: expected one event, got {events}"
        return events[0]

    def close(self) -> None:
        self.probes.close()


@pytest.fixture(scope="module", params=["links", "perf-events"])
def traced(request, real_nccl, bpf):
    """Every test of this module twice: with uprobe_multi links (this kernel),
    and with one BCC perf event per probe (what kernels before 6.6 get)."""
    lib = real_nccl
    try:
        import bcc  # noqa: F401
    except ImportError:
        pytest.skip("the bcc module is not importable (make deps venv)")
    t = Traced(lib, links=request.param == "links")
    try:
        t.run_all()
        yield t
    finally:
        t.close()  # detaching 64 uprobes: seconds on some kernels


# --- attach -------------------------------------------------------------------------

def test_attach_report_one_probe_per_address(traced):
    report = traced.report
    exported = exported_functions(traced.lib_path)
    in_lib = {f for f in contract.NCCL_FUNCTIONS if f in exported or "p" + f in exported}
    assert in_lib == set(contract.NCCL_FUNCTIONS), "NCCL 2.32 exports the whole contract"
    assert report.missing == []
    assert report.failed == {}
    assert set(report.attached) | set(report.aliases) == in_lib
    assert not set(report.attached) & set(report.aliases)
    for fn, op in report.attached.items():
        assert op == contract.NCCL_FUNCTIONS[fn][0]

    # ncclX is pncclX: one address, so one probe.
    for fn in in_lib:
        assert exported[fn] == exported["p" + fn], fn
    addresses = [exported[fn] for fn in report.attached]
    assert len(set(addresses)) == len(addresses), "an address was probed twice"
    for alias, probed in report.aliases.items():
        assert exported[alias] == exported[probed]

    # What the kernel got: one entry and one return probe per address, nothing more.
    if traced.probes.uses_links:
        # uprobe_multi links (Linux >= 6.6): no perf event; each link's
        # /proc/PID/fdinfo names its kind and lists its file offsets, and
        # each entry probe's cookie names its function's op and layout
        from exporter.sources.nccl.probes import cookie

        assert traced.perf_fds_added == 0 and len(traced.probes.link_fds) == 2
        entry, ret = {}, {}
        for fd in traced.probes.link_fds:
            kind, rows = link_fdinfo(fd)
            assert kind in ("uprobe_multi", "uretprobe_multi"), kind
            (ret if kind == "uretprobe_multi" else entry).update({off: ck for ck, off in rows})
        offsets = dict(zip(vaddrs_to_offsets(traced.lib_path, addresses), report.attached))
        assert sorted(entry) == sorted(ret) == sorted(offsets)
        assert {off: entry[off] for off in offsets} == {
            off: cookie(*contract.NCCL_FUNCTIONS[fn]) for off, fn in offsets.items()}
    else:
        assert traced.perf_fds_added == 2 * len(report.attached)
        names = [n.decode() for n in traced.probes.bpf.uprobe_fds]
        entry = sorted(int(n.rsplit("_0x", 1)[1], 16) for n in names if n.startswith("p_"))
        ret = sorted(int(n.rsplit("_0x", 1)[1], 16) for n in names if n.startswith("r_"))
        assert entry == ret == sorted(addresses)


def link_fdinfo(fd: int) -> tuple[str, list[tuple[int, int]]]:
    """A uprobe_multi link's kind (link_type) and (cookie, file offset) rows,
    as the kernel shows them in /proc/self/fdinfo (a table "cookie offset
    ref_ctr_offset")."""
    kind, offsets, table = "", [], False
    for line in open(f"/proc/self/fdinfo/{fd}").read().splitlines():
        if line.startswith("link_type:"):
            kind = line.split(":", 1)[1].strip()
        elif line.split()[:2] == ["cookie", "offset"]:
            table = True
        elif table and line.strip():
            offsets.append((int(line.split()[0]), int(line.split()[1], 16)))
    return kind, offsets


def test_attach_same_file_again_is_a_no_op(traced, tmp_path):
    assert traced.probes.attach(traced.lib_path) is None
    link = tmp_path / "libnccl.so.2"
    link.symlink_to(traced.lib_path)
    assert traced.probes.attach(str(link)) is None  # same (dev, inode)


# --- lifecycle ------------------------------------------------------------------------

def test_get_unique_id(traced):
    assert traced.results["ncclGetUniqueId"] == NCCL_SUCCESS
    e = traced.only_event("ncclGetUniqueId")
    assert e.op == "GET_UNIQUE_ID"
    assert e.tid == traced.tid
    assert e.result == NCCL_SUCCESS
    assert e.comm == hashing.nccl_comm_hash(traced.uid_bytes)  # the `comm` label
    assert e.nccl_comm_hash == hashing.nccl_comm_hash(traced.uid_bytes)
    assert e.end_ns >= e.start_ns > 0


def test_comm_init_rank_decodes_id_on_stack_and_rank_in_rdx(traced):
    rc = traced.results["ncclCommInitRank"]
    assert rc != NCCL_SUCCESS, "no GPU here: ncclCommInitRank should fail"
    e = traced.only_event("ncclCommInitRank")
    assert e.op == "COMM_INIT_RANK"
    assert e.result == rc  # the uretprobe saw what the caller got
    assert e.comm == hashing.nccl_comm_hash(traced.uid_bytes) != 0
    assert e.nccl_comm_hash == hashing.nccl_comm_hash(traced.uid_bytes) != 0
    assert (e.rank, e.nranks) == (1, 2)
    # A failed init makes no communicator.
    assert not [c for c in traced.reader.communicators() if c.pid == traced.pid]
    assert traced.reader.errors()[("COMM_INIT_RANK", contract.result_name(rc))] >= 1


# --- collectives ------------------------------------------------------------------------

def test_all_reduce_decode(traced):
    assert traced.results["ncclAllReduce"] == NCCL_INVALID_ARGUMENT
    e = traced.only_event("ncclAllReduce")
    assert e.op == "ALL_REDUCE"
    assert (e.count, e.datatype, e.red_op, e.stream) == (1000, FLOAT32, SUM, 0x1234)
    assert (e.result, e.bytes) == (NCCL_INVALID_ARGUMENT, 4000)
    assert (e.root, e.peer, e.comm) == (-1, -1, 0)
    assert (e.comm, e.rank, e.nranks) == (0, -1, -1)  # NULL comm: unknown


def test_reduce_decodes_r9_and_stack(traced):
    assert traced.results["ncclReduce"] == NCCL_INVALID_ARGUMENT
    e = traced.only_event("ncclReduce")
    assert e.op == "REDUCE"
    assert (e.count, e.datatype, e.red_op, e.root) == (77, FLOAT64, MAX, 3)
    assert (e.comm, e.stream) == (0, 0xABC0)
    assert (e.bytes, e.result) == (77 * 8, NCCL_INVALID_ARGUMENT)


@pytest.mark.parametrize("name,op,count,dtype,size,peer,stream", [
    ("ncclSend", "SEND", 12, INT32, 4, 5, 0x5E4D),
    ("ncclRecv", "RECV", 13, INT8, 1, 6, 0x4ECF),
])
def test_p2p_decode(traced, name, op, count, dtype, size, peer, stream):
    assert traced.results[name] == NCCL_INVALID_ARGUMENT
    e = traced.only_event(name)
    assert e.op == op
    assert (e.count, e.datatype, e.peer, e.root, e.stream) == (count, dtype, peer, -1, stream)
    assert (e.bytes, e.result, e.red_op) == (count * size, NCCL_INVALID_ARGUMENT, -1)


def test_bcast_counts_once_although_it_calls_ncclBroadcast(traced):  # noqa: N802 - NCCL's function name
    objdump = shutil.which("objdump")
    if objdump:  # the premise: ncclBcast's body calls the probed ncclBroadcast
        exported = exported_functions(traced.lib_path)
        start = exported["ncclBcast"]
        asm = subprocess.run(
            [objdump, "-d", f"--start-address={start:#x}", f"--stop-address={start + 128:#x}",
             traced.lib_path], capture_output=True, text=True, check=True).stdout
        assert "<ncclBroadcast@plt>" in asm or "<pncclBroadcast@plt>" in asm, asm

    assert traced.results["ncclBcast"] == NCCL_INVALID_ARGUMENT
    e = traced.only_event("ncclBcast")  # not two
    assert e.op == "BROADCAST"
    assert (e.count, e.datatype, e.root, e.stream) == (10, FLOAT32, 1, 0xB0CA)
    calls = sum(s.calls for s in traced.reader.series() if s.op == "BROADCAST")
    assert calls == 1
    assert traced.reader.errors()[("BROADCAST", "ncclInvalidArgument")] == 1


def test_series_and_errors_count_each_call_once(traced):
    errors = traced.reader.errors()
    for op in ("ALL_REDUCE", "REDUCE", "SEND", "RECV", "BROADCAST"):
        assert errors[(op, "ncclInvalidArgument")] == 1, op
        assert sum(s.calls for s in traced.reader.series() if s.op == op) == 1, op
    bytes_by_op = {s.op: s.bytes for s in traced.reader.series()}
    assert bytes_by_op["ALL_REDUCE"] == 4000
    assert bytes_by_op["REDUCE"] == 616
    assert ("GET_UNIQUE_ID", "ncclSuccess") not in errors  # successes are not errors
    # Nothing left inside the library on this thread.
    assert not [c for c in traced.reader.inflight() if c.tid == traced.tid]
    assert traced.reader.counters()["EVENTS_LOST"] == 0


def test_collector_exposes_call_errors(traced):
    from prometheus_client import CollectorRegistry, generate_latest

    from exporter.sinks.prometheus import Collector, NcclCollector
    from exporter.sources.processes import ProcessTable

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector("test-node", ProcessTable(traced.probes), [NcclCollector(traced.reader)]))
    samples = parse_metrics(generate_latest(registry).decode())
    err = metrics.CALL_ERRORS
    assert sample_value(samples, err, node="test-node", op="ALL_REDUCE",
                        result="ncclInvalidArgument") == 1
    assert sample_value(samples, err, op="BROADCAST", result="ncclInvalidArgument") == 1
    assert sample_value(samples, metrics.COLLECTIVE_BYTES, op="ALL_REDUCE",
                        comm="unknown", rank="unknown") == 4000
    assert sample_value(samples, metrics.COLLECTIVE_DURATION + "_count", op="BROADCAST",
                        comm="unknown") == 1
    attached = [s for s in samples if s.name == metrics.EXPORTER_PROBE_ATTACHED
                and s.labels["library"] == traced.lib_path]
    assert len(attached) == len(traced.report.attached)
    assert all(s.value == 1 for s in attached)


# --- NCCL's own commHash, computed by the wheel's own code ------------------------

def _local_functions(path: str) -> dict[str, int]:
    """Defined symbols of .symtab (internal ones included) -> address, via binutils' nm."""
    out = subprocess.run(["nm", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    syms: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3:
            syms.setdefault(parts[2], int(parts[0], 16))
    return syms


def test_nccl_comm_hash_equals_the_librarys_own_hash_functions(real_nccl):
    """exporter.hashing.nccl_comm_hash / split_nccl_comm_hash against the wheel's
    eatHash<unsigned long>, eatHash<int> and digestHash (internal functions, found
    in .symtab and called with ctypes; no GPU needed). The root hash is NCCL's
    getHash(id, 128): its length prefix (xor 128) is made by pre-xoring the state
    around 8-byte eats."""
    path = real_nccl
    syms = _local_functions(path)
    need = {"eat_u64": "_Z7eatHashImEvPmPKT_", "eat_i32": "_Z7eatHashIiEvPmPKT_",
            "digest": "_ZL10digestHashPKm"}
    if not all(name in syms for name in need.values()):
        pytest.skip(f"{path} has no {', '.join(need.values())} in .symtab (another NCCL version)")
    lib = ctypes.CDLL(path)
    base = ctypes.cast(lib.ncclGetUniqueId, c_void_p).value - exported_functions(path)["ncclGetUniqueId"]
    eater = ctypes.CFUNCTYPE(None, c_void_p, c_void_p)
    eat_u64 = eater(base + syms[need["eat_u64"]])
    eat_i32 = eater(base + syms[need["eat_i32"]])
    digest = ctypes.CFUNCTYPE(ctypes.c_uint64, c_void_p)(base + syms[need["digest"]])

    def library_root_hash(uid: bytes) -> int:
        acc = (ctypes.c_uint64 * 2)(1, 1)
        for i in range(16):
            acc[0] ^= (128 ^ 8) if i == 0 else 8  # eatHash<u64> xors 8; getHash(id, 128) xors 128 once
            word = ctypes.c_uint64(int.from_bytes(uid[8 * i:8 * i + 8], "little"))
            eat_u64(acc, byref(word))
        return digest(acc)

    def library_split_hash(parent: int, count: int, color: int) -> int:
        acc = (ctypes.c_uint64 * 2)(1, 1)
        eat_u64(acc, byref(ctypes.c_uint64(parent)))
        eat_i32(acc, byref(ctypes.c_int32(count)))
        eat_i32(acc, byref(ctypes.c_int32(color)))
        return digest(acc)

    uid = UniqueId()
    assert lib.ncclGetUniqueId(byref(uid)) == NCCL_SUCCESS
    ids = [ctypes.string_at(ctypes.addressof(uid), hashing.UNIQUE_ID_BYTES), bytes(128),
           bytes(range(128)), os.urandom(128)]
    for raw in ids:
        assert hashing.nccl_comm_hash(raw) == library_root_hash(raw), raw.hex()
    parent = hashing.nccl_comm_hash(ids[0])
    for count, color in ((1, 0), (2, 0), (1, 1), (3, -2), (7, 12345)):
        assert hashing.split_nccl_comm_hash(parent, count, color) == library_split_hash(parent, count, color)

"""The ctypes binding of a libnccl.so.2 (the simulator's or a real one):
NCCL's exact prototypes, ncclUniqueId passed by value as PyTorch does, one
NcclError per failed call, and the rendezvous of a unique id through a
directory."""

from __future__ import annotations

import ctypes
import os
import pathlib
import time
from ctypes import c_int, c_size_t, c_void_p

NCCL_UNIQUE_ID_BYTES = 128


class ncclUniqueId(ctypes.Structure):  # noqa: N801 - NCCL's type name
    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]


class NcclError(RuntimeError):
    pass


# Position of the communicator argument of each collective (GPU-like mode syncs on it).
COMM_ARG = {"ncclAllReduce": 5, "ncclAllReduceConfig": 5, "ncclReduceScatter": 5, "ncclAllGather": 4,
            "ncclAlltoAll": 4, "ncclBroadcast": 5, "ncclBcast": 4, "ncclReduce": 6, "ncclGather": 5,
            "ncclScatter": 5, "ncclSend": 4, "ncclRecv": 4}


class Nccl:
    """Thin ctypes wrapper with NCCL's exact prototypes."""

    def __init__(self, path: str, rank: int):
        self.lib = ctypes.CDLL(path)
        lib = self.lib
        pcomm = ctypes.POINTER(c_void_p)
        protos = {
            "ncclGetVersion": [ctypes.POINTER(c_int)],
            "ncclGetUniqueId": [ctypes.POINTER(ncclUniqueId)],
            "ncclCommInitRank": [pcomm, c_int, ncclUniqueId, c_int],
            "ncclCommInitRankConfig": [pcomm, c_int, ncclUniqueId, c_int, c_void_p],
            "ncclCommSplit": [c_void_p, c_int, c_int, pcomm, c_void_p],
            "ncclCommFinalize": [c_void_p], "ncclCommDestroy": [c_void_p], "ncclCommAbort": [c_void_p],
            "ncclCommCount": [c_void_p, ctypes.POINTER(c_int)], "ncclCommUserRank": [c_void_p, ctypes.POINTER(c_int)],
            "ncclCommCuDevice": [c_void_p, ctypes.POINTER(c_int)],
            "ncclGroupStart": [], "ncclGroupEnd": [],
            "ncclAllReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclAllReduceConfig": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p, c_void_p],
            "ncclReduceScatter": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclAllGather": [c_void_p, c_void_p, c_size_t, c_int, c_void_p, c_void_p],
            "ncclAlltoAll": [c_void_p, c_void_p, c_size_t, c_int, c_void_p, c_void_p],
            "ncclBroadcast": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclBcast": [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_int, c_void_p, c_void_p],
            "ncclGather": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclScatter": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclSend": [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclRecv": [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
        }
        for name, args in protos.items():
            f = getattr(lib, name)
            f.argtypes = args
            f.restype = c_int
        lib.ncclGetErrorString.argtypes = [c_int]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        self.ncalls = 0
        # GPU-like mode (NCCL_SIM_GPU=1): calls only enqueue; results are there after
        # simStreamSynchronize (the simulator's cudaStreamSynchronize). With autosync
        # every collective is followed by one, so the checking workloads stay correct.
        self.gpu = os.environ.get("NCCL_SIM_GPU", "0") not in ("", "0") and hasattr(lib, "simStreamSynchronize")
        self.autosync = self.gpu
        self._group_comms: list = []
        self._group_depth = 0
        if self.gpu:
            lib.simStreamSynchronize.argtypes = [c_void_p]
            lib.simStreamSynchronize.restype = c_int
        # An opaque, per-rank "stream" handle (host memory stands in for the GPU).
        self._stream_obj = ctypes.create_string_buffer(64)
        self.stream = c_void_p(ctypes.addressof(self._stream_obj))

    def __call__(self, name: str, *args) -> None:
        self.ncalls += 1
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            msg = self.lib.ncclGetErrorString(rc).decode()
            raise NcclError(f"{name} -> {rc} ({msg})")
        if self.autosync:
            if name == "ncclGroupStart":
                self._group_depth += 1
            elif name == "ncclGroupEnd":
                self._group_depth -= 1
                if self._group_depth == 0:
                    comms, self._group_comms = self._group_comms, []
                    for c in comms:
                        self.sync(c)
            elif name in COMM_ARG:
                comm = args[COMM_ARG[name]]
                if self._group_depth:
                    if all(comm is not c for c in self._group_comms):
                        self._group_comms.append(comm)
                else:
                    self.sync(comm)

    def sync(self, comm) -> None:
        """Wait for the communicator's stream (GPU-like mode; a no-op otherwise)."""
        if not self.gpu:
            return
        rc = self.lib.simStreamSynchronize(comm)
        if rc != 0:
            raise NcclError(f"simStreamSynchronize -> {rc} ({self.lib.ncclGetErrorString(rc).decode()})")


# --------------------------------------------------------------- rendezvous --
def publish_or_fetch(nccl: Nccl, rank: int, rdv: pathlib.Path, name: str, timeout: float = 120.0) -> ncclUniqueId:
    path = rdv / f"{name}.uid"
    if rank == 0:
        uid = ncclUniqueId()
        nccl("ncclGetUniqueId", ctypes.byref(uid))
        tmp = rdv / f".{name}.uid.{os.getpid()}.tmp"
        # uid.internal (a c_char array) stops at the first NUL: take the raw 128 bytes
        tmp.write_bytes(ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES))
        os.replace(tmp, path)
        return uid
    deadline = time.monotonic() + timeout
    while True:
        try:
            raw = path.read_bytes()
            if len(raw) == NCCL_UNIQUE_ID_BYTES:
                uid = ncclUniqueId()
                ctypes.memmove(ctypes.addressof(uid), raw, NCCL_UNIQUE_ID_BYTES)
                return uid
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise NcclError(f"rendezvous: {path} did not appear in {timeout:.0f}s")
        time.sleep(0.02)

"""A split communicator's rank reaches the recording: its
first event (the ncclCommSplit that made it) has rank -1, the rank is learnt
when the program asks (ncclCommUserRank); the communicators row must not keep -1."""

from __future__ import annotations

import dataclasses
import sqlite3

from exporter.records.events import CallEvent
from exporter.sinks.recording import writer


def ev(i, rank, nranks, op="ALL_REDUCE", kind=1):
    return CallEvent(kind=kind, op=op, pid=100, tid=100, start_ns=i * 10, end_ns=i * 10 + 5,
                     start_real_ns=1_700_000_000_000_000_000 + i * 10, comm_ptr=1, comm=0xAB, nccl_comm_hash=0xCD,
                     seq=i, rank=rank, nranks=nranks, count=4, bytes=16, datatype=7, red_op=0, root=-1,
                     peer=-1, stream=0x10, result=0, color=1)


def test_split_child_rank_is_recorded(tmp_path):
    db = tmp_path / "r.db"
    with writer.Recorder(str(db), node="n", identify_processes=False) as r:
        r(ev(1, -1, -1, op="COMM_SPLIT", kind=2))  # the split: rank not known yet
        r(ev(2, -1, -1, op="COMM_USER_RANK", kind=2))
        r(ev(3, 1, 2))  # calls after ncclCommUserRank/ncclCommCount carry it
        r(ev(4, 1, 2))
    c = sqlite3.connect(db)
    assert c.execute("SELECT comm_id_hash, rank, nranks FROM communicators").fetchall() == [
        ("00000000000000ab", 1, 2)]


def test_known_rank_is_never_overwritten(tmp_path):
    db = tmp_path / "r.db"
    with writer.Recorder(str(db), node="n", identify_processes=False) as r:
        r(ev(1, 3, 8))
        r(dataclasses.replace(ev(2, 5, 8), pid=100))
    c = sqlite3.connect(db)
    assert c.execute("SELECT rank, nranks FROM communicators").fetchall() == [(3, 8)]

"""Merge recordings of many nodes into one file (`nccl-exporter merge --db OUT.db IN.db...`).

Every row keeps its node. Every input is checked before anything is
written. Rows are deduplicated by a row identity (sinks/recording/combine.py),
so merging the same recording twice, two copies of it, or overlapping
windows of one node adds nothing. Inputs of an older schema version are
migrated on a temporary copy (the input is never written). Two inputs that
give one node name to different machines (`meta.machine_id`) are refused
unless one is renamed (`--rename [FILE:]OLD=NEW`). The clock offsets
estimated from the data (exporter/offline/analysis/skew.py) are stored in
`clock_skew`; rows keep their own node's clock (readers subtract the offset;
`--no-align` leaves the table empty).

Row identity: exporter/sinks/recording/combine.py (docs/fleet.md), which holds
the SQL; this module decides what is merged and when.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field

from exporter.sinks.recording import combine
from exporter.sinks.recording.combine import TABLES, MergeError
from exporter.sinks.recording.read import Recording
from exporter.sinks.recording.schema import SCHEMA_VERSION

__all__ = ["MergeError", "Report", "merge", "parse_renames"]


@dataclass
class Report:
    inputs: int = 0
    added: dict = field(default_factory=lambda: {t: 0 for t in TABLES})
    offered: dict = field(default_factory=lambda: {t: 0 for t in TABLES})
    nodes: int = 0
    skew: list = field(default_factory=list)
    seconds: float = 0.0
    phases: dict = field(default_factory=dict)  # seconds: check, rows, indexes, skew


def parse_renames(specs) -> list[tuple[str | None, str, str]]:
    """'[FILE:]OLD=NEW' -> (file or None, old, new)."""
    out = []
    for spec in specs or ():
        left, eq, new = spec.rpartition("=")
        if not eq or not left or not new:
            raise MergeError(f"--rename {spec!r}: expected OLD=NEW or FILE:OLD=NEW")
        path, colon, old = left.rpartition(":")
        out.append((path if colon else None, old, new))
    return out


def _identities(path: str, label: str, mapping: dict) -> list[tuple]:
    """The nodes an input holds: (node after renaming, machine_id, boot_id, hostname, start, end, source)."""
    return [(mapping.get(n, n), *rest) for n, *rest in combine.identities(path, label)]


def _mapping(renames, label: str) -> dict:
    return {old: new for f, old, new in renames if f is None or os.path.abspath(f) == os.path.abspath(label)}


def merge(out: str, inputs: list[str], renames=(), align: bool = True, query_indexes: bool = False) -> Report:
    """Merge `inputs` into `out`. Every input is checked (readable, schema, node identities) before
    anything is written, so a refused merge leaves `out` as it was. A new `out` is built in
    `out`.partial and renamed at the end; an existing one is added to in place, one transaction per
    input (an interrupted merge keeps the inputs done so far; running it again finishes it)."""
    t0 = time.monotonic()
    rep = Report()
    renames = parse_renames(renames) if renames and isinstance(next(iter(renames)), str) else list(renames)
    if not inputs:
        raise MergeError("no input recordings")
    if any(os.path.abspath(p) == os.path.abspath(out) for p in inputs):
        raise MergeError(f"{out}: the output is also an input")
    tmpdir = tempfile.mkdtemp(prefix="nccl-merge-")
    fresh = not os.path.exists(out)
    work = out + ".partial" if fresh else out
    conn = None
    try:
        # 1. Check everything first.
        seen: dict[str, tuple] = {}
        if not fresh:
            combine.open_input(out, tmpdir)  # a recording of a version we can read
            for node, machine, *_rest, source in _identities(out, out, {}):
                if machine:
                    seen[node] = (machine, source)
        plan = []
        for label in inputs:
            path = combine.open_input(label, tmpdir)
            try:
                ids = _identities(path, label, _mapping(renames, label))
            except (sqlite3.DatabaseError, ValueError) as e:
                raise MergeError(f"{label}: cannot read its nodes ({e})") from None
            for node, machine, *_rest in ids:
                if not machine:
                    continue
                other = seen.get(node)
                if other and other[0] != machine:
                    raise MergeError(f"{label}: node name {node!r} is already used by another machine (machine id "
                                     f"{other[0][:12]}… from {other[1]}, here {machine[:12]}…): rename one with "
                                     f"--rename {label}:{node}=NEW")
                seen.setdefault(node, (machine, label))
            plan.append((label, path, ids))
        rep.phases["check"] = time.monotonic() - t0
        # 2. Write.
        try:
            if fresh and os.path.exists(work):
                os.unlink(work)
            conn, later = combine.open_output(work, fresh)
        except (sqlite3.DatabaseError, OSError, RuntimeError) as e:
            raise MergeError(f"cannot write {out}: {e}") from None
        for label, path, ids in plan:
            try:
                added, offered = combine.add_input(conn, path, ids, _mapping(renames, label))
            except sqlite3.DatabaseError as e:
                raise MergeError(f"{label}: {e}") from None
            for table in TABLES:
                rep.added[table] += added[table]
                rep.offered[table] += offered[table]
            rep.inputs += 1
        rep.nodes = combine.count_nodes(conn)
        rep.phases["rows"] = time.monotonic() - t0 - sum(rep.phases.values())
        combine.build_indexes(conn, later, query_indexes)
        rep.phases["indexes"] = time.monotonic() - t0 - sum(rep.phases.values())
        if align:
            from exporter.offline.analysis import skew

            rep.skew = list(skew.estimate(Recording(conn, work)).values())
        # how the inputs kept run-queue waits (meta sched): one way, or 'mixed'
        scheds = {combine.meta_value(path, "sched") for _, path, _ in plan}
        if not fresh:
            scheds.add(combine.meta_value(work, "sched"))
        combine.store_skew_and_meta(conn, [o.row() for o in rep.skew], {
            "node": "(merged)", "schema_version": str(SCHEMA_VERSION),
            "merged_ns": str(time.time_ns()), "aligned": "1" if align else "0",
            "sched": scheds.pop() if len(scheds) == 1 else "mixed"})
        rep.phases["skew"] = time.monotonic() - t0 - sum(rep.phases.values())
        combine.close_output(conn, fresh)
        conn = None
        if fresh:
            os.replace(work, out)
    finally:
        if conn is not None:
            conn.close()
        if fresh and os.path.exists(work):
            os.unlink(work)
        shutil.rmtree(tmpdir, ignore_errors=True)
    rep.seconds = time.monotonic() - t0
    return rep

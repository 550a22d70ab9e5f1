"""Expiry of per-owner kernel entries (bpf/tcp.c links and srtt, bpf/sched.c
stats) for the agent's prune: an ended owner's entries leave after the TTL,
and an exported label set's counters never go down while it exists (see
docs/tcp.md, "Expiry of ended owners"). Shared by the TCP and sched sources.
"""

from __future__ import annotations

import dataclasses
import os


def sum_records(a, b):
    """Two records of the same type summed field by field (ints and bucket tuples)."""
    out = {}
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ("family", "saddr", "daddr", "port", "owner", "pid", "thread"):
            out[f.name] = x
        elif isinstance(x, tuple):
            out[f.name] = tuple(i + j for i, j in zip(x, y))
        else:
            out[f.name] = x + y
    return type(a)(**out)


def _ident(key):
    """A hashable identity of a map key: a ctypes key's bytes; a plain tuple
    (SchedTotals' keys, not a kernel map's) as it is."""
    return key if isinstance(key, tuple) else bytes(key)


class OwnerExpiry:
    """Expiry of kernel map entries keyed by an owner process whose counters
    the Prometheus sink sums by label set (docs/metrics.md, "Series lifecycle").

    The rule, so that a label set's counters never go backwards while it
    exists and it disappears whole:

    * An owner is *gone* from the first prune that finds its /proc entry
      missing; its rank label is frozen then (later the process table no
      longer knows it, and its entries would otherwise move to rank "").
    * An entry *expires* `ttl` seconds after its owner was found gone. An
      entry of owner 0 (unattributed: untraced sockets) has no process to
      outlive: it expires when it has counted nothing for `ttl` (as a
      comm="unknown" series does).
    * A label set *lives* while at least one of its entries has not expired.
      Expired entries of a living set are folded into the set's retired total
      here (one record per label set, not per owner) and deleted from the
      kernel map: the set's sum is unchanged. When no entry of a set lives,
      all its entries and its retired total go at once: the series vanishes.

    So kernel entries of ended processes stay at most `ttl` (+ one prune
    interval), and what stays longer is bounded by label sets, not by jobs.
    Only the agent's loop calls `expire` (it writes kernel state); the sink
    reads `label_of` and `retired`.
    """

    def __init__(self):
        self.gone: dict[int, tuple[float, str]] = {}  # owner -> (found gone, frozen rank label)
        self.retired: dict[tuple, dict[str, object]] = {}  # label set -> {map name: summed record}
        self.idle: dict[tuple, tuple[object, float]] = {}  # owner 0's (map, key bytes) -> (record, since)

    def label_of(self, owner: int, rank_label) -> str:
        g = self.gone.get(owner)
        return g[1] if g is not None else rank_label(owner)

    def expire(self, entries, ttl: float, now: float, rank_label, proc: str = "/proc"):
        """entries: (map name, key, owner, labels without rank, record) of every
        kernel entry. Returns the (map name, key) pairs to delete."""
        ranks: dict[int, str] = {}

        def rank_label_once(owner: int) -> str:  # one rank_of per owner and prune
            if owner not in ranks:
                ranks[owner] = rank_label(owner)
            return ranks[owner]

        owners = {e[2] for e in entries if e[2]}
        for o in owners:
            if o not in self.gone and not os.path.exists(f"{proc}/{o}"):
                self.gone[o] = (now, rank_label_once(o))
        groups: dict[tuple, list] = {}
        idle: dict[tuple, tuple[object, float]] = {}
        for name, key, owner, labels, rec in entries:
            lset = (*labels, self.label_of(owner, rank_label_once))
            if owner == 0:
                ident = (name, _ident(key))
                prev = self.idle.get(ident)
                idle[ident] = (rec, prev[1] if prev is not None and prev[0] == rec else now)
                expired = now - idle[ident][1] >= ttl
            else:
                g = self.gone.get(owner)
                expired = g is not None and now - g[0] >= ttl
            groups.setdefault(lset, []).append((name, key, expired, rec))
        delete = []
        for lset, items in groups.items():
            if all(expired for _n, _k, expired, _r in items):
                delete += [(n, k) for n, k, _e, _r in items]  # the whole set goes
                self.retired.pop(lset, None)
                continue
            for name, key, expired, rec in items:
                if expired:
                    kept = self.retired.setdefault(lset, {})
                    kept[name] = sum_records(kept[name], rec) if name in kept else rec
                    delete.append((name, key))
        for lset in [s for s in self.retired if s not in groups]:
            del self.retired[lset]  # no entry maps to it any more: it ends whole
        # An owner with no entries left is forgotten (a reused pid starts afresh).
        deleted = {id(k) for _n, k in delete}  # map keys are ctypes structs: not hashable
        left = {e[2] for e in entries if id(e[1]) not in deleted}
        self.gone = {o: g for o, g in self.gone.items() if o in left}
        gone_keys = {(n, _ident(k)) for n, k in delete}
        self.idle = {i: v for i, v in idle.items() if i not in gone_keys}
        return delete


def delete_keys(program, pairs) -> int:
    n = 0
    for name, key in pairs:
        try:
            del program[name][key]
            n += 1
        except KeyError:
            pass
    return n

"""The TCP source: bpf/tcp.c loaded, and its maps and ring buffer as records.

Links are counted in the kernel per (family, local address, remote address,
service port, owner process); the Prometheus sink turns owners into rank
labels. See docs/tcp.md. Needs bpf/nccl.c loaded first (it owns the traced
processes): without it nothing is traced and this source reports nothing.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

from exporter.records import contract
from exporter.records.events import AF_INET, AF_INET6, TcpEvent, TcpLink, TcpSrtt
from exporter.sources.bpf import ClockOffset, Program

# Capacity of each map this program owns, for nccl_exporter_map_capacity.
MAP_CAPACITY = {
    "sock_owner": contract.MAX_SOCKETS,
    "tcp_links": contract.MAX_LINKS,
    "tcp_srtt": contract.MAX_LINKS,
}


def format_addr(family: int, raw) -> str:
    """An address of bpf/tcp.c (16 bytes; IPv4 in the first 4) as text.

    IPv4-mapped IPv6 addresses (an AF_INET6 socket talking IPv4) are shown
    as IPv4, so one peer has one label value whatever the socket family.
    """
    b = bytes(raw)
    if family == AF_INET:
        return socket.inet_ntop(socket.AF_INET, b[:4])
    if family == AF_INET6:
        if b[:12] == b"\0" * 10 + b"\xff\xff":
            return socket.inet_ntop(socket.AF_INET, b[12:16])
        return socket.inet_ntop(socket.AF_INET6, b[:16])
    return ""


def _link_fields(k) -> dict:
    """The link of a tcp_links / tcp_srtt key, decoded."""
    return {"family": k.family, "saddr": format_addr(k.family, k.saddr),
            "daddr": format_addr(k.family, k.daddr), "port": k.port, "owner": k.owner}


def _add(a, b):
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
                ident = (name, bytes(key))
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
                    kept[name] = _add(kept[name], rec) if name in kept else rec
                    delete.append((name, key))
        for lset in [s for s in self.retired if s not in groups]:
            del self.retired[lset]  # no entry maps to it any more: it ends whole
        # An owner with no entries left is forgotten (a reused pid starts afresh).
        deleted = {id(k) for _n, k in delete}  # map keys are ctypes structs: not hashable
        left = {e[2] for e in entries if id(e[1]) not in deleted}
        self.gone = {o: g for o, g in self.gone.items() if o in left}
        gone_keys = {(n, bytes(k)) for n, k in delete}
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


class TcpSource(Program):
    """bpf/tcp.c: reads tcp_links / tcp_srtt and decodes tcp_events."""

    def __init__(self, clock: ClockOffset | None = None):
        super().__init__("tcp")
        self.clock = clock or ClockOffset()
        self.expiry = OwnerExpiry()

    @staticmethod
    def _link(k, v) -> TcpLink:
        return TcpLink(**_link_fields(k), retransmits=v.retransmits, failures=v.failures,
                       resets_sent=v.resets_sent, resets_received=v.resets_received)

    @staticmethod
    def _srtt(k, v) -> TcpSrtt:
        return TcpSrtt(**_link_fields(k), count=v.count, sum_us=v.sum_us, buckets=tuple(v.buckets))

    def links(self) -> list[TcpLink]:
        """Entries of tcp_links (kernel only, no retired totals)."""
        return [self._link(k, v) for k, v in self["tcp_links"].items()]

    def srtt(self) -> list[TcpSrtt]:
        """Entries of tcp_srtt (kernel only, no retired totals)."""
        return [self._srtt(k, v) for k, v in self["tcp_srtt"].items()]

    def labelled(self, rank_label) -> tuple[list, list]:
        """(links, srtt) as the sink exports them: ((saddr, daddr, port, rank),
        record) pairs, kernel entries (the frozen rank of an owner that is
        gone) and the retired totals of label sets (OwnerExpiry).
        rank_label(owner) -> str labels a living owner."""
        links, srtt = [], []
        for out, recs in ((links, self.links()), (srtt, self.srtt())):
            for r in recs:
                out.append(((r.saddr, r.daddr, str(r.port), self.expiry.label_of(r.owner, rank_label)), r))
        for lset, kept in self.expiry.retired.items():
            if "tcp_links" in kept:
                links.append((lset, kept["tcp_links"]))
            if "tcp_srtt" in kept:
                srtt.append((lset, kept["tcp_srtt"]))
        return links, srtt

    def expire_owners(self, ttl: float, rank_label, now: float | None = None, proc: str = "/proc") -> int:
        """Apply OwnerExpiry to tcp_links and tcp_srtt; returns the entries
        deleted. For the agent's loop; never called by a scrape."""
        now = time.monotonic() if now is None else now
        entries = []
        for name, decode in (("tcp_links", self._link), ("tcp_srtt", self._srtt)):
            for k, v in self[name].items():
                r = decode(k, v)
                entries.append((name, k, r.owner, (r.saddr, r.daddr, str(r.port)), r))
        return delete_keys(self, self.expiry.expire(entries, ttl, now, rank_label, proc))

    def socket_owners(self) -> int:
        """Entries in sock_owner (sockets of traced processes now known)."""
        return sum(1 for _ in self["sock_owner"].keys())

    def decode_event(self, data) -> TcpEvent:
        e = self["tcp_events"].event(data)
        return TcpEvent(
            kind=e.kind,
            event=contract.TCP_EVENTS.get(e.kind, f"tcp_event_{e.kind}"),
            timestamp_ns=e.ts_ns,
            timestamp_real_ns=self.clock.to_realtime(e.ts_ns),
            family=e.family,
            saddr=format_addr(e.family, e.saddr),
            daddr=format_addr(e.family, e.daddr),
            sport=e.sport,
            dport=e.dport,
            state=e.state,
            pid=e.pid,
            tid=e.tid,
            seq=e.seq,
        )

    def on_event(self, callback) -> None:
        """Call `callback(TcpEvent)` for each event, from bpf.ring_buffer_poll()."""
        self.open_ring("tcp_events", self.decode_event, callback)

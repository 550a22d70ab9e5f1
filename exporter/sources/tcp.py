"""The TCP source: bpf/tcp.c loaded, and its maps and ring buffer as records.

Links are counted in the kernel per (family, local address, remote address,
service port, owner process); the Prometheus sink turns owners into rank
labels. See docs/tcp.md. Needs bpf/nccl.c loaded first (it owns the traced
processes): without it nothing is traced and this source reports nothing.
"""

from __future__ import annotations

import socket
import time

from exporter.records import contract
from exporter.records.events import AF_INET, AF_INET6, TcpEvent, TcpLink, TcpSrtt
from exporter.sources.base import Source, shared_counter
from exporter.sources.bpf import ClockOffset, Program, set_tracepoint
from exporter.sources.expiry import OwnerExpiry, delete_keys

# Capacity of each map this program owns, for nccl_exporter_map_capacity.
MAP_CAPACITY = {
    "sock_owner": contract.MAX_SOCKETS,
    "tcp_links": contract.MAX_LINKS,
    "tcp_srtt": contract.MAX_LINKS,
}


def retransmits_missed(counters: dict[str, int]) -> int:
    """tcp_retransmit_skb hits bpf/tcp.c's program did not run for, from the
    shared counters (`NcclReader.counters()`): every hit is counted by a raw
    tracepoint beside it (see bpf/tcp.c)."""
    return max(0, counters.get("RETRANSMIT_HITS", 0) - counters.get("RETRANSMIT_SEEN", 0))


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


class TcpSource(Program, Source):
    """bpf/tcp.c: reads tcp_links / tcp_srtt and decodes tcp_events.

    srtt_sampling: (window, period) s of tcp_probe attached while hot (None:
    the whole time); owner_window: s the owner tracepoints stay attached after
    a socket may have an unknown owner (None: the whole time). Both are duty
    cycles of `tick` (docs/tcp.md, "srtt" and "Owner windows")."""

    node_wide = "socket"
    OWNER_POLL_S = 1.0  # how often tick looks for a reason to open an owner window

    # Every incoming segment, and every send and receive on any socket of the
    # node: only srtt and socket ownership need them, and `run` attaches them
    # in windows (srtt_duty, owner_duty). Retransmits, resets, connect(),
    # listen() and socket ends stay attached.
    SRTT_TRACEPOINT = "tcp:tcp_probe"
    OWNER_TRACEPOINTS = ("sock:sock_send_length", "sock:sock_recv_length")
    HOT_TRACEPOINTS = (SRTT_TRACEPOINT, *OWNER_TRACEPOINTS)

    def __init__(self, clock: ClockOffset | None = None, srtt_sampling: tuple[float, float] | None = None,
                 owner_window: float | None = None):
        super().__init__("tcp")
        self.srtt_sampling = srtt_sampling
        self.owner_window = owner_window
        self._next_owner_poll = 0.0
        self.clock = clock or ClockOffset()
        self.expiry = OwnerExpiry()
        self._hot_since = time.monotonic()  # the duty cycles start here (attached at load)
        self._owners_asked = -1.0  # monotonic s of the last reason for an owner window
        self._owners_wanted = 0    # counters[OWNERS_WANTED] last seen
        self._owner_pids: set[int] = set()

    def set_hot(self, on: bool) -> None:
        if on != self.hot:  # the duty cycles start again when the source goes hot
            self._hot_since = time.monotonic()
        super().set_hot(on)

    def tick(self, now: float) -> None:
        """The duty cycles, without the agent's lock: a detach waits ~70 ms for
        the kernel (RCU), which a scrape need not share (scrapes never attach
        or detach)."""
        if self.srtt_sampling is not None:
            self.srtt_duty(now, *self.srtt_sampling)
        if self.owner_window is not None and now >= self._next_owner_poll:
            self._next_owner_poll = now + self.OWNER_POLL_S
            self.owner_duty(now, self.owner_window, shared_counter(self, "OWNERS_WANTED"),
                            [k.value for k in self["traced_processes"].keys()])

    def prune(self, ttl: float, rank_label) -> None:
        self.expire_owners(ttl, rank_label)

    def losses(self) -> dict[str, int]:
        counters = {name: shared_counter(self, name)
                    for name in ("TCP_EVENTS_LOST", "RETRANSMIT_HITS", "RETRANSMIT_SEEN")}
        # retransmits bpf/tcp.c did not run for (e.g. another BPF program was running on that CPU)
        return {"kernel_tcp_events": counters["TCP_EVENTS_LOST"],
                "kernel_skipped_retransmits": retransmits_missed(counters)}

    def srtt_duty(self, now: float, window: float, period: float) -> bool:
        """While hot, keep tcp_probe (every incoming segment of every socket
        of the node) attached for `window` s of every `period` s, from the
        moment the source went hot: srtt is sampled in those windows only
        (docs/tcp.md, "srtt"). For the agent's loop; returns whether it is
        attached now. Without calls it stays attached, as loaded."""
        want = self.hot and (now - self._hot_since) % period < window
        set_tracepoint(self.bpf, self.SRTT_TRACEPOINT, want)  # idempotent: acts on a change only
        return want

    def owner_duty(self, now: float, window: float, wanted: int, pids) -> bool:
        """While hot, keep the send/recv tracepoints (every socket call of the
        node), which only learn socket owners, attached for `window` s after
        each moment a socket may have an owner not yet known: the source
        going hot, a traced process not seen before (its older sockets), and
        a rise of `wanted` (counters[OWNERS_WANTED]: a connection accepted on
        a traced listening port, or a retransmit/reset there with no owner).
        A socket a traced thread connects is learnt at connect(), windows or
        not (docs/tcp.md, "Owner windows"). `pids`: the traced processes now. For
        the agent's loop; returns whether they are attached now. Without
        calls they stay attached, as loaded."""
        pids = set(pids)
        if wanted != self._owners_wanted or pids - self._owner_pids:
            self._owners_asked = now
        self._owners_wanted, self._owner_pids = wanted, pids
        want = self.hot and now - max(self._hot_since, self._owners_asked) < window
        for tp in self.OWNER_TRACEPOINTS:
            set_tracepoint(self.bpf, tp, want)  # idempotent: acts on a change only
        return want

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

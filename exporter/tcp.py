"""TCP reader: the maps and ring buffer of bpf/tcp.c as records and metrics.

Links are counted in the kernel per (family, local address, remote address,
service port, owner process); this module turns owners into rank labels and
sums the series that then share their labels. See docs/tcp.md.
"""

from __future__ import annotations

import socket
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from . import contract
from .maps import ClockOffset, open_ring

AF_INET = 2
AF_INET6 = 10

# Event kinds of bpf/tcp.c (TCP_EV_*) -> event names.
EVENT_NAMES = {
    1: "tcp_retransmit_skb",
    2: "tcp_retransmit_failed",
    3: "tcp_send_reset",
    4: "tcp_receive_reset",
}

# srtt histogram of bpf/tcp.c: bucket i holds srtt <= 2^i us (i < SRTT_FINITE),
# the last one everything above.
SRTT_FINITE = 24
SRTT_BOUNDS_S = tuple((1 << i) * 1e-6 for i in range(SRTT_FINITE))

TCP_STATES = {
    1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
    6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN",
    11: "CLOSING", 12: "NEW_SYN_RECV",
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


@dataclass(frozen=True)
class TcpLink:
    """Counts of one (local, remote, port, owner) link, as kept in the kernel."""

    family: int
    saddr: str
    daddr: str
    port: int
    owner: int  # tgid of the socket's owner; 0 = untraced or unknown
    retransmits: int      # tcp_retransmit_skb hits (skbs, not segments) that sent
    failures: int         # tcp_retransmit_skb hits with err != 0 (kernel >= 6.17)
    resets_sent: int
    resets_received: int


@dataclass(frozen=True)
class TcpSrtt:
    """Smoothed-RTT samples (one per tcp_probe hit) of a traced process's link."""

    family: int
    saddr: str
    daddr: str
    port: int
    owner: int
    count: int
    sum_us: int
    buckets: tuple[int, ...]  # per bucket, not cumulative; last = overflow


@dataclass(frozen=True)
class TcpEvent:
    """A retransmit or reset on a traced process's socket."""

    kind: int
    event: str
    timestamp_ns: int       # CLOCK_MONOTONIC, as the kernel saw it
    timestamp_real_ns: int  # wall clock, via the agent's clock offset
    family: int
    saddr: str
    daddr: str
    sport: int
    dport: int
    state: int
    pid: int
    tid: int
    seq: int  # 0: not a tracepoint argument on this kernel

    def as_dict(self) -> dict:
        return {
            "event": self.event,
            "timestamp_ns": self.timestamp_real_ns,
            "pid": self.pid,
            "tid": self.tid,
            "family": "ipv6" if self.family == AF_INET6 else "ipv4",
            "saddr": self.saddr,
            "daddr": self.daddr,
            "sport": self.sport,
            "dport": self.dport,
            "state": TCP_STATES.get(self.state, str(self.state)),
            "seq": self.seq,
        }


def _link_fields(k) -> dict:
    """The link of a tcp_links / tcp_srtt key, decoded."""
    return {"family": k.family, "saddr": format_addr(k.family, k.saddr),
            "daddr": format_addr(k.family, k.daddr), "port": k.port, "owner": k.owner}


class TcpReader:
    """Reads tcp_links / tcp_srtt and decodes tcp_events of bpf/tcp.c."""

    def __init__(self, bpf, clock: ClockOffset | None = None):
        self.bpf = bpf
        self.clock = clock or ClockOffset()

    def links(self) -> list[TcpLink]:
        return [
            TcpLink(
                **_link_fields(k),
                retransmits=v.retransmits,
                failures=v.failures,
                resets_sent=v.resets_sent,
                resets_received=v.resets_received,
            )
            for k, v in self.bpf["tcp_links"].items()
        ]

    def srtt(self) -> list[TcpSrtt]:
        return [
            TcpSrtt(
                **_link_fields(k),
                count=v.count,
                sum_us=v.sum_us,
                buckets=tuple(v.buckets),
            )
            for k, v in self.bpf["tcp_srtt"].items()
        ]

    def socket_owners(self) -> int:
        """Entries in sock_owner (sockets of traced processes now known)."""
        return sum(1 for _ in self.bpf["sock_owner"].keys())

    def decode_event(self, data) -> TcpEvent:
        e = self.bpf["tcp_events"].event(data)
        return TcpEvent(
            kind=e.kind,
            event=EVENT_NAMES.get(e.kind, f"tcp_event_{e.kind}"),
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
        open_ring(self.bpf, "tcp_events", self.decode_event, callback)

    def families(self, node: str, rank_of) -> list:
        """Metric families; rank_of(pid) -> int | None labels each owner."""

        def rank(owner: int) -> str:
            if not owner:
                return ""
            r = rank_of(owner)
            return "" if r is None or r < 0 else str(r)

        retrans: dict[tuple, int] = defaultdict(int)
        failures: dict[tuple, int] = defaultdict(int)
        resets: dict[tuple, int] = defaultdict(int)
        for l in self.links():
            labels = (node, l.saddr, l.daddr, str(l.port), rank(l.owner))
            if l.retransmits:
                retrans[labels] += l.retransmits
            if l.failures:
                failures[labels] += l.failures
            if l.resets_sent:
                resets[(node, "sent", *labels[1:])] += l.resets_sent
            if l.resets_received:
                resets[(node, "received", *labels[1:])] += l.resets_received

        link_labels = ["node", "saddr", "daddr", "port", "rank"]
        rt = _counter(
            contract.TCP_RETRANSMITS,
            "TCP retransmissions on a link, counted as tcp_retransmit_skb tracepoint hits, "
            "i.e. retransmitted skbs that were sent. One skb can carry many segments "
            "under GSO/TSO, so this is not comparable to the kernel's RetransSegs "
            "(node_exporter's node_netstat_Tcp_RetransSegs), which counts segments. "
            "port: the link's service port; rank: the owning process's rank, empty "
            "when the socket's owner is untraced or unknown.",
            link_labels, retrans,
        )
        fl = _counter(
            contract.TCP_RETRANSMIT_FAILURES,
            "TCP retransmission attempts that failed (tcp_retransmit_skb hits with "
            "err != 0: nothing was sent, e.g. the qdisc or a local queue refused it). "
            "Counted on kernels >= 6.17 only; 0 before.",
            link_labels, failures,
        )
        rs = _counter(
            contract.TCP_RESETS,
            "TCP resets (RST segments) sent or received on a link, one per "
            "tcp_send_reset / tcp_receive_reset tracepoint hit.",
            ["node", "direction", "saddr", "daddr", "port", "rank"], resets,
        )

        hist: dict[tuple, list] = {}
        for s in self.srtt():
            labels = (node, s.saddr, s.daddr, str(s.port), rank(s.owner))
            acc = hist.setdefault(labels, [0] * (SRTT_FINITE + 1) + [0])
            for i, c in enumerate(s.buckets):
                acc[i] += c
            acc[-1] += s.sum_us
        sr = HistogramMetricFamily(
            contract.TCP_SRTT,
            "Smoothed round-trip time of traced processes' TCP sockets (the kernel's "
            "srtt, in seconds), one sample per tcp_probe tracepoint hit (an incoming "
            "segment on an established socket).",
            labels=link_labels,
        )
        for labels, acc in sorted(hist.items()):
            cumulative, buckets = 0, []
            for bound, c in zip(SRTT_BOUNDS_S, acc[:SRTT_FINITE]):
                cumulative += c
                buckets.append((floatToGoString(bound), cumulative))
            cumulative += acc[SRTT_FINITE]
            buckets.append(("+Inf", cumulative))
            sr.add_metric(list(labels), buckets, acc[-1] * 1e-6)
        return [rt, fl, rs, sr]


def _counter(name: str, help_text: str, labels: list[str], values: dict[tuple, int]) -> CounterMetricFamily:
    """A counter family with one sample per label tuple of `values`, in sorted order."""
    family = CounterMetricFamily(name, help_text, labels=labels)
    for label_values, v in sorted(values.items()):
        family.add_metric(list(label_values), v)
    return family

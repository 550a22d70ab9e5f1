"""The TCP source: bpf/tcp.c loaded, and its maps and ring buffer as records.

Links are counted in the kernel per (family, local address, remote address,
service port, owner process); the Prometheus sink turns owners into rank
labels. See docs/tcp.md. Needs bpf/nccl.c loaded first (it owns the traced
processes): without it nothing is traced and this source reports nothing.
"""

from __future__ import annotations

import socket

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


class TcpSource(Program):
    """bpf/tcp.c: reads tcp_links / tcp_srtt and decodes tcp_events."""

    def __init__(self, clock: ClockOffset | None = None):
        super().__init__("tcp")
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
            for k, v in self["tcp_links"].items()
        ]

    def srtt(self) -> list[TcpSrtt]:
        return [
            TcpSrtt(
                **_link_fields(k),
                count=v.count,
                sum_us=v.sum_us,
                buckets=tuple(v.buckets),
            )
            for k, v in self["tcp_srtt"].items()
        ]

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

"""The network figures' pure logic (docs/network.md): the ring event's
decoding, the recording rows, the span attributes and the bounded label set
of nccl_network_*. The data path end to end is tests/test_network_waits.py."""

from __future__ import annotations

from conftest import exposition, sample_value, sample_values
from exporter.records import contract
from exporter.records.events import GpuCall, NetworkSeries, PeerWait
from exporter.records.render import gpu_span_attributes, top_network_wait
from exporter.sinks.prometheus import network_families
from exporter.sinks.recording.schema import PEER_WAIT_FIELDS
from exporter.sinks.recording.rows import peer_wait_rows
from exporter.sources.plugin.source import peer_waits

MS = 1_000_000


def call(*waits: PeerWait) -> GpuCall:
    return GpuCall(op="ALL_REDUCE", pid=7, tid=8, comm=0xABC, seq=812, rank=3, nranks=8, peer=-1,
                   kind="coll", bytes=1 << 20, enqueue_ns=1, start_ns=2, duration_ns=50 * MS,
                   enqueue_real_ns=1, start_real_ns=2, peer_waits=waits)


def test_ring_event_words_decode_to_peer_waits():
    # struct nx_peer_wait as 8 u64 words: peer | direction << 32, bytes, wall[3], step[3]
    words = [5 | 1 << 32, 4096, 41 * MS, 2, 3, 82 * MS, 4, 6,
             (2**32 - 1) | 0 << 32, 100, 7, 8, 9, 10, 11, 12] + [0] * 64
    got = peer_waits(words, 2)
    assert got == (PeerWait(5, "recv", 4096, (41 * MS, 2, 3), (82 * MS, 4, 6)),
                   PeerWait(-1, "send", 100, (7, 8, 9), (10, 11, 12)))
    assert peer_waits(words, 0) == ()


def test_recording_rows_one_per_phase_bytes_on_the_transsize_phase():
    rows = peer_wait_rows(call(PeerWait(5, "recv", 4096, (41 * MS, 2, 3), (82 * MS, 4, 6)),
                               PeerWait(-1, "send", 100, (7, 8, 9), (10, 11, 12))), "0000000000000abc", "n1")
    assert all(len(r) == len(PEER_WAIT_FIELDS) for r in rows)
    as_dicts = [dict(zip(PEER_WAIT_FIELDS, r)) for r in rows]
    assert [(d["peer"], d["direction"], d["phase"], d["wall_ns"], d["step_ns"], d["bytes"]) for d in as_dicts] == [
        (5, "recv", "recv_wait", 41 * MS, 82 * MS, 0), (5, "recv", "recv_flush_wait", 2, 4, 4096),
        (5, "recv", "recv_gpu_wait", 3, 6, 0),
        (None, "send", "send_gpu_wait", 7, 10, 0), (None, "send", "send_peer_wait", 8, 11, 0),
        (None, "send", "send_wait", 9, 12, 100)]
    assert {(d["pid"], d["op"], d["seq"], d["kind"], d["rank"], d["node"]) for d in as_dicts} == \
        {(7, "ALL_REDUCE", 812, "coll", 3, "n1")}


def test_span_names_the_peer_with_the_most_wall_wait_its_phase_and_share():
    e = call(PeerWait(5, "recv", 4096, (41 * MS, 1 * MS, 0), (82 * MS, 0, 0)),
             PeerWait(4, "recv", 4096, (7 * MS, 0, 0), (9 * MS, 0, 0)),
             PeerWait(4, "send", 4096, (0, 0, 1 * MS), (0, 0, 1 * MS)))
    assert top_network_wait(e.peer_waits) == (5, "recv", "recv_wait", 41 * MS, 41 / 50)
    attrs = gpu_span_attributes(e)
    assert attrs["nccl.network.peer"] == 5 and attrs["nccl.network.phase"] == "recv_wait"
    assert attrs["nccl.network.direction"] == "recv" and attrs["nccl.network.wait_ns"] == 41 * MS
    assert attrs["nccl.network.wait_share"] == 0.82
    assert "nccl.network.peer" not in gpu_span_attributes(call())  # no figures, no claim
    assert top_network_wait([PeerWait(1, "send", 0, (0, 0, 0), (0, 0, 0))]) is None


class Plugin:
    def __init__(self, series):
        self.s = series

    def network(self):
        return self.s

    def foreign_proxy_ops(self):
        return {7: 3, 8: 1}


def series(peer: int, wait_ms: int, rank: int = 0) -> NetworkSeries:
    return NetworkSeries(0xABC, rank, peer, "recv", ops=1, bytes=10, wall_ns=(wait_ms * MS, 0, 0),
                         step_ns=(wait_ms * MS, 0, 0))


def test_at_most_k_named_peers_per_comm_and_rank_and_the_names_stick():
    named: dict = {}
    comm_of = "{:016x}".format
    first = [series(p, w) for p, w in ((1, 1), (2, 9), (3, 8), (4, 7), (5, 6), (6, 5))] + [series(-1, 2)]
    text = exposition(network_families("n", Plugin(first), comm_of, lambda pid: pid == 7, named))
    got = {lbl for lbl in ("1", "2", "3", "4", "5", "6", "other")
           if sample_values(text, "nccl_network_wait_seconds_total", peer=lbl, phase="recv_wait")}
    assert len(got - {"other"}) == contract.NET_TOP_K
    assert got == {"2", "3", "4", "5", "other"}  # the four that waited most
    # "other": peers 1 and 6 plus the plugin's own other
    assert sample_value(text, "nccl_network_wait_seconds_total", peer="other", phase="recv_wait") == 0.008
    assert sample_value(text, "nccl_network_wire_bytes_total", peer="other", direction="recv") == 30
    assert sample_values(text, "nccl_network_foreign_proxy_ops_total") == [3]  # live processes only
    # later peer 1 waits most: it stays in "other" (no series moves), the named ones stay named
    later = [series(1, 500)] + first[1:]
    text = exposition(network_families("n", Plugin(later), comm_of, lambda pid: True, named))
    assert sample_values(text, "nccl_network_wait_seconds_total", peer="1", phase="recv_wait") == []
    assert sample_value(text, "nccl_network_wait_seconds_total", peer="other", phase="recv_wait") == 0.507
    # another rank of the same communicator has its own K
    text = exposition(network_families("n", Plugin([series(9, 1, rank=1)] + first), comm_of, lambda pid: True,
                                       named))
    assert sample_values(text, "nccl_network_wait_seconds_total", rank="1", peer="9", phase="recv_wait") == [0.001]
    # a communicator whose series expired forgets its names
    network_families("n", Plugin([]), comm_of, lambda pid: True, named)
    assert named == {}

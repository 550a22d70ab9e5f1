"""Which link slowed the collectives: the profiler plugin's per-peer network
waits (recording table nccl_peer_waits, docs/network.md) judged per link.

A link is one direction between two ranks of a communicator: sender →
receiver. Its figures, summed over the recording's operations (wall time:
the time with at least one step in the phase, never the step-seconds):

- recv_wait: the receiver waited for the sender's data to arrive. High when
  the link is slow, AND when the sender's GPU was late producing the data;
- send_wait: the sender waited for the network to take the data it had
  posted. High only when the data path itself is slow;
- send_gpu_wait: the sender's proxy waited for its own GPU to produce the
  data: a late sender (compute straggler), not the network.

Each link is compared with the median of its communicator's OTHER links
(in a 2-rank communicator: the link the other way), per communicator with
at least MIN_PAIRS links measured on the receiving side. (The alert takes
the median over all links, itself included, which needs 3 links to let one
stand out; with 3 or more and one outlier the two medians agree.)

- slow link: the receiver's recv_wait from the sender is at least SHARE of
  the receiver's time in those operations, AND the sender's send_wait to
  the receiver is at least RATIO times the median link's send_wait and
  SHARE of that time (not the receiver's wait against the median: in a
  ring every receiver waits when one link is slow, each rank sending on
  what it received; only the slow link's sender waits for the network);
- GPU straggler: the same recv_wait, but the sender's send_wait is not high
  while its send_gpu_wait to that receiver is (RATIO times the median, and
  SHARE of the time): the receiver waited for the sender's GPU;
- neither slow link nor GPU straggler when at least STALL_SHARE of the
  sender's figure fell in one operation: one stall (its receiver stopped a
  moment, its GPU paused once), not a link or GPU that slows every
  operation it carries (a rank stopped for good leaves no finished
  operation after the stall: `hang` names it);
- unexplained: the receiver's recv_wait is at least RATIO times the
  communicator's median link and SHARE of its time, and neither of the
  sender's figures is high, or the sender's side is not in the recording
  (its node's recording was not merged).

The receiver's time in the operations is their GPU time (gpu_intervals);
without GPU intervals, its process's span in the recording. Retransmits
quoted beside a link are those of the sender's sockets (tcp_events) in the
recording, on connections to the receiver's addresses where those are
known.

Recordings made before the table existed (schema 6 and older) have no such
figures: `available` is False and the callers say so.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from exporter.offline.analysis.words import ms as _ms
from exporter.sinks.recording.read import Recording

RATIO = 3.0        # times the communicator's median link (the alert NcclPeerNetworkWaitHigh uses the same)
SHARE = 0.10       # of the receiver's time in the operations (the alert: of wall time)
MIN_PAIRS = 2      # links measured on the receiving side, per communicator (2: a 2-rank one)
STALL_SHARE = 0.5  # of a sender's wait in one operation: a stall, no verdict (_stall)

SLOW_LINK = "slow link"
GPU_STRAGGLER = "GPU straggler"
UNEXPLAINED = "unexplained"


@dataclass
class Link:
    comm: str                  # nccl_comm_hash
    label: str                 # comm_id_hash where the recording knows it, else nccl_comm_hash
    sender: int
    receiver: int
    recv: dict = field(default_factory=dict)   # receiver's recv phases from sender: phase -> wall ns
    send: dict = field(default_factory=dict)   # sender's send phases to receiver: phase -> wall ns
    send_worst: dict = field(default_factory=dict)  # phase -> the largest one operation's wall ns
    send_bytes: int = 0        # transSize the sender reported sending to the receiver
    recv_bytes: int = 0        # transSize the receiver reported receiving from the sender
    operations: int = 0        # operations with figures for this link on the receiving side
    receiver_at: tuple | None = None   # (node, pid)
    sender_at: tuple | None = None
    receiver_time_ns: int = 0  # the receiver's time in its operations (GPU time, else its span)
    retransmits: int = 0
    retransmit_links: dict = field(default_factory=dict)   # 'saddr→daddr' -> count
    # judged against the communicator's median link (judge()):
    recv_x: float = 0.0
    send_x: float = 0.0
    gpu_x: float = 0.0
    median_recv_ns: float = 0.0
    median_send_ns: float = 0.0
    verdict: str = ""

    @property
    def recv_wait_ns(self) -> int:
        return self.recv.get("recv_wait", 0)

    @property
    def send_wait_ns(self) -> int:
        return self.send.get("send_wait", 0)

    @property
    def send_gpu_wait_ns(self) -> int:
        return self.send.get("send_gpu_wait", 0)

    @property
    def bytes(self) -> int:
        return self.send_bytes or self.recv_bytes

    @property
    def share(self) -> float | None:
        return self.recv_wait_ns / self.receiver_time_ns if self.receiver_time_ns else None


def available(rec: Recording) -> bool:
    """The recording has the table (schema 7 and later)."""
    return rec.has_table("nccl_peer_waits")


def load(rec: Recording, comm: str | None = None, op: str | None = None) -> list[Link]:
    """Every link of the recording with its figures (unjudged); [] without the table."""
    if not available(rec):
        return []
    labels = rec.comm_labels()
    links: dict[tuple, Link] = {}
    at: dict[tuple, tuple] = {}   # (comm, rank) -> (node, pid)

    def link(c, sender, receiver) -> Link:
        key = (c, sender, receiver)
        if key not in links:
            links[key] = Link(c, labels.get(c, c), sender, receiver)
        return links[key]

    for c, rank, peer, direction, phase, wall, nbytes, ops, node, pid, worst in rec.peer_waits(op):
        if rank is None or (comm and not (c.startswith(comm) or labels.get(c, "").startswith(comm))):
            continue
        at[(c, rank)] = (node, pid)
        if direction == "recv":
            lk = link(c, peer, rank)
            lk.recv[phase] = lk.recv.get(phase, 0) + (wall or 0)
            lk.operations = max(lk.operations, ops)
            lk.recv_bytes += nbytes or 0
        else:
            lk = link(c, rank, peer)
            lk.send[phase] = lk.send.get(phase, 0) + (wall or 0)
            lk.send_worst[phase] = max(lk.send_worst.get(phase, 0), worst or 0)
            lk.send_bytes += nbytes or 0
    for lk in links.values():
        lk.receiver_at = at.get((lk.comm, lk.receiver))
        lk.sender_at = at.get((lk.comm, lk.sender))
    _receiver_time(rec, links.values(), op)
    _retransmits(rec, links.values())
    return sorted(links.values(), key=lambda lk: (lk.label, lk.receiver, lk.sender))


def _receiver_time(rec: Recording, links, op) -> None:
    """Each receiver's time in its operations: GPU time where gpu_intervals has them, else the
    process's span in the recording."""
    gpu = rec.gpu_time_of_peer_waits(op)
    span: dict[tuple, int] = {}
    for lk in links:
        t = gpu.get((lk.comm, lk.receiver))
        if t:
            lk.receiver_time_ns = t
        elif lk.receiver_at:
            if lk.receiver_at not in span:
                span[lk.receiver_at] = rec.span(*lk.receiver_at)
            lk.receiver_time_ns = span[lk.receiver_at]


def _retransmits(rec: Recording, links) -> None:
    """The sender's sockets' retransmits, on connections to the receiver's addresses where known."""
    by_owner: dict[tuple, list] = defaultdict(list)
    addrs: dict[tuple, set] = defaultdict(set)
    for e in rec.tcp_events(order=""):
        if e.saddr:
            addrs[(e.node, e.pid)].add(e.saddr)
        if e.event == "tcp_retransmit_skb":
            by_owner[(e.node, e.pid)].append((e.saddr, e.daddr))
    for lk in links:
        if not lk.sender_at:
            continue
        theirs = addrs.get(lk.receiver_at, set()) if lk.receiver_at else set()
        for saddr, daddr in by_owner.get(lk.sender_at, ()):
            if theirs and daddr not in theirs:
                continue
            name = f"{saddr}\u2192{daddr}"
            lk.retransmit_links[name] = lk.retransmit_links.get(name, 0) + 1
            lk.retransmits += 1


def _x(value: float, median: float) -> float:
    if median > 0:
        return value / median
    return float("inf") if value > 0 else 0.0


def _median_without(lk: Link, links: list[Link], figure) -> float:
    others = [figure(o) for o in links if o is not lk]
    return statistics.median(others) if others else 0.0


def _stall(lk: Link, phase: str) -> bool:
    """Most of the sender's wait in `phase` fell in one operation (at least STALL_SHARE): one
    stall (a receiver stopped a moment, a GPU paused once), not a slow link or GPU, which
    slows every operation it carries."""
    return lk.send_worst.get(phase, 0) >= STALL_SHARE * lk.send.get(phase, 0) > 0


def judge(links: list[Link]) -> list[Link]:
    """Set each link's ratios to its communicator's median link and its verdict; returns the
    links with a verdict, the largest recv_wait excess first."""
    by_comm: dict[str, list[Link]] = defaultdict(list)
    for lk in links:
        by_comm[lk.comm].append(lk)
    found = []
    for group in by_comm.values():
        measured = [lk for lk in group if lk.recv]
        sending = [lk for lk in group if lk.send]
        if len(measured) < MIN_PAIRS:
            continue
        for lk in group:
            # the median of the OTHER links: in a 2-rank communicator, the link the other way
            med_recv = _median_without(lk, measured, Link.recv_wait_ns.fget)
            med_send = _median_without(lk, sending, Link.send_wait_ns.fget)
            med_gpu = _median_without(lk, sending, Link.send_gpu_wait_ns.fget)
            lk.median_recv_ns, lk.median_send_ns = med_recv, med_send
            lk.recv_x = _x(lk.recv_wait_ns, med_recv)
            lk.send_x = _x(lk.send_wait_ns, med_send) if lk.send else 0.0
            lk.gpu_x = _x(lk.send_gpu_wait_ns, med_gpu) if lk.send else 0.0
            share = lk.share
            if not (lk.recv and (share is None or share >= SHARE)):
                continue
            # The sender's own figure names the cause: in a ring every receiver waits when one link
            # or one GPU is slow (each rank sends on what it received), so the receiver's wait need
            # not stand out; the slow link's sender waits for the network, the slow GPU's for its GPU.
            # Its wait must be a real share too: SHARE of the receiver's time in the operations.
            floor = SHARE * lk.receiver_time_ns if lk.receiver_time_ns else 0
            if lk.send and lk.send_x >= RATIO and lk.send_wait_ns >= floor and not _stall(lk, "send_wait"):
                lk.verdict = SLOW_LINK
            elif lk.send and lk.gpu_x >= RATIO and lk.send_gpu_wait_ns >= floor and not _stall(lk, "send_gpu_wait"):
                lk.verdict = GPU_STRAGGLER
            elif lk.recv_x >= RATIO:
                lk.verdict = UNEXPLAINED
            else:
                continue
            found.append(lk)
    order = {SLOW_LINK: 0, GPU_STRAGGLER: 1, UNEXPLAINED: 2}
    return sorted(found, key=lambda lk: (order[lk.verdict], -(lk.recv_wait_ns - lk.median_recv_ns)))


# --- words ------------------------------------------------------------------------------

def _times(x: float) -> str:
    return "∞×" if x == float("inf") else f"{x:.1f}×"


def _where(at) -> str:
    return f" on {at[0]}" if at and at[0] else ""


def retransmit_text(lk: Link) -> str:
    if not lk.retransmits:
        return ""
    top, n = max(lk.retransmit_links.items(), key=lambda kv: kv[1])
    more = f" ({lk.retransmits} in all)" if n != lk.retransmits else ""
    return f"{n} retransmits on {top}{more}"


def headline(lk: Link) -> str:
    """'rank 5 ← rank 4: recv_wait 6.0× the comm's median pair, and rank 4's send_wait to 5 as
    high (5.8×); 3 retransmits on 198.18.0.6→198.18.0.7'"""
    head = f"rank {lk.receiver} \u2190 rank {lk.sender}: recv_wait {_times(lk.recv_x)} the comm's median pair"
    if lk.verdict == SLOW_LINK:
        text = f"{head}, and rank {lk.sender}'s send_wait to {lk.receiver} as high ({_times(lk.send_x)})"
    elif lk.verdict == GPU_STRAGGLER:
        text = (f"{head}, but rank {lk.sender}'s send_wait to {lk.receiver} is {_times(lk.send_x)} and its "
                f"send_gpu_wait {_times(lk.gpu_x)}")
    elif not lk.send:
        text = f"{head}; rank {lk.sender}'s side is not in this recording"
    else:
        text = f"{head}; rank {lk.sender}'s send_wait {_times(lk.send_x)}, send_gpu_wait {_times(lk.gpu_x)}"
    retx = retransmit_text(lk)
    return text + (f"; {retx}" if retx else "")


def verdict_line(lk: Link) -> str:
    comm = f"comm {lk.label[:8]}\u2026"
    if lk.verdict == SLOW_LINK:
        return f"slow link: {headline(lk)} (on {comm})"
    if lk.verdict == GPU_STRAGGLER:
        return (f"GPU straggler: rank {lk.sender}{_where(lk.sender_at)} is late producing its data, not the "
                f"network: {headline(lk)} (on {comm})")
    return (f"network wait: rank {lk.receiver} waits for rank {lk.sender}'s data and the sender's figures do "
            f"not say why: {headline(lk)} (on {comm})")


def evidence(lk: Link) -> list[str]:
    share = lk.share
    of = (f", {100 * share:.0f} % of its time in them" if share is not None else "")
    lines = [f"rank {lk.receiver}{_where(lk.receiver_at)} waited {_ms(lk.recv_wait_ns)} for rank {lk.sender}'s "
             f"data (recv_wait, wall time) over {lk.operations} operations{of}; the comm's median pair "
             f"{_ms(lk.median_recv_ns)}"]
    if lk.send:
        lines.append(f"rank {lk.sender}{_where(lk.sender_at)} sending to {lk.receiver}: send_wait (the network "
                     f"taking its data) {_ms(lk.send_wait_ns)}, the comm's median pair {_ms(lk.median_send_ns)}; "
                     f"send_gpu_wait (its GPU producing the data) {_ms(lk.send_gpu_wait_ns)}; send_peer_wait "
                     f"(the receiver's buffer) {_ms(lk.send.get('send_peer_wait', 0))}; {lk.bytes} bytes")
    else:
        lines.append(f"rank {lk.sender}'s own figures are not in this recording: merge its node's recording "
                     f"to tell a slow link from a slow GPU (docs/network.md)")
    retx = retransmit_text(lk)
    lines.append(f"rank {lk.sender}'s sockets: {retx} in the recording" if retx else
                 f"rank {lk.sender}'s sockets: no retransmits in the recording (not TCP loss: on IB/RoCE see "
                 f"node_exporter's infiniband port counters, docs/network.md)")
    return lines


LINK_COLUMNS = ["comm", "receiver", "sender", "receiver_node", "sender_node", "operations", "recv_wait_ms",
                "recv_wait_x", "recv_share_pct", "send_wait_ms", "send_wait_x", "send_gpu_wait_ms",
                "send_gpu_wait_x", "bytes", "retransmits", "verdict"]


def _rx(x: float):
    return None if x == float("inf") else round(x, 2)


def link_rows(links: list[Link]) -> list[tuple]:
    """One row per link, the judged ones first, then by recv_wait."""
    order = {SLOW_LINK: 0, GPU_STRAGGLER: 1, UNEXPLAINED: 2, "": 3}
    rows = []
    for lk in sorted(links, key=lambda lk: (order[lk.verdict], -lk.recv_wait_ns, lk.label, lk.receiver,
                                            lk.sender)):
        share = lk.share
        rows.append((lk.label, lk.receiver, lk.sender, (lk.receiver_at or ("",))[0], (lk.sender_at or ("",))[0],
                     lk.operations, round(lk.recv_wait_ns / 1e6, 3), _rx(lk.recv_x),
                     None if share is None else round(100 * share, 1),
                     round(lk.send_wait_ns / 1e6, 3) if lk.send else None, _rx(lk.send_x) if lk.send else None,
                     round(lk.send_gpu_wait_ns / 1e6, 3) if lk.send else None,
                     _rx(lk.gpu_x) if lk.send else None, lk.bytes, lk.retransmits, lk.verdict))
    return rows

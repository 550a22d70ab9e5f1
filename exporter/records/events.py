"""The typed records every stage shares: what the sources decode from the
kernel's maps and ring buffers, and what the sinks publish.

Sources (exporter/sources/) build these; sinks (exporter/sinks/) and tools
read them and never touch BCC. Their text form (trace output, recording
rows, span attributes) is made in one place: exporter/records/render.py
(render.as_dict(record)).
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.records.contract import LOCAL_COMM_TAG, SERIES_OVERFLOW_COMM


def format_comm(h: int) -> str:
    """Label value of a communicator hash; 'local-<pid>-<n>' for one the agent
    did not see made (local_comm_hash); 'unknown' until it is named so;
    'overflow' for the series that count calls once the map is full."""
    if h == SERIES_OVERFLOW_COMM:
        return "overflow"
    if h >> 40 == LOCAL_COMM_TAG:
        return f"local-{(h >> 16) & 0xFFFFFF}-{h & 0xFFFF}"
    return f"{h:016x}" if h else "unknown"


def local_comm_hash(pid: int, n: int) -> int:
    """The id of the n-th (from 1) communicator of a process that the agent
    did not see created: per process, never shared by two processes."""
    return (LOCAL_COMM_TAG << 40) | ((pid & 0xFFFFFF) << 16) | (n & 0xFFFF)


# --- NCCL calls (bpf/nccl.c) ----------------------------------------------------

@dataclass(frozen=True)
class Series:
    """Calls of one op on one communicator by one rank, as counted in the kernel."""

    op: str
    comm: int
    rank: int
    nranks: int
    calls: int
    bytes: int
    sum_ns: int
    buckets: tuple[int, ...]
    slot: int = -1  # index in the kernel's series_stats array
    last_ns: int = 0  # CLOCK_MONOTONIC of the latest return counted (0: none)
    next_seq: int = 0  # NCCL's seqNumber + 1 of the latest call the plugin numbered (0: none)

    @property
    def last_seq(self) -> int:
        """The seq of the latest call: NCCL's when the plugin numbered calls (an
        agent that attached mid-job counts from there), else the count - 1."""
        return max(self.calls, self.next_seq) - 1


@dataclass(frozen=True)
class Communicator:
    pid: int
    comm_ptr: int     # the ncclComm_t pointer in that process (0: announced by the plugin, no call seen)
    comm: int         # the `comm` label: NCCL's commHash where known (docs/communicators.md)
    nccl_comm_hash: int  # NCCL's commHash; 0: unknown
    rank: int
    nranks: int


@dataclass(frozen=True)
class InflightCall:
    tid: int
    op: str
    comm: int
    rank: int
    nranks: int
    start_ns: int  # CLOCK_MONOTONIC
    stopped: bool = False  # its thread is stopped (/proc state T or t), read once in flight over 1 s
    nbytes: int = 0  # count x datatype size, as nccl_collective_bytes_total counts it (0: unknown)


@dataclass(frozen=True)
class CallEvent:
    """One NCCL call that crossed to user space (slow, lifecycle, or recorded)."""

    kind: int  # contract.EVENT_CALL | EVENT_LIFECYCLE
    op: str
    pid: int
    tid: int
    start_ns: int  # CLOCK_MONOTONIC, as the kernel saw it
    end_ns: int
    start_real_ns: int  # wall clock, converted with the agent's clock offset
    comm_ptr: int  # the ncclComm_t pointer in that process
    comm: int  # the `comm` label: NCCL's commHash where known (docs/communicators.md)
    nccl_comm_hash: int  # NCCL's commHash; 0: unknown
    seq: int
    rank: int
    nranks: int
    count: int
    bytes: int
    datatype: int
    red_op: int
    root: int
    peer: int
    stream: int
    result: int
    color: int
    runq_wait_ns: int | None = 0  # the calling thread's run-queue wait during the call (None: not measured)
    proxy_wait_ns: int | None = 0  # the process's NCCL proxy threads' run-queue wait during it (None: ditto)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


# --- TCP (bpf/tcp.c) ---------------------------------------------------------------

AF_INET = 2
AF_INET6 = 10

TCP_STATES = {
    1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
    6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN",
    11: "CLOSING", 12: "NEW_SYN_RECV",
}


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


# --- Scheduler (bpf/sched.c) ----------------------------------------------------------

@dataclass(frozen=True)
class SchedStats:
    """Run-queue delay and off-CPU time of one (process, thread kind)."""

    pid: int
    thread: str  # caller | proxy | other
    count: int  # run-queue delay samples (switch-ins after waiting runnable)
    sum_ns: int
    offcpu_ns: int
    buckets: tuple[int, ...]

    @property
    def sum_seconds(self) -> float:
        return self.sum_ns / 1e9


@dataclass(frozen=True)
class SchedEvent:
    """One run-queue wait of a traced thread: runnable from timestamp for duration."""

    timestamp_ns: int       # CLOCK_MONOTONIC: when it became runnable
    timestamp_real_ns: int  # the same, wall clock
    duration_ns: int        # until it was switched in
    pid: int
    tid: int
    thread: str             # caller | proxy | other
    thread_name: str        # the thread's name
    cpu: int
    op: str                 # the NCCL call it was inside ("" for none)


@dataclass(frozen=True)
class SchedInterval:
    """`--sched totals`: what one (process, thread kind) waited runnable for a
    CPU between two reads of /proc (sources/schedstat.py): the per-second
    stand-in, in recordings, for SchedEvent's single waits."""

    timestamp_real_ns: int  # wall clock: the interval's start (the previous read)
    interval_ns: int        # until this read
    pid: int
    thread: str             # caller | proxy | other
    runq_wait_ns: int       # summed over its threads (> 0: intervals without a wait are not sent)
    switch_ins: int


# --- GPU time from the profiler plugin (bpf/plugin.c) -----------------------------

@dataclass(frozen=True)
class GpuSeries:
    """Collectives of one op on one communicator by one rank, timed on the GPU
    (earliest KernelCh start .. latest KernelCh stop), as counted in the kernel."""

    op: str
    comm: int       # NCCL's commHash: the `comm` label (docs/communicators.md)
    rank: int
    nranks: int
    calls: int
    bytes: int
    sum_ns: int
    buckets: tuple[int, ...]


@dataclass(frozen=True)
class GpuInflight:
    """One collective the plugin reported enqueued (queued) or started on the GPU
    (running) and not yet done or abandoned."""

    pid: int
    id: int  # the plugin's record id (unique per process)
    op: str
    comm: int
    rank: int
    nranks: int
    seq: int
    state: str  # queued | running
    since_ns: int  # CLOCK_MONOTONIC: host enqueue (queued), GPU start (running)


@dataclass(frozen=True)
class PeerWait:
    """What one operation's network transfers with one peer in one direction
    waited for (the profiler plugin's ProxyStep figures; docs/network.md)."""

    peer: int  # the peer's rank in the communicator; -1: the other peers, summed
    direction: str  # send | recv
    bytes: int  # transSize summed (given at send_wait / recv_flush_wait)
    wall_ns: tuple[int, int, int]  # per phase of contract.NETWORK_PHASES[direction]: >= 1 step in it
    step_ns: tuple[int, int, int]  # the same summed over steps


@dataclass(frozen=True)
class NetworkSeries:
    """Network figures of one (communicator, rank, peer, direction), summed
    over its operations in the kernel (bpf/plugin.c net_series)."""

    comm: int
    rank: int
    peer: int  # -1: other
    direction: str  # send | recv
    ops: int  # operations that carried this pair
    bytes: int
    wall_ns: tuple[int, int, int]  # per phase of contract.NETWORK_PHASES[direction]
    step_ns: tuple[int, int, int]


@dataclass(frozen=True)
class GpuCall:
    """One slow collective or point-to-point operation as the GPU ran it (the
    profiler plugin's record, sent by bpf/plugin.c when its GPU time reached
    the op's slow threshold): the span of its GPU interval."""

    op: str
    pid: int
    tid: int
    comm: int       # NCCL's commHash
    seq: int  # NCCL's seqNumber: per communicator and op, from 0
    rank: int
    nranks: int
    peer: int  # p2p: the peer; -1 for collectives
    kind: str  # coll | p2p
    bytes: int
    enqueue_ns: int  # CLOCK_MONOTONIC: the host enqueue
    start_ns: int  # CLOCK_MONOTONIC: GPU start
    duration_ns: int  # GPU time
    enqueue_real_ns: int  # the same instants in CLOCK_REALTIME
    start_real_ns: int
    peer_waits: tuple[PeerWait, ...] = ()  # with proxy accounting: per (peer, direction), top K + other


@dataclass(frozen=True)
class PluginProcess:
    """A process that loaded the profiler plugin (it made a hook call)."""

    pid: int
    first_seen_ns: int  # CLOCK_MONOTONIC
    last_seen_ns: int  # its last communicator init/fini (or its first record)
    comms: int  # communicators initialised and not finalized
    dropped: int  # the plugin's pool drops (process-wide)
    iface_version: int


@dataclass(frozen=True)
class PluginComm:
    """A live communicator of a process with the profiler plugin, as the
    plugin announced it (at init, and once a period: docs/plugin.md)."""

    pid: int
    comm: int       # NCCL's commHash: the `comm` label
    rank: int
    nranks: int
    nnodes: int
    last_ns: int  # CLOCK_MONOTONIC of its last announcement

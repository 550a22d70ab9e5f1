"""Metric names, types, label sets and help texts: a contract with
dashboards, alerts and users, defined once.

The Prometheus sink builds every family from these specs; the dashboard and
alert tests check every expression against them (names and labels).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str    # without the _total suffix prometheus_client adds to counters
    kind: str    # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str

    @property
    def exposed(self) -> tuple[str, ...]:
        """The sample names Prometheus stores for this family."""
        if self.kind == "counter":
            return (self.name + "_total",)
        if self.kind == "histogram":
            return (self.name + "_bucket", self.name + "_sum", self.name + "_count")
        return (self.name,)


LINK = ("node", "saddr", "daddr", "port", "rank")
_ALL: list[Metric] = []


def _m(name: str, kind: str, labels: tuple[str, ...], help_text: str) -> str:
    """Register a metric; returns its name as exposed (counters with _total),
    the form dashboards and alerts use."""
    base = name.removesuffix("_total") if kind == "counter" else name
    _ALL.append(Metric(base, kind, labels, help_text))
    return name


# --- The NCCL call surface (bpf/nccl.c) -------------------------------------------

COLLECTIVE_DURATION = _m(
    "nccl_collective_duration_seconds", "histogram", ("node", "op", "comm", "rank"),
    "Duration of NCCL collective and point-to-point API calls, from entry to return of the "
    "library function (on a GPU this is host-side time: enqueue, or the wait when the call blocks).")
COLLECTIVE_BYTES = _m(
    "nccl_collective_bytes_total", "counter", ("node", "op", "comm", "rank"),
    "Bytes named by NCCL calls: the count argument times the datatype size (per-rank send count "
    "for ALL_GATHER/GATHER, per-rank receive count for REDUCE_SCATTER/SCATTER, per-peer count "
    "for ALL_TO_ALL).")
CALL_ERRORS = _m(
    "nccl_call_errors_total", "counter", ("node", "op", "result"),
    "NCCL API calls that returned something other than ncclSuccess, by op and ncclResult_t.")
LIFECYCLE_DURATION = _m(
    "nccl_lifecycle_duration_seconds", "histogram", ("node", "op"),
    "Duration of NCCL lifecycle calls (communicator init/split/destroy, group end, ...).")
INFLIGHT_OLDEST = _m(
    "nccl_inflight_oldest_seconds", "gauge", ("node", "op", "comm", "rank"),
    "Age of the oldest NCCL call still inside the library, per op, communicator and rank. "
    "A value that keeps growing is a hang.")
INFLIGHT_STOPPED = _m(
    "nccl_inflight_stopped_seconds", "gauge", ("node", "op", "comm", "rank"),
    "Age of the oldest NCCL call in flight whose calling thread is stopped (SIGSTOP, a job-control "
    "stop, a debugger: state T or t in /proc), per op, communicator and rank; read at each scrape "
    "for calls in flight over 1 s. No sample while no such caller is stopped.")
INFLIGHT_BYTES = _m(
    "nccl_inflight_bytes", "gauge", ("node", "op", "comm", "rank"),
    "Size of the oldest NCCL call in flight per op, communicator and rank (the series of "
    "nccl_inflight_oldest_seconds): its count times the datatype's size, as "
    "nccl_collective_bytes_total counts it. Ranks of one communicator waiting in the same op "
    "with different sizes are desynchronized (a wrong count on one rank).")
COLLECTIVE_LAST_SEQ = _m(
    "nccl_collective_last_seq", "gauge", ("node", "op", "comm", "rank"),
    "Sequence number of this rank's latest returned call of this op on this communicator, from 0 "
    "like the recordings' seq (every rank makes the same sequence). The call in flight, if any, "
    "is this + 1: a rank whose value stays below its peers' in-flight call never joined it.")
COLLECTIVE_LAST_RETURN = _m(
    "nccl_collective_last_return_timestamp_seconds", "gauge", ("node", "op", "comm", "rank"),
    "Unix time at which this rank's latest call of this op on this communicator returned.")
# Where a traced process runs in Kubernetes (sources/pods.py; "" outside a
# pod or where unknown): only on the two per-process info families, joined
# to the other series in PromQL (docs/metrics.md, "Pod identity").
POD = ("namespace", "pod", "container", "pod_uid", "container_id")

COMMUNICATOR_INFO = _m(
    "nccl_communicator_info", "gauge",
    ("node", "comm", "nccl_comm_hash", "rank", "nranks", "pid", "launcher", "launcher_rank", "world_size",
     *POD),
    "One per live communicator of a traced process (value 1). namespace, pod, container, pod_uid, "
    "container_id: the Kubernetes pod and container of the process (empty outside a pod or where unknown).")

COMMUNICATOR_ASYNC_ERROR = _m(
    "nccl_communicator_async_error", "gauge", ("node", "comm", "rank", "result"),
    "1 for the ncclResult_t that ncclCommGetAsyncError last returned in *asyncError for a "
    "communicator of a live traced process (ncclSuccess; ncclInProgress, normal for "
    "non-blocking communicators; anything else is an asynchronous error, e.g. ncclRemoteError).")
COMMUNICATOR_ASYNC_POLLS = _m(
    "nccl_communicator_async_error_polls_total", "counter", ("node", "comm", "rank"),
    "Successful ncclCommGetAsyncError calls per communicator (PyTorch's watchdog polls it), "
    "counted in the kernel.")

RANK_EXIT = _m(
    "nccl_rank_exit_timestamp_seconds", "gauge", ("node", "comm", "rank", "signal"),
    "Unix time at which the process holding this rank of this communicator ended without "
    "destroying it (killed, crashed, or exited without ncclCommDestroy). signal: the signal that "
    "ended it (SIGKILL, SIGSEGV, ...), empty for an exit(). Kept for the series TTL "
    "(run --series-ttl) after the exit, at most one per communicator and rank.")

# --- GPU time from the profiler plugin (bpf/plugin.c, docs/plugin.md) -------------------

GPU_DURATION = _m(
    "nccl_collective_gpu_duration_seconds", "histogram", ("node", "op", "comm", "rank"),
    "Duration of NCCL collective and point-to-point operations on the GPU (earliest kernel "
    "channel start to latest channel stop, from nccl-exporter's profiler plugin); the host "
    "histogram's buckets. comm: the agent's communicator id when it saw the communicator made, "
    "else NCCL's commHash in hex.")
GPU_INFLIGHT_OLDEST = _m(
    "nccl_gpu_inflight_oldest_seconds", "gauge", ("node", "op", "comm", "rank", "state"),
    "Age of the oldest NCCL operation enqueued but not started on the GPU (state=queued, since "
    "the host enqueue) or started but not finished (state=running, since the GPU start), per op, "
    "communicator and rank. A value that keeps growing is a GPU-side hang.")
PROFILER_PLUGIN_ACTIVE = _m(
    "nccl_profiler_plugin_active", "gauge", ("node", "pid", *POD, "libnccl_version", "collectives"),
    "1 for a traced process that loaded nccl-exporter's profiler plugin (GPU time is measured), "
    "0 for a traced process without it (host time only). libnccl_version: its libnccl's version "
    "(\"\": unknown; the plugin needs 2.27 or newer); collectives: \"yes\" once a collective of "
    "the process was counted, else \"no\"; the pod labels as on nccl_communicator_info.")

# --- Network time per peer from the profiler plugin's proxy steps (docs/network.md) ----

_NET_LABELS = ("node", "comm", "rank", "peer", "direction", "phase")
_NET_HELP = (
    " peer: the peer's rank in the communicator, or \"other\" for the peers beyond the 4 that waited most "
    "(per communicator and rank); direction: send | recv; phase: NCCL's ProxyStep state (send_gpu_wait, "
    "send_peer_wait, send_wait, recv_wait, recv_flush_wait, recv_gpu_wait). NET transports only (IB, RoCE, "
    "Socket, net plugins), not P2P, SHM or NVLS; comm as on nccl_collective_gpu_duration_seconds.")
NETWORK_WAIT = _m(
    "nccl_network_wait_seconds_total", "counter", _NET_LABELS,
    "Wall time the network transfers of a rank with a peer spent with at least one step in a phase, "
    "summed over operations (the profiler plugin's ProxyStep events). recv_wait high from a peer "
    "together with that peer's send_wait high to this rank: a slow link; the peer's send_gpu_wait "
    "high: a slow GPU (compute straggler) on the sender." + _NET_HELP)
NETWORK_STEP_WAIT = _m(
    "nccl_network_step_wait_seconds_total", "counter", _NET_LABELS,
    "The same as nccl_network_wait_seconds_total summed over steps (up to 8 steps of a channel "
    "overlap, and there is one per channel): step-seconds, at least the wall time." + _NET_HELP)
NETWORK_BYTES = _m(
    "nccl_network_wire_bytes_total", "counter", ("node", "comm", "rank", "peer", "direction"),
    "Bytes a rank's network transfers put on the wire with a peer (the sum of NCCL's ProxyStep transSize: "
    "the network buffer sizes, LL/LL128 flag lines included, so up to 2x the payload with LL)."
    + _NET_HELP.replace(" phase: NCCL's ProxyStep state (send_gpu_wait, send_peer_wait, send_wait, "
                        "recv_wait, recv_flush_wait, recv_gpu_wait).", ""))
NETWORK_FOREIGN_OPS = _m(
    "nccl_network_foreign_proxy_ops_total", "counter", ("node", "pid"),
    "ProxyOps the profiler plugin of a process was given for another process (PXN: a proxy moving "
    "another rank's data) and left out of the network figures.")

# --- Kernel side: TCP (bpf/tcp.c) and scheduler (bpf/sched.c) --------------------------

TCP_RETRANSMITS = _m(
    "nccl_tcp_retransmits_total", "counter", LINK,
    "TCP retransmissions on a link, counted as tcp_retransmit_skb tracepoint hits, i.e. "
    "retransmitted skbs that were sent. One skb can carry many segments under GSO/TSO, so this "
    "is not comparable to the kernel's RetransSegs (node_exporter's "
    "node_netstat_Tcp_RetransSegs), which counts segments. port: the link's service port; "
    "rank: the owning process's rank, empty when the socket's owner is untraced or unknown.")
TCP_RETRANSMIT_FAILURES = _m(
    "nccl_tcp_retransmit_failures_total", "counter", LINK,
    "TCP retransmission attempts that failed (tcp_retransmit_skb hits with err != 0: nothing "
    "was sent, e.g. the qdisc or a local queue refused it). Counted on kernels >= 6.17 only; "
    "0 before.")
TCP_RESETS = _m(
    "nccl_tcp_resets_total", "counter", ("node", "direction", "saddr", "daddr", "port", "rank"),
    "TCP resets (RST segments) sent or received on a link, one per tcp_send_reset / "
    "tcp_receive_reset tracepoint hit.")
TCP_SRTT = _m(
    "nccl_tcp_srtt_seconds", "histogram", LINK,
    "Smoothed round-trip time of traced processes' TCP sockets (the kernel's srtt, in seconds), "
    "one sample per tcp_probe tracepoint hit (an incoming segment on an established socket).")
RUNQUEUE_DELAY = _m(
    "nccl_runqueue_delay_seconds", "histogram", ("node", "rank", "thread"),
    "Time threads of NCCL processes waited runnable on a CPU run queue before they ran (woken "
    "or preempted, until switched in), by thread kind: caller (threads that call NCCL), proxy "
    "(NCCL's own 'NCCL ...' threads), other.")
OFFCPU = _m(
    "nccl_offcpu_seconds_total", "counter", ("node", "rank", "thread"),
    "Time threads of NCCL processes spent asleep (switched out while not runnable, until "
    "woken), by thread kind.")

# --- The exporter itself ------------------------------------------------------------------

EXPORTER_BUILD_INFO = _m(
    "nccl_exporter_build_info", "gauge", ("node", "version"), "nccl-exporter version (value 1).")
EXPORTER_PROBE_ATTACHED = _m(
    "nccl_exporter_probe_attached", "gauge", ("node", "library", "function"),
    "1 when the function of that library is probed, 0 when it is missing from the library or "
    "could not be attached. Aliases probed through their twin at the same address are not listed.")
EXPORTER_NODE_TRACEPOINTS = _m(
    "nccl_exporter_node_tracepoints_attached", "gauge", ("node", "source"),
    "1 while the source's tracepoints that run at every context switch and wakeup (sched) or "
    "socket send, receive and incoming segment (tcp) of the node are attached; 0 while they are "
    "detached because no process has been traced for `run --idle-detach`.")
EXPORTER_MAP_ENTRIES = _m(
    "nccl_exporter_map_entries", "gauge", ("node", "map"), "Entries in each BPF map.")
EXPORTER_MAP_CAPACITY = _m(
    "nccl_exporter_map_capacity", "gauge", ("node", "map"), "Capacity of each BPF map.")
EXPORTER_MAP_FULL = _m(
    "nccl_exporter_map_full_total", "counter", ("node", "map"),
    "Updates dropped because a BPF map was full (those calls are not counted).")
EXPORTER_EVENTS_LOST = _m(
    "nccl_exporter_events_lost_total", "counter", ("node", "source"),
    "Events dropped because a ring buffer to user space was full, by source (nccl, tcp, sched).")
EXPORTER_GPU_INTERVALS_REJECTED = _m(
    "nccl_exporter_gpu_intervals_rejected_total", "counter", ("node", "reason"),
    "GPU intervals of the NCCL profiler plugin left out of nccl_collective_gpu_duration_seconds "
    "because they cannot be right, by reason: longer_than_host (longer than the host's time from "
    "enqueue to delivery), start_before_enqueue (started before the host enqueued it, beyond the "
    "clock error), stop_before_start. NCCL >= 2.29 produces them after a Broadcast on the "
    "AllGatherV path (NCCL_ALLGATHERV_ENABLE=1, the default).")
EXPORTER_GPU_INTERVALS_SHARED = _m(
    "nccl_exporter_gpu_intervals_shared_total", "counter", ("node",),
    "GPU operations of the NCCL profiler plugin whose interval is the one of the operation "
    "done before them on the same communicator: NCCL's kernel writes one start and one stop "
    "for a batch of collectives, so the batch's interval is counted once in "
    "nccl_collective_gpu_duration_seconds, under the operation that finished first, and these "
    "are left out.")
EXPORTER_GPU_OPERATIONS_UNTIMED = _m(
    "nccl_exporter_gpu_operations_untimed_total", "counter", ("node",),
    "GPU operations of the NCCL profiler plugin done with no GPU interval, so not in "
    "nccl_collective_gpu_duration_seconds: NCCL gives none to time (a rank's Send/Recv to itself "
    "on NCCL <= 2.30, a CollNet/NVLS collective with no KernelCh event) or the plugin's mask "
    "asks for none (NCCL_EXPORTER_PROFILER_MASK=counts).")
EXPORTER_RECORDING_DROPPED = _m(
    "nccl_exporter_recording_dropped_total", "counter", ("node", "reason"),
    "Events `run --db` did not write to its recording, by reason: queue_full (the writer was "
    "behind), write_failed (writing failed: disk full, read-only file or directory, locked "
    "database; the recording stopped and the error was logged once).")
EXPORTER_SCRAPE_DURATION = _m(
    "nccl_exporter_scrape_duration_seconds", "gauge", ("node",),
    "Time this scrape spent reading the BPF maps.")
EXPORTER_SPANS = _m(
    "nccl_exporter_spans_total", "counter", ("node", "outcome"),
    "Spans of slow calls by outcome: exported to the OTLP backend, failed to export (backend "
    "down or refusing), or dropped before export because the backend was behind (the probe "
    "path never waits for it).")
EXPORTER_BPF_MISSES = _m(
    "nccl_exporter_bpf_recursion_misses_total", "counter", ("node", "program"),
    "Tracepoint/uprobe hits the kernel did not run a program for, because another BPF program "
    "was already running on that CPU (e.g. a retransmit in a softirq that interrupted a "
    "scheduler probe). Those hits are missing from every count.")
EXPORTER_RETRANSMITS_MISSED = _m(
    "nccl_exporter_retransmits_missed_total", "counter", ("node",),
    "TCP retransmits on this node that the TCP program did not run for (a second, raw "
    "tracepoint program counts every one): missing from every link count and event. The "
    "kernel skips the program while another BPF program runs on that CPU.")
EXPORTER_RETURNS_MISSED = _m(
    "nccl_exporter_returns_missed_total", "counter", ("node",),
    "NCCL calls whose return probe never fired, so they are in no count or event: the thread's "
    "next call showed that the call had ended. Expected only for a call in progress while the "
    "agent attached; growth afterwards means the kernel is dropping return probes.")

ALL: tuple[Metric, ...] = tuple(_ALL)
BY_NAME: dict[str, Metric] = {m.name: m for m in ALL}


def spec(name: str) -> Metric:
    """The Metric of a name as exposed or as declared (with or without _total)."""
    return BY_NAME[name.removesuffix("_total") if name.endswith("_total") else name]


def exposed_names() -> dict[str, Metric]:
    """Every sample name Prometheus stores -> its Metric."""
    return {sample: m for m in ALL for sample in m.exposed}

"""Names other people depend on: op names, NCCL enums, metric names.

Dashboards, alert rules, SQL queries and the BPF program all use these
values. Change them here or not at all.
"""

# --- NCCL ABI enums (nccl.h, NCCL 2.32) -------------------------------------

NCCL_RESULTS = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}

# ncclDataType_t -> (name, size in bytes)
NCCL_DATATYPES = {
    0: ("ncclInt8", 1),
    1: ("ncclUint8", 1),
    2: ("ncclInt32", 4),
    3: ("ncclUint32", 4),
    4: ("ncclInt64", 8),
    5: ("ncclUint64", 8),
    6: ("ncclFloat16", 2),
    7: ("ncclFloat32", 4),
    8: ("ncclFloat64", 8),
    9: ("ncclBfloat16", 2),
    10: ("ncclFloat8e4m3", 1),
    11: ("ncclFloat8e5m2", 1),
}

NCCL_REDOPS = {0: "ncclSum", 1: "ncclProd", 2: "ncclMax", 3: "ncclMin", 4: "ncclAvg"}


def result_name(code: int) -> str:
    return NCCL_RESULTS.get(code, f"ncclResult({code})")


def datatype_name(code: int) -> str:
    return NCCL_DATATYPES.get(code, (f"ncclDataType({code})", 0))[0]


def datatype_size(code: int) -> int:
    """Bytes per element of ncclDataType_t `code`; 0 for one not known (or -1: no datatype)."""
    return NCCL_DATATYPES.get(code, ("", 0))[1]


def redop_name(code: int) -> str:
    # Values >= ncclNumOps are user-created ops (ncclRedOpCreatePreMulSum).
    return NCCL_REDOPS.get(code, f"ncclRedOp({code})")


# --- Operations ---------------------------------------------------------------
# One vocabulary everywhere: metric labels, trace span names, SQL rows.
# op code (shared with bpf/nccl.c through -D defines) -> op name.

COLLECTIVE_OPS = {
    1: "ALL_REDUCE",
    2: "ALL_GATHER",
    3: "REDUCE_SCATTER",
    4: "BROADCAST",
    5: "REDUCE",
    6: "SEND",
    7: "RECV",
    8: "ALL_TO_ALL",
    9: "GATHER",
    10: "SCATTER",
    # One-sided ops on registered windows (NCCL >= 2.28/2.29: nccl.h "Device API"
    # host calls): counted and timed per communicator like collectives.
    11: "PUT_SIGNAL",
    12: "SIGNAL",
    13: "WAIT_SIGNAL",
}

LIFECYCLE_OPS = {
    16: "GET_UNIQUE_ID",
    17: "COMM_INIT_RANK",
    18: "COMM_INIT_RANK_CONFIG",
    19: "COMM_INIT_ALL",
    20: "COMM_INIT_RANK_SCALABLE",
    21: "COMM_SPLIT",
    22: "COMM_FINALIZE",
    23: "COMM_DESTROY",
    24: "COMM_ABORT",
    25: "GROUP_START",
    26: "GROUP_END",
    27: "COMM_COUNT",
    28: "COMM_USER_RANK",
    # NCCL 2.28-2.32 additions (docs/metrics.md, "NCCL 2.28–2.32 calls"). COMM_GET_ASYNC_ERROR is
    # polled (PyTorch's watchdog): its series counts the polls; its result is
    # kept per communicator in the kernel (async_errors), never sent as an event.
    29: "COMM_GET_ASYNC_ERROR",
    30: "COMM_SHRINK",
    31: "COMM_GROW",
    32: "COMM_REVOKE",
    33: "COMM_SUSPEND",
    34: "COMM_RESUME",
    35: "COMM_REGISTER",
    36: "COMM_DEREGISTER",
    37: "COMM_WINDOW_REGISTER",
    38: "COMM_WINDOW_DEREGISTER",
}

OPS = {**COLLECTIVE_OPS, **LIFECYCLE_OPS}
OP_CODES = {name: code for code, name in OPS.items()}


def op_name(code: int) -> str:
    return OPS.get(code, f"OP_{code}")


# Public NCCL function -> (op name, argument layout in bpf/nccl.c).
# The layout names the BPF entry handler that decodes that signature; the
# `*Config` variants take the same leading arguments plus a trailing config.
NCCL_FUNCTIONS = {
    "ncclAllReduce": ("ALL_REDUCE", "reduce_like"),
    "ncclAllReduceConfig": ("ALL_REDUCE", "reduce_like"),
    "ncclReduceScatter": ("REDUCE_SCATTER", "reduce_like"),
    "ncclReduceScatterConfig": ("REDUCE_SCATTER", "reduce_like"),
    "ncclAllGather": ("ALL_GATHER", "gather_like"),
    "ncclAllGatherConfig": ("ALL_GATHER", "gather_like"),
    "ncclAlltoAll": ("ALL_TO_ALL", "gather_like"),
    "ncclAlltoAllConfig": ("ALL_TO_ALL", "gather_like"),
    "ncclBroadcast": ("BROADCAST", "rooted"),
    "ncclBroadcastConfig": ("BROADCAST", "rooted"),
    "ncclGather": ("GATHER", "rooted"),
    "ncclGatherConfig": ("GATHER", "rooted"),
    "ncclScatter": ("SCATTER", "rooted"),
    "ncclScatterConfig": ("SCATTER", "rooted"),
    "ncclReduce": ("REDUCE", "reduce"),
    "ncclReduceConfig": ("REDUCE", "reduce"),
    "ncclBcast": ("BROADCAST", "bcast"),
    "ncclSend": ("SEND", "p2p"),
    "ncclRecv": ("RECV", "p2p"),
    "ncclGetUniqueId": ("GET_UNIQUE_ID", "get_unique_id"),
    "ncclCommInitRank": ("COMM_INIT_RANK", "init_rank"),
    "ncclCommInitRankConfig": ("COMM_INIT_RANK_CONFIG", "init_rank"),
    "ncclCommInitAll": ("COMM_INIT_ALL", "init_all"),
    "ncclCommInitRankScalable": ("COMM_INIT_RANK_SCALABLE", "init_scalable"),
    "ncclCommSplit": ("COMM_SPLIT", "split"),
    "ncclCommFinalize": ("COMM_FINALIZE", "comm_only"),
    "ncclCommDestroy": ("COMM_DESTROY", "comm_only"),
    "ncclCommAbort": ("COMM_ABORT", "comm_only"),
    "ncclGroupStart": ("GROUP_START", "no_args"),
    "ncclGroupEnd": ("GROUP_END", "no_args"),
    "ncclCommCount": ("COMM_COUNT", "comm_query"),
    "ncclCommUserRank": ("COMM_USER_RANK", "comm_query"),
    # (comm, ncclResult_t* asyncError): the same shape as ncclCommUserRank.
    "ncclCommGetAsyncError": ("COMM_GET_ASYNC_ERROR", "comm_query"),
    "ncclCommShrink": ("COMM_SHRINK", "shrink"),
    "ncclCommGrow": ("COMM_GROW", "grow"),
    "ncclCommRevoke": ("COMM_REVOKE", "comm_only"),     # (comm, int revokeFlags)
    "ncclCommSuspend": ("COMM_SUSPEND", "comm_only"),   # (comm, int flags)
    "ncclCommResume": ("COMM_RESUME", "comm_only"),     # (comm)
    "ncclCommRegister": ("COMM_REGISTER", "comm_only"),  # (comm, buff, size, void** handle)
    "ncclCommDeregister": ("COMM_DEREGISTER", "comm_only"),  # (comm, handle)
    "ncclCommWindowRegister": ("COMM_WINDOW_REGISTER", "comm_only"),  # (comm, buff, size, win*, flags)
    "ncclCommWindowDeregister": ("COMM_WINDOW_DEREGISTER", "comm_only"),  # (comm, win)
    "ncclPutSignal": ("PUT_SIGNAL", "put_signal"),
    "ncclSignal": ("SIGNAL", "signal"),
    "ncclWaitSignal": ("WAIT_SIGNAL", "wait_signal"),
}


# --- The kernel side: map sizes, counter slots, record kinds ------------------
# Map sizes are the bounds on what the kernel side can hold (and so on the
# cardinality of what is exported). A full map is counted, never fatal.

MAX_SERIES = 2048      # (op, comm, rank, nranks) series: series_index / series_stats
                       # (the default of `run --series-capacity`)
# comm of the overflow series: calls made while series_index is full
# (one series per op, exported as comm="overflow"; STATS_FULL counts them).
SERIES_OVERFLOW_COMM = (1 << 64) - 1
# A communicator the agent did not see created (it attached mid-job) gets a
# stable local id per process, comm="local-<pid>-<n>" (docs/communicators.md
# "Communicators made before the agent"): LOCAL_COMM_TAG in the top 24 bits,
# the pid in the next 24, n (from 1, per process) in the low 16.
LOCAL_COMM_TAG = 0x10CA1D
DEFAULT_SERIES_TTL = 300.0  # s: `run --series-ttl`, how long an ended communicator's series stay
MAX_COMMS = 4096       # live communicators, all processes (also async_errors' size)
MAX_THREADS = 16384    # threads that have called NCCL (inflight slots)
# inflight_fast: a fixed call slot per thread-id residue (a power of two); a
# thread whose slot another thread holds uses `inflight` (bpf/traced.h).
FAST_THREADS = 1024
MAX_ERRORS = 512       # (op, result) pairs with a result outside 1..ERROR_RESULTS-1
ERROR_RESULTS = 16     # call_errors_fast: one counter per op and result 1..15 (NCCL's are 1..8)
MAX_PROCESSES = 4096   # traced processes
EVENT_PAGES = 256      # events ring buffer (bpf/nccl.c): 1 MiB
MAX_SOCKETS = 65536    # sock_owner: sockets of traced processes (bpf/tcp.c)
MAX_LINKS = 4096       # tcp_links: (family, saddr, daddr, port, owner) series
TCP_EVENT_PAGES = 64   # tcp_events ring buffer: 256 KiB
MAX_SCHED_THREADS = 65536  # thread_sched: scheduler state of traced threads (bpf/sched.c)
SCHED_EVENT_PAGES = 256  # sched_events ring buffer (run-queue waits, recordings only): 1 MiB
GPU_MAX_SERIES = 2048   # (op, NCCL commHash, rank, nranks) GPU histograms (bpf/plugin.c)
GPU_MAX_INFLIGHT = 65536  # (pid, record id) collectives queued/running on the GPU (bpf/plugin.c)
PLUGIN_MAX_PROCS = 4096  # processes that loaded the profiler plugin (bpf/plugin.c)
GPU_EVENT_PAGES = 128  # gpu_events ring buffer (slow GPU operations, for spans, with their network part): 512 KiB
NET_MAX_SERIES = 16384  # (NCCL commHash, rank, peer, direction) network figures (bpf/plugin.c net_series)
NET_TOP_K = 4  # peers the profiler plugin names per operation, the rest are "other" (NCCL_EXPORTER_NET_TOP_K)
# What a network transfer's steps waited for (the profiler plugin's ProxyStep
# states, NET transports only; docs/network.md), in NCCL's order per direction:
# the `phase` label of nccl_network_*_seconds_total and nccl_peer_waits.phase.
NETWORK_PHASES = {
    "send": ("send_gpu_wait", "send_peer_wait", "send_wait"),
    "recv": ("recv_wait", "recv_flush_wait", "recv_gpu_wait"),
}

# Why a GPU interval of the profiler plugin was left out of the histograms
# (nccl_exporter_gpu_intervals_rejected_total{reason}): the plugin's record
# flags NCCL_EXPORTER_F_REJECT_LONG / _EARLY / _REVERSED / _LOST_CHANNEL
# (plugin/nccl_exporter_plugin.h) and bpf/plugin.c's PD_REJECT_* slots.
# docs/plugin.md, "Implausible GPU intervals" and "NCCL habits".
GPU_REJECT_REASONS = ("longer_than_host", "start_before_enqueue", "stop_before_start", "channel_lost")
GPU_REJECT_FLAGS = {"longer_than_host": 0x80, "start_before_enqueue": 0x100, "stop_before_start": 0x200,
                    "channel_lost": 0x1000}
GPU_REJECT_SLOTS = {"longer_than_host": 5, "start_before_enqueue": 6, "stop_before_start": 7, "channel_lost": 11}

OP_COUNT = 64  # op codes are < 64 (a power of two); event_config[OP_COUNT] = record every call

# Slots of the shared `counters` array (bpf/traced.h), as CNT_<name>.
COUNTERS = {
    "STATS_FULL": 0,
    "COMMS_FULL": 1,
    "INFLIGHT_FULL": 2,
    "ERRORS_FULL": 3,
    "EVENTS_LOST": 4,
    "SOCKETS_FULL": 5,
    "LINKS_FULL": 6,
    "TCP_EVENTS_LOST": 7,
    "SCHED_FULL": 8,
    "SCHED_EVENTS_LOST": 9,
    "ASYNC_FULL": 10,
    "GPU_EVENTS_LOST": 11,
    # tcp_retransmit_skb hits: every one (a raw tracepoint), and those bpf/tcp.c's
    # program ran for; the difference is nccl_exporter_retransmits_missed_total
    "RETRANSMIT_HITS": 12,
    "RETRANSMIT_SEEN": 13,
    # connections accepted on a traced process's listening port, and its
    # retransmits/resets, whose socket owner was not known (bpf/tcp.c): each
    # opens an owner window (TcpSource.owner_duty)
    "OWNERS_WANTED": 14,
    # calls whose return probe never fired (bpf/nccl.c begin()): each was
    # replaced by the thread's next outermost call, unrecorded
    "RETURNS_MISSED": 15,
}
COUNTER_SLOTS = 16

# Which counter says a map was full: (counter, map) as exported by
# nccl_exporter_map_full_total{map=...}.
MAP_FULL_COUNTERS = (
    ("STATS_FULL", "series_index"),
    ("COMMS_FULL", "communicators"),
    ("INFLIGHT_FULL", "inflight"),
    ("ERRORS_FULL", "call_errors"),
    ("SOCKETS_FULL", "sock_owner"),
    ("LINKS_FULL", "tcp_links"),
    ("SCHED_FULL", "thread_sched"),
    ("ASYNC_FULL", "async_errors"),
)
# Ring buffer losses by source: (counter, source).
EVENTS_LOST_COUNTERS = (
    ("EVENTS_LOST", "nccl"),
    ("TCP_EVENTS_LOST", "tcp"),
    ("SCHED_EVENTS_LOST", "sched"),
    ("GPU_EVENTS_LOST", "plugin"),
)

# Kinds of the NCCL call records on the `events` ring buffer (EVENT_*).
EVENT_CALL = 1       # a slow call, or any call while recording
EVENT_LIFECYCLE = 2  # a rare lifecycle call (init, split, destroy, ...)

# Event kinds of bpf/tcp.c (TCP_EV_*) -> event names (tcp_events.event).
TCP_EVENTS = {
    1: "tcp_retransmit_skb",
    2: "tcp_retransmit_failed",
    3: "tcp_send_reset",
    4: "tcp_receive_reset",
}
TCP_EVENT_MACROS = {1: "RETRANSMIT", 2: "RETRANSMIT_FAILED", 3: "SEND_RESET", 4: "RECEIVE_RESET"}

# srtt histogram of bpf/tcp.c: records/histogram.py's SRTT layout. One srtt
# sample per socket at most this often: tcp_probe fires at every
# incoming segment, the kernel's srtt is already smoothed over ~8 of them.
SRTT_SAMPLE_NS = 10_000_000

# Thread kinds of bpf/sched.c (SCHED_KIND_*): the thread label.
THREAD_KINDS = {0: "other", 1: "caller", 2: "proxy"}

# Kinds of bpf/loader.c's records (LOADER_EV_*): why a process's libraries
# should be looked at again.
LOADER_EVENTS = {1: "LINK_MAP", 2: "EXEC"}  # _dl_debug_state(), sched_process_exec

DEFAULT_PORT = 9862

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
}


# --- Metric names (a contract with dashboards, alerts and users) -------------

COLLECTIVE_DURATION = "nccl_collective_duration_seconds"
COLLECTIVE_BYTES = "nccl_collective_bytes_total"
CALL_ERRORS = "nccl_call_errors_total"
LIFECYCLE_DURATION = "nccl_lifecycle_duration_seconds"
INFLIGHT_OLDEST = "nccl_inflight_oldest_seconds"
COMMUNICATOR_INFO = "nccl_communicator_info"

# Kernel side: TCP (bpf/tcp.c) and scheduler (bpf/sched.c).
TCP_RETRANSMITS = "nccl_tcp_retransmits_total"
TCP_RETRANSMIT_FAILURES = "nccl_tcp_retransmit_failures_total"
TCP_RESETS = "nccl_tcp_resets_total"
TCP_SRTT = "nccl_tcp_srtt_seconds"
RUNQUEUE_DELAY = "nccl_runqueue_delay_seconds"
OFFCPU = "nccl_offcpu_seconds_total"

EXPORTER_BUILD_INFO = "nccl_exporter_build_info"
EXPORTER_PROBE_ATTACHED = "nccl_exporter_probe_attached"
EXPORTER_MAP_ENTRIES = "nccl_exporter_map_entries"
EXPORTER_MAP_CAPACITY = "nccl_exporter_map_capacity"
EXPORTER_MAP_FULL = "nccl_exporter_map_full_total"
EXPORTER_EVENTS_LOST = "nccl_exporter_events_lost_total"
EXPORTER_SCRAPE_DURATION = "nccl_exporter_scrape_duration_seconds"
EXPORTER_SPANS = "nccl_exporter_spans_total"
EXPORTER_BPF_MISSES = "nccl_exporter_bpf_recursion_misses_total"

DEFAULT_PORT = 9862

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

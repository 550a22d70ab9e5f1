/*
 * profiler_abi.h -- our own declarations of the parts of NCCL's profiler
 * plugin interface (v4 .. v7) that nccl-exporter's plugin relies on.
 *
 * Written for nccl-exporter from the facts in docs/plugin.md (layouts read
 * from NCCL's public interface headers and from the DWARF of the NCCL 2.32.3
 * wheel).  Every size and offset below is checked by tests/test_plugin_abi.py
 * against `gdb ptype /o` of the real libnccl.so.2, so a mismatch fails a test
 * rather than corrupting memory in a job.
 *
 * ABI rules this file encodes:
 *  - the function table is 6 pointers (48 bytes), same order in v4..v7;
 *  - v4's descriptor starts with a uint8_t type; v5..v7 with a uint64_t type;
 *  - every descriptor has parentObj @8, rank @16 and a union @24;
 *  - newer versions only APPEND members to an event's struct, so the common
 *    prefix of one event type has the same offsets in every version (the
 *    chain-loading code converts between versions by copying that prefix);
 *  - recordEventState's args are one 8-byte union in v4..v7.
 */
#ifndef NCCL_EXPORTER_PROFILER_ABI_H
#define NCCL_EXPORTER_PROFILER_ABI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ncclResult_t is a C enum (int-sized); 0 = success, 7 = in progress. */
typedef int nxp_result_t;
#define NXP_SUCCESS 0
#define NXP_INTERNAL_ERROR 3

/* NCCL's logger: (level, flags, file, line, fmt, ...); level 2 = WARN, 3 = INFO. */
typedef void (*nxp_logger_t)(int level, unsigned long flags, const char *file, int line, const char *fmt, ...);
#define NXP_LOG_WARN 2
#define NXP_LOG_INFO 3

/* Event type bits (descriptor `type`; also the activation mask bits). */
enum {
  NXP_EV_GROUP = 0x1,
  NXP_EV_COLL = 0x2,
  NXP_EV_P2P = 0x4,
  NXP_EV_PROXY_OP = 0x8,
  NXP_EV_PROXY_STEP = 0x10,
  NXP_EV_PROXY_CTRL = 0x20,
  NXP_EV_KERNEL_CH = 0x40,
  NXP_EV_NET_PLUGIN = 0x80,
  NXP_EV_GROUP_API = 0x100, /* v5+ */
  NXP_EV_COLL_API = 0x200,  /* v5+ */
  NXP_EV_P2P_API = 0x400,   /* v5+ */
  NXP_EV_KERNEL_LAUNCH = 0x800, /* v5+ */
  NXP_EV_CE_COLL = 0x1000,  /* v6+ */
  NXP_EV_CE_SYNC = 0x2000,  /* v6+ */
  NXP_EV_CE_BATCH = 0x4000, /* v6+ */
  NXP_EV_KERNEL_PHASE = 0x8000, /* v7 */
};

/* recordEventState states (one enum shared by all versions). */
enum {
  NXP_STATE_PROXY_STEP_FIRST = 8,
  /* ProxyStep states (one network step; docs/network.md): a state marks the
   * start of a wait, the next state or stopEvent ends it.  transSize comes
   * with SEND_WAIT and RECV_FLUSH_WAIT. */
  NXP_STATE_SEND_GPU_WAIT = 8,
  NXP_STATE_SEND_WAIT = 9,
  NXP_STATE_RECV_WAIT = 10,
  NXP_STATE_RECV_FLUSH_WAIT = 11,
  NXP_STATE_RECV_GPU_WAIT = 12,
  NXP_STATE_SEND_PEER_WAIT = 20,       /* "_v4": NCCL 2.27+ */
  NXP_STATE_NET_PLUGIN_UPDATE = 21,
  NXP_STATE_KERNEL_CH_STOP = 22, /* args->kernelCh.pTimer = GPU stop timer */
  NXP_STATE_GROUP_START_API_STOP = 23, /* v5+ */
  NXP_STATE_GROUP_END_API_START = 24,  /* v5+ */
  NXP_STATE_CE_FIRST = 25,             /* v6+: 25..30 */
  NXP_STATE_CE_LAST = 30,
  NXP_STATE_KERNEL_PHASE_STOP = 31,    /* v7 */
};

/* ---- per-event members; each version only appends ---------------------- */

#define NXP_COLL_V4_MEMBERS                                                   \
  uint64_t seqNumber;     /* @24 per comm and per func, from 0 */            \
  const char *func;       /* @32 "AllReduce", ... (static string) */         \
  const void *sendBuff;   /* @40 */                                          \
  void *recvBuff;         /* @48 */                                          \
  size_t count;           /* @56 elements (per rank for AllGather) */         \
  int root;               /* @64 */                                          \
  const char *datatype;   /* @72 "ncclFloat32", ... */                       \
  uint8_t nChannels;      /* @80 number of KernelCh children to expect */    \
  uint8_t nWarps;         /* @81 */                                          \
  const char *algo;       /* @88 */                                          \
  const char *proto;      /* @96 */

#define NXP_P2P_V4_MEMBERS                                                    \
  const char *func;       /* @24 "Send" / "Recv" */                          \
  void *buff;             /* @32 */                                          \
  const char *datatype;   /* @40 */                                          \
  size_t count;           /* @48 */                                          \
  int peer;               /* @56 */                                          \
  uint8_t nChannels;      /* @60 (NOT copied by NCCL 2.32.3's v4 adapter) */

#define NXP_PROXY_OP_MEMBERS                                                  \
  int pid; uint8_t channelId; int peer; int nSteps; int chunkSize; int isSend;

#define NXP_KERNEL_CH_MEMBERS                                                 \
  uint8_t channelId;      /* @24 */                                          \
  uint64_t pTimer;        /* @32 GPU %globaltimer at work start, ns */

#define NXP_NET_PLUGIN_MEMBERS int64_t id; void *data;

#define NXP_COLL_API_V5_MEMBERS                                               \
  const char *func; size_t count; const char *datatype; int root;            \
  void *stream; bool graphCaptured;

#define NXP_P2P_API_V5_MEMBERS                                                \
  const char *func; size_t count; const char *datatype; void *stream;        \
  bool graphCaptured;

#define NXP_CE_COLL_V6_MEMBERS                                                \
  uint64_t seqNumber; const char *func; const void *sendBuff; void *recvBuff; \
  size_t count; int root; const char *datatype; const char *syncStrategy;    \
  bool intraBatchSync; uint32_t batchSize; uint32_t numBatches;              \
  uint32_t ceSeqNum; void *stream;

#define NXP_CE_SYNC_MEMBERS bool isComplete; int nRanks;
#define NXP_CE_BATCH_MEMBERS int numOps; size_t totalBytes; bool useIntraSync;

/* ---- v4 (NCCL 2.27): 104 bytes, uint8_t type -------------------------- */
typedef struct {
  uint8_t type;      /* @0  (uint8_t only in v4) */
  void *parentObj;   /* @8 */
  int rank;          /* @16 */
  union {            /* @24, 80 bytes */
    struct { NXP_COLL_V4_MEMBERS } coll;
    struct { NXP_P2P_V4_MEMBERS } p2p;
    struct { NXP_PROXY_OP_MEMBERS } proxyOp;
    struct { int step; } proxyStep;
    struct { NXP_KERNEL_CH_MEMBERS } kernelCh;
    struct { NXP_NET_PLUGIN_MEMBERS } netPlugin;
  };
} nxp_descr_v4;

/* ---- v5 (NCCL 2.28): 112 bytes ----------------------------------------- */
typedef struct {
  uint64_t type;
  void *parentObj;
  int rank;
  union {            /* @24, 88 bytes */
    struct { bool graphCaptured; int groupDepth; } groupApi;
    struct { NXP_COLL_API_V5_MEMBERS } collApi;
    struct { NXP_P2P_API_V5_MEMBERS } p2pApi;
    struct { void *stream; } kernelLaunch;
    struct { NXP_COLL_V4_MEMBERS void *parentGroup; /* @104 */ } coll;
    struct { NXP_P2P_V4_MEMBERS void *parentGroup; /* @64 */ } p2p;
    struct { NXP_PROXY_OP_MEMBERS } proxyOp;
    struct { int step; } proxyStep;
    struct { NXP_KERNEL_CH_MEMBERS } kernelCh;
    struct { NXP_NET_PLUGIN_MEMBERS } netPlugin;
  };
} nxp_descr_v5;

/* ---- v6 (NCCL 2.29): 112 bytes, adds copy-engine events ---------------- */
typedef struct {
  uint64_t type;
  void *parentObj;
  int rank;
  union {            /* @24, 88 bytes */
    struct { bool graphCaptured; int groupDepth; } groupApi;
    struct { NXP_COLL_API_V5_MEMBERS } collApi;
    struct { NXP_P2P_API_V5_MEMBERS } p2pApi;
    struct { void *stream; } kernelLaunch;
    struct { NXP_COLL_V4_MEMBERS void *parentGroup; } coll;
    struct { NXP_P2P_V4_MEMBERS void *parentGroup; } p2p;
    struct { NXP_PROXY_OP_MEMBERS } proxyOp;
    struct { int step; } proxyStep;
    struct { NXP_KERNEL_CH_MEMBERS } kernelCh;
    struct { NXP_NET_PLUGIN_MEMBERS } netPlugin;
    struct { NXP_CE_COLL_V6_MEMBERS } ceColl;
    struct { NXP_CE_SYNC_MEMBERS } ceCollSync;
    struct { NXP_CE_BATCH_MEMBERS } ceCollBatch;
  };
} nxp_descr_v6;

/* ---- v7 (NCCL 2.31/2.32): 136 bytes, adds userTag and KernelPhase ------ */
typedef struct {
  uint64_t type;
  void *parentObj;
  int rank;
  union {            /* @24, 112 bytes */
    struct { bool graphCaptured; int groupDepth; } groupApi;
    struct { NXP_COLL_API_V5_MEMBERS uint64_t userTag; /* @72 */ } collApi;
    struct { NXP_P2P_API_V5_MEMBERS uint64_t userTag; /* @64 */ } p2pApi;
    struct { void *stream; } kernelLaunch;
    struct {
      NXP_COLL_V4_MEMBERS
      void *parentGroup;         /* @104 */
      const char *kernelVariant; /* @112 */
      bool isSymColl;            /* @120 */
      uint64_t userTag;          /* @128 */
    } coll;
    struct { NXP_P2P_V4_MEMBERS void *parentGroup; uint64_t userTag; /* @72 */ } p2p;
    struct { NXP_PROXY_OP_MEMBERS } proxyOp;
    struct { int step; } proxyStep;
    struct { NXP_KERNEL_CH_MEMBERS } kernelCh;
    struct { NXP_NET_PLUGIN_MEMBERS } netPlugin;
    struct { NXP_CE_COLL_V6_MEMBERS uint64_t userTag; /* @112 */ } ceColl;
    struct { NXP_CE_SYNC_MEMBERS } ceCollSync;
    struct { NXP_CE_BATCH_MEMBERS } ceCollBatch;
    struct {
      uint8_t channelId;  /* @24 */
      uint8_t phaseId;    /* @25 */
      const char *phaseName; /* @32 */
      uint64_t pTimer;    /* @40 */
    } kernelPhase;
  };
} nxp_descr_v7;

/* recordEventState args, v4..v7: one 8-byte union, every member @0. */
typedef union {
  struct { size_t transSize; } proxyStep;
  struct { int appendedProxyOps; } proxyCtrl;
  struct { void *data; } netPlugin;
  struct { uint64_t pTimer; } kernelCh; /* GPU stop timer with KERNEL_CH_STOP */
} nxp_state_args;

/* ---- function tables: 48 bytes, same slot order in every version ------- */
/* v4 init: (ctx, mask, commName, commHash, nNodes, nranks, rank, logfn) */
typedef struct {
  const char *name;
  nxp_result_t (*init)(void **ctx, int *mask, const char *commName, uint64_t commHash,
                       int nNodes, int nranks, int rank, nxp_logger_t logfn);
  nxp_result_t (*startEvent)(void *ctx, void **handle, nxp_descr_v4 *d);
  nxp_result_t (*stopEvent)(void *handle);
  nxp_result_t (*recordEventState)(void *handle, int state, nxp_state_args *a);
  nxp_result_t (*finalize)(void *ctx);
} nxp_profiler_v4;

/* v5..v7 init: (ctx, commId, mask, commName, nNodes, nranks, rank, logfn) */
#define NXP_PROFILER_TABLE(N)                                                    \
  typedef struct {                                                               \
    const char *name;                                                            \
    nxp_result_t (*init)(void **ctx, uint64_t commId, int *mask, const char *commName, \
                         int nNodes, int nranks, int rank, nxp_logger_t logfn); \
    nxp_result_t (*startEvent)(void *ctx, void **handle, nxp_descr_v##N *d);   \
    nxp_result_t (*stopEvent)(void *handle);                                     \
    nxp_result_t (*recordEventState)(void *handle, int state, nxp_state_args *a); \
    nxp_result_t (*finalize)(void *ctx);                                         \
  } nxp_profiler_v##N;
NXP_PROFILER_TABLE(5)
NXP_PROFILER_TABLE(6)
NXP_PROFILER_TABLE(7)

/* Generic view of any table: the slot order is identical, only the
 * descriptor type and init's argument order differ. */
typedef struct {
  const char *name;
  void *init;
  nxp_result_t (*startEvent)(void *ctx, void **handle, void *d);
  nxp_result_t (*stopEvent)(void *handle);
  nxp_result_t (*recordEventState)(void *handle, int state, nxp_state_args *a);
  nxp_result_t (*finalize)(void *ctx);
} nxp_profiler_any;

#endif

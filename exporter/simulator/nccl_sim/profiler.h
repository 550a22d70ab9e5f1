/* profiler.h -- the simulator's side of NCCL's profiler plugin interface, shared
 * by profiler.c (loading the plugin, its init/finalize, NCCL's gating, the
 * network proxy's events) and gpu.c (the events of the stream threads).
 * Only these two files include it. */
#ifndef NCCL_SIM_PROFILER_H
#define NCCL_SIM_PROFILER_H

#include "nccl_sim.h"

/* ---- our declarations of the profiler interface (v4 .. v7; layouts as in
 * NCCL 2.27 .. 2.32.3, the same facts as plugin/profiler_abi.h) ---------- */
enum { EV_GROUP = 0x1, EV_COLL = 0x2, EV_P2P = 0x4, EV_PROXY_OP = 0x8, EV_PROXY_STEP = 0x10, EV_KERNEL_CH = 0x40,
       EV_NET_PLUGIN = 0x80, EV_GROUP_API = 0x100, EV_COLL_API = 0x200, EV_P2P_API = 0x400, EV_KERNEL_LAUNCH = 0x800 };
enum { ST_KERNEL_CH_STOP = 22, ST_GROUP_START_API_STOP = 23, ST_GROUP_END_API_START = 24 };
typedef struct {
  uint64_t type;        /* v4: uint8_t at @0 (the other 7 bytes are padding) */
  void *parentObj;      /* @8 */
  int rank;             /* @16 */
  union {               /* @24 */
    struct { bool graphCaptured; int groupDepth; } groupApi;
    struct { const char *func; size_t count; const char *datatype; int root; void *stream; bool graphCaptured;
             uint64_t userTag; } collApi;
    struct { const char *func; size_t count; const char *datatype; void *stream; bool graphCaptured;
             uint64_t userTag; } p2pApi;
    struct { void *stream; } kernelLaunch;
    struct { uint64_t seqNumber; const char *func; const void *sendBuff; void *recvBuff; size_t count; int root;
             const char *datatype; uint8_t nChannels; uint8_t nWarps; const char *algo; const char *proto;
             void *parentGroup; const char *kernelVariant; bool isSymColl; uint64_t userTag; } coll; /* v4 ends at proto */
    struct { const char *func; void *buff; const char *datatype; size_t count; int peer; uint8_t nChannels;
             void *parentGroup; uint64_t userTag; } p2p;                                          /* v4 ends at nChannels */
    struct { uint8_t channelId; uint64_t pTimer; } kernelCh;
    struct { int pid; uint8_t channelId; int peer; int nSteps; int chunkSize; int isSend; } proxyOp;
    struct { int step; } proxyStep;
    char raw[112];
  };
} sim_descr_t;          /* 136 bytes = v7's size; v4 reads 104, v5/v6 112 */
typedef union { struct { uint64_t pTimer; } kernelCh; struct { size_t transSize; } proxyStep; char raw[8]; } sim_state_args_t;
typedef void (*sim_logger_t)(int level, unsigned long flags, const char *file, int line, const char *fmt, ...);
typedef struct {
  const char *name;
  void *init;
  int (*startEvent)(void *ctx, void **handle, void *descr);
  int (*stopEvent)(void *handle);
  int (*recordEventState)(void *handle, int state, void *args);
  int (*finalize)(void *ctx);
} sim_prof_t;
typedef int (*prof_init_v4_t)(void **, int *, const char *, uint64_t, int, int, int, sim_logger_t);
typedef int (*prof_init_v5_t)(void **, uint64_t, int *, const char *, int, int, int, sim_logger_t);

extern sim_prof_t *g_prof;              /* the loaded plugin's table (NULL: none) */
extern int g_prof_ver;                  /* its interface version, 4 .. 7 */
extern int g_prof_mask;                 /* NCCL's one process-wide activation mask */
extern long long g_prof_purged_kch, g_prof_purged_ops;
/* the stream thread's current Coll (gpu.c run_kernel), for gpu_net_op */
extern __thread void *tl_net_parent;
extern __thread int tl_net_kind;
extern __thread uint64_t tl_net_seq;

uint64_t gpu_timer(uint64_t mono);
void d_init(sim_descr_t *d, uint64_t type, void *parent, int rank);
void *p_start(ncclComm_t c, sim_descr_t *d);
void p_stop(void *h);
void p_record(void *h, int st, uint64_t ptimer, int null_args);
void prof_comm_finalize(ncclComm_t c, int abort);
void gpu_truth_simple(const char *fn, const char *op, ncclComm_t c, const char *extra);

#endif

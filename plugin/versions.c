/*
 * versions.c -- the version adapters: NCCL's ncclProfiler_v4 .. v7 tables, each
 * entry reading its version's descriptor into struct ev (profiler_abi.h), and
 * the counters exported for tests and `nccl-exporter check`.
 */
#include "internal.h" /* first: it includes glibc_floor.h before any system header */

/* ------------------------------------------------------------------------ */
/* Per-version entry points                                                */

static nxp_result_t init_v4(void **ctx, int *mask, const char *name, uint64_t hash, int nnodes, int nranks, int rank,
                            nxp_logger_t logfn) {
  return common_init(4, ctx, hash, mask, name, nnodes, nranks, rank, logfn);
}
#define INIT_V(N)                                                                                                  \
  static nxp_result_t init_v##N(void **ctx, uint64_t hash, int *mask, const char *name, int nnodes, int nranks,   \
                                int rank, nxp_logger_t logfn) {                                                    \
    return common_init(N, ctx, hash, mask, name, nnodes, nranks, rank, logfn);                                     \
  }
INIT_V(5)
INIT_V(6)
INIT_V(7)

/* Read only the fields of the event's own type: NCCL's v4/v5 adapters do not
 * zero the rest of the descriptor. */
#define START_V(N, TYPEEXPR)                                                                                       \
  static nxp_result_t start_v##N(void *ctx, void **h, nxp_descr_v##N *d) {                                      \
    if (UNLIKELY(!h)) return NXP_SUCCESS;                                                                           \
    if (UNLIKELY(!d)) { *h = NULL; return NXP_SUCCESS; }                                                            \
    struct ev e;                                                                                                    \
    e.type = (TYPEEXPR);                                                                                            \
    e.parent = d->parentObj;                                                                                        \
    if (LIKELY(!G.chain) && !(e.type & ((uint64_t)G.our_mask | NXP_EV_GROUP))) { *h = NULL; return NXP_SUCCESS; } \
    if (e.type == NXP_EV_COLL) {                                                                                    \
      e.seq = d->coll.seqNumber; e.func = d->coll.func; e.datatype = d->coll.datatype;                              \
      e.count = d->coll.count; e.root_or_peer = d->coll.root; e.nchannels = d->coll.nChannels;                     \
    } else if (e.type == NXP_EV_P2P) {                                                                              \
      e.seq = 0; e.func = d->p2p.func; e.datatype = d->p2p.datatype; e.count = d->p2p.count;                        \
      e.root_or_peer = d->p2p.peer; e.nchannels = d->p2p.nChannels;                                                 \
    } else if (e.type == NXP_EV_KERNEL_CH) {                                                                        \
      e.channel = d->kernelCh.channelId; e.ptimer = d->kernelCh.pTimer;                                             \
    } else if (e.type == NXP_EV_PROXY_STEP) {                                                                       \
      e.step = d->proxyStep.step;                                                                                   \
    } else if (e.type == NXP_EV_PROXY_OP) {                                                                         \
      e.pid = d->proxyOp.pid; e.peer = d->proxyOp.peer; e.is_send = d->proxyOp.isSend;                             \
    }                                                                                                               \
    return common_start(N, ctx, h, d, &e);                                                                          \
  }
START_V(4, (uint64_t)d->type)
START_V(5, d->type)
START_V(6, d->type)
START_V(7, d->type)

static nxp_result_t stop_any(void *h) { return common_stop(h); }
#define RECORD_V(N)                                                                                                \
  static nxp_result_t record_v##N(void *h, int st, nxp_state_args *a) { return common_record(N, h, st, a); }
RECORD_V(4)
RECORD_V(5)
RECORD_V(6)
RECORD_V(7)

EXPORT const nxp_profiler_v7 ncclProfiler_v7 = {"nccl-exporter", init_v7, start_v7, stop_any, record_v7, common_finalize};
EXPORT const nxp_profiler_v6 ncclProfiler_v6 = {"nccl-exporter", init_v6, start_v6, stop_any, record_v6, common_finalize};
EXPORT const nxp_profiler_v5 ncclProfiler_v5 = {"nccl-exporter", init_v5, start_v5, stop_any, record_v5, common_finalize};
EXPORT const nxp_profiler_v4 ncclProfiler_v4 = {"nccl-exporter", init_v4, start_v4, stop_any, record_v4, common_finalize};

/* For tests and `nccl-exporter check`: counters of this process. */
EXPORT void nccl_exporter_profiler_stats(uint64_t out[6]) {
  out[0] = atomic_load(&G.completed);
  out[1] = atomic_load(&G.abandoned);
  out[2] = atomic_load(&G.dropped);
  out[3] = atomic_load(&G.stale);
  out[4] = atomic_load(&G.wrap_dropped);
  out[5] = (uint64_t)atomic_load(&G.disabled);
}

/* For tests and `nccl-exporter check`: the pools and the proxy accounting's
 * counters.  out[0] record slots in use, [1] ProxyOp slots in use,
 * [2] ProxyOps accounted, [3] ProxyOps of another pid (PXN) ignored,
 * [4] ProxyOps whose operation was gone, [5] ProxyOps after their done record,
 * [6] ProxyOps dropped for lack of a pool slot, [7] proxy accounting on. */
EXPORT void nccl_exporter_profiler_pools(uint64_t out[8]) {
  uint64_t live = 0, plive = 0;
  for (uint32_t i = 0; i < G.nslots; i++) live += atomic_load(&G.slots[i].state) != SLOT_FREE;
  for (uint32_t i = 0; i < G.npops; i++) plive += atomic_load(&G.pops[i].state) != SLOT_FREE;
  out[0] = live;
  out[1] = plive;
  out[2] = atomic_load(&G.proxy_ops);
  out[3] = atomic_load(&G.proxy_foreign);
  out[4] = atomic_load(&G.proxy_orphan);
  out[5] = atomic_load(&G.proxy_late);
  out[6] = atomic_load(&G.proxy_dropped);
  out[7] = (uint64_t)G.proxy_on;
}

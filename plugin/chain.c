/*
 * chain.c -- chain-loading (NCCL_EXPORTER_PROFILER_CHAIN): the chained plugin's
 * loading, its mask, conversion of descriptors between interface versions, and
 * handles of both plugins kept apart.
 */
#include "internal.h" /* first: it includes glibc_floor.h before any system header */

void load_chain(void) {
  const char *p = getenv("NCCL_EXPORTER_PROFILER_CHAIN");
  if (!p || !*p) return;
  void *dl = dlopen(p, RTLD_NOW | RTLD_LOCAL);
  if (!dl) {
    logmsg(NXP_LOG_WARN, "nccl-exporter profiler: chain: cannot load %s: %s", p, dlerror());
    return;
  }
  static const char *syms[] = {"ncclProfiler_v7", "ncclProfiler_v6", "ncclProfiler_v5", "ncclProfiler_v4"};
  for (int i = 0; i < 4; i++) {
    void *t = dlsym(dl, syms[i]);
    if (!t) continue;
    Dl_info self, other;
    if (dladdr((void *)&load_chain, &self) && dladdr(t, &other)) {
      if (other.dli_fbase == self.dli_fbase) {
        logmsg(NXP_LOG_WARN, "nccl-exporter profiler: chain: %s is this plugin; not chained", p);
        dlclose(dl);
        return;
      }
    }
    G.chain_dl = dl;
    G.chain_ver = 7 - i;
    G.chain = t;
    logmsg(NXP_LOG_INFO, "nccl-exporter profiler: chained %s (%s, v%d)", p,
           G.chain->name ? G.chain->name : "?", G.chain_ver);
    return;
  }
  logmsg(NXP_LOG_WARN, "nccl-exporter profiler: chain: %s exports no ncclProfiler_v4..v7; not chained", p);
  dlclose(dl);
}

/* ------------------------------------------------------------------------ */
/* Chain: conversion between interface versions                            */

/* Size of one event type's member in version v (0 = the type does not exist there). */
static size_t member_size(int v, uint64_t type) {
#define MS(T, m) sizeof(((T *)0)->m)
  switch (type) {
  case NXP_EV_GROUP: return v >= 4 ? 0 + 1 : 0; /* no payload; 1 = "exists" */
  case NXP_EV_COLL: return v == 4 ? MS(nxp_descr_v4, coll) : v == 7 ? MS(nxp_descr_v7, coll) : MS(nxp_descr_v5, coll);
  case NXP_EV_P2P: return v == 4 ? MS(nxp_descr_v4, p2p) : v == 7 ? MS(nxp_descr_v7, p2p) : MS(nxp_descr_v5, p2p);
  case NXP_EV_PROXY_OP: return MS(nxp_descr_v4, proxyOp);
  case NXP_EV_PROXY_STEP: return MS(nxp_descr_v4, proxyStep);
  case NXP_EV_PROXY_CTRL: return 1;
  case NXP_EV_KERNEL_CH: return MS(nxp_descr_v4, kernelCh);
  case NXP_EV_NET_PLUGIN: return MS(nxp_descr_v4, netPlugin);
  case NXP_EV_GROUP_API: return v >= 5 ? MS(nxp_descr_v5, groupApi) : 0;
  case NXP_EV_COLL_API: return v >= 7 ? MS(nxp_descr_v7, collApi) : v >= 5 ? MS(nxp_descr_v5, collApi) : 0;
  case NXP_EV_P2P_API: return v >= 7 ? MS(nxp_descr_v7, p2pApi) : v >= 5 ? MS(nxp_descr_v5, p2pApi) : 0;
  case NXP_EV_KERNEL_LAUNCH: return v >= 5 ? MS(nxp_descr_v5, kernelLaunch) : 0;
  case NXP_EV_CE_COLL: return v >= 7 ? MS(nxp_descr_v7, ceColl) : v == 6 ? MS(nxp_descr_v6, ceColl) : 0;
  case NXP_EV_CE_SYNC: return v >= 6 ? MS(nxp_descr_v6, ceCollSync) : 0;
  case NXP_EV_CE_BATCH: return v >= 6 ? MS(nxp_descr_v6, ceCollBatch) : 0;
  case NXP_EV_KERNEL_PHASE: return v >= 7 ? MS(nxp_descr_v7, kernelPhase) : 0;
  }
  return 0;
#undef MS
}

int state_exists(int v, int st) {
  if (st < NXP_STATE_PROXY_STEP_FIRST) return v <= 3; /* deprecated ProxyOp states */
  if (st <= NXP_STATE_KERNEL_CH_STOP) return 1;
  if (st <= NXP_STATE_GROUP_END_API_START) return v >= 5;
  if (st <= NXP_STATE_CE_LAST) return v >= 6;
  if (st == NXP_STATE_KERNEL_PHASE_STOP) return v >= 7;
  return 0;
}

/* Event types NCCL would send a plugin whose mask is m (its gating rules). */
static int types_for_mask(int m) {
  const int ce = NXP_EV_CE_COLL | NXP_EV_CE_SYNC | NXP_EV_CE_BATCH;
  const int net = NXP_EV_PROXY_OP | NXP_EV_PROXY_STEP | NXP_EV_KERNEL_CH | NXP_EV_NET_PLUGIN;
  int t = m;
  if (m & (NXP_EV_GROUP_API | NXP_EV_P2P_API | NXP_EV_COLL_API | NXP_EV_KERNEL_LAUNCH | NXP_EV_GROUP | NXP_EV_COLL |
           NXP_EV_P2P | net | ce))
    t |= NXP_EV_GROUP_API;
  if (m & (NXP_EV_COLL_API | NXP_EV_COLL | net | ce)) t |= NXP_EV_COLL_API;
  if (m & (NXP_EV_P2P_API | NXP_EV_P2P | net)) t |= NXP_EV_P2P_API;
  if (m & (NXP_EV_GROUP | NXP_EV_COLL | NXP_EV_P2P | net)) t |= NXP_EV_GROUP;
  if (m & (NXP_EV_COLL | net)) t |= NXP_EV_COLL;
  if (m & (NXP_EV_P2P | net)) t |= NXP_EV_P2P;
  if (m & NXP_EV_KERNEL_PHASE) t |= NXP_EV_KERNEL_CH;
  return t;
}

void merge_masks(void) {
  int cm = __atomic_load_n(&G.chain_mask, __ATOMIC_RELAXED);
  int never = 0;
  if (UNLIKELY(cm & NXP_EV_KERNEL_PHASE) && atomic_compare_exchange_strong(&G.phase_warned, &never, 1))
    logmsg(NXP_LOG_WARN, "nccl-exporter profiler: the chained plugin %s asks for KernelPhase events (its mask 0x%x); "
           "NCCL 2.31 spends 4-13 %% more GPU time with them (NVIDIA/nccl#2355). nccl-exporter never asks for them",
           G.chain && G.chain->name ? G.chain->name : "?", cm);
  if (UNLIKELY(cm & NXP_EV_KERNEL_PHASE) && G.log_fd >= 0 && atomic_load(&G.phase_warned) == 1) {
    /* the same, once, in logging mode's file (2: written) */
    int one = 1;
    if (atomic_compare_exchange_strong(&G.phase_warned, &one, 2)) {
      char line[160];
      int n = snprintf(line, sizeof line, "nccl-exporter-profiler event=warn what=chained_kernel_phase chain_mask=0x%x "
                       "pid=%d\n", cm, (int)getpid());
      if (n > 0 && write(G.log_fd, line, (size_t)n) < 0) { /* best effort */ }
    }
  }
  int seen = atomic_exchange(&G.chain_mask_seen, cm);
  atomic_store(&G.chain_types, types_for_mask(cm));
  if (G.nccl_mask) {
    int cur = __atomic_load_n(G.nccl_mask, __ATOMIC_RELAXED);
    /* bits only the chained plugin had asked for and dropped since go away */
    int ours = atomic_load(&G.disabled) ? 0 : G.our_mask;
    int next = (cur & ~(seen & ~G.our_mask)) | ours | cm;
    __atomic_store_n(G.nccl_mask, next, __ATOMIC_RELAXED);
  }
}

/* Copy the header and the event's own member from version `from` into a
 * zeroed descriptor of version `to`; returns 0 if `to` lacks the type. */
int convert(int from, const void *src, int to, void *dst, void *parent) {
  uint64_t type = from == 4 ? ((const nxp_descr_v4 *)src)->type : ((const nxp_descr_v7 *)src)->type;
  size_t ssz = member_size(from, type), dsz = member_size(to, type);
  if (!dsz) return 0;
  size_t dsize = to == 4 ? sizeof(nxp_descr_v4) : to == 7 ? sizeof(nxp_descr_v7) : sizeof(nxp_descr_v5);
  memset(dst, 0, dsize);
  if (to == 4) ((nxp_descr_v4 *)dst)->type = (uint8_t)type;
  else ((nxp_descr_v7 *)dst)->type = type;
  /* parentObj @8, rank @16, union @24 in every version */
  memcpy((char *)dst + 8, &parent, sizeof parent);
  memcpy((char *)dst + 16, (const char *)src + 16, sizeof(int));
  if (type == NXP_EV_GROUP || type == NXP_EV_PROXY_CTRL) return 1;
  memcpy((char *)dst + 24, (const char *)src + 24, ssz < dsz ? ssz : dsz);
  /* v4 Coll/P2p have no parentGroup; a newer receiver gets the parent there. */
  if (from == 4 && to >= 5) {
    if (type == NXP_EV_COLL) ((nxp_descr_v5 *)dst)->coll.parentGroup = parent;
    if (type == NXP_EV_P2P) ((nxp_descr_v5 *)dst)->p2p.parentGroup = parent;
  }
  return 1;
}

/* ------------------------------------------------------------------------ */
/* Chain: handle classification                                            */

void split(void *h, void **ours, void **theirs) {
  *ours = *theirs = NULL;
  if (!h) return;
  if (h_is_ours(h)) {
    *ours = h;
    /* only a Coll/P2p handle (sub 0) can carry theirs; a KernelCh handle of
     * ours alone may outlive its slot by its stopEvent (ours_stop) */
    uint32_t sub;
    struct slot *s = ((uintptr_t)h & 0x1ff) ? NULL : h_slot(h, &sub);
    if (s && sub == 0) *theirs = s->theirs;
    return;
  }
  if (is_wrap(h)) {
    struct wrap *w = h;
    *ours = w->ours;
    *theirs = w->theirs;
    return;
  }
  *theirs = h;
}

static void *wrap_alloc(struct ctx *c, void *ours, void *theirs) {
  for (uint32_t tries = 0; tries < G.nwraps; tries++) {
    uint32_t i = atomic_fetch_add_explicit(&G.wcursor, 1, memory_order_relaxed) % G.nwraps;
    struct wrap *w = &G.wraps[i];
    uint32_t f = 0;
    if (atomic_load_explicit(&w->used, memory_order_relaxed) == 0 &&
        atomic_compare_exchange_strong(&w->used, &f, 1)) {
      w->ctx = c;
      w->ours = ours;
      w->theirs = theirs;
      return w;
    }
  }
  atomic_fetch_add_explicit(&G.wrap_dropped, 1, memory_order_relaxed);
  return NULL;
}

/* Combine our handle and the chained plugin's into what NCCL gets. */
void *combine(struct ctx *c, uint64_t type, void *ours, void *theirs) {
  if (!theirs) return ours;
  if (ours && (type == NXP_EV_COLL || type == NXP_EV_P2P)) {
    uint32_t sub;
    struct slot *s = h_slot(ours, &sub);
    if (s) { s->theirs = theirs; return ours; }
  }
  if (!ours && !h_is_ours(theirs) && !is_wrap(theirs)) return theirs; /* pass through */
  void *w = wrap_alloc(c, ours, theirs);
  return w ? w : ours; /* no wrapper: ours wins (theirs is dropped, counted) */
}

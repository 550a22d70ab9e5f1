/*
 * entry.c -- what every interface version shares: init and finalize per
 * communicator (with the process-wide setup at the first), and startEvent,
 * stopEvent and recordEventState dispatched to gpu.c, net.c and chain.c.
 */
#include "internal.h" /* first: it includes glibc_floor.h before any system header */

/* What we ask NCCL for (NCCL_EXPORTER_PROFILER_MASK, docs/plugin.md "The
 * activation mask"): `counts` Coll|P2p only (no GPU intervals); `gpu` adds
 * KernelCh; `net` (the default with proxy accounting on) adds ProxyOp and
 * ProxyStep. Never KernelPhase (bit 15, v7). What KernelCh costs NCCL:
 * a profiler proxy op in every plan, so a captured graph runs a host callback
 * at every replay (NCCL v2.28.9-1 src/enqueue.cc:1519-1531) and, up to 2.30,
 * our KernelCh hooks run on NCCL's proxy progress thread; on NCCL 2.31.2
 * asking for KernelCh alone also turns on the kernels' KernelPhase timestamp
 * writes and a system fence, the 4-13 % of GPU time measured in
 * NVIDIA/nccl#2355/#2357 (so our mask pays it, although it never asks for
 * KernelPhase). A chained plugin that asks for KernelPhase gets it, with one
 * WARN line (merge_masks). */
#define OUR_MASK (NXP_EV_COLL | NXP_EV_P2P | NXP_EV_KERNEL_CH)
#define COUNTS_MASK (NXP_EV_COLL | NXP_EV_P2P)
_Static_assert((OUR_MASK & NXP_EV_KERNEL_PHASE) == 0, "never ask for KernelPhase events");
/* ...and with proxy accounting on (NCCL_EXPORTER_PROFILER_PROXY, the default;
 * docs/plugin.md "Network time per peer"), the network steps too. */
#define PROXY_MASK (NXP_EV_PROXY_OP | NXP_EV_PROXY_STEP)

/* ------------------------------------------------------------------------ */
/* Common entry points: startEvent, stopEvent, recordEventState            */

nxp_result_t common_start(int ver, void *context, void **eHandle, const void *descr, const struct ev *e) {
  *eHandle = NULL; /* always written: NCCL may reuse the slot otherwise */
  /* PXN: another process's ProxyOp; its context and parentObj are that
   * process's: decided from the pid before anything is read through them.
   * Its ProxySteps come with the NULL we returned as their parent. */
  if (e->type == NXP_EV_PROXY_OP && e->pid != G.pid) {
    atomic_fetch_add_explicit(&G.proxy_foreign, 1, memory_order_relaxed);
    return NXP_SUCCESS;
  }
  if (e->type == NXP_EV_PROXY_STEP && !e->parent) return NXP_SUCCESS;
  struct ctx *c = as_ctx(context);
  if (UNLIKELY(!c)) return NXP_SUCCESS;
  void *ours = NULL, *parent_theirs = NULL;
  struct ev e2 = *e;

  if (LIKELY(!G.chain)) {
    if (e->type == NXP_EV_PROXY_STEP) *eHandle = proxy_start_step(e);
    else if (e->type == NXP_EV_KERNEL_CH) *eHandle = ours_start_kch(c, e);
    else if (e->type == NXP_EV_PROXY_OP) *eHandle = proxy_start_op(e);
    else if (e->type == NXP_EV_COLL || e->type == NXP_EV_P2P) *eHandle = ours_start_op(c, e);
    else if (e->type == NXP_EV_GROUP) *eHandle = H_GROUP;
    return NXP_SUCCESS;
  }

  /* chain mode */
  if (UNLIKELY(__atomic_load_n(&G.chain_mask, __ATOMIC_RELAXED) != atomic_load_explicit(&G.chain_mask_seen, memory_order_relaxed)))
    merge_masks();
  void *parent_ours;
  split(e->parent, &parent_ours, &parent_theirs);
  e2.parent = parent_ours;
  if (e->type == NXP_EV_KERNEL_CH) ours = parent_ours ? ours_start_kch(c, &e2) : NULL;
  else if (e->type == NXP_EV_COLL || e->type == NXP_EV_P2P) ours = ours_start_op(c, &e2);
  else if (G.proxy_on && e->type == NXP_EV_PROXY_OP) ours = proxy_start_op(&e2); /* pid checked first */
  else if (G.proxy_on && e->type == NXP_EV_PROXY_STEP) ours = parent_ours ? proxy_start_step(&e2) : NULL;
  else if (e->type == NXP_EV_GROUP) ours = H_GROUP;

  void *theirs = NULL;
  if (c->chain_ok && (atomic_load_explicit(&G.chain_types, memory_order_relaxed) & (int)e->type)) {
    union { nxp_descr_v4 v4; nxp_descr_v5 v5; nxp_descr_v6 v6; nxp_descr_v7 v7; } d;
    if (convert(ver, descr, G.chain_ver, &d, parent_theirs)) {
      G.chain->startEvent(c->chain_ctx, &theirs, &d);
    }
  }
  *eHandle = combine(c, e->type, ours, theirs);
  return NXP_SUCCESS;
}

nxp_result_t common_stop(void *h) {
  if (!h) return NXP_SUCCESS;
  if (LIKELY(!G.chain)) {
    ours_stop(h);
    return NXP_SUCCESS;
  }
  void *ours, *theirs;
  split(h, &ours, &theirs);
  if (theirs) G.chain->stopEvent(theirs);
  if (ours) ours_stop(ours);
  if (is_wrap(h)) {
    struct wrap *w = h;
    w->ours = w->theirs = NULL;
    atomic_store(&w->used, 0);
  }
  return NXP_SUCCESS;
}

nxp_result_t common_record(int ver, void *h, int state, nxp_state_args *a) {
  if (!h) return NXP_SUCCESS;
  void *ours = h, *theirs = NULL;
  if (UNLIKELY(G.chain != NULL)) split(h, &ours, &theirs);
  if (ours && h_is_proxy(ours)) proxy_record(ours, state, a);
  else if (ours && state == NXP_STATE_KERNEL_CH_STOP && a) ours_kch_stop_state(ours, a->kernelCh.pTimer);
  if (theirs && state_exists(G.chain_ver, state)) {
    nxp_state_args copy;
    memset(&copy, 0, sizeof copy);
    if (a) copy = *a;
    G.chain->recordEventState(theirs, state, (a || G.chain_ver < 7) ? &copy : NULL);
  }
  (void)ver;
  return NXP_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* init / finalize                                                         */

static void open_log(void) {
  const char *p = getenv("NCCL_EXPORTER_PROFILER_LOG");
  if (!p || !*p) return;
  char path[4096];
  size_t o = 0;
  for (const char *q = p; *q && o < sizeof path - 32; q++) { /* %p -> pid */
    if (q[0] == '%' && q[1] == 'p') { o += (size_t)snprintf(path + o, sizeof path - o, "%d", (int)getpid()); q++; }
    else path[o++] = *q;
  }
  path[o] = 0;
  G.log_fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (G.log_fd < 0) logmsg(NXP_LOG_WARN, "nccl-exporter profiler: cannot open log %s: %s", path, strerror(errno));
}

/* Pin the library: never unmapped while the process lives. NCCL dlcloses the
 * plugin when its load count reaches 0 (v2.28.9-1 src/plugin/profiler.cc:107-119),
 * and that count can fall to 0 under live communicators: commFree unloads
 * also for a communicator whose init failed before the plugin was loaded
 * (init.cc:336 vs :1251), and 2.30.x unloads twice after an init error
 * (v2.30.7-1 profiler.cc:253, :268). Our announcer thread would then run in
 * unmapped code. The link flag -z nodelete (exporter/sources/plugin/build.py)
 * does the same for our build; this covers any other build of these sources. */
static void pin_self(void) {
  Dl_info self;
  if (!dladdr((void *)&pin_self, &self) || !self.dli_fname ||
      !dlopen(self.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE)) {
    const char *err = dlerror();
    logmsg(NXP_LOG_WARN, "nccl-exporter profiler: cannot pin the plugin in memory (%s); its announcer thread is "
           "off", err ? err : "dladdr");
  } else G.pinned = 1;
}

static void global_init(nxp_logger_t logfn) {
  G.logfn = logfn;
  pin_self();
  G.max_age_ns = env_u64("NCCL_EXPORTER_PROFILER_MAX_AGE_S", 300, 1, 86400 * 365) * 1000000000ull;
  G.window_ns = env_u64("NCCL_EXPORTER_PROFILER_CLOCK_WINDOW_MS", 200, 10, 3600000) * 1000000ull;
  /* 1 ms (the enqueue time's lateness, timer resolution) + 2 windows of 500 ppm drift */
  G.clock_err_ns = env_u64("NCCL_EXPORTER_PROFILER_CLOCK_ERROR_US", 1000 + G.window_ns / 1000000ull, 1,
                           3600000000ull) * 1000ull;
  G.settle_ns = env_u64("NCCL_EXPORTER_PROFILER_SETTLE_MS", 1000, 1, 3600000) * 1000000ull;
  G.nslots = (uint32_t)env_u64("NCCL_EXPORTER_PROFILER_POOL", 4096, 16, MAX_POOL);
  G.slot_cap = (uint32_t)env_u64("NCCL_EXPORTER_PROFILER_POOL_MAX", 1u << 16, 16, MAX_POOL);
  if (G.slot_cap < G.nslots) G.slot_cap = G.nslots;
  G.slots = pool_reserve(G.slot_cap, sizeof *G.slots);
  if (!G.slots) { /* no address space for the reserve: the initial size, never grown */
    G.slot_cap = G.nslots;
    G.slots = pool_reserve(G.slot_cap, sizeof *G.slots);
  }
  if (!G.slots) {
    G.nslots = G.slot_cap = 0;
    disable("cannot allocate the record pool");
  }
  atomic_store(&G.next_id, 1);
  G.pid = (int)getpid();
  G.our_mask = OUR_MASK;
  G.proxy_on = G.slots && env_u64("NCCL_EXPORTER_PROFILER_PROXY", 1, 0, 1);
  const char *m = getenv("NCCL_EXPORTER_PROFILER_MASK");
  if (m && !strcmp(m, "counts")) {
    G.our_mask = COUNTS_MASK;
    G.proxy_on = 0;
  } else if (m && !strcmp(m, "gpu")) {
    G.proxy_on = 0;
  } else if (m && *m && strcmp(m, "net") && strcmp(m, "auto")) {
    logmsg(NXP_LOG_WARN, "nccl-exporter profiler: NCCL_EXPORTER_PROFILER_MASK=%s is not counts, gpu or net; "
           "using the default", m);
  }
  if (G.proxy_on) {
    G.npops = (uint32_t)env_u64("NCCL_EXPORTER_PROFILER_PROXY_POOL", 8192, 16, MAX_POOL);
    G.pop_cap = G.slot_cap > G.nslots ? 2 * G.slot_cap : G.npops;
    if (G.pop_cap < G.npops) G.pop_cap = G.npops;
    G.nets = pool_reserve(G.slot_cap, sizeof *G.nets);
    G.pops = pool_reserve(G.pop_cap, sizeof *G.pops);
    if (!G.nets || !G.pops) {
      pool_free(G.nets, G.slot_cap, sizeof *G.nets);
      pool_free(G.pops, G.pop_cap, sizeof *G.pops);
      G.nets = NULL;
      G.pops = NULL;
      G.npops = 0;
      G.proxy_on = 0;
      logmsg(NXP_LOG_WARN, "nccl-exporter profiler: cannot allocate the proxy pools; no network figures");
    }
  }
  if (G.proxy_on) G.our_mask |= PROXY_MASK;
  open_log();
  load_chain();
  if (G.chain) {
    G.nwraps = G.nslots ? 4 * G.nslots : 4096;
    G.wrap_cap = G.slot_cap ? 4 * G.slot_cap : G.nwraps;
    G.wraps = pool_reserve(G.wrap_cap, sizeof *G.wraps);
    if (!G.wraps) G.nwraps = G.wrap_cap = 0;
  }
  G.initialized = 1;
}

nxp_result_t common_init(int ver, void **context, uint64_t hash, int *mask, const char *name, int nnodes,
                                int nranks, int rank, nxp_logger_t logfn) {
  if (context) *context = NULL;
  if (!context || !mask) return NXP_SUCCESS;
  pthread_mutex_lock(&G.lock);
  if (!G.initialized) global_init(logfn);
  pools_grow(nranks);
  G.nccl_mask = mask;
  struct ctx *c = ctx_alloc();
  if (!c) {
    int full = ctx_arena != NULL;
    pthread_mutex_unlock(&G.lock);
    if (full) logmsg(NXP_LOG_WARN, "nccl-exporter profiler: more than %d live communicators; comm 0x%" PRIx64
                     " is not profiled", CTX_MAX, hash);
    else disable("cannot allocate a communicator context");
    return NXP_SUCCESS; /* NULL context: NCCL sends nothing, calls no finalize */
  }
  c->magic = CTX_MAGIC;
  c->iface = ver;
  c->comm_hash = hash;
  c->rank = rank;
  c->nranks = nranks;
  c->nnodes = nnodes;
  if (name) snprintf(c->name, sizeof c->name, "%s", name);
  if (nranks > 0) {
    c->p2p_n = nranks > 65536 ? 65536 : (uint32_t)nranks;
    c->p2p_seq = calloc(2 * (size_t)c->p2p_n, sizeof *c->p2p_seq);
  }
  if (G.chain) {
    int r;
    if (G.chain_ver == 4)
      r = ((nxp_profiler_v4 *)G.chain)->init(&c->chain_ctx, &G.chain_mask, name, hash, nnodes, nranks, rank, logfn);
    else
      r = ((nxp_profiler_v5 *)G.chain)->init(&c->chain_ctx, hash, &G.chain_mask, name, nnodes, nranks, rank, logfn);
    c->chain_ok = (r == NXP_SUCCESS || (r == 7 && G.chain_ver <= 5));
    if (!c->chain_ok) logmsg(NXP_LOG_WARN, "nccl-exporter profiler: chained plugin init failed (%d); not forwarding for comm 0x%" PRIx64, r, hash);
  }
  /* OR ours (and the chained plugin's) into NCCL's process-wide mask. */
  if (!atomic_load(&G.disabled)) __atomic_fetch_or(mask, G.our_mask, __ATOMIC_RELAXED);
  if (G.chain) merge_masks();
  G.ncomms++;
  int first = G.ncomms == 1;
  pthread_mutex_unlock(&G.lock);
  int now_mask = __atomic_load_n(mask, __ATOMIC_RELAXED); /* another communicator's init may OR into it */

  if (first)
    logmsg(NXP_LOG_INFO, "nccl-exporter profiler: v%d, mask 0x%x, pool %u, proxy %s (pool %u), log %s, chain %s", ver,
           now_mask, G.nslots, G.proxy_on ? "on" : "off", G.npops, G.log_fd >= 0 ? "on" : "off", G.chain ? "on" : "off");
  if (first && ver >= 7 && (G.our_mask & NXP_EV_KERNEL_CH))
    logmsg(NXP_LOG_INFO, "nccl-exporter profiler: NCCL >= 2.31 (interface v7) also makes its kernels write "
           "per-phase timestamps and a fence when KernelCh is asked for (NVIDIA/nccl#2355: 4-13 %% GPU time on 2.31.2); "
           "NCCL_EXPORTER_PROFILER_MASK=counts asks for no KernelCh (operation counts, no GPU intervals)");
  struct nccl_exporter_comm ci = comm_record(c);
  hook_comm_init(&ci);
  if (G.log_fd >= 0) {
    char line[256];
    int n = snprintf(line, sizeof line, "nccl-exporter-profiler event=init comm=0x%016" PRIx64 " rank=%d nranks=%d nnodes=%d iface=v%d mask=0x%x chain=v%d pid=%d\n",
                     hash, rank, nranks, nnodes, ver, now_mask, G.chain_ver, (int)getpid());
    if (n > 0 && write(G.log_fd, line, (size_t)n) < 0) { /* best effort */ }
  }
  *context = c;
  announce_add(c);
  return NXP_SUCCESS;
}

nxp_result_t common_finalize(void *context) {
  struct ctx *c = as_ctx(context);
  if (!c) return NXP_SUCCESS;
  if (G.chain && c->chain_ok && G.chain->finalize) G.chain->finalize(c->chain_ctx);
  uint64_t now = mono_ns(), pending = 0;
  for (uint32_t i = 0; i < G.nslots; i++) {
    struct slot *s = &G.slots[i];
    if (atomic_load_explicit(&s->state, memory_order_acquire) == SLOT_LIVE && s->ctx == c) {
      pending++;
      release_at_finalize(s, now);
    }
  }
  if (G.pops) pops_reclaim(); /* its ProxyOps NCCL will not stop now */
  for (uint32_t i = 0; i < G.nwraps; i++) {
    struct wrap *w = &G.wraps[i];
    if (atomic_load(&w->used) && w->ctx == c) {
      w->ours = w->theirs = NULL;
      atomic_store(&w->used, 0);
    }
  }
  struct nccl_exporter_comm ci = comm_record(c);
  ci.pending = pending;
  hook_comm_fini(&ci);
  if (G.log_fd >= 0) {
    char line[640];
    int n = snprintf(line, sizeof line, "nccl-exporter-profiler event=finalize comm=0x%016" PRIx64 " rank=%d pending=%" PRIu64
                     " completed=%" PRIu64 " abandoned=%" PRIu64 " dropped=%" PRIu64 " stale=%" PRIu64 " rejected=%" PRIu64
                     " proxy_ops=%" PRIu64 " proxy_foreign=%" PRIu64 " proxy_late=%" PRIu64 " lost_channel=%" PRIu64
                     " net_unfinished=%" PRIu64 " proxy_reclaimed=%" PRIu64 " dup_stops=%" PRIu64 " pid=%d\n",
                     c->comm_hash, c->rank, pending, atomic_load(&G.completed), atomic_load(&G.abandoned),
                     atomic_load(&G.dropped), atomic_load(&G.stale), atomic_load(&G.rejected),
                     atomic_load(&G.proxy_ops), atomic_load(&G.proxy_foreign),
                     atomic_load(&G.proxy_late) + atomic_load(&G.proxy_orphan), atomic_load(&G.lost_channel),
                     atomic_load(&G.net_unfinished), atomic_load(&G.proxy_reclaimed), atomic_load(&G.dup_stops),
                     (int)getpid());
    if (n > 0 && write(G.log_fd, line, (size_t)n) < 0) { /* best effort */ }
  }
  announce_remove(c); /* before it is freed: the announcer reads it */
  pthread_mutex_lock(&G.lock);
  G.ncomms--;
  pthread_mutex_unlock(&G.lock);
  free((void *)c->p2p_seq);
  c->p2p_seq = NULL;
  ctx_release(c);
  return NXP_SUCCESS;
}

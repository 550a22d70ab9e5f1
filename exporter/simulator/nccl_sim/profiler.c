/* profiler.c -- GPU-like mode's switch (gpu_on), its drifting GPU timer, and NCCL's
 * side of the profiler plugin interface: the plugin loaded, counted and
 * closed as NCCL does, its init and finalize per communicator, NCCL's gating
 * by the activation mask, and the network proxy's events (netsteps.c). The
 * stream threads' events are gpu.c's. Nothing here runs with NCCL_SIM_GPU unset. */
#include "profiler.h"

sim_prof_t *g_prof;
int g_prof_ver;
int g_prof_mask;
static pthread_once_t g_prof_once = PTHREAD_ONCE_INIT;
static long long g_prof_starts, g_prof_nulls;
long long g_prof_purged_kch, g_prof_purged_ops;

int gpu_on(void) {
  static int v = -1;
  if (v < 0) v = env_int("NCCL_SIM_GPU", 0) ? 1 : 0;
  return v;
}

/* ---- the GPU timer: %globaltimer-like, offset from CLOCK_MONOTONIC and drifting */
static uint64_t g_t0;
static int64_t g_timer_off;
static double g_drift_ppm;
static pthread_once_t g_timer_once = PTHREAD_ONCE_INIT;
static void timer_setup(void) {
  g_t0 = now_ns(CLOCK_MONOTONIC);
  const char *o = getenv("NCCL_SIM_GPU_TIMER_OFFSET_NS");
  g_timer_off = (o && *o) ? strtoll(o, NULL, 0) : 1700000000000000000ll;
  const char *d = getenv("NCCL_SIM_GPU_DRIFT_PPM");
  g_drift_ppm = (d && *d) ? atof(d) : 200.0;
}
uint64_t gpu_timer(uint64_t mono) {
  pthread_once(&g_timer_once, timer_setup);
  int64_t dt = (int64_t)(mono - g_t0);
  return (uint64_t)((int64_t)mono + g_timer_off + (int64_t)((double)dt * g_drift_ppm * 1e-6));
}


static void sim_logger(int level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags; (void)file; (void)line;
  const char *dbg = getenv("NCCL_DEBUG");
  if (level > 2 && !(dbg && (!strcasecmp(dbg, "INFO") || !strcasecmp(dbg, "TRACE")))) return;
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stderr, "NCCL %s %s\n", level <= 2 ? "WARN" : "INFO", buf);
}

static void *g_prof_dl;
static void prof_load(void) {
  const char *p = getenv("NCCL_PROFILER_PLUGIN");
  if (!gpu_on() || !p || !*p) return;
  void *dl = dlopen(p, RTLD_NOW | RTLD_LOCAL);
  if (!dl) { sim_logger(3, 0, __FILE__, __LINE__, "PROFILER/Plugin: Could not find: %s (%s)", p, dlerror()); return; }
  g_prof_dl = dl;
  int maxv = env_int("NCCL_SIM_GPU_PROFILER_VERSION", 7);
  for (int v = 7; v >= 4; v--) {      /* newest first, as NCCL does */
    if (v > maxv) continue;
    char sym[32];
    snprintf(sym, sizeof sym, "ncclProfiler_v%d", v);
    sim_prof_t *t = dlsym(dl, sym);
    if (t) { g_prof = t; g_prof_ver = v; break; }
  }
  if (g_prof) sim_logger(3, 0, __FILE__, __LINE__, "PROFILER/Plugin: Loaded %s (v%d)", g_prof->name ? g_prof->name : "?", g_prof_ver);
  else sim_logger(3, 0, __FILE__, __LINE__, "PROFILER/Plugin: %s has no ncclProfiler_v4..v%d", p, maxv);
}

/* NCCL's load count (NCCL_SIM_GPU_UNLOAD=1; without it the plugin is loaded
 * once and never closed). NCCL v2.28.9-1 src/plugin/profiler.cc:107-119
 * (ncclProfilerPluginUnload): every ncclProfilerPluginFinalize (:201-211)
 * drops the count and at 0 dlcloses the plugin and forgets it; init.cc:336
 * (commFree) calls that finalize for every communicator, also one whose init
 * failed before ncclProfilerPluginInit (init.cc:1251) and so never loaded it:
 * the count goes out of balance and NCCL closes the plugin under live
 * communicators. NCCL_SIM_GPU_FAILED_INIT=N plays N such communicators'
 * commFree, after the first profiler init. On 2.30.x an init that
 * returns an error unloads at once (v2.30.7-1 profiler.cc:253) and again in
 * commFree (:268): NCCL_SIM_GPU_INIT_ERROR_UNLOADS=1. */
static pthread_mutex_t g_prof_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_prof_refs;
static int prof_unload_on(void) {
  static int v = -1;
  if (v < 0) v = env_int("NCCL_SIM_GPU_UNLOAD", 0) ? 1 : 0;
  return v;
}
static void prof_acquire(void) {
  if (!prof_unload_on()) { pthread_once(&g_prof_once, prof_load); return; }
  pthread_mutex_lock(&g_prof_mu);
  if (g_prof_refs++ == 0 && !g_prof) prof_load();
  pthread_mutex_unlock(&g_prof_mu);
}
static void prof_release(void) {
  if (!prof_unload_on()) return;
  pthread_mutex_lock(&g_prof_mu);
  if (--g_prof_refs == 0 && g_prof_dl) {
    sim_logger(3, 0, __FILE__, __LINE__, "PROFILER/Plugin: Closing profiler plugin %s", g_prof && g_prof->name ? g_prof->name : "?");
    g_prof = NULL;
    dlclose(g_prof_dl);
    g_prof_dl = NULL;
  }
  pthread_mutex_unlock(&g_prof_mu);
}

/* NCCL's gating: is an event of type t started, given the mask? */
static int prof_gated(uint64_t t) {
  const int net = EV_PROXY_OP | EV_PROXY_STEP | EV_KERNEL_CH | EV_NET_PLUGIN;
  int m = __atomic_load_n(&g_prof_mask, __ATOMIC_RELAXED);
  switch (t) {
    case EV_GROUP_API: return (m & (EV_GROUP_API | EV_P2P_API | EV_COLL_API | EV_KERNEL_LAUNCH | EV_GROUP | EV_COLL | EV_P2P | net)) != 0;
    case EV_COLL_API: return (m & (EV_COLL_API | EV_COLL | net)) != 0;
    case EV_P2P_API: return (m & (EV_P2P_API | EV_P2P | net)) != 0;
    case EV_GROUP: return (m & (EV_GROUP | EV_COLL | EV_P2P | net)) != 0;
    case EV_COLL: return (m & (EV_COLL | net)) != 0;
    case EV_P2P: return (m & (EV_P2P | net)) != 0;
    default: return (m & (int)t) != 0;
  }
}

/* v4/v5 descriptors are not zeroed by NCCL: garbage in what the event type does not set. */
void d_init(sim_descr_t *d, uint64_t type, void *parent, int rank) {
  memset(d, g_prof_ver <= 5 ? 0xA5 : 0, sizeof *d);
  if (g_prof_ver == 4) *(uint8_t *)d = (uint8_t)type; else d->type = type;
  d->parentObj = parent; d->rank = rank;
}
static uint64_t d_type(const sim_descr_t *d) { return g_prof_ver == 4 ? *(const uint8_t *)d : d->type; }

/* startEvent with the given context: the communicator's own, or (PXN) another process's */
static void *p_start_ctx(ncclComm_t c, void *ctx, sim_descr_t *d) {
  uint64_t t = d_type(d);
  if (!g_prof || !c->prof_inited || !prof_gated(t)) return NULL;
  if (g_prof_ver == 4 && (t & (EV_GROUP_API | EV_COLL_API | EV_P2P_API | EV_KERNEL_LAUNCH))) return NULL;
  void *h = (void *)0xdeadbeef; /* NCCL's slot may hold a stale value: the plugin must write it */
  __atomic_fetch_add(&g_prof_starts, 1, __ATOMIC_RELAXED);
  g_prof->startEvent(ctx, &h, d);
  if (!h) __atomic_fetch_add(&g_prof_nulls, 1, __ATOMIC_RELAXED);
  return h;                     /* NULL: NCCL makes no further call for this event */
}
void *p_start(ncclComm_t c, sim_descr_t *d) { return p_start_ctx(c, c->prof_ctx, d); }
void p_stop(void *h) { if (g_prof && h) g_prof->stopEvent(h); }
void p_record(void *h, int st, uint64_t ptimer, int null_args) {
  if (!g_prof || !h) return;
  sim_state_args_t a;
  memset(&a, g_prof_ver <= 5 ? 0xA5 : 0, sizeof a);
  a.kernelCh.pTimer = ptimer;
  g_prof->recordEventState(h, st, null_args ? NULL : &a);
}

/* ---- the network proxy's events (netsteps.c calls them on the proxy thread) */
__thread void *tl_net_parent;   /* the stream thread's current Coll (gpu.c, run_kernel) */
__thread int tl_net_kind;
__thread uint64_t tl_net_seq;

/* Network transfers in steps on the proxy thread (netsteps.c): GPU-like mode,
 * unless NCCL_SIM_GPU_NET_STEPS=0. */
int gpu_net_steps(void) {
  static int v = -1;
  if (v < 0) v = gpu_on() && env_int("NCCL_SIM_GPU_NET_STEPS", 1) ? 1 : 0;
  return v;
}
/* A transfer of the stream thread's current collective: its parent and identity. */
void gpu_net_op(p2p_t *o) {
  if (o->parent || o->okind) return;
  o->parent = tl_net_parent;
  o->okind = tl_net_kind;
  o->oseq = tl_net_seq;
}
void *gpu_proxy_op_start(ncclComm_t c, void *parent, int pid, int ch, int peer, int nsteps, int chunk, int is_send) {
  if (!g_prof || !c->prof_inited) return NULL;
  if (parent == NULL && pid == (int)getpid()) return NULL; /* NCCL: no Coll handle, no proxy events */
  sim_descr_t d;
  d_init(&d, EV_PROXY_OP, parent, c->rank);
  d.proxyOp.pid = pid; d.proxyOp.channelId = (uint8_t)ch; d.proxyOp.peer = peer; d.proxyOp.nSteps = nsteps;
  d.proxyOp.chunkSize = chunk; d.proxyOp.isSend = is_send;
  return p_start(c, &d);
}
void *gpu_proxy_step_start(ncclComm_t c, void *op, int step) {
  if (!op) return NULL;
  sim_descr_t d;
  d_init(&d, EV_PROXY_STEP, op, c->rank);
  d.proxyStep.step = step;
  return p_start(c, &d);
}
/* PXN (NCCL_SIM_GPU_PXN=1): a ProxyOp that another process posted into this
 * process's proxy carries that process's profiler context and parent handle
 * (NCCL 2.28.9: the sender sets op->profilerContext, src/enqueue.cc:1275; it
 * travels in the shared proxy pool, src/proxy.cc:385 `sub->profilerContext =
 * op->profilerContext`; ncclProfilerStartProxyOpEvent passes it to
 * startEvent, src/plugin/profiler.cc:493). Its ProxySteps follow even when
 * the ProxyOp start returned NULL: parentObj = sub->opEventHandle (NULL) and
 * the same foreign context (src/plugin/profiler.cc:516-541). Here the foreign
 * context is an address of an inaccessible page: a plugin that reads through
 * it crashes, as it would on a real node. */
static void *g_foreign_ctx;
static pthread_once_t g_foreign_once = PTHREAD_ONCE_INIT;
static void foreign_setup(void) {
  void *p = mmap(NULL, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  g_foreign_ctx = p == MAP_FAILED ? (void *)(uintptr_t)0x10 : p;
}
void *gpu_foreign_ctx(void) {
  pthread_once(&g_foreign_once, foreign_setup);
  return g_foreign_ctx;
}
void *gpu_proxy_op_start_ctx(ncclComm_t c, void *ctx, void *parent, int pid, int ch, int peer, int nsteps, int chunk,
                             int is_send) {
  if (!g_prof || !c->prof_inited) return NULL;
  sim_descr_t d;
  d_init(&d, EV_PROXY_OP, parent, c->rank);
  d.proxyOp.pid = pid; d.proxyOp.channelId = (uint8_t)ch; d.proxyOp.peer = peer; d.proxyOp.nSteps = nsteps;
  d.proxyOp.chunkSize = chunk; d.proxyOp.isSend = is_send;
  return p_start_ctx(c, ctx, &d);
}
/* A ProxyStep start whatever the ProxyOp start returned (NULL included). */
void *gpu_proxy_step_start_ctx(ncclComm_t c, void *ctx, void *op, int step) {
  sim_descr_t d;
  d_init(&d, EV_PROXY_STEP, op, c->rank);
  d.proxyStep.step = step;
  return p_start_ctx(c, ctx, &d);
}
void gpu_proxy_record(void *h, int state, size_t trans_size) {
  if (!g_prof || !h) return;
  sim_state_args_t a;
  memset(&a, g_prof_ver <= 5 ? 0xA5 : 0, sizeof a);
  a.proxyStep.transSize = trans_size;
  g_prof->recordEventState(h, state, &a);
}
void gpu_proxy_stop(void *h) { p_stop(h); }

void gpu_truth_simple(const char *fn, const char *op, ncclComm_t c, const char *extra) {
  uint64_t m = now_ns(CLOCK_MONOTONIC), r = now_ns(CLOCK_REALTIME);
  rec_t rec = {fn, op, (uint64_t)(uintptr_t)c, c ? c->rank : -1, c ? c->nranks : -1, 0, -1, -1, -1, -1, 0,
               m, m, r, r, 0, extra};
  truth_write(&rec);
}

/* Called once a communicator exists (init, split): profiler init with its identity. */
void gpu_comm_ready(ncclComm_t c) {
  if (!gpu_on() || !c) return;
  if (!c->p2p_seq) c->p2p_seq = calloc(2 * (size_t)c->nranks, sizeof(uint64_t));
  prof_acquire();
  char extra[160];
  snprintf(extra, sizeof extra, ",\"comm_hash\":\"%016llx\"", (unsigned long long)c->nccl_hash);
  gpu_truth_simple("gpuCommReady", "GPU_COMM_READY", c, extra);
  if (!g_prof) return;
  int r;
  int nnodes = env_int("NCCL_SIM_GPU_NNODES", c->nranks);
  if (g_prof_ver == 4) r = ((prof_init_v4_t)g_prof->init)(&c->prof_ctx, &g_prof_mask, NULL, c->nccl_hash, nnodes, c->nranks, c->rank, sim_logger);
  else r = ((prof_init_v5_t)g_prof->init)(&c->prof_ctx, c->nccl_hash, &g_prof_mask, NULL, nnodes, c->nranks, c->rank, sim_logger);
  if (r != 0) {
    sim_logger(2, 0, __FILE__, __LINE__, "PROFILER/Plugin: init failed (%d)", r);
    if (env_int("NCCL_SIM_GPU_INIT_ERROR_UNLOADS", 0)) prof_release(); /* 2.30.x; commFree unloads again */
    return;
  }
  c->prof_inited = 1;
  static int failed_once;
  int nfailed = env_int("NCCL_SIM_GPU_FAILED_INIT", 0);
  if (nfailed > 0 && !__atomic_exchange_n(&failed_once, 1, __ATOMIC_RELAXED))
    for (int i = 0; i < nfailed; i++) {
      gpu_truth_simple("failedCommFree", "FAILED_COMM_FREE", c, "");
      prof_release(); /* a communicator that never loaded the plugin unloads it (init.cc:336) */
    }
  snprintf(extra, sizeof extra, ",\"comm_hash\":\"%016llx\",\"iface\":%d,\"mask\":%d", (unsigned long long)c->nccl_hash,
           g_prof_ver, __atomic_load_n(&g_prof_mask, __ATOMIC_RELAXED));
  gpu_truth_simple("profilerInit", "PROFILER_INIT", c, extra);
}

/* The plugin's finalize for a communicator destroyed or aborted (its stream
 * stopped first: gpu_comm_teardown), then NCCL's unload count. */
void prof_comm_finalize(ncclComm_t c, int abort) {
  if (c->prof_inited) {
    c->prof_inited = 0;
    char extra[256];
    snprintf(extra, sizeof extra, ",\"comm_hash\":\"%016llx\",\"abort\":%d,\"starts\":%lld,\"null_handles\":%lld,"
             "\"purged_kernelch\":%lld,\"purged_ops\":%lld", (unsigned long long)c->nccl_hash, abort,
             __atomic_load_n(&g_prof_starts, __ATOMIC_RELAXED), __atomic_load_n(&g_prof_nulls, __ATOMIC_RELAXED),
             __atomic_load_n(&g_prof_purged_kch, __ATOMIC_RELAXED), __atomic_load_n(&g_prof_purged_ops, __ATOMIC_RELAXED));
    if (g_prof) g_prof->finalize(c->prof_ctx); /* NCCL: only while it holds the plugin */
    c->prof_ctx = NULL;
    gpu_truth_simple("profilerFinalize", "PROFILER_FINALIZE", c, extra);
  }
  prof_release(); /* commFree: always (init.cc:336) */
}

/*
 * state.c -- process-wide state (G), the log line through NCCL's logger,
 * the communicators' contexts, the environment's settings and the pools'
 * memory (reserved at the first init, grown at each, freed at unload).
 */
#include "internal.h" /* first: it includes glibc_floor.h before any system header */

struct plugin_state G = {.lock = PTHREAD_MUTEX_INITIALIZER, .log_fd = -1};
struct ctx *ctx_arena;
uint32_t ctx_used;

void logmsg(int level, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (G.logfn) G.logfn(level, 0x4001 /* NCCL_INIT|NCCL_PROFILE */, __FILE__, __LINE__, "%s", buf);
  else if (level == NXP_LOG_WARN) fprintf(stderr, "%s\n", buf);
}

/* Disable our part for good; one line through NCCL's logger. */
void disable(const char *why) {
  int expected = 0;
  if (atomic_compare_exchange_strong(&G.disabled, &expected, 1))
    logmsg(NXP_LOG_WARN, "nccl-exporter profiler: disabled: %s (NCCL continues; chained plugin, if any, still runs)", why);
}

/* ------------------------------------------------------------------------ */
/* Contexts                                                                */

/* Contexts live in one array of ours (ctx_alloc), so that a context pointer
 * NCCL passes can be checked before it is read: a ProxyOp or ProxyStep that
 * another process posted through PXN carries *that* process's context
 * (NCCL 2.28.9 src/enqueue.cc:1275, src/proxy.cc:385, src/plugin/profiler.cc:493
 * and 516-541), an address that may be unmapped here. */
/* ctx_arena: [CTX_MAX], allocated at the first init, kept until unload;
 * ctx_used: entries handed out at least once (G.lock) */
static uint32_t ctx_free_n;            /* ctx_free_list[0..n): reusable entries (G.lock) */
static uint32_t *ctx_free_list;

struct ctx *as_ctx(void *p) {
  uintptr_t a = (uintptr_t)p, base = (uintptr_t)ctx_arena;
  if (!p || !base || a < base || a >= base + CTX_MAX * sizeof(struct ctx) || (a - base) % sizeof(struct ctx))
    return NULL; /* not one of ours: never read through it */
  struct ctx *c = p;
  return c->magic == CTX_MAGIC ? c : NULL;
}

/* Under G.lock. */
struct ctx *ctx_alloc(void) {
  if (!ctx_arena) {
    ctx_arena = calloc(CTX_MAX, sizeof *ctx_arena);
    ctx_free_list = calloc(CTX_MAX, sizeof *ctx_free_list);
    if (!ctx_arena || !ctx_free_list) {
      free(ctx_arena);
      free(ctx_free_list);
      ctx_arena = NULL;
      ctx_free_list = NULL;
      return NULL;
    }
  }
  struct ctx *c = NULL;
  if (ctx_free_n) c = &ctx_arena[ctx_free_list[--ctx_free_n]];
  else if (ctx_used < CTX_MAX) c = &ctx_arena[ctx_used++];
  if (c) memset(c, 0, sizeof *c);
  return c;
}

void ctx_release(struct ctx *c) {
  pthread_mutex_lock(&G.lock);
  c->magic = 0;
  ctx_free_list[ctx_free_n++] = (uint32_t)(c - ctx_arena);
  pthread_mutex_unlock(&G.lock);
}


uint64_t env_u64(const char *name, uint64_t dflt, uint64_t lo, uint64_t hi) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end;
  errno = 0;
  unsigned long long x = strtoull(v, &end, 0);
  if (errno || *end) return dflt;
  return x < lo ? lo : x > hi ? hi : x;
}

/* The pools (record slots and their network tables, ProxyOps, chain
 * wrappers) are reserved at the first init for their largest size
 * (NCCL_EXPORTER_PROFILER_POOL_MAX records, default 65,536: address space
 * only, MAP_NORESERVE; a page costs memory once a slot on it is first used)
 * and used up to a size that grows at each communicator's init, off the
 * event path (pools_grow). Readers see the size grow, never shrink. */
void *pool_reserve(size_t n, size_t size) {
  if (!n) return NULL;
  void *p = mmap(NULL, n * size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}
void pool_free(void *p, size_t n, size_t size) {
  if (p) munmap(p, n * size);
}

/* One ncclAlltoAll is 2 x nranks P2P tasks (NCCL v2.28.9-1 src/enqueue.cc:2585-2588),
 * each a record with one ProxyOp per channel and direction it uses: room for
 * two of them enqueued ahead of the GPU, 8 x nranks records and twice as many
 * ProxyOps (at least the configured sizes). Under G.lock. */
void pools_grow(int nranks) {
  if (nranks <= 0 || !G.slots) return;
  uint64_t want = 8ull * (uint64_t)nranks;
  if (want > G.slot_cap) want = G.slot_cap;
  if (want > G.nslots) {
    logmsg(NXP_LOG_INFO, "nccl-exporter profiler: record pool %u -> %u for %d ranks", G.nslots, (uint32_t)want, nranks);
    __atomic_store_n(&G.nslots, (uint32_t)want, __ATOMIC_RELEASE);
  }
  if (G.pops && 2ull * G.nslots > G.npops)
    __atomic_store_n(&G.npops, 2 * G.nslots > G.pop_cap ? G.pop_cap : 2 * G.nslots, __ATOMIC_RELEASE);
  if (G.wraps && 4ull * G.nslots > G.nwraps)
    __atomic_store_n(&G.nwraps, 4 * G.nslots > G.wrap_cap ? G.wrap_cap : 4 * G.nslots, __ATOMIC_RELEASE);
}

/* dlclose by NCCL after the last communicator: give the memory back. */
__attribute__((destructor)) static void nxp_unload(void) {
  if (G.ncomms > 0) return; /* process exit with live comms: leave everything */
  pool_free(G.slots, G.slot_cap, sizeof *G.slots);
  pool_free(G.wraps, G.wrap_cap, sizeof *G.wraps);
  pool_free(G.nets, G.slot_cap, sizeof *G.nets);
  pool_free(G.pops, G.pop_cap, sizeof *G.pops);
  G.nets = NULL;
  G.pops = NULL;
  G.npops = 0;
  G.slots = NULL;
  G.wraps = NULL;
  G.nslots = G.nwraps = G.slot_cap = G.pop_cap = G.wrap_cap = 0;
  if (G.log_fd >= 0) close(G.log_fd);
  G.log_fd = -1;
  if (G.chain_dl) dlclose(G.chain_dl);
  G.chain_dl = NULL;
  free(ctx_arena);
  free(ctx_free_list);
  ctx_arena = NULL;
  ctx_free_list = NULL;
  ctx_free_n = ctx_used = 0;
  G.chain = NULL;
}

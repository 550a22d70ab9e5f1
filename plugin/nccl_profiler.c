/*
 * nccl_profiler.c -- nccl-exporter's NCCL profiler plugin.
 *
 * Computes, per collective and per P2p operation, the GPU interval (earliest
 * KernelCh start timer .. latest KernelCh stop timer) and hands one record
 * per state change to empty exported hook functions that the agent uprobes
 * (see nccl_exporter_plugin.h).  Exports ncclProfiler_v7, _v6, _v5 and _v4:
 * every interface version that carries GPU timestamps.
 *
 * Design notes (details in docs/plugin.md):
 *  - Handles we return are not pointers: bit 63 set, a slot index, the slot's
 *    generation and a sub-index (0 = the Coll/P2p itself, c+1 = KernelCh of
 *    channel c).  A stale or foreign handle is detected (generation mismatch)
 *    and ignored instead of being dereferenced.
 *  - Slots come from one fixed pool allocated at the first init; allocation
 *    is a lock-free CAS scan from a rotating cursor.  A slot lives until the
 *    Coll/P2p was stopped (= enqueued) and all its expected KernelCh children
 *    were stopped, or until finalize / age-out reclaims it.
 *  - No locks, no malloc, no syscalls per event (clock_gettime is the vDSO);
 *    the optional log file costs one write(2) per completed operation.
 *  - Chain-loading: NCCL_EXPORTER_PROFILER_CHAIN=/path/plugin.so is dlopened
 *    and every callback is forwarded to it, converted to its newest supported
 *    interface version, with its handles kept apart from ours.
 */
#include "glibc_floor.h" /* first: binds libc calls to versions glibc 2.17 has */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "nccl_exporter_plugin.h"
#include "profiler_abi.h"

#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

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

_Static_assert(sizeof(struct nccl_exporter_record) == 144, "record layout");
_Static_assert(offsetof(struct nccl_exporter_record, comm_hash) == 16, "record layout");
_Static_assert(offsetof(struct nccl_exporter_record, gpu_start_timer) == 64, "record layout");
_Static_assert(offsetof(struct nccl_exporter_record, rank) == 104, "record layout");
_Static_assert(offsetof(struct nccl_exporter_record, kind) == 120, "record layout");
_Static_assert(offsetof(struct nccl_exporter_record, op_name) == 128, "record layout");
_Static_assert(sizeof(struct nccl_exporter_comm) == 80, "comm layout");
_Static_assert(sizeof(struct nccl_exporter_peer_wait) == 64, "peer wait layout");
_Static_assert(offsetof(struct nccl_exporter_net, e) == 32 && sizeof(struct nccl_exporter_net) == 672, "net layout");
_Static_assert(offsetof(struct nccl_exporter_done, net) == 144 && sizeof(struct nccl_exporter_done) == 816,
               "done record layout");
_Static_assert(sizeof(nxp_descr_v4) == 104 && sizeof(nxp_descr_v5) == 112 &&
               sizeof(nxp_descr_v6) == 112 && sizeof(nxp_descr_v7) == 136, "descriptor sizes");

/* ------------------------------------------------------------------------ */
/* Hooks: empty on purpose, exported, opaque to the compiler (noipa: every   */
/* call is kept and the record is in memory before it).                     */
/*                                                                          */
/* On x86-64 a hook is a 5-byte nop and a ret, and the agent's uprobe sits  */
/* on the nop. A kernel that optimizes uprobes (this project's 6.18 does)   */
/* rewrites that nop into a call to its uprobe trampoline after the first   */
/* hit: ~0.2 us a hit on this VM, against ~14 us for an int3 trap followed  */
/* by a single-step of a `ret`, which x86 uprobes cannot emulate            */
/* (bench/plugin_cost.py, docs/plugin.md "Cost"). That call pushes a return */
/* address below rsp; at a function's entry nothing lives there. A kernel   */
/* without the optimization single-steps the nop as it did the ret.         */
/* tests/test_plugin_abi.py checks the bytes of the built library.          */

#if defined(__x86_64__)
#define HOOK __attribute__((visibility("default"), naked, noipa, used))
#define HOOK_BODY { __asm__ volatile(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00\n\tret"); }
#else
#define HOOK __attribute__((visibility("default"), noipa, used))
#define HOOK_BODY { __asm__ volatile("" ::: "memory"); }
#endif

HOOK void nccl_exporter_coll_queued(const struct nccl_exporter_record *r) HOOK_BODY
HOOK void nccl_exporter_gpu_start(const struct nccl_exporter_record *r) HOOK_BODY
HOOK void nccl_exporter_gpu_done(const struct nccl_exporter_record *r) HOOK_BODY
HOOK void nccl_exporter_abandoned(const struct nccl_exporter_record *r) HOOK_BODY
HOOK void nccl_exporter_comm_init(const struct nccl_exporter_comm *r) HOOK_BODY
HOOK void nccl_exporter_comm_fini(const struct nccl_exporter_comm *r) HOOK_BODY
HOOK void nccl_exporter_comm_live(const struct nccl_exporter_comm *r) HOOK_BODY
/* Direct (non-PLT) calls to the same addresses the uprobes attach to. */
extern void hook_coll_queued(const struct nccl_exporter_record *r) __attribute__((visibility("hidden"), alias("nccl_exporter_coll_queued")));
extern void hook_gpu_start(const struct nccl_exporter_record *r) __attribute__((visibility("hidden"), alias("nccl_exporter_gpu_start")));
extern void hook_gpu_done(const struct nccl_exporter_record *r) __attribute__((visibility("hidden"), alias("nccl_exporter_gpu_done")));
extern void hook_abandoned(const struct nccl_exporter_record *r) __attribute__((visibility("hidden"), alias("nccl_exporter_abandoned")));
extern void hook_comm_init(const struct nccl_exporter_comm *r) __attribute__((visibility("hidden"), alias("nccl_exporter_comm_init")));
extern void hook_comm_fini(const struct nccl_exporter_comm *r) __attribute__((visibility("hidden"), alias("nccl_exporter_comm_fini")));
extern void hook_comm_live(const struct nccl_exporter_comm *r) __attribute__((visibility("hidden"), alias("nccl_exporter_comm_live")));

/* ------------------------------------------------------------------------ */
/* Process-wide state                                                      */

#define CTX_MAGIC 0x6e786370u /* "nxcp" */
#define MAX_POOL (1u << 22)

struct clk {            /* GPU timer -> CLOCK_MONOTONIC offset estimator */
  _Atomic int64_t cur_min;     /* min(mono_at_delivery - timer) this window */
  _Atomic int64_t prev_min;    /* previous window's min */
  _Atomic uint64_t win_start;  /* mono ns when this window began */
  _Atomic uint32_t nsamples;
};

struct ctx {
  uint32_t magic;
  int iface;            /* version NCCL called init through */
  uint64_t comm_hash;
  int rank, nranks, nnodes;
  char name[32];
  void *chain_ctx;      /* the chained plugin's context for this comm */
  int chain_ok;         /* chained init succeeded */
  struct clk clk;
  _Atomic uint64_t batch_a, batch_b; /* the last done interval not shared (shared_with_last) */
  _Atomic uint64_t *p2p_seq; /* [2 * p2p_n]: per (peer, send/recv) order */
  uint32_t p2p_n;
  /* operations in start order (slot.ord), for sweep(): */
  _Atomic uint64_t ord_next;
  _Atomic uint64_t kch_done_ord; /* 1 + the newest ord whose every KernelCh stopped (0: none) */
  uint64_t sweep_min_run;        /* sweep(): the oldest ord with a KernelCh running (UINT64_MAX: none) */
};

struct slot {
  _Atomic uint32_t state;   /* FREE, LIVE, CLOSING */
  _Atomic uint32_t gen;     /* bumped on every allocation; part of handles */
  struct ctx *ctx;
  void *theirs;             /* chained plugin's handle for this Coll/P2p */
  _Atomic int32_t refs;     /* 1 (the event) + expected KernelCh children */
  _Atomic uint32_t started, stopped;
  _Atomic uint32_t finished; /* done or abandoned already emitted */
  _Atomic uint32_t flags;
  _Atomic uint64_t min_start, max_stop;
  _Atomic uint64_t first_start_host;
  _Atomic uint64_t first_start_timer; /* pTimer of the first KernelCh start delivered */
  uint64_t created;         /* mono ns */
  /* proxy accounting: the done record waits for the ProxyOps too */
  _Atomic int32_t proxy_open;   /* ProxyOps started and not stopped */
  _Atomic uint32_t kch_done;    /* every expected KernelCh stopped */
  _Atomic uint32_t net_used;    /* G.nets[this slot] holds this operation's figures */
  _Atomic uint32_t pending_ch;  /* F_CHANNELS_UNKNOWN: holds a reference until its channels stopped */
  uint32_t done_reject;         /* judge()'s verdict at the last KernelCh stop */
  uint64_t done_now;            /* and when */
  /* NCCL <= 2.30 can stop a KernelCh through the handle of an older operation
   * (see sweep()): each channel's start, stop state and stopEvent count once */
  _Atomic uint64_t ch_started[4], ch_stopped[4], ch_released[4];
  uint64_t ord;                 /* this operation's place in its communicator's start order */
  uint64_t lost_since;          /* sweep(): first seen with a channel that will never come (0: not) */
  struct nccl_exporter_record rec; /* the static part, filled at start */
};
enum { SLOT_FREE = 0, SLOT_LIVE = 1, SLOT_CLOSING = 2 };

struct wrap {               /* chain mode: a KernelCh handle of both plugins */
  _Atomic uint32_t used;
  struct ctx *ctx;
  void *ours;
  void *theirs;
};

static struct {
  pthread_mutex_t lock;     /* init/finalize only */
  int initialized;
  _Atomic int disabled;
  nxp_logger_t logfn;
  int *nccl_mask;           /* NCCL's process-wide activation mask */
  struct slot *slots;
  uint32_t nslots;          /* in use; grows at init up to slot_cap (pools_grow) */
  uint32_t slot_cap;        /* reserved: slots[], nets[] */
  uint32_t pop_cap;         /* reserved: pops[] */
  uint32_t wrap_cap;        /* reserved: wraps[] */
  _Atomic uint32_t cursor;
  struct wrap *wraps;
  uint32_t nwraps;
  _Atomic uint32_t wcursor;
  _Atomic uint64_t next_id;
  _Atomic uint64_t dropped, stale, abandoned, completed, wrap_dropped, rejected;
  _Atomic uint64_t last_sweep;
  uint64_t max_age_ns;
  uint64_t window_ns;
  uint64_t clock_err_ns;    /* tolerance of the plausibility checks (judge) */
  _Atomic int phase_warned; /* the chained plugin's KernelPhase WARN was logged */
  int log_fd;
  int ncomms;
  int our_mask;             /* OUR_MASK, | PROXY_MASK with proxy accounting on */
  int proxy_on;
  int pid;                  /* ours: a ProxyOp of another pid (PXN) is not ours */
  int pinned;               /* RTLD_NODELETE took: the announcer may run (pin_self) */
  struct net_tab *nets;     /* [nslots]: per operation, by slot index (proxy on) */
  struct pop *pops;         /* ProxyOp pool (proxy on) */
  uint32_t npops;
  _Atomic uint32_t pcursor;
  _Atomic uint64_t proxy_ops, proxy_foreign, proxy_orphan, proxy_late, proxy_dropped;
  _Atomic uint64_t lost_channel, net_unfinished, proxy_reclaimed, dup_stops;
  uint64_t settle_ns;       /* how long a stop NCCL may never send is waited for (sweep) */
  /* chain */
  void *chain_dl;
  int chain_ver;            /* 4..7, 0 = none */
  nxp_profiler_any *chain;
  int chain_mask;           /* the chained plugin's own mask variable */
  _Atomic int chain_mask_seen;
  _Atomic int chain_types;  /* event types NCCL would send it, from its mask */
} G = {.lock = PTHREAD_MUTEX_INITIALIZER, .log_fd = -1};

static struct ctx *ctx_arena; /* the communicators' contexts (as_ctx, ctx_alloc) */
static uint32_t ctx_used;

static inline uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void logmsg(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void logmsg(int level, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (G.logfn) G.logfn(level, 0x4001 /* NCCL_INIT|NCCL_PROFILE */, __FILE__, __LINE__, "%s", buf);
  else if (level == NXP_LOG_WARN) fprintf(stderr, "%s\n", buf);
}

/* Disable our part for good; one line through NCCL's logger. */
static void disable(const char *why) {
  int expected = 0;
  if (atomic_compare_exchange_strong(&G.disabled, &expected, 1))
    logmsg(NXP_LOG_WARN, "nccl-exporter profiler: disabled: %s (NCCL continues; chained plugin, if any, still runs)", why);
}

/* ------------------------------------------------------------------------ */
/* Names                                                                   */

/* exporter op codes: exporter/contract.py COLLECTIVE_OPS */
static uint8_t op_code(const char *f) {
  if (!f) return 0;
  switch (f[0]) {
  case 'A':
    if (!strcmp(f, "AllReduce")) return 1;
    if (!strcmp(f, "AllGather")) return 2;
    if (!strcmp(f, "AlltoAll") || !strcmp(f, "AllToAll")) return 8;
    return 0;
  case 'R':
    if (!strcmp(f, "ReduceScatter")) return 3;
    if (!strcmp(f, "Reduce")) return 5;
    if (!strcmp(f, "Recv")) return 7;
    return 0;
  case 'B': return strcmp(f, "Broadcast") ? 0 : 4;
  case 'S':
    if (!strcmp(f, "Send")) return 6;
    if (!strcmp(f, "Scatter")) return 10;
    return 0;
  case 'G': return strcmp(f, "Gather") ? 0 : 9;
  }
  return 0;
}

/* ncclDataType_t from NCCL's datatype string; *size = bytes per element. */
static uint8_t dtype_code(const char *d, unsigned *size, uint32_t *flags) {
  static const struct { const char *n; uint8_t code, size; } T[] = {
    {"ncclInt8", 0, 1},     {"ncclUint8", 1, 1},     {"ncclInt32", 2, 4},  {"ncclUint32", 3, 4},
    {"ncclInt64", 4, 8},    {"ncclUint64", 5, 8},    {"ncclFloat16", 6, 2}, {"ncclFloat32", 7, 4},
    {"ncclFloat64", 8, 8},  {"ncclBfloat16", 9, 2},  {"ncclFloat8e4m3", 10, 1}, {"ncclFloat8e5m2", 11, 1},
  };
  if (d && d[0] == 'n' && d[1] == 'c' && d[2] == 'c' && d[3] == 'l') {
    for (unsigned i = 0; i < sizeof T / sizeof T[0]; i++)
      if (!strcmp(d + 4, T[i].n + 4)) { *size = T[i].size; return T[i].code; }
  }
  /* NCCL's ncclDatatypeToString has no case for ncclUint8: "Unknown". */
  if (d && !strcmp(d, "Unknown")) { *size = 1; *flags |= NCCL_EXPORTER_F_DTYPE_GUESSED; return 1; }
  *size = 0;
  return 255;
}

/* NCCL's func/datatype strings are static literals: remember the decoded
 * value per string address.  One 64-bit word per entry, (address << 16) |
 * (a << 8) | b, so concurrent readers never see a torn entry. */
#define NAME_CACHE 64
static _Atomic uint64_t op_cache[NAME_CACHE], dt_cache[NAME_CACHE];

static inline unsigned name_slot(const char *p) { return (unsigned)(((uintptr_t)p >> 3) * 0x9E3779B1u >> 26) % NAME_CACHE; }

static uint8_t op_code_cached(const char *f) {
  uintptr_t a = (uintptr_t)f;
  if (!f || a >> 47) return op_code(f);
  _Atomic uint64_t *e = &op_cache[name_slot(f)];
  uint64_t v = atomic_load_explicit(e, memory_order_relaxed);
  if (v && (v >> 16) == a) return (uint8_t)(v >> 8);
  uint8_t c = op_code(f);
  atomic_store_explicit(e, ((uint64_t)a << 16) | ((uint64_t)c << 8), memory_order_relaxed);
  return c;
}

static uint8_t dtype_code_cached(const char *d, unsigned *size, uint32_t *flags) {
  uintptr_t a = (uintptr_t)d;
  if (!d || a >> 47) return dtype_code(d, size, flags);
  _Atomic uint64_t *e = &dt_cache[name_slot(d)];
  uint64_t v = atomic_load_explicit(e, memory_order_relaxed);
  if (v && (v >> 16) == a) {
    uint8_t code = (uint8_t)(v >> 8);
    *size = (unsigned)(v & 0x7f);
    if (v & 0x80) *flags |= NCCL_EXPORTER_F_DTYPE_GUESSED;
    return code;
  }
  uint32_t fl = 0;
  uint8_t c = dtype_code(d, size, &fl);
  *flags |= fl;
  atomic_store_explicit(e, ((uint64_t)a << 16) | ((uint64_t)c << 8) | (fl ? 0x80 : 0) | (*size & 0x7f),
                        memory_order_relaxed);
  return c;
}

/* ------------------------------------------------------------------------ */
/* Clock mapping                                                           */

/* Every KernelCh delivery gives one upper bound of (mono - gpu timer): the
 * host sees a timer only after the GPU wrote it.  The smallest bound over a
 * sliding window (two windows of window_ns, default 200 ms) is the estimate; it is late by
 * the smallest delivery lag (the poll interval of NCCL's profiler/proxy
 * thread) and follows drift within 2 windows. */
static void clk_sample(struct clk *c, uint64_t timer, uint64_t now) {
  int64_t s = (int64_t)(now - timer);
  uint64_t ws = atomic_load_explicit(&c->win_start, memory_order_relaxed);
  if (UNLIKELY(ws == 0 || now - ws > G.window_ns)) {
    int64_t cur = atomic_load_explicit(&c->cur_min, memory_order_relaxed);
    /* after an idle gap the previous window is too old to trust: start afresh */
    atomic_store_explicit(&c->prev_min, (ws && now - ws <= 2 * G.window_ns) ? cur : s, memory_order_relaxed);
    atomic_store_explicit(&c->cur_min, s, memory_order_relaxed);
    atomic_store_explicit(&c->win_start, now, memory_order_relaxed);
  } else {
    int64_t cur = atomic_load_explicit(&c->cur_min, memory_order_relaxed);
    while (s < cur && !atomic_compare_exchange_weak_explicit(&c->cur_min, &cur, s, memory_order_relaxed,
                                                             memory_order_relaxed)) {
    }
  }
  atomic_fetch_add_explicit(&c->nsamples, 1, memory_order_relaxed);
}

static int64_t clk_offset(struct clk *c) {
  int64_t a = atomic_load_explicit(&c->cur_min, memory_order_relaxed);
  int64_t b = atomic_load_explicit(&c->prev_min, memory_order_relaxed);
  return a < b ? a : b;
}

/* ------------------------------------------------------------------------ */
/* Handles                                                                 */

#define H_OURS (1ull << 63)
#define H_PROXY (1ull << 62) /* a ProxyOp (sub 0) or ProxyStep (sub 1 + step % 64) handle: G.pops */
#define H_GEN 0x3fffffffu
static inline void *h_make(uint32_t idx, uint32_t gen, uint32_t sub) {
  return (void *)(uintptr_t)(H_OURS | ((uint64_t)(gen & H_GEN) << 32) | ((uint64_t)idx << 9) | sub);
}
static inline int h_is_proxy(void *h) { return ((uintptr_t)h & (H_OURS | H_PROXY)) == (H_OURS | H_PROXY); }
static inline int h_is_ours(void *h) { return ((uintptr_t)h & H_OURS) != 0; }
/* What we return for a Group event: one constant, never a slot (index beyond
 * MAX_POOL), ignored at its stop. NCCL bumps seqNumber for a graph-captured
 * plan only when the plugin gave it a Group or CollApi handle (v2.28.9-1
 * src/plugin/profiler.cc:419-427); with NULL every replay of a captured
 * collective came with the same seqNumber as the replay before. With a handle
 * each replay has its own number, the same on every rank (KernelCh makes
 * NCCL run the plan's host callback at every replay on every rank). */
#define H_GROUP ((void *)(uintptr_t)(H_OURS | (0x7fffffull << 9)))
_Static_assert(MAX_POOL <= 0x7fffff, "the Group handle's index is beyond any slot");

/* The live slot a handle refers to, or NULL (stale/foreign). */
static inline struct slot *h_slot(void *h, uint32_t *sub) {
  uint64_t v = (uintptr_t)h;
  if (!(v & H_OURS) || (v & H_PROXY)) return NULL;
  uint32_t idx = (uint32_t)((v >> 9) & 0x7fffffu);
  if (idx >= G.nslots) return NULL;
  struct slot *s = &G.slots[idx];
  if ((atomic_load_explicit(&s->gen, memory_order_acquire) & H_GEN) != (uint32_t)((v >> 32) & H_GEN) ||
      atomic_load_explicit(&s->state, memory_order_acquire) != SLOT_LIVE) {
    uint64_t st = atomic_fetch_add_explicit(&G.stale, 1, memory_order_relaxed) + 1;
    /* A few stale handles are normal (age-out under pressure); a flood means
     * our bookkeeping and NCCL's disagree: stop rather than guess. */
    if (UNLIKELY(st >= 100000 && st > 10 * atomic_load_explicit(&G.completed, memory_order_relaxed)))
      disable("most handles NCCL passes back are unknown to the plugin");
    return NULL;
  }
  *sub = (uint32_t)(v & 0x1ff);
  return s;
}

/* ------------------------------------------------------------------------ */
/* Records                                                                 */

static void snapshot(struct slot *s, struct nccl_exporter_record *r, uint8_t state, uint64_t now) {
  *r = s->rec;
  r->state = state;
  r->host_event_mono_ns = now;
  uint32_t started = atomic_load_explicit(&s->started, memory_order_relaxed);
  uint32_t stopped = atomic_load_explicit(&s->stopped, memory_order_relaxed);
  r->channels_started = started > 255 ? 255 : (uint8_t)started;
  r->channels_stopped = stopped > 255 ? 255 : (uint8_t)stopped;
  r->flags |= atomic_load_explicit(&s->flags, memory_order_relaxed);
  uint64_t a = atomic_load_explicit(&s->min_start, memory_order_relaxed);
  uint64_t b = atomic_load_explicit(&s->max_stop, memory_order_relaxed);
  r->gpu_start_timer = a == UINT64_MAX ? 0 : a;
  r->gpu_stop_timer = b;
  struct clk *c = &s->ctx->clk;
  uint32_t n = atomic_load_explicit(&c->nsamples, memory_order_relaxed);
  if (n) {
    int64_t off = clk_offset(c);
    r->gpu_to_mono_offset_ns = off;
    if (r->gpu_start_timer) r->gpu_start_mono_ns = r->gpu_start_timer + (uint64_t)off;
    if (r->gpu_stop_timer) r->gpu_stop_mono_ns = r->gpu_stop_timer + (uint64_t)off;
    if (n < 2) r->flags |= NCCL_EXPORTER_F_OFFSET_COARSE;
  }
  if (!r->gpu_stop_timer) r->flags |= NCCL_EXPORTER_F_NO_GPU_TIME;
}

static const char *state_name(uint8_t st) {
  switch (st) {
  case NCCL_EXPORTER_STATE_DONE: return "done";
  case NCCL_EXPORTER_STATE_ABANDONED: return "abandoned";
  case NCCL_EXPORTER_STATE_RUNNING: return "running";
  default: return "queued";
  }
}

static const char *const PHASE_NAMES[2][NCCL_EXPORTER_NET_PHASES] = {
  {"send_gpu_wait", "send_peer_wait", "send_wait"},      /* contract.NETWORK_PHASES */
  {"recv_wait", "recv_flush_wait", "recv_gpu_wait"},
};

/* Logging mode: one line per (peer, direction) of a done record's network part. */
static void log_net(const struct nccl_exporter_record *r, const struct nccl_exporter_net *net) {
  for (uint32_t i = 0; i < net->nentries && i < NCCL_EXPORTER_NET_ENTRIES; i++) {
    const struct nccl_exporter_peer_wait *w = &net->e[i];
    const char *const *ph = PHASE_NAMES[w->direction ? 1 : 0];
    char line[640], peer[16] = "other";
    if (w->peer >= 0) snprintf(peer, sizeof peer, "%d", w->peer);
    int n = snprintf(line, sizeof line,
                     "nccl-exporter-profiler event=peer_wait op=%s comm=0x%016" PRIx64 " rank=%d seq=%" PRIu64
                     " id=%" PRIu64 " peer=%s direction=%s bytes=%" PRIu64
                     " %s_wall_ns=%" PRIu64 " %s_wall_ns=%" PRIu64 " %s_wall_ns=%" PRIu64
                     " %s_step_ns=%" PRIu64 " %s_step_ns=%" PRIu64 " %s_step_ns=%" PRIu64 " net_flags=0x%x pid=%d\n",
                     r->op_name[0] ? r->op_name : "?", r->comm_hash, r->rank, r->seq, r->id,
                     peer, w->direction ? "recv" : "send", w->bytes,
                     ph[0], w->wall_ns[0], ph[1], w->wall_ns[1], ph[2], w->wall_ns[2],
                     ph[0], w->step_ns[0], ph[1], w->step_ns[1], ph[2], w->step_ns[2], net->flags, (int)getpid());
    if (n > 0 && write(G.log_fd, line, (size_t)(n < (int)sizeof line ? n : (int)sizeof line - 1)) < 0) { /* best effort */ }
  }
}

static void log_record(const struct nccl_exporter_record *r) {
  if (G.log_fd < 0) return;
  char line[768];
  uint64_t gpu_ns = (r->gpu_stop_timer && r->gpu_start_timer && r->gpu_stop_timer >= r->gpu_start_timer)
                        ? r->gpu_stop_timer - r->gpu_start_timer : 0;
  int n = snprintf(line, sizeof line,
                   "nccl-exporter-profiler event=%s kind=%s op=%s opcode=%u comm=0x%016" PRIx64 " rank=%d nranks=%d"
                   " seq=%" PRIu64 " peer=%d count=%" PRIu64 " bytes=%" PRIu64 " dtype=%u"
                   " enqueue_mono_ns=%" PRIu64 " gpu_start_timer=%" PRIu64 " gpu_stop_timer=%" PRIu64
                   " gpu_ns=%" PRIu64 " gpu_start_mono_ns=%" PRIu64 " gpu_stop_mono_ns=%" PRIu64
                   " offset_ns=%" PRId64 " channels=%u/%u/%u flags=0x%x iface=v%u id=%" PRIu64 " pid=%d\n",
                   state_name(r->state), r->kind == NCCL_EXPORTER_KIND_P2P ? "p2p" : "coll",
                   r->op_name[0] ? r->op_name : "?", r->op, r->comm_hash, r->rank, r->nranks, r->seq, r->peer,
                   r->count, r->bytes, r->datatype, r->host_enqueue_mono_ns, r->gpu_start_timer, r->gpu_stop_timer,
                   gpu_ns, r->gpu_start_mono_ns, r->gpu_stop_mono_ns, r->gpu_to_mono_offset_ns,
                   r->channels_started, r->channels_stopped, r->nchannels, r->flags, r->iface_version, r->id,
                   (int)getpid());
  if (n > 0) {
    ssize_t w = write(G.log_fd, line, (size_t)(n < (int)sizeof line ? n : (int)sizeof line - 1));
    (void)w;
  }
}

static void net_fill(struct slot *s, struct nccl_exporter_net *out);
static void net_clear(uint32_t idx);

/* Batched collectives share one interval: the kernel writes one start and one
 * stop timer for all the work items of a batch on a channel, read in one loop
 * (NCCL v2.28.9-1 src/device/common.h:309-327), so N collectives of one batch
 * report the same interval, within the loop's few ns. A done interval whose
 * start and stop both lie within SHARED_NS of the communicator's last
 * unshared done interval is that one's: flagged F_SHARED, it counts once (the
 * agent leaves it out of sums and histograms). Two operations run one after
 * the other cannot match unless the first lasted under SHARED_NS. */
#define SHARED_NS 1000
static int shared_with_last(struct ctx *c, uint64_t a, uint64_t b) {
  if (!a || !b) return 0;
  uint64_t pa = atomic_load_explicit(&c->batch_a, memory_order_relaxed);
  uint64_t pb = atomic_load_explicit(&c->batch_b, memory_order_relaxed);
  if (pa && (a > pa ? a - pa : pa - a) <= SHARED_NS && (b > pb ? b - pb : pb - b) <= SHARED_NS) return 1;
  atomic_store_explicit(&c->batch_a, a, memory_order_relaxed);
  atomic_store_explicit(&c->batch_b, b, memory_order_relaxed);
  return 0;
}

/* Emit done/abandoned exactly once.  With proxy accounting on, a done record
 * carries the network part (struct nccl_exporter_done). */
static void finish(struct slot *s, uint8_t state, uint32_t extra_flags, uint64_t now) {
  if (atomic_exchange_explicit(&s->finished, 1, memory_order_acq_rel)) return;
  struct nccl_exporter_done d;
  struct nccl_exporter_record *rp = &d.r;
#define r (*rp)
  snapshot(s, &r, state, now);
  r.flags |= extra_flags;
  if (state == NCCL_EXPORTER_STATE_DONE) {
    uint64_t fsh = atomic_load_explicit(&s->first_start_host, memory_order_relaxed);
    if (fsh && !(extra_flags & NCCL_EXPORTER_F_REJECTED) && r.gpu_stop_timer > r.gpu_start_timer &&
        (now - fsh) + 20000 < r.gpu_stop_timer - r.gpu_start_timer)
      r.flags |= NCCL_EXPORTER_F_START_LATE;
    if (!(r.flags & NCCL_EXPORTER_F_REJECTED) && shared_with_last(s->ctx, r.gpu_start_timer, r.gpu_stop_timer))
      r.flags |= NCCL_EXPORTER_F_SHARED;
    atomic_fetch_add_explicit(&G.completed, 1, memory_order_relaxed);
    if (G.proxy_on) {
      net_fill(s, &d.net);
      r.size = sizeof d;
    }
    hook_gpu_done(&r);
  } else {
    r.flags &= ~NCCL_EXPORTER_F_OFFSET_COARSE;
    atomic_fetch_add_explicit(&G.abandoned, 1, memory_order_relaxed);
    hook_abandoned(&r);
  }
  log_record(&r);
  if (G.log_fd >= 0 && r.size == sizeof d) log_net(&r, &d.net);
#undef r
}

/* Return a slot to the pool (exactly one caller wins the LIVE->CLOSING CAS). */
static void release(struct slot *s, uint32_t abandon_flags, uint64_t now) {
  uint32_t live = SLOT_LIVE;
  if (!atomic_compare_exchange_strong(&s->state, &live, SLOT_CLOSING)) return;
  if (!atomic_load(&s->finished)) finish(s, NCCL_EXPORTER_STATE_ABANDONED, abandon_flags, now ? now : mono_ns());
  atomic_fetch_add_explicit(&s->gen, 1, memory_order_release); /* outstanding handles go stale */
  atomic_store_explicit(&s->state, SLOT_FREE, memory_order_release);
}

static inline void unref(struct slot *s) {
  if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) == 1) release(s, 0, 0);
}

static void pops_reclaim(void);
static inline int ch_test(_Atomic uint64_t *m, unsigned ch) {
  return (atomic_load_explicit(&m[(ch >> 6) & 3], memory_order_relaxed) >> (ch & 63)) & 1;
}
/* Set channel ch's bit; 1 if it was set already. */
static inline int ch_set(_Atomic uint64_t *m, unsigned ch) {
  uint64_t bit = 1ull << (ch & 63);
  return (atomic_fetch_or_explicit(&m[(ch >> 6) & 3], bit, memory_order_acq_rel) & bit) != 0;
}

/* Records NCCL will never complete, found by a periodic sweep (at most every
 * 100 ms: from an operation's start at most every 250 ms, from the announcer
 * thread each period, and when the pool is full):
 *  - older than NCCL_EXPORTER_PROFILER_MAX_AGE_S: abandoned (F_AGED) when the
 *    pool is full; without that pressure only if it cannot be a real hang
 *    (aged_out below): a collective whose kernel runs, or waits to start, for
 *    minutes is what the agent's hang alerts must keep seeing in flight
 *    (docs/alerts.md, NcclCollectiveHung and NcclGpuQueueStalled). A
 *    CHANNELS_UNKNOWN operation (CollNet/NVLS) no KernelCh ever ran for is
 *    NCCL giving it nothing to time: counted done, F_UNTIMED, not abandoned;
 *  - a lost channel (NCCL <= 2.30, transport/profiler.cc:35-44 in 2.28.9): in
 *    one pass of profilerProxyProgress the start check can miss a channel's
 *    start and the stop check, a moment later, see its stop; the stop then goes
 *    out through sub->kernelEventHandle, which still holds the handle of the
 *    operation that used those sub-args before (proxy.cc:358-388 never resets
 *    it), and that args is done: the operation never gets that channel's start
 *    or stop. The older operation's second stop is ignored (ch_stopped). An
 *    operation is taken as lost when none of its channels runs, no older one
 *    of its communicator runs, and either some of its channels ended or a
 *    newer operation of its communicator had every channel stop (kernels of
 *    one communicator end in order), all that for
 *    NCCL_EXPORTER_PROFILER_SETTLE_MS: done with F_REJECT_LOST_CHANNEL (its
 *    interval is partial: counted by that reason). One that lost every
 *    channel with nothing after it in its communicator waits for MAX_AGE;
 *  - ProxyOps never stopped (2.28.9: proxy.cc:427 starts one for every non-
 *    profiler pattern, only transport/net.cc:1364,1635 stop them; CollNet and
 *    the SHM/P2P copy-engine modes never do): once the last KernelCh stopped,
 *    open ProxyOps hold the done record back for SETTLE_MS at most, then it
 *    goes out with F_NET_UNFINISHED and the slot is reclaimed;
 *  - ProxyOp entries whose operation was reclaimed (finalize, age-out, the
 *    cases above) go back to their pool. */
/* t at least d before now. Another thread may have stored t after this one
 * read now: a t later than now is never old (unsigned now - t would wrap). */
static inline int older_than(uint64_t now, uint64_t t, uint64_t d) { return now > t && now - t >= d; }

/* The sweep ends a slot it found LIVE with generation gen0: claimed by the
 * LIVE -> CLOSING CAS, unless the operation ended and the slot went to another
 * one meanwhile (then it is put back at once, untouched). Emits the record
 * (state DONE or ABANDONED, with flags) unless it went out already. */
static void sweep_end(struct slot *s, uint32_t gen0, uint8_t state, uint32_t flags, uint64_t now) {
  uint32_t live = SLOT_LIVE;
  if (!atomic_compare_exchange_strong(&s->state, &live, SLOT_CLOSING)) return;
  if (atomic_load(&s->gen) != gen0) {
    atomic_store_explicit(&s->state, SLOT_LIVE, memory_order_release);
    return;
  }
  if (!atomic_load(&s->finished)) finish(s, state, flags, now);
  atomic_fetch_add_explicit(&s->gen, 1, memory_order_release); /* outstanding handles go stale */
  atomic_store_explicit(&s->state, SLOT_FREE, memory_order_release);
}

static void sweep(uint64_t now, int pressure) {
  uint64_t last = atomic_load(&G.last_sweep);
  if (last >= now || (now - last < 100000000ull && !(pressure && now - last >= 10000000ull))) return;
  if (!atomic_compare_exchange_strong(&G.last_sweep, &last, now)) return;
  for (uint32_t i = 0; ctx_arena && i < ctx_used; i++) ctx_arena[i].sweep_min_run = UINT64_MAX;
  for (uint32_t i = 0; i < G.nslots; i++) { /* the oldest running operation per communicator */
    struct slot *s = &G.slots[i];
    if (atomic_load_explicit(&s->state, memory_order_acquire) != SLOT_LIVE) continue;
    if (atomic_load_explicit(&s->started, memory_order_relaxed) > atomic_load_explicit(&s->stopped, memory_order_relaxed) &&
        s->ord < s->ctx->sweep_min_run)
      s->ctx->sweep_min_run = s->ord;
  }
  for (uint32_t i = 0; i < G.nslots; i++) {
    struct slot *s = &G.slots[i];
    uint32_t gen0 = atomic_load_explicit(&s->gen, memory_order_acquire);
    if (atomic_load_explicit(&s->state, memory_order_acquire) != SLOT_LIVE) continue;
    if (older_than(now, s->created, G.max_age_ns + 1)) {
      int untimed = (s->rec.flags & NCCL_EXPORTER_F_CHANNELS_UNKNOWN) && !atomic_load(&s->started);
      if (untimed) {
        sweep_end(s, gen0, NCCL_EXPORTER_STATE_DONE, NCCL_EXPORTER_F_UNTIMED, now);
        continue;
      }
      if (pressure) {
        sweep_end(s, gen0, NCCL_EXPORTER_STATE_ABANDONED, NCCL_EXPORTER_F_AGED, now);
        continue;
      }
    }
    if (atomic_load(&s->finished)) continue;
    if (atomic_load(&s->kch_done)) {
      if (atomic_load(&s->proxy_open) > 0 && older_than(now, s->done_now, G.settle_ns)) {
        atomic_fetch_add_explicit(&G.net_unfinished, 1, memory_order_relaxed);
        sweep_end(s, gen0, NCCL_EXPORTER_STATE_DONE, s->done_reject | NCCL_EXPORTER_F_NET_UNFINISHED, now);
      }
      continue;
    }
    struct ctx *c = s->ctx;
    uint32_t started = atomic_load_explicit(&s->started, memory_order_relaxed);
    uint32_t stopped = atomic_load_explicit(&s->stopped, memory_order_relaxed);
    /* nothing of it runs, nothing older of its communicator runs, and either
     * some of its channels ended (its kernel ran) or a newer operation of its
     * communicator ended (kernels of one communicator end in order) */
    int lost = started <= stopped && c->sweep_min_run > s->ord &&
               (stopped > 0 || atomic_load_explicit(&c->kch_done_ord, memory_order_relaxed) > s->ord + 1);
    if (!lost) {
      s->lost_since = 0;
    } else if (!s->lost_since) {
      s->lost_since = now;
    } else if (older_than(now, s->lost_since, G.settle_ns)) {
      atomic_fetch_add_explicit(&G.lost_channel, 1, memory_order_relaxed);
      atomic_fetch_add_explicit(&G.rejected, 1, memory_order_relaxed);
      sweep_end(s, gen0, NCCL_EXPORTER_STATE_DONE, NCCL_EXPORTER_F_REJECT_LOST_CHANNEL, now);
    }
  }
  if (G.pops) pops_reclaim();
}

static struct slot *slot_alloc(uint64_t now, uint32_t *idx_out) {
  for (int pass = 0; pass < 2; pass++) {
    for (uint32_t tries = 0; tries < G.nslots; tries++) {
      uint32_t i = atomic_fetch_add_explicit(&G.cursor, 1, memory_order_relaxed) % G.nslots;
      struct slot *s = &G.slots[i];
      uint32_t f = SLOT_FREE;
      if (atomic_load_explicit(&s->state, memory_order_relaxed) == SLOT_FREE &&
          atomic_compare_exchange_strong_explicit(&s->state, &f, SLOT_CLOSING, memory_order_acquire,
                                                  memory_order_relaxed)) {
        *idx_out = i;
        return s; /* CLOSING until the caller publishes it LIVE */
      }
    }
    if (pass == 0) sweep(now, 1);
  }
  if (atomic_fetch_add_explicit(&G.dropped, 1, memory_order_relaxed) == 0)
    logmsg(NXP_LOG_WARN, "nccl-exporter profiler: record pool (%u) exhausted; operations are dropped and counted "
           "(NCCL_EXPORTER_PROFILER_POOL)", G.nslots);
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* Our event logic (version independent)                                   */

struct ev {               /* the fields we use, read from any version */
  uint64_t type;
  void *parent;
  /* coll / p2p */
  uint64_t seq;
  const char *func, *datatype;
  size_t count;
  int root_or_peer;
  unsigned nchannels;
  /* kernelCh */
  unsigned channel;
  uint64_t ptimer;
  /* proxyOp / proxyStep */
  int pid, peer, is_send, step;
};

static void *ours_start_op(struct ctx *c, const struct ev *e) {
  if (UNLIKELY(atomic_load_explicit(&G.disabled, memory_order_relaxed) || !G.slots)) return NULL;
  unsigned nch = e->nchannels;
  uint32_t fl = 0;
  /* Without KernelCh events (the counts mask, or a RAS override of NCCL's
   * mask) no GPU interval can come: counted, untimed, done at its enqueue. */
  if (UNLIKELY(G.nccl_mask && !(__atomic_load_n(G.nccl_mask, __ATOMIC_RELAXED) & NXP_EV_KERNEL_CH))) {
    nch = 0;
    fl = NCCL_EXPORTER_F_UNTIMED;
  } else if (e->type == NXP_EV_P2P && e->root_or_peer == c->rank && c->iface <= 6) {
    /* NCCL <= 2.30 (interface <= v6): a rank's Send/Recv to itself gets no
     * proxy op, hence no profiler proxy op and no KernelCh events (v2.28.9-1
     * src/enqueue.cc:805 nProxyOps = selfSend ? 0 : 2; :1010-1019). Counted,
     * untimed, done at its enqueue: it must not stay in flight. */
    nch = 0;
    fl = NCCL_EXPORTER_F_UNTIMED;
  } else if (nch == 0) {
    /* CollNet (and NVLS): NCCL never sets the task's nChannels (v2.28.9-1
     * src/enqueue.cc:568-597), yet adds a profiler proxy op per channel whose
     * KernelCh events take this handle as parent: count the channels as they
     * come; done once every one started so far stopped. */
    fl = NCCL_EXPORTER_F_CHANNELS_UNKNOWN;
  }
  uint64_t now = mono_ns();
  if (UNLIKELY(older_than(now, atomic_load_explicit(&G.last_sweep, memory_order_relaxed), 250000000ull))) sweep(now, 0);
  uint32_t idx;
  struct slot *s = slot_alloc(now, &idx);
  if (!s) return NULL;
  uint32_t gen = atomic_fetch_add_explicit(&s->gen, 1, memory_order_relaxed) + 1;
  if ((gen & H_GEN) == 0) gen = atomic_fetch_add_explicit(&s->gen, 1, memory_order_relaxed) + 1;
  s->ctx = c;
  s->theirs = NULL;
  s->created = now;
  /* CHANNELS_UNKNOWN: one reference for the channels to come (pending_ch) */
  atomic_store_explicit(&s->refs, 1 + (int32_t)nch + ((fl & NCCL_EXPORTER_F_CHANNELS_UNKNOWN) ? 1 : 0),
                        memory_order_relaxed);
  atomic_store_explicit(&s->pending_ch, (fl & NCCL_EXPORTER_F_CHANNELS_UNKNOWN) ? 1 : 0, memory_order_relaxed);
  atomic_store_explicit(&s->started, 0, memory_order_relaxed);
  atomic_store_explicit(&s->stopped, 0, memory_order_relaxed);
  atomic_store_explicit(&s->finished, 0, memory_order_relaxed);
  atomic_store_explicit(&s->flags, 0, memory_order_relaxed);
  atomic_store_explicit(&s->min_start, UINT64_MAX, memory_order_relaxed);
  atomic_store_explicit(&s->max_stop, 0, memory_order_relaxed);
  atomic_store_explicit(&s->first_start_host, 0, memory_order_relaxed);
  atomic_store_explicit(&s->first_start_timer, 0, memory_order_relaxed);
  atomic_store_explicit(&s->proxy_open, 0, memory_order_relaxed);
  atomic_store_explicit(&s->kch_done, 0, memory_order_relaxed);
  atomic_store_explicit(&s->net_used, 0, memory_order_relaxed);
  for (int k = 0; k < 4; k++) {
    atomic_store_explicit(&s->ch_started[k], 0, memory_order_relaxed);
    atomic_store_explicit(&s->ch_stopped[k], 0, memory_order_relaxed);
    atomic_store_explicit(&s->ch_released[k], 0, memory_order_relaxed);
  }
  s->ord = atomic_fetch_add_explicit(&c->ord_next, 1, memory_order_relaxed);
  s->lost_since = 0;
  if (G.proxy_on) net_clear(idx); /* here, before any ProxyOp: several proxy threads may fill it (net_entry) */

  struct nccl_exporter_record *r = &s->rec;
  memset(r, 0, sizeof *r);
  r->version = NCCL_EXPORTER_RECORD_VERSION;
  r->size = sizeof *r;
  r->id = atomic_fetch_add_explicit(&G.next_id, 1, memory_order_relaxed);
  r->comm_hash = c->comm_hash;
  r->rank = c->rank;
  r->nranks = c->nranks;
  r->iface_version = (uint8_t)c->iface;
  r->nchannels = (uint8_t)nch;
  r->count = e->count;
  r->host_enqueue_mono_ns = now;
  unsigned esize = 0;
  r->datatype = dtype_code_cached(e->datatype, &esize, &fl);
  r->bytes = (uint64_t)e->count * esize;
  r->op = op_code_cached(e->func);
  if (e->func) {
    size_t n = strnlen(e->func, sizeof r->op_name - 1);
    memcpy(r->op_name, e->func, n);
  }
  if (e->type == NXP_EV_COLL) {
    r->kind = NCCL_EXPORTER_KIND_COLL;
    r->seq = e->seq;
    r->peer = (r->op == 4 || r->op == 5) ? e->root_or_peer : -1; /* Broadcast/Reduce have a root */
  } else {
    r->kind = NCCL_EXPORTER_KIND_P2P;
    r->peer = e->root_or_peer;
    if (c->p2p_seq && e->root_or_peer >= 0) {
      uint32_t k = ((uint32_t)e->root_or_peer % c->p2p_n) * 2 + (r->op == 7);
      r->seq = atomic_fetch_add_explicit(&c->p2p_seq[k], 1, memory_order_relaxed);
    }
  }
  r->flags = fl;
  atomic_store_explicit(&s->state, SLOT_LIVE, memory_order_release);

  struct nccl_exporter_record q;
  snapshot(s, &q, NCCL_EXPORTER_STATE_QUEUED, now);
  q.flags &= ~(NCCL_EXPORTER_F_NO_GPU_TIME | NCCL_EXPORTER_F_OFFSET_COARSE);
  hook_coll_queued(&q);
  return h_make(idx, gen, 0);
}

static void *ours_start_kch(struct ctx *c, const struct ev *e) {
  uint32_t sub;
  struct slot *s = h_slot(e->parent, &sub);
  if (!s || sub != 0) return NULL;
  uint32_t idx = (uint32_t)(((uintptr_t)e->parent >> 9) & 0x7fffffu);
  void *h = h_make(idx, (uint32_t)((uintptr_t)e->parent >> 32) & H_GEN, 1 + (e->channel & 0xff));
  if (ch_set(s->ch_started, e->channel)) return h; /* this channel started already: counted once */
  uint64_t cur = atomic_load_explicit(&s->min_start, memory_order_relaxed);
  while (e->ptimer < cur && !atomic_compare_exchange_weak_explicit(&s->min_start, &cur, e->ptimer,
                                                                   memory_order_relaxed, memory_order_relaxed)) {
  }
  uint32_t n = atomic_fetch_add_explicit(&s->started, 1, memory_order_acq_rel);
  if (n >= s->rec.nchannels) { /* more children than announced: keep the slot for them too */
    if (s->rec.nchannels) atomic_fetch_or_explicit(&s->flags, NCCL_EXPORTER_F_EXTRA_CHANNELS, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->refs, 1, memory_order_acq_rel);
  }
  if (n == 0) {
    /* One host clock read per operation start (not per channel): the RUNNING
     * hook's time, and a clock sample kept until the operation ends (judge():
     * only a plausible interval's timers feed the offset estimator). */
    uint64_t now = mono_ns();
    (void)c;
    atomic_store_explicit(&s->first_start_timer, e->ptimer, memory_order_relaxed);
    atomic_store_explicit(&s->first_start_host, now, memory_order_relaxed);
    struct nccl_exporter_record r;
    snapshot(s, &r, NCCL_EXPORTER_STATE_RUNNING, now);
    r.flags &= ~NCCL_EXPORTER_F_NO_GPU_TIME;
    hook_gpu_start(&r);
  }
  return h;
}

/* Is the finished operation's GPU interval plausible against the host's own
 * times?  0, or the one NCCL_EXPORTER_F_REJECT_* reason (docs/plugin.md,
 * "Implausible GPU intervals").  NCCL >= 2.29 maps KernelCh timers onto the
 * wrong operation after a Broadcast it ran without an activation mask
 * (NCCL_ALLGATHERV_ENABLE=1, the default: NVIDIA/nccl#2368): seconds-long
 * intervals, starts long before the operation was enqueued, stops before
 * starts.  Checked in this order:
 *   REVERSED  latest stop timer < earliest start timer;
 *   LONG      stop - start > (now - host enqueue) + E: the GPU cannot have
 *             worked longer than the host knew of the operation (needs no
 *             clock mapping; drift over one interval is ppm);
 *   EARLY     the start mapped to CLOCK_MONOTONIC lies more than E before the
 *             host enqueue.  The mapping is the offset estimate including this
 *             operation's own two samples: it errs late, never early, except by
 *             drift staleness (2 windows x drift).
 * E = clock_err_ns: 1 ms + 2 windows x 500 ppm (1.2 ms at 200 ms windows), or
 * NCCL_EXPORTER_PROFILER_CLOCK_ERROR_US.  The 1 ms is for the enqueue time:
 * NCCL starts the Coll event on the host thread just after it launched the
 * kernel (enqueue.cc: ncclLaunchKernelAfter_NoCuda -> hostStreamPlanTask), so
 * a kernel may start a little before its "enqueue", more if that thread is
 * preempted in between. */
static uint32_t judge(struct slot *s, uint64_t last_ptimer, uint64_t now) {
  uint64_t a = atomic_load_explicit(&s->min_start, memory_order_relaxed);
  uint64_t b = atomic_load_explicit(&s->max_stop, memory_order_relaxed);
  if (a == UINT64_MAX || !b) return 0; /* nothing to judge (no start timer seen) */
  if (b < a) return NCCL_EXPORTER_F_REJECT_REVERSED;
  uint64_t enq = s->rec.host_enqueue_mono_ns;
  if (b - a > (now - enq) + G.clock_err_ns) return NCCL_EXPORTER_F_REJECT_LONG;
  int64_t off = (int64_t)(now - last_ptimer);
  uint64_t fst = atomic_load_explicit(&s->first_start_timer, memory_order_relaxed);
  uint64_t fsh = atomic_load_explicit(&s->first_start_host, memory_order_relaxed);
  if (fsh && (int64_t)(fsh - fst) < off) off = (int64_t)(fsh - fst);
  struct clk *c = &s->ctx->clk;
  if (atomic_load_explicit(&c->nsamples, memory_order_relaxed)) {
    int64_t est = clk_offset(c);
    if (est < off) off = est;
  }
  uint64_t start_mono = a + (uint64_t)off;
  if (start_mono + G.clock_err_ns < enq) return NCCL_EXPORTER_F_REJECT_EARLY;
  return 0;
}

static void ours_kch_stop_state(void *h, uint64_t ptimer) {
  uint32_t sub;
  struct slot *s = h_slot(h, &sub);
  if (!s || sub == 0) return;
  /* A second stop of a channel is another operation's, sent through this
   * operation's stale handle (see sweep()): never counted here. */
  if (!ch_test(s->ch_started, sub - 1) || ch_set(s->ch_stopped, sub - 1)) {
    atomic_fetch_add_explicit(&G.dup_stops, 1, memory_order_relaxed);
    return;
  }
  uint64_t cur = atomic_load_explicit(&s->max_stop, memory_order_relaxed);
  while (ptimer > cur && !atomic_compare_exchange_weak_explicit(&s->max_stop, &cur, ptimer, memory_order_relaxed,
                                                               memory_order_relaxed)) {
  }
  uint32_t n = atomic_fetch_add_explicit(&s->stopped, 1, memory_order_acq_rel) + 1;
  uint32_t started = atomic_load_explicit(&s->started, memory_order_acquire);
  uint32_t want = s->rec.nchannels > started ? s->rec.nchannels : started;
  if (n == want) { /* the last channel: one clock read per operation end */
    uint64_t now = mono_ns();
    uint32_t reject = judge(s, ptimer, now);
    if (!reject) { /* the operation's two clock samples: its first start and its last stop */
      uint64_t fst = atomic_load_explicit(&s->first_start_timer, memory_order_relaxed);
      uint64_t fsh = atomic_load_explicit(&s->first_start_host, memory_order_relaxed);
      if (fsh) clk_sample(&s->ctx->clk, fst, fsh);
      clk_sample(&s->ctx->clk, ptimer, now);
    } else {
      atomic_fetch_add_explicit(&G.rejected, 1, memory_order_relaxed);
    }
    /* Done now, unless ProxyOps are still open: they can end after the last
     * kernel channel; the last one to stop sends it (proxy_close). */
    s->done_reject = reject;
    s->done_now = now;
    uint64_t mine = s->ord + 1, seen = atomic_load_explicit(&s->ctx->kch_done_ord, memory_order_relaxed);
    while (seen < mine && !atomic_compare_exchange_weak(&s->ctx->kch_done_ord, &seen, mine)) {
    }
    atomic_store(&s->kch_done, 1);
    if (atomic_load(&s->proxy_open) == 0) finish(s, NCCL_EXPORTER_STATE_DONE, reject, now);
    /* CHANNELS_UNKNOWN: channels starting after this are not waited for (a stale handle, counted) */
    if (atomic_exchange(&s->pending_ch, 0)) unref(s);
  }
}

static void proxy_stop(void *h);

static void ours_stop(void *h) {
  if (h_is_proxy(h)) {
    proxy_stop(h);
    return;
  }
  uint32_t sub;
  struct slot *s = h_slot(h, &sub);
  if (!s) return;
  if (sub && ch_set(s->ch_released, sub - 1)) return; /* a KernelCh's stopEvent counts once (see sweep()) */
  if (sub == 0 && (s->rec.flags & NCCL_EXPORTER_F_UNTIMED)) /* no KernelCh will come: done when enqueued */
    finish(s, NCCL_EXPORTER_STATE_DONE, 0, mono_ns());
  unref(s);
}


/* ------------------------------------------------------------------------ */
/* Network time per peer: ProxyOp and ProxyStep events                     */
/*                                                                          */
/* NCCL's proxy progress thread sends, per operation, one ProxyOp per       */
/* channel x network peer x direction (parent: our Coll/P2p handle) and     */
/* under it nSteps ProxySteps, at most NCCL_STEPS = 8 open at once, each    */
/* going through its direction's states (docs/network.md).  We keep, per    */
/* operation (the slot's net_tab) and per (peer, direction), for each phase */
/* how many steps are in it now, so that wall time (>= 1 step in the phase, */
/* over all channels) and step time (summed over steps) accumulate at every */
/* transition.  Per step: no allocation, no lock, no syscall; one           */
/* clock_gettime (vDSO) per state and one at the stop.                      */
/*                                                                          */
/* Writers: one ProxyOp's steps have one writer, the proxy thread that     */
/* progresses it. One operation's net_tab can have several: a process that  */
/* drives several GPUs (JAX-style) with PXN has its ProxyOps started by     */
/* another communicator's proxy thread, with our own pid and our handle as  */
/* parent (NCCL 2.28.9 src/proxy.cc:385). So the table's entries are        */
/* claimed with a CAS on their key and every figure is a relaxed atomic:    */
/* never more than NET_TAB entries, whatever the interleaving. The done     */
/* record reads the table only after the last ProxyOp stopped (proxy_open,  */
/* a seq_cst counter, orders it).                                           */

#define NET_TAB 8     /* (peer, direction) pairs kept by name per operation */
#define PH_NONE 0xff
#define POP_STEPS 8   /* NCCL_STEPS: open steps per ProxyOp, indexed step % 8 */

struct net_ent {
  _Atomic uint64_t key; /* 0: free; else net_key(peer, dir) (the over[] entries: unused) */
  int32_t peer;       /* -1: the pairs beyond NET_TAB, summed */
  uint32_t dir;       /* NCCL_EXPORTER_NET_SEND / _RECV */
  _Atomic uint32_t nin[NCCL_EXPORTER_NET_PHASES];   /* steps in each phase now */
  _Atomic uint64_t since[NCCL_EXPORTER_NET_PHASES]; /* when nin[p] went 0 -> 1 */
  _Atomic uint64_t wall[NCCL_EXPORTER_NET_PHASES], step[NCCL_EXPORTER_NET_PHASES], bytes;
};
struct net_tab {
  _Atomic uint32_t n, flags, nops;
  _Atomic uint32_t shared;  /* ProxyOps of it came from more than one thread: atomic figures */
  _Atomic uintptr_t writer; /* the thread of its first ProxyOp */
  struct net_ent e[NET_TAB];
  struct net_ent over[2];   /* per direction: pairs beyond NET_TAB */
};
struct pstep {
  int32_t step;       /* NCCL's step number, -1: free */
  uint8_t phase;      /* PH_NONE or 0..2 */
  uint64_t t;         /* entered the phase */
};
struct pop {
  _Atomic uint32_t state;   /* SLOT_FREE / SLOT_LIVE */
  _Atomic uint32_t gen;
  struct slot *s;
  uint32_t sgen;            /* s->gen when this ProxyOp started: finalize or age-out may reclaim the
                               slot for another operation under it (pop_slot) */
  struct net_ent *ent;
  struct net_tab *tab;
  uint32_t is_send;
  struct pstep st[POP_STEPS];
};

/* A ProxyOp can no longer change the operation: maybe it was the last. */
static void proxy_close(struct slot *s) {
  if (atomic_fetch_sub(&s->proxy_open, 1) == 1 && atomic_load(&s->kch_done))
    finish(s, NCCL_EXPORTER_STATE_DONE, s->done_reject, s->done_now);
}

static inline uint64_t net_key(int peer, uint32_t dir) { return (((uint64_t)(uint32_t)peer << 1) | (dir & 1)) + 1; }

/* The (peer, direction) entry, claimed by CAS if new: safe with several writers. */
static struct net_ent *net_entry(struct net_tab *t, int peer, uint32_t dir) {
  uint64_t k = net_key(peer, dir);
  for (uint32_t i = 0; i < NET_TAB; i++) {
    uint64_t cur = atomic_load_explicit(&t->e[i].key, memory_order_acquire);
    if (cur == k) return &t->e[i];
    if (cur == 0) {
      if (atomic_compare_exchange_strong(&t->e[i].key, &cur, k)) {
        t->e[i].peer = peer;
        t->e[i].dir = dir;
        atomic_fetch_add_explicit(&t->n, 1, memory_order_relaxed);
        return &t->e[i];
      }
      if (cur == k) return &t->e[i]; /* another thread claimed it for the same pair */
    }
  }
  atomic_fetch_or_explicit(&t->flags, NCCL_EXPORTER_NET_F_TABLE_FULL, memory_order_relaxed);
  return &t->over[dir & 1];
}

static void net_clear(uint32_t idx) {
  struct net_tab *t = &G.nets[idx];
  memset(t, 0, sizeof *t);
  t->over[0].peer = t->over[1].peer = -1;
  t->over[NCCL_EXPORTER_NET_RECV].dir = NCCL_EXPORTER_NET_RECV;
}

/* The live slot of a ProxyOp's operation, or NULL when the slot was reclaimed
 * (finalize, age-out) since the ProxyOp started: then it must not touch it. */
static inline struct slot *pop_slot(struct pop *p) {
  struct slot *s = p->s;
  if (!s || (atomic_load_explicit(&s->gen, memory_order_acquire) & H_GEN) != p->sgen ||
      atomic_load_explicit(&s->state, memory_order_acquire) != SLOT_LIVE)
    return NULL;
  return s;
}

static inline struct pop *pop_of(void *h, uint32_t *sub) {
  uint64_t v = (uintptr_t)h;
  uint32_t idx = (uint32_t)((v >> 9) & 0x7fffffu);
  if (idx >= G.npops) return NULL;
  struct pop *p = &G.pops[idx];
  if ((atomic_load_explicit(&p->gen, memory_order_acquire) & H_GEN) != (uint32_t)((v >> 32) & H_GEN) ||
      atomic_load_explicit(&p->state, memory_order_acquire) != SLOT_LIVE)
    return NULL;
  *sub = (uint32_t)(v & 0x1ff);
  return p;
}

/* A figure of a table: a plain add while the table has one writer thread (no
 * lock prefix: the common case costs what it did), an atomic one once it has
 * several (see above). Two threads crossing a phase's 0 <-> 1 count at once can
 * misplace one wall interval by the time between their two transitions; a
 * transition already under way when the second thread arrives may use the
 * plain add once. */
static inline uint64_t nadd64(_Atomic uint64_t *a, uint64_t v, int sh) {
  if (UNLIKELY(sh)) return atomic_fetch_add_explicit(a, v, memory_order_relaxed);
  uint64_t old = atomic_load_explicit(a, memory_order_relaxed);
  atomic_store_explicit(a, old + v, memory_order_relaxed);
  return old;
}
static inline uint32_t nadd32(_Atomic uint32_t *a, uint32_t v, int sh) {
  if (UNLIKELY(sh)) return atomic_fetch_add_explicit(a, v, memory_order_relaxed);
  uint32_t old = atomic_load_explicit(a, memory_order_relaxed);
  atomic_store_explicit(a, old + v, memory_order_relaxed);
  return old;
}
static inline int tab_shared(const struct net_tab *t) {
  return (int)atomic_load_explicit(&((struct net_tab *)t)->shared, memory_order_relaxed);
}

static inline void ph_leave(struct net_ent *e, struct pstep *st, uint64_t now, int sh) {
  uint8_t p = st->phase;
  if (p == PH_NONE) return;
  nadd64(&e->step[p], now - st->t, sh);
  if (nadd32(&e->nin[p], (uint32_t)-1, sh) == 1) {
    uint64_t since = atomic_load_explicit(&e->since[p], memory_order_relaxed);
    if (now > since) nadd64(&e->wall[p], now - since, sh);
  }
  st->phase = PH_NONE;
}

static inline void ph_enter(struct net_ent *e, struct pstep *st, uint8_t p, uint64_t now, int sh) {
  if (nadd32(&e->nin[p], 1, sh) == 0) atomic_store_explicit(&e->since[p], now, memory_order_relaxed);
  st->phase = p;
  st->t = now;
}

static void *proxy_start_op(const struct ev *e) {
  if (e->pid != G.pid) return NULL; /* PXN: counted in common_start */
  uint32_t sub;
  struct slot *s = h_slot(e->parent, &sub);
  int32_t refs = s && sub == 0 ? atomic_load(&s->refs) : 0;
  do { /* a reference only while the operation is still held by someone */
    if (refs <= 0) {
      atomic_fetch_add_explicit(&G.proxy_orphan, 1, memory_order_relaxed);
      return NULL;
    }
  } while (!atomic_compare_exchange_weak(&s->refs, &refs, refs + 1));
  if ((atomic_load(&s->gen) & H_GEN) != (uint32_t)(((uintptr_t)e->parent >> 32) & H_GEN)) {
    unref(s); /* the slot was reused under us: not our operation */
    atomic_fetch_add_explicit(&G.proxy_orphan, 1, memory_order_relaxed);
    return NULL;
  }
  atomic_fetch_add(&s->proxy_open, 1);
  if (atomic_load(&s->kch_done) && atomic_load(&s->finished)) { /* its done record is out already */
    atomic_fetch_add_explicit(&G.proxy_late, 1, memory_order_relaxed);
    proxy_close(s);
    unref(s);
    return NULL;
  }
  struct pop *p = NULL;
  uint32_t pi = 0;
  for (uint32_t tries = 0; tries < G.npops; tries++) {
    uint32_t i = atomic_fetch_add_explicit(&G.pcursor, 1, memory_order_relaxed) % G.npops;
    uint32_t f = SLOT_FREE;
    if (atomic_load_explicit(&G.pops[i].state, memory_order_relaxed) == SLOT_FREE &&
        atomic_compare_exchange_strong(&G.pops[i].state, &f, SLOT_CLOSING)) {
      p = &G.pops[i];
      pi = i;
      break;
    }
  }
  if (!p) {
    if (atomic_fetch_add_explicit(&G.proxy_dropped, 1, memory_order_relaxed) == 0)
      logmsg(NXP_LOG_WARN, "nccl-exporter profiler: ProxyOp pool (%u) exhausted; network figures of operations are "
             "dropped and counted (NCCL_EXPORTER_PROFILER_PROXY_POOL)", G.npops);
    proxy_close(s);
    unref(s);
    return NULL;
  }
  struct net_tab *t = &G.nets[s - G.slots]; /* cleared when the operation started (ours_start_op) */
  atomic_store_explicit(&s->net_used, 1, memory_order_release);
  atomic_fetch_add_explicit(&t->nops, 1, memory_order_relaxed);
  uintptr_t me = (uintptr_t)pthread_self(), w = 0; /* a second proxy thread makes the table shared */
  if (!atomic_compare_exchange_strong(&t->writer, &w, me) && w != me) atomic_store(&t->shared, 1);
  p->s = s;
  p->sgen = (uint32_t)(((uintptr_t)e->parent >> 32) & H_GEN);
  p->tab = t;
  p->is_send = e->is_send ? 1 : 0;
  p->ent = net_entry(t, e->peer, p->is_send ? NCCL_EXPORTER_NET_SEND : NCCL_EXPORTER_NET_RECV);
  for (int k = 0; k < POP_STEPS; k++) { p->st[k].step = -1; p->st[k].phase = PH_NONE; }
  uint32_t gen = (atomic_fetch_add(&p->gen, 1) + 1) & H_GEN;
  if (!gen) gen = (atomic_fetch_add(&p->gen, 1) + 1) & H_GEN;
  atomic_store_explicit(&p->state, SLOT_LIVE, memory_order_release);
  atomic_fetch_add_explicit(&G.proxy_ops, 1, memory_order_relaxed);
  return (void *)(uintptr_t)(H_OURS | H_PROXY | ((uint64_t)gen << 32) | ((uint64_t)pi << 9));
}

static void *proxy_start_step(const struct ev *e) {
  uint32_t sub;
  struct pop *p = h_is_proxy(e->parent) ? pop_of(e->parent, &sub) : NULL;
  if (!p || sub != 0 || e->step < 0 || !pop_slot(p)) return NULL;
  struct pstep *st = &p->st[e->step % POP_STEPS];
  if (UNLIKELY(st->step >= 0)) {
    ph_leave(p->ent, st, mono_ns(), tab_shared(p->tab));
    /* The same step started again is NCCL restarting a receive step whose
     * irecv was not posted yet (2.28.9 src/transport/net.cc:1432: every
     * progress pass starts sub->posted until it is posted): not a reuse.
     * Only the step 8 before it still open is one. */
    if (st->step != e->step)
      atomic_fetch_or_explicit(&p->tab->flags, NCCL_EXPORTER_NET_F_STEP_REUSED, memory_order_relaxed);
  }
  st->step = e->step;
  st->phase = PH_NONE;
  return (void *)(uintptr_t)(((uintptr_t)e->parent & ~(uintptr_t)0x1ff) | (1 + (uint32_t)(e->step % 64)));
}

/* The open step a ProxyStep handle refers to (NULL: stale). */
static inline struct pstep *proxy_step(void *h, struct pop **pp) {
  uint32_t sub;
  struct pop *p = pop_of(h, &sub);
  if (!p || sub == 0) return NULL;
  struct pstep *st = &p->st[(sub - 1) % POP_STEPS];
  if (st->step < 0 || (uint32_t)(st->step % 64) != sub - 1) return NULL;
  *pp = p;
  return st;
}

static void proxy_record(void *h, int state, const nxp_state_args *a) {
  struct pop *p;
  struct pstep *st = proxy_step(h, &p);
  if (!st) return;
  int ph;
  if (p->is_send)
    ph = state == NXP_STATE_SEND_GPU_WAIT ? 0 : state == NXP_STATE_SEND_PEER_WAIT ? 1 : state == NXP_STATE_SEND_WAIT ? 2 : -1;
  else
    ph = state == NXP_STATE_RECV_WAIT ? 0 : state == NXP_STATE_RECV_FLUSH_WAIT ? 1 : state == NXP_STATE_RECV_GPU_WAIT ? 2 : -1;
  if (ph < 0) return;
  uint64_t now = mono_ns();
  int sh = tab_shared(p->tab);
  ph_leave(p->ent, st, now, sh);
  ph_enter(p->ent, st, (uint8_t)ph, now, sh);
  if (ph == (p->is_send ? 2 : 1) && a) nadd64(&p->ent->bytes, a->proxyStep.transSize, sh);
}

static void proxy_stop(void *h) {
  uint32_t sub;
  struct pop *p = pop_of(h, &sub);
  if (!p) return;
  if (sub) { /* ProxyStep */
    struct pop *q;
    struct pstep *st = proxy_step(h, &q);
    if (!st) return;
    ph_leave(p->ent, st, mono_ns(), tab_shared(p->tab));
    st->step = -1;
    return;
  }
  struct slot *s = pop_slot(p);
  uint64_t now = 0;
  for (int k = 0; k < POP_STEPS; k++) /* steps NCCL never stopped end with their op */
    if (p->st[k].step >= 0) {
      if (!now) now = mono_ns();
      if (s) ph_leave(p->ent, &p->st[k], now, tab_shared(p->tab));
      p->st[k].step = -1;
    }
  uint32_t live = SLOT_LIVE; /* the sweep may be reclaiming it (pops_reclaim) */
  if (!atomic_compare_exchange_strong(&p->state, &live, SLOT_CLOSING)) return;
  atomic_fetch_add(&p->gen, 1); /* its handles go stale */
  atomic_store_explicit(&p->state, SLOT_FREE, memory_order_release);
  if (!s) { /* its operation was reclaimed (finalize, age-out): the slot may be another's now */
    atomic_fetch_add_explicit(&G.proxy_orphan, 1, memory_order_relaxed);
    return;
  }
  proxy_close(s);
  unref(s);
}

/* ProxyOp entries whose operation was reclaimed (finalize, age-out, sweep):
 * NCCL may never stop them (an aborted communicator; CollNet and the SHM/P2P
 * copy-engine modes never do). Their handles go stale. */
static void pops_reclaim(void) {
  for (uint32_t i = 0; i < G.npops; i++) {
    struct pop *p = &G.pops[i];
    if (atomic_load_explicit(&p->state, memory_order_acquire) != SLOT_LIVE || pop_slot(p)) continue;
    uint32_t live = SLOT_LIVE;
    if (!atomic_compare_exchange_strong(&p->state, &live, SLOT_CLOSING)) continue;
    atomic_fetch_add(&p->gen, 1);
    atomic_store_explicit(&p->state, SLOT_FREE, memory_order_release);
    atomic_fetch_add_explicit(&G.proxy_reclaimed, 1, memory_order_relaxed);
  }
}

/* The done record's network part: the top K peers by wall wait (both
 * directions), by rank; the rest summed into peer -1 per direction. */
static void net_fill(struct slot *s, struct nccl_exporter_net *out) {
  memset(out, 0, sizeof *out);
  out->version = NCCL_EXPORTER_NET_VERSION;
  out->top_k = NCCL_EXPORTER_NET_TOP_K;
  out->foreign_ops = atomic_load_explicit(&G.proxy_foreign, memory_order_relaxed);
  if (!atomic_load_explicit(&s->net_used, memory_order_acquire)) return;
  struct net_tab *t = &G.nets[s - G.slots];
  out->flags = atomic_load_explicit(&t->flags, memory_order_relaxed);
  if (atomic_load_explicit(&s->proxy_open, memory_order_relaxed) > 0) out->flags |= NCCL_EXPORTER_NET_F_UNFINISHED;
  out->proxy_ops = atomic_load_explicit(&t->nops, memory_order_relaxed);
  /* entries are claimed in order (net_entry): the used ones are a prefix */
  uint32_t tn = 0;
  while (tn < NET_TAB && atomic_load_explicit(&t->e[tn].key, memory_order_acquire)) tn++;
  int peers[NET_TAB];
  uint64_t wait[NET_TAB];
  int np = 0;
  for (uint32_t i = 0; i < tn; i++) {
    struct net_ent *e = &t->e[i];
    uint64_t w = e->wall[0] + e->wall[1] + e->wall[2];
    int j = 0;
    while (j < np && peers[j] != e->peer) j++;
    if (j == np) { peers[np] = e->peer; wait[np++] = 0; }
    wait[j] += w;
  }
  out->npeers = (uint32_t)np;
  int keep[NET_TAB] = {0};
  for (int k = 0; k < NCCL_EXPORTER_NET_TOP_K && k < np; k++) { /* selection: np <= 8 */
    int best = -1;
    for (int j = 0; j < np; j++)
      if (!keep[j] && (best < 0 || wait[j] > wait[best] || (wait[j] == wait[best] && peers[j] < peers[best])))
        best = j;
    keep[best] = 1;
  }
  struct nccl_exporter_peer_wait other[2];
  memset(other, 0, sizeof other);
  int have_other[2] = {0, 0};
  uint32_t n = 0;
  for (uint32_t i = 0; i < tn + 2; i++) {
    struct net_ent *e = i < tn ? &t->e[i] : &t->over[i - tn];
    if (i >= tn && !(e->bytes || e->wall[0] || e->wall[1] || e->wall[2] || e->step[0] || e->step[1] || e->step[2]))
      continue; /* an unused overflow entry */
    int j = 0;
    while (i < tn && j < np && peers[j] != e->peer) j++;
    struct nccl_exporter_peer_wait *w;
    if (i < tn && j < np && keep[j]) {
      w = &out->e[n++];
      w->peer = e->peer;
    } else {
      w = &other[e->dir];
      w->peer = -1;
      have_other[e->dir] = 1;
    }
    w->direction = e->dir;
    w->bytes += e->bytes;
    for (int p = 0; p < NCCL_EXPORTER_NET_PHASES; p++) {
      w->wall_ns[p] += e->wall[p];
      w->step_ns[p] += e->step[p];
    }
  }
  for (int d = 0; d < 2; d++)
    if (have_other[d]) out->e[n++] = other[d];
  out->nentries = n;
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

static inline int state_exists(int v, int st) {
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

static void merge_masks(void) {
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
static int convert(int from, const void *src, int to, void *dst, void *parent) {
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

static inline int is_wrap(void *h) {
  return G.wraps && (char *)h >= (char *)G.wraps && (char *)h < (char *)(G.wraps + G.nwraps);
}

static void split(void *h, void **ours, void **theirs) {
  *ours = *theirs = NULL;
  if (!h) return;
  if (h_is_ours(h)) {
    *ours = h;
    uint32_t sub;
    struct slot *s = h_slot(h, &sub);
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
static void *combine(struct ctx *c, uint64_t type, void *ours, void *theirs) {
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

/* ------------------------------------------------------------------------ */
/* Common entry points                                                     */

/* Contexts live in one array of ours (ctx_alloc), so that a context pointer
 * NCCL passes can be checked before it is read: a ProxyOp or ProxyStep that
 * another process posted through PXN carries *that* process's context
 * (NCCL 2.28.9 src/enqueue.cc:1275, src/proxy.cc:385, src/plugin/profiler.cc:493
 * and 516-541), an address that may be unmapped here. */
#define CTX_MAX 4096 /* live communicators per process; more: their init gets no context */
/* ctx_arena: [CTX_MAX], allocated at the first init, kept until unload;
 * ctx_used: entries handed out at least once (G.lock) */
static uint32_t ctx_free_n;            /* ctx_free_list[0..n): reusable entries (G.lock) */
static uint32_t *ctx_free_list;

static struct ctx *as_ctx(void *p) {
  uintptr_t a = (uintptr_t)p, base = (uintptr_t)ctx_arena;
  if (!p || !base || a < base || a >= base + CTX_MAX * sizeof(struct ctx) || (a - base) % sizeof(struct ctx))
    return NULL; /* not one of ours: never read through it */
  struct ctx *c = p;
  return c->magic == CTX_MAGIC ? c : NULL;
}

/* Under G.lock. */
static struct ctx *ctx_alloc(void) {
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

static void ctx_release(struct ctx *c) {
  pthread_mutex_lock(&G.lock);
  c->magic = 0;
  ctx_free_list[ctx_free_n++] = (uint32_t)(c - ctx_arena);
  pthread_mutex_unlock(&G.lock);
}

static nxp_result_t common_start(int ver, void *context, void **eHandle, const void *descr, const struct ev *e) {
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

static nxp_result_t common_stop(void *h) {
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

static nxp_result_t common_record(int ver, void *h, int state, nxp_state_args *a) {
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

static uint64_t env_u64(const char *name, uint64_t dflt, uint64_t lo, uint64_t hi) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end;
  errno = 0;
  unsigned long long x = strtoull(v, &end, 0);
  if (errno || *end) return dflt;
  return x < lo ? lo : x > hi ? hi : x;
}

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

static void load_chain(void) {
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

/* The pools (record slots and their network tables, ProxyOps, chain
 * wrappers) are reserved at the first init for their largest size
 * (NCCL_EXPORTER_PROFILER_POOL_MAX records, default 65,536: address space
 * only, MAP_NORESERVE; a page costs memory once a slot on it is first used)
 * and used up to a size that grows at each communicator's init, off the
 * event path (pools_grow). Readers see the size grow, never shrink. */
static void *pool_reserve(size_t n, size_t size) {
  if (!n) return NULL;
  void *p = mmap(NULL, n * size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}
static void pool_free(void *p, size_t n, size_t size) {
  if (p) munmap(p, n * size);
}

/* One ncclAlltoAll is 2 x nranks P2P tasks (NCCL v2.28.9-1 src/enqueue.cc:2585-2588),
 * each a record with one ProxyOp per channel and direction it uses: room for
 * two of them enqueued ahead of the GPU, 8 x nranks records and twice as many
 * ProxyOps (at least the configured sizes). Under G.lock. */
static void pools_grow(int nranks) {
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

/* ------------------------------------------------------------------------ */
/* Announcing the live communicators (docs/plugin.md, "Communicators made   */
/* before the agent"). An agent that attaches mid-job missed every          */
/* comm_init: a small thread of ours calls nccl_exporter_comm_live for each */
/* live communicator once a period (NCCL_EXPORTER_PROFILER_ANNOUNCE_MS,     */
/* default 1000; 0: never), so the agent knows them within a period, idle   */
/* or hung ones included. Off NCCL's threads; costs one wake-up a period    */
/* and, with an agent attached, one uprobe hit per communicator. The thread */
/* starts with the first communicator and is joined when the last is        */
/* finalized (NCCL dlcloses us after that).                                 */

#define ANNOUNCE_MAX 256 /* communicators announced per process (more: the first 256) */

static struct {
  pthread_mutex_t lock;
  pthread_cond_t wake;
  struct ctx *live[ANNOUNCE_MAX];
  int n;
  uint64_t period_ms;       /* read at the first communicator; 0: off */
  int configured;
  int running;
  uint64_t gen;             /* a thread runs while gen is the one it started with */
  pthread_t thread;
} A = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static struct nccl_exporter_comm comm_record(const struct ctx *c) {
  struct nccl_exporter_comm ci = {.version = NCCL_EXPORTER_RECORD_VERSION, .size = sizeof ci,
                                  .comm_hash = c->comm_hash, .rank = c->rank, .nranks = c->nranks,
                                  .nnodes = c->nnodes, .iface_version = (uint32_t)c->iface,
                                  .dropped = atomic_load(&G.dropped)};
  memcpy(ci.name, c->name, sizeof ci.name);
  return ci;
}

static void *announcer(void *arg) {
  uint64_t mine = (uint64_t)(uintptr_t)arg;
  pthread_mutex_lock(&A.lock);
  while (A.gen == mine) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    uint64_t ns = (uint64_t)t.tv_nsec + A.period_ms * 1000000ull;
    t.tv_sec += (time_t)(ns / 1000000000ull);
    t.tv_nsec = (long)(ns % 1000000000ull);
    pthread_cond_timedwait(&A.wake, &A.lock, &t);
    if (A.gen != mine) break;
    for (int i = 0; i < A.n; i++) {
      struct nccl_exporter_comm ci = comm_record(A.live[i]);
      hook_comm_live(&ci);
    }
    if (G.slots) sweep(mono_ns(), 0); /* records NCCL will never complete, also while the job is idle */
  }
  pthread_mutex_unlock(&A.lock);
  return NULL;
}

/* A fork's child has no announcer thread: it must not join one. */
static void announce_forked(void) {
  pthread_mutex_init(&A.lock, NULL);
  A.running = 0;
  A.n = 0;
}

static void announce_add(struct ctx *c) {
  pthread_mutex_lock(&A.lock);
  if (!A.configured) {
    A.configured = 1;
    A.period_ms = env_u64("NCCL_EXPORTER_PROFILER_ANNOUNCE_MS", 1000, 0, 3600000);
    pthread_atfork(NULL, NULL, announce_forked);
  }
  if (A.n < ANNOUNCE_MAX) A.live[A.n++] = c;
  if (!A.running && A.period_ms && G.pinned) {
    /* the job's signals stay with the job's threads */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    uint64_t gen = ++A.gen;
    if (pthread_create(&A.thread, NULL, announcer, (void *)(uintptr_t)gen) == 0) {
      A.running = 1;
      pthread_setname_np(A.thread, "nccl-announce"); /* 15 characters at most */
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
  }
  pthread_mutex_unlock(&A.lock);
}

static void announce_remove(struct ctx *c) {
  pthread_mutex_lock(&A.lock);
  for (int i = 0; i < A.n; i++)
    if (A.live[i] == c) {
      A.live[i] = A.live[--A.n];
      break;
    }
  if (A.n > 0 || !A.running) {
    pthread_mutex_unlock(&A.lock);
    return;
  }
  pthread_t t = A.thread;
  A.running = 0;
  A.gen++; /* that thread stops */
  pthread_cond_broadcast(&A.wake);
  pthread_mutex_unlock(&A.lock);
  pthread_join(t, NULL);
}

static nxp_result_t common_init(int ver, void **context, uint64_t hash, int *mask, const char *name, int nnodes,
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

  if (first)
    logmsg(NXP_LOG_INFO, "nccl-exporter profiler: v%d, mask 0x%x, pool %u, proxy %s (pool %u), log %s, chain %s", ver,
           *mask, G.nslots, G.proxy_on ? "on" : "off", G.npops, G.log_fd >= 0 ? "on" : "off", G.chain ? "on" : "off");
  if (first && ver >= 7 && (G.our_mask & NXP_EV_KERNEL_CH))
    logmsg(NXP_LOG_INFO, "nccl-exporter profiler: NCCL >= 2.31 (interface v7) also makes its kernels write "
           "per-phase timestamps and a fence when KernelCh is asked for (NVIDIA/nccl#2355: 4-13 %% GPU time on 2.31.2); "
           "NCCL_EXPORTER_PROFILER_MASK=counts asks for no KernelCh (operation counts, no GPU intervals)");
  struct nccl_exporter_comm ci = comm_record(c);
  hook_comm_init(&ci);
  if (G.log_fd >= 0) {
    char line[256];
    int n = snprintf(line, sizeof line, "nccl-exporter-profiler event=init comm=0x%016" PRIx64 " rank=%d nranks=%d nnodes=%d iface=v%d mask=0x%x chain=v%d pid=%d\n",
                     hash, rank, nranks, nnodes, ver, *mask, G.chain_ver, (int)getpid());
    if (n > 0 && write(G.log_fd, line, (size_t)n) < 0) { /* best effort */ }
  }
  *context = c;
  announce_add(c);
  return NXP_SUCCESS;
}

static nxp_result_t common_finalize(void *context) {
  struct ctx *c = as_ctx(context);
  if (!c) return NXP_SUCCESS;
  if (G.chain && c->chain_ok && G.chain->finalize) G.chain->finalize(c->chain_ctx);
  uint64_t now = mono_ns(), pending = 0;
  for (uint32_t i = 0; i < G.nslots; i++) {
    struct slot *s = &G.slots[i];
    if (atomic_load_explicit(&s->state, memory_order_acquire) == SLOT_LIVE && s->ctx == c) {
      pending++;
      release(s, NCCL_EXPORTER_F_FINALIZED, now);
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

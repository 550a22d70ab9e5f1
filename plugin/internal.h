/*
 * internal.h -- what the files of nccl-exporter's NCCL profiler plugin share.
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
 *    takes the slot freed last (in cache), else a lock-free CAS scan from a
 *    rotating cursor.  A slot lives until the Coll/P2p was stopped
 *    (= enqueued) and all its KernelCh children started so far, at least as
 *    many as announced, had their stop state (a KernelCh's stopEvent changes
 *    nothing), or until finalize / age-out / the sweep reclaims it.
 *  - No locks, no malloc, no syscalls per event (clock_gettime is the vDSO);
 *    the optional log file costs one write(2) per completed operation.
 *  - Chain-loading: NCCL_EXPORTER_PROFILER_CHAIN=/path/plugin.so is dlopened
 *    and every callback is forwarded to it, converted to its newest supported
 *    interface version, with its handles kept apart from ours.
 *
 * The files, one concern each (every .c in plugin/ is compiled into the one
 * library: exporter/sources/plugin/build.py):
 * from the top (NCCL's entry points) down; a file calls only files below it
 * (tests/test_c_layout.py checks that from the object files' symbols):
 *   versions.c  NCCL's ncclProfiler_v4..v7 tables: each version's descriptor -> struct ev
 *   entry.c     init/finalize and start/stop/record, shared by every version
 *   announce.c  the announcer thread
 *   chain.c     a chained plugin: loading, masks, descriptor conversion, handles
 *   gpu.c       GPU intervals: Coll/P2p and KernelCh events, judge()
 *   net.c       network time per peer: ProxyOp/ProxyStep events
 *   pool.c      the record pool and its ages (slot_alloc, release, sweep)
 *   records.c   the record handed to the hooks, log lines, finish()
 *   net_table.c the per-operation network tables: cleared, reclaimed, read out
 *   clock.c     GPU timer -> CLOCK_MONOTONIC
 *   state.c     process state G, contexts, settings, the pools' memory
 *   hooks.c     the hook functions the agent uprobes (an ABI: names, first bytes)
 * NCCL's layouts are in profiler_abi.h, the record and the hooks in
 * nccl_exporter_plugin.h; what the files share, here.
 */
#ifndef NCCL_EXPORTER_PLUGIN_INTERNAL_H
#define NCCL_EXPORTER_PLUGIN_INTERNAL_H

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

/* Everything declared from here on is internal to the library, declarations
 * included (so that calls and data between the files are direct, PC-relative,
 * never through the GOT or PLT).  Only EXPORT and the hooks leave it. */
#pragma GCC visibility push(hidden)

#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ------------------------------------------------------------------------ */
/* Process-wide state                                                      */

#define CTX_MAGIC 0x6e786370u /* "nxcp" */
#define MAX_POOL (1u << 22)

struct clk {            /* GPU timer -> CLOCK_MONOTONIC offset estimator */
  _Atomic int64_t cur_min;     /* min(mono_at_delivery - timer) this window */
  _Atomic int64_t prev_min;    /* previous window's min */
  _Atomic uint64_t win_start;  /* mono ns when this window began */
  _Atomic uint32_t nsamples;  /* 0, 1, 2 = two or more */
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
  _Atomic uint64_t kch_done_ord; /* 1 + the newest ord whose every KernelCh stopped (0: none) */
  _Atomic uint64_t kch_done_at;  /* when the last of them stopped (sweep(): since when one is lost) */
  uint64_t sweep_min_run;        /* sweep(): the oldest ord with a KernelCh running (UINT64_MAX: none) */
};

struct slot {
  _Atomic uint32_t state;   /* FREE, LIVE, CLOSING */
  _Atomic uint32_t gen;     /* bumped on every allocation; part of handles */
  struct ctx *ctx;
  void *theirs;             /* chained plugin's handle for this Coll/P2p */
  _Atomic int32_t refs;     /* 1 (the event) + 1 (its KernelCh children: ch_ref) + open ProxyOps */
  _Atomic uint32_t claimed;  /* gen << 2 | CLAIM_*: the first KernelCh start's and the last stop's work, done once */
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
  uint32_t done_reject;         /* judge()'s verdict at the last KernelCh stop */
  uint64_t done_now;            /* and when */
  /* NCCL <= 2.30 can stop a KernelCh through the handle of an older operation
   * (see sweep()): each channel's start and stop state count once.
   * The bits are also the counts (ch_count): one atomic per channel event. */
  _Atomic uint64_t ch_started[4], ch_stopped[4];
  uint64_t ord;                 /* its place in its communicator's start order: its record id (ids grow in
                                   start order, over all communicators) */
  uint64_t lost_since;          /* sweep(): first seen with a channel that will never come (0: not) */
  struct nccl_exporter_record rec; /* the static part, filled at start */
};
enum { SLOT_FREE = 0, SLOT_LIVE = 1, SLOT_CLOSING = 2 };
enum { CLAIM_RUNNING = 1, CLAIM_LAST_STOP = 2 };

/* Its KernelCh children hold one reference, dropped by the last stop (none
 * when no KernelCh will come: F_UNTIMED). */
static inline int ch_ref(const struct slot *s) {
  return s->rec.nchannels || (s->rec.flags & NCCL_EXPORTER_F_CHANNELS_UNKNOWN);
}

/* Bits set in x (no popcnt instruction: the plugin runs on any x86-64). */
static inline uint32_t bits64(uint64_t x) {
  x -= (x >> 1) & 0x5555555555555555ull;
  x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
  x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0full;
  return (uint32_t)((x * 0x0101010101010101ull) >> 56);
}
/* Channels whose bit is set in a channel bitset (ch_started, ch_stopped). */
static inline uint32_t ch_count(_Atomic uint64_t *m) {
  uint32_t n = 0;
  for (int k = 0; k < 4; k++) {
    uint64_t w = atomic_load(&m[k]);
    if (w) n += bits64(w);
  }
  return n;
}

struct wrap {               /* chain mode: a KernelCh handle of both plugins */
  _Atomic uint32_t used;
  struct ctx *ctx;
  void *ours;
  void *theirs;
};


struct plugin_state {
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
  atomic_int sweep_live;    /* the last sweep found records in flight: the announcer sweeps again (announce.c) */
  /* chain */
  void *chain_dl;
  int chain_ver;            /* 4..7, 0 = none */
  nxp_profiler_any *chain;
  int chain_mask;           /* the chained plugin's own mask variable */
  _Atomic int chain_mask_seen;
  _Atomic int chain_types;  /* event types NCCL would send it, from its mask */
};
extern struct plugin_state G; /* state.c */

extern struct ctx *ctx_arena; /* the communicators' contexts (as_ctx, ctx_alloc); state.c */
extern uint32_t ctx_used;

static inline uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The hooks by the hidden aliases defined beside them (hooks.c): direct
 * (non-PLT) calls to the same addresses the uprobes attach to. */
void hook_coll_queued(const struct nccl_exporter_record *r);
void hook_gpu_start(const struct nccl_exporter_record *r);
void hook_gpu_done(const struct nccl_exporter_record *r);
void hook_abandoned(const struct nccl_exporter_record *r);
void hook_comm_init(const struct nccl_exporter_comm *r);
void hook_comm_fini(const struct nccl_exporter_comm *r);
void hook_comm_live(const struct nccl_exporter_comm *r);

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

/* state.c: process state, contexts, settings, the pools' memory */
void logmsg(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void disable(const char *why);
#define CTX_MAX 4096 /* live communicators per process; more: their init gets no context */
struct ctx *as_ctx(void *p);
struct ctx *ctx_alloc(void);
void ctx_release(struct ctx *c);
void *pool_reserve(size_t n, size_t size);
void pool_free(void *p, size_t n, size_t size);
void pools_grow(int nranks);
uint64_t env_u64(const char *name, uint64_t dflt, uint64_t lo, uint64_t hi);

/* pool.c: the record pool and its ages */
struct slot *slot_alloc(uint64_t now, uint32_t *idx_out);
void release(struct slot *s, uint32_t abandon_flags, uint64_t now);
void release_at_finalize(struct slot *s, uint64_t now);
int sweep(uint64_t now, int pressure);

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

static inline void unref(struct slot *s) {
  if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) == 1) release(s, 0, 0);
}

/* t at least d before now. Another thread may have stored t after this one
 * read now: a t later than now is never old (unsigned now - t would wrap). */
static inline int older_than(uint64_t now, uint64_t t, uint64_t d) { return now > t && now - t >= d; }

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
  struct net_ent over[2];   /* per direction: pairs beyond NET_TAB (their peer and dir fields unused) */
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

/* The live slot of a ProxyOp's operation, or NULL when the slot was reclaimed
 * (finalize, age-out) since the ProxyOp started: then it must not touch it. */
static inline struct slot *pop_slot(struct pop *p) {
  struct slot *s = p->s;
  if (!s || (atomic_load_explicit(&s->gen, memory_order_acquire) & H_GEN) != p->sgen ||
      atomic_load_explicit(&s->state, memory_order_acquire) != SLOT_LIVE)
    return NULL;
  return s;
}

/* records.c: the record */
uint8_t op_code_cached(const char *f);
uint8_t dtype_code_cached(const char *d, unsigned *size, uint32_t *flags);
void snapshot(struct slot *s, struct nccl_exporter_record *r, uint8_t state, uint64_t now);
void finish(struct slot *s, uint8_t state, uint32_t extra_flags, uint64_t now);

/* One event as versions.c reads it from any version's descriptor. */
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

/* clock.c: GPU timer -> CLOCK_MONOTONIC */
void clk_sample(struct clk *c, uint64_t timer, uint64_t now);
int64_t clk_offset(struct clk *c);

/* gpu.c: GPU intervals */
void *ours_start_op(struct ctx *c, const struct ev *e);
void *ours_start_kch(struct ctx *c, const struct ev *e);
void ours_kch_stop_state(void *h, uint64_t ptimer);
void ours_stop(void *h);

/* net_table.c: the tables */
void net_clear(uint32_t idx);
void net_fill(struct slot *s, struct nccl_exporter_net *out);
void pops_reclaim(void);

/* net.c: network time per peer (proxy accounting) */
void *proxy_start_op(const struct ev *e);
void *proxy_start_step(const struct ev *e);
void proxy_record(void *h, int state, const nxp_state_args *a);
void proxy_stop(void *h);

/* chain.c: a chained plugin */
void load_chain(void);
void merge_masks(void);
int state_exists(int v, int st);
int convert(int from, const void *src, int to, void *dst, void *parent);
void split(void *h, void **ours, void **theirs);
void *combine(struct ctx *c, uint64_t type, void *ours, void *theirs);
static inline int is_wrap(void *h) {
  return G.wraps && (char *)h >= (char *)G.wraps && (char *)h < (char *)(G.wraps + G.nwraps);
}

/* announce.c */
struct nccl_exporter_comm comm_record(const struct ctx *c);
void announce_add(struct ctx *c);
void announce_remove(struct ctx *c);

/* entry.c: what every interface version calls */
nxp_result_t common_init(int ver, void **context, uint64_t hash, int *mask, const char *name, int nnodes,
                         int nranks, int rank, nxp_logger_t logfn);
nxp_result_t common_finalize(void *context);
nxp_result_t common_start(int ver, void *context, void **eHandle, const void *descr, const struct ev *e);
nxp_result_t common_stop(void *h);
nxp_result_t common_record(int ver, void *h, int state, nxp_state_args *a);

#pragma GCC visibility pop

#endif

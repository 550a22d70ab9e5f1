/*
 * driver.c -- a stand-in for NCCL's side of the profiler plugin interface.
 *
 * Loads a profiler plugin the way NCCL does (dlopen, ncclProfiler_vN), inits
 * communicators and makes the callbacks in NCCL's order with NCCL's habits:
 *  - API/Group/Coll parents are stopped before their KernelCh children start;
 *  - KernelCh callbacks come from another thread (the "profiler thread"),
 *    sometimes the start only after the kernel ended (start+stop back to back);
 *  - a NULL handle suppresses every later call for that event;
 *  - finalize with KernelCh work pending (no stopEvent for it);
 *  - nranks = 1 gives no events at all;
 *  - v4/v5 descriptors are not zeroed (garbage in the fields of other types);
 *  - with DRIVER_IMPLAUSIBLE_EVERY=N and DRIVER_IMPLAUSIBLE=long|early|reversed,
 *    every N-th kernel delivers timers that cannot be right (as NCCL >= 2.29
 *    does after a Broadcast run without an activation mask): stop timers
 *    5 s in the future (long), both timers 5 s early (early), or stops before
 *    starts (reversed).  Its truth line says implausible=<kind>.
 * The GPU timer is a synthetic %globaltimer: CLOCK_MONOTONIC + a large offset,
 * drifting by DRIVER_DRIFT_PPM.
 *
 * Usage: driver PLUGIN.so|none VERSION SCENARIO [N]
 *   scenarios: ops, pending, nranks1, pool, bench, net, netbench (N NCH STEPS)
 * Prints "truth ..." lines (what the plugin should report) and "sent ..."
 * counts to stdout.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "profiler_abi.h"

static int VER;
static nxp_profiler_any *P;          /* NULL: no plugin */
static int MASK;                     /* NCCL's process-wide activation mask */
static long long sent[16];           /* startEvent calls per type bit */
static int64_t GPU_OFFSET = 1700000000000000000ll; /* like a Unix-epoch globaltimer */
static double DRIFT_PPM;
static uint64_t T0;

static uint64_t mono(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static uint64_t gpu_timer(uint64_t t) { return (uint64_t)((int64_t)t + GPU_OFFSET + (int64_t)((double)(t - T0) * DRIFT_PPM * 1e-6)); }
static void spin_until(uint64_t t) { while (mono() < t) { } }

static void logger(int level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "NCCL-LOG[%d] ", level);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  (void)flags; (void)file; (void)line;
}

static int bit_index(uint64_t t) { int i = 0; while (t > 1) { t >>= 1; i++; } return i; }

/* NCCL's gating: is an event of type t started given the mask? */
static int gated(uint64_t t) {
  const int net = NXP_EV_PROXY_OP | NXP_EV_PROXY_STEP | NXP_EV_KERNEL_CH | NXP_EV_NET_PLUGIN;
  int m = __atomic_load_n(&MASK, __ATOMIC_RELAXED);
  switch (t) {
  case NXP_EV_GROUP_API: return (m & (NXP_EV_GROUP_API | NXP_EV_P2P_API | NXP_EV_COLL_API | NXP_EV_KERNEL_LAUNCH | NXP_EV_GROUP | NXP_EV_COLL | NXP_EV_P2P | net)) != 0;
  case NXP_EV_COLL_API: return (m & (NXP_EV_COLL_API | NXP_EV_COLL | net)) != 0;
  case NXP_EV_P2P_API: return (m & (NXP_EV_P2P_API | NXP_EV_P2P | net)) != 0;
  case NXP_EV_GROUP: return (m & (NXP_EV_GROUP | NXP_EV_COLL | NXP_EV_P2P | net)) != 0;
  case NXP_EV_COLL: return (m & (NXP_EV_COLL | net)) != 0;
  case NXP_EV_P2P: return (m & (NXP_EV_P2P | net)) != 0;
  default: return (m & (int)t) != 0;
  }
}

/* One descriptor of any version: garbage-filled for v4/v5, zeroed for v6/v7. */
typedef union { nxp_descr_v4 v4; nxp_descr_v5 v5; nxp_descr_v6 v6; nxp_descr_v7 v7; } descr_u;
static void descr_init(descr_u *d, uint64_t type, void *parent, int rank) {
  memset(d, VER <= 5 ? 0xA5 : 0, sizeof *d);
  if (VER == 4) { d->v4.type = (uint8_t)type; d->v4.parentObj = parent; d->v4.rank = rank; }
  else { d->v7.type = type; d->v7.parentObj = parent; d->v7.rank = rank; }
}

static void *start(void *ctx, descr_u *d) {
  uint64_t type = VER == 4 ? d->v4.type : d->v7.type;
  if (!P || !gated(type)) return NULL;
  if (VER == 4 && (type & (NXP_EV_GROUP_API | NXP_EV_COLL_API | NXP_EV_P2P_API | NXP_EV_KERNEL_LAUNCH))) return NULL;
  void *h = (void *)0xdeadbeef; /* NCCL's slot may hold a stale value: the plugin must write it */
  __atomic_fetch_add(&sent[bit_index(type)], 1, __ATOMIC_RELAXED);
  P->startEvent(ctx, &h, d);
  return h;
}
static void stop(void *h) { if (P && h) P->stopEvent(h); }
static void record(void *h, int st, uint64_t ptimer, int null_args) {
  if (!P || !h) return;
  nxp_state_args a;
  memset(&a, VER <= 5 ? 0xA5 : 0, sizeof a);
  a.kernelCh.pTimer = ptimer;
  P->recordEventState(h, st, null_args ? NULL : &a);
}

/* ---- communicators ---------------------------------------------------- */
struct comm {
  void *ctx;
  uint64_t hash;
  int rank, nranks;
  uint64_t seq[16];     /* per func */
  uint64_t p2pseq[64][2];
};

static int comm_init(struct comm *c, uint64_t hash, int rank, int nranks) {
  memset(c, 0, sizeof *c);
  c->hash = hash; c->rank = rank; c->nranks = nranks;
  if (!P) return 0;
  int r;
  if (VER == 4) r = ((nxp_profiler_v4 *)P)->init(&c->ctx, &MASK, "drv", hash, 1, nranks, rank, logger);
  else r = ((nxp_profiler_v5 *)P)->init(&c->ctx, hash, &MASK, "drv", 1, nranks, rank, logger);
  if (r != 0) { fprintf(stderr, "init failed %d\n", r); return 1; }
  printf("mask 0x%x\n", MASK);
  return 0;
}
static void comm_fini(struct comm *c) { if (P && c->ctx) P->finalize(c->ctx); }

/* ---- the "GPU": one stream thread per process, delivering KernelCh ---- */
struct work {
  void *parent;      /* Coll/P2p handle */
  void *ctx;
  int nch, late, hang, proxy;
  uint64_t dur_ns;
  char truth[512];
};
#define QN 4096
static struct work Q[QN];
static int qhead, qtail, qdone, qclosed, gpu_paused;
static pthread_mutex_t qm = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t qc = PTHREAD_COND_INITIALIZER;

static void push(struct work *w) {
  pthread_mutex_lock(&qm);
  Q[qtail++ % QN] = *w;
  pthread_cond_broadcast(&qc);
  pthread_mutex_unlock(&qm);
}

static int nwork;
static void run_work(struct work *w) {
  uint64_t ts = mono();
  uint64_t te = ts + w->dur_ns;
  void *kh[64] = {0};
  uint64_t st[64], sp[64];
  for (int c = 0; c < w->nch; c++) { st[c] = ts + (uint64_t)c * 300; sp[c] = te - (uint64_t)c * 200; }
  /* timers as delivered (gpu_timer(st + dst) / gpu_timer(sp + dsp)): see DRIVER_IMPLAUSIBLE */
  int every = getenv("DRIVER_IMPLAUSIBLE_EVERY") ? atoi(getenv("DRIVER_IMPLAUSIBLE_EVERY")) : 0;
  const char *bad = (every > 0 && nwork++ % every == every - 1) ? getenv("DRIVER_IMPLAUSIBLE") : NULL;
  int64_t dst = 0, dsp = 0;
  if (bad && !strcmp(bad, "long")) dsp = 5000000000ll;
  else if (bad && !strcmp(bad, "early")) dst = dsp = -5000000000ll;
  else if (bad && !strcmp(bad, "reversed")) dsp = -(int64_t)(te - ts) - 1000;
  else bad = NULL;
#define TIMER_START(c) gpu_timer((uint64_t)((int64_t)st[c] + dst))
#define TIMER_STOP(c) gpu_timer((uint64_t)((int64_t)sp[c] + dsp))
  descr_u d;
  if (w->proxy) { /* ProxyOp per channel, parent Coll, started by the proxy thread */
    for (int c = 0; c < w->nch; c++) {
      descr_init(&d, NXP_EV_PROXY_OP, w->parent, 0);
      /* NCCL always sets the pid (ncclProfilerAddPidToProxyOp): a ProxyOp of another pid is PXN's */
      if (VER == 4) { d.v4.proxyOp.channelId = (uint8_t)c; d.v4.proxyOp.peer = 1; d.v4.proxyOp.nSteps = 2; d.v4.proxyOp.pid = (int)getpid(); }
      else { d.v7.proxyOp.channelId = (uint8_t)c; d.v7.proxyOp.peer = 1; d.v7.proxyOp.nSteps = 2; d.v7.proxyOp.pid = (int)getpid(); }
      void *h = start(w->ctx, &d);
      record(h, 19, 0, 0);
      stop(h);
    }
  }
  if (!w->late) {
    for (int c = 0; c < w->nch; c++) {
      spin_until(st[c]);
      descr_init(&d, NXP_EV_KERNEL_CH, w->parent, 0); /* rank is not set for KernelCh */
      if (VER == 4) { d.v4.kernelCh.channelId = (uint8_t)c; d.v4.kernelCh.pTimer = TIMER_START(c); }
      else { d.v7.kernelCh.channelId = (uint8_t)c; d.v7.kernelCh.pTimer = TIMER_START(c); }
      kh[c] = start(w->ctx, &d);
    }
  }
  if (w->hang) { printf("%s\n", w->truth); fflush(stdout); return; } /* started, never stopped */
  spin_until(te);
  if (w->late) { /* the profiler thread saw the start only after the kernel ended */
    for (int c = 0; c < w->nch; c++) {
      descr_init(&d, NXP_EV_KERNEL_CH, w->parent, 0);
      if (VER == 4) { d.v4.kernelCh.channelId = (uint8_t)c; d.v4.kernelCh.pTimer = TIMER_START(c); }
      else { d.v7.kernelCh.channelId = (uint8_t)c; d.v7.kernelCh.pTimer = TIMER_START(c); }
      kh[c] = start(w->ctx, &d);
    }
  }
  for (int c = w->nch - 1; c >= 0; c--) {
    record(kh[c], NXP_STATE_KERNEL_CH_STOP, TIMER_STOP(c), 0);
    stop(kh[c]);
  }
  printf("%s late=%d start_mono=%" PRIu64 " stop_mono=%" PRIu64 " gpu_start_timer=%" PRIu64 " gpu_stop_timer=%" PRIu64
         " implausible=%s\n", w->truth, w->late, ts, te, TIMER_START(0), TIMER_STOP(0), bad ? bad : "no");
  fflush(stdout);
}

static void *gpu_thread(void *arg) {
  (void)arg;
  for (;;) {
    pthread_mutex_lock(&qm);
    while ((qhead == qtail || gpu_paused) && !qclosed) pthread_cond_wait(&qc, &qm);
    if (qhead == qtail && qclosed) { pthread_mutex_unlock(&qm); return NULL; }
    struct work w = Q[qhead++ % QN];
    pthread_mutex_unlock(&qm);
    run_work(&w);
    __atomic_fetch_add(&qdone, 1, __ATOMIC_RELEASE);
  }
}

static void drain(void) {
  pthread_mutex_lock(&qm);
  while (__atomic_load_n(&qdone, __ATOMIC_ACQUIRE) != qtail) { pthread_mutex_unlock(&qm); usleep(200); pthread_mutex_lock(&qm); }
  pthread_mutex_unlock(&qm);
}

/* ---- one API call, NCCL's order (enqueue.cc/group.cc) ------------------ */
static const char *FUNCS[] = {"AllReduce", "AllGather", "ReduceScatter", "Broadcast"};

/* kind 0 = coll (func index), 1 = Send, 2 = Recv.  Returns the Coll/P2p handle. */
static void *api_call(struct comm *c, int kind, int func, size_t count, int peer, int nch, struct work *w) {
  descr_u d;
  void *gapi = NULL, *capi = NULL, *grp = NULL, *op = NULL;
  descr_init(&d, NXP_EV_GROUP_API, NULL, 0);
  if (VER >= 5) { d.v7.groupApi.graphCaptured = 0; d.v7.groupApi.groupDepth = 1; }
  gapi = start(c->ctx, &d);
  record(gapi, NXP_STATE_GROUP_START_API_STOP, 0, VER >= 7);
  if (kind == 0) {
    descr_init(&d, NXP_EV_COLL_API, gapi, 0);
    if (VER >= 5) { d.v7.collApi.func = FUNCS[func]; d.v7.collApi.count = count; d.v7.collApi.datatype = "ncclFloat32"; d.v7.collApi.root = 0; }
  } else {
    descr_init(&d, NXP_EV_P2P_API, gapi, 0);
    if (VER >= 5) { d.v7.p2pApi.func = kind == 1 ? "Send" : "Recv"; d.v7.p2pApi.count = count; d.v7.p2pApi.datatype = "ncclFloat32"; }
  }
  capi = start(c->ctx, &d);
  stop(capi);                                   /* the API parent stops before Coll starts */
  record(gapi, NXP_STATE_GROUP_END_API_START, 0, VER >= 7);
  descr_init(&d, NXP_EV_KERNEL_LAUNCH, gapi, 0);
  void *kl = start(c->ctx, &d);
  stop(kl);
  descr_init(&d, NXP_EV_GROUP, NULL, 0);
  grp = start(c->ctx, &d);
  void *parent = VER == 4 ? grp : capi;
  if (kind == 0) {
    descr_init(&d, NXP_EV_COLL, parent, c->rank);
    uint64_t s = c->seq[func]++;
#define FILL_COLL(X) X.coll.seqNumber = s; X.coll.func = FUNCS[func]; X.coll.sendBuff = (void *)0x1000; X.coll.recvBuff = (void *)0x2000; \
    X.coll.count = count; X.coll.root = 0; X.coll.datatype = "ncclFloat32"; X.coll.nChannels = (uint8_t)nch; X.coll.nWarps = 16; \
    X.coll.algo = "RING"; X.coll.proto = "SIMPLE";
    if (VER == 4) { FILL_COLL(d.v4) } else { FILL_COLL(d.v5) d.v5.coll.parentGroup = grp; }
    if (VER == 7) { d.v7.coll.kernelVariant = "default"; d.v7.coll.userTag = 0; }
    snprintf(w->truth, sizeof w->truth, "truth kind=coll op=%s seq=%" PRIu64 " comm=0x%016" PRIx64 " rank=%d peer=-1 count=%zu bytes=%zu nch=%d",
             FUNCS[func], s, c->hash, c->rank, count, count * 4, nch);
  } else {
    descr_init(&d, NXP_EV_P2P, parent, c->rank);
    uint64_t s = c->p2pseq[peer % 64][kind - 1]++;
#define FILL_P2P(X) X.p2p.func = kind == 1 ? "Send" : "Recv"; X.p2p.buff = (void *)0x3000; X.p2p.datatype = "ncclFloat32"; \
    X.p2p.count = count; X.p2p.peer = peer; X.p2p.nChannels = (uint8_t)nch;
    if (VER == 4) { FILL_P2P(d.v4) } else { FILL_P2P(d.v5) d.v5.p2p.parentGroup = grp; }
    snprintf(w->truth, sizeof w->truth, "truth kind=p2p op=%s seq=%" PRIu64 " comm=0x%016" PRIx64 " rank=%d peer=%d count=%zu bytes=%zu nch=%d",
             kind == 1 ? "Send" : "Recv", s, c->hash, c->rank, peer, count, count * 4, nch);
  }
  op = start(c->ctx, &d);
  w->parent = op;
  w->ctx = c->ctx;
  w->nch = nch;
  if (op || !P) push(w);                        /* KernelCh work is posted with the Coll handle */
  else { printf("%s dropped=1\n", w->truth); fflush(stdout); }
  stop(op);                                     /* "enqueued", not done */
  stop(grp);
  stop(gapi);
  return op;
}

static void print_sent(void) {
  static const char *names[16] = {"Group", "Coll", "P2p", "ProxyOp", "ProxyStep", "ProxyCtrl", "KernelCh", "NetPlugin",
                                  "GroupApi", "CollApi", "P2pApi", "KernelLaunch", "CeColl", "CeSync", "CeBatch", "KernelPhase"};
  for (int i = 0; i < 16; i++) printf("sent %s %lld\n", names[i], sent[i]);
}

static void print_stats(void *dl) {
  void (*stats)(uint64_t *) = dl ? (void (*)(uint64_t *))dlsym(dl, "nccl_exporter_profiler_stats") : NULL;
  if (!stats) return;
  uint64_t s[6];
  stats(s);
  printf("stats completed=%" PRIu64 " abandoned=%" PRIu64 " dropped=%" PRIu64 " stale=%" PRIu64 " wrap_dropped=%" PRIu64 " disabled=%" PRIu64 "\n",
         s[0], s[1], s[2], s[3], s[4], s[5]);
}

/* ---- bench: the full per-collective sequence on one thread -------------- */
static void bench(int n, int nch) {
  struct comm c;
  comm_init(&c, 0x1234, 0, 8);
  descr_u d;
  uint64_t t0 = mono();
  for (int i = 0; i < n; i++) {
    struct work w;
    descr_init(&d, NXP_EV_GROUP_API, NULL, 0);
    void *gapi = start(c.ctx, &d);
    record(gapi, NXP_STATE_GROUP_START_API_STOP, 0, 1);
    descr_init(&d, NXP_EV_COLL_API, gapi, 0);
    if (VER >= 5) { d.v7.collApi.func = "AllReduce"; d.v7.collApi.count = 262144; d.v7.collApi.datatype = "ncclFloat32"; }
    void *capi = start(c.ctx, &d);
    stop(capi);
    record(gapi, NXP_STATE_GROUP_END_API_START, 0, 1);
    descr_init(&d, NXP_EV_GROUP, NULL, 0);
    void *grp = start(c.ctx, &d);
    descr_init(&d, NXP_EV_COLL, VER == 4 ? grp : capi, 0);
    uint64_t s = c.seq[0]++;
    int func = 0;
    size_t count = 262144;
    if (VER == 4) { FILL_COLL(d.v4) } else { FILL_COLL(d.v5) }
    void *op = start(c.ctx, &d);
    stop(op);
    stop(grp);
    stop(gapi);
    uint64_t tm = gpu_timer(mono());
    void *kh[64];
    for (int ch = 0; ch < nch; ch++) {
      descr_init(&d, NXP_EV_KERNEL_CH, op, 0);
      if (VER == 4) { d.v4.kernelCh.channelId = (uint8_t)ch; d.v4.kernelCh.pTimer = tm; }
      else { d.v7.kernelCh.channelId = (uint8_t)ch; d.v7.kernelCh.pTimer = tm; }
      kh[ch] = op ? start(c.ctx, &d) : NULL;
    }
    for (int ch = 0; ch < nch; ch++) {
      record(kh[ch], NXP_STATE_KERNEL_CH_STOP, tm + 1000, 0);
      stop(kh[ch]);
    }
    (void)w;
  }
  uint64_t t1 = mono();
  printf("bench ns_per_coll=%.1f n=%d nch=%d\n", (double)(t1 - t0) / n, n, nch);
  comm_fini(&c);
}

/* ---- net: ProxyOp/ProxyStep as NCCL's proxy thread sends them -----------
 * N ring collectives of rank 1 of 4 (send to 2, receive from 0), NCH channels:
 * per channel one send and one recv ProxyOp (pid = ours), STEPS steps each.
 * The steps of all channels move through their states together, each phase
 * lasting D[phase] ns (spun), so per (peer, direction) the plugin's wall time
 * of a phase is STEPS * D and its step time NCH * STEPS * D; bytes are
 * NCH * STEPS * CHUNK.  Every other operation's ProxyOps stop after its last
 * KernelCh (NCCL: they may).  Each operation also gets a PXN-like ProxyOp of
 * another pid whose parentObj is an address that must never be read.
 * Prints "net expect ..." and pool counts before and after. */
#define NET_CHUNK 131072
static const uint64_t NET_D[2][3] = {{3000, 1000, 20000}, {25000, 2000, 4000}}; /* send, recv phases (ns) */
static const int NET_STATES[2][3] = {{NXP_STATE_SEND_GPU_WAIT, NXP_STATE_SEND_PEER_WAIT, NXP_STATE_SEND_WAIT},
                                     {NXP_STATE_RECV_WAIT, NXP_STATE_RECV_FLUSH_WAIT, NXP_STATE_RECV_GPU_WAIT}};

static void proxy_record_args(void *h, int st, size_t trans) {
  if (!P || !h) return;
  nxp_state_args a;
  memset(&a, VER <= 5 ? 0xA5 : 0, sizeof a);
  a.proxyStep.transSize = trans;
  P->recordEventState(h, st, &a);
}

static void *proxy_op(void *ctx, void *parent, int pid, int ch, int peer, int steps, int is_send) {
  descr_u d;
  descr_init(&d, NXP_EV_PROXY_OP, parent, 1);
#define FILL_POP(X) X.proxyOp.pid = pid; X.proxyOp.channelId = (uint8_t)ch; X.proxyOp.peer = peer; \
  X.proxyOp.nSteps = steps; X.proxyOp.chunkSize = NET_CHUNK; X.proxyOp.isSend = is_send;
  if (VER == 4) { FILL_POP(d.v4) } else { FILL_POP(d.v7) }
  return start(ctx, &d);
}
static void *proxy_step(void *ctx, void *parent, int step) {
  if (!parent) return NULL; /* NCCL: no step events under a NULL ProxyOp handle */
  descr_u d;
  descr_init(&d, NXP_EV_PROXY_STEP, parent, 1);
  if (VER == 4) d.v4.proxyStep.step = step; else d.v7.proxyStep.step = step;
  return start(ctx, &d);
}

static void pools(void *dl, const char *when) {
  void (*f)(uint64_t *) = dl ? (void (*)(uint64_t *))dlsym(dl, "nccl_exporter_profiler_pools") : NULL;
  if (!f) return;
  uint64_t o[8];
  f(o);
  printf("pools %s slots=%" PRIu64 " proxy_slots=%" PRIu64 " proxy_ops=%" PRIu64 " foreign=%" PRIu64 " orphan=%" PRIu64
         " late=%" PRIu64 " dropped=%" PRIu64 " proxy_on=%" PRIu64 "\n", when, o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]);
}

static void net(void *dl, int n, int nch, int steps, int spin) {
  struct comm c;
  comm_init(&c, 0xfeed, 1, 4);
  /* a plugin that does not ask for them (noop.c) gets the proxy events too:
   * the bench's reference for the same callbacks */
  if (getenv("DRIVER_PROXY_MASK")) MASK |= NXP_EV_PROXY_OP | NXP_EV_PROXY_STEP;
  pools(dl, "before");
  int pid = (int)getpid();
  descr_u d;
  uint64_t t0 = mono();
  long long events = 0;
  for (int i = 0; i < n; i++) {
    descr_init(&d, NXP_EV_GROUP, NULL, 0);
    void *grp = start(c.ctx, &d);
    descr_init(&d, NXP_EV_COLL, grp, 1);
    uint64_t s = c.seq[0]++;
    int func = 0;
    size_t count = 262144;
    if (VER == 4) { FILL_COLL(d.v4) } else { FILL_COLL(d.v5) d.v5.coll.parentGroup = grp; }
    void *op = start(c.ctx, &d);
    stop(op);
    stop(grp);
    void *pxn = proxy_op(c.ctx, (void *)0x10, pid + 1, 0, 3, steps, 1); /* PXN: not ours */
    stop(pxn);
    void *kh[64], *po[64][2];
    uint64_t tm = gpu_timer(mono());
    for (int ch = 0; ch < nch; ch++) {
      descr_init(&d, NXP_EV_KERNEL_CH, op, 0);
      if (VER == 4) { d.v4.kernelCh.channelId = (uint8_t)ch; d.v4.kernelCh.pTimer = tm; }
      else { d.v7.kernelCh.channelId = (uint8_t)ch; d.v7.kernelCh.pTimer = tm; }
      kh[ch] = start(c.ctx, &d);
      po[ch][0] = proxy_op(c.ctx, op, pid, ch, 2, steps, 1);
      po[ch][1] = proxy_op(c.ctx, op, pid, ch, 0, steps, 0);
    }
    for (int st = 0; st < steps; st++) {
      for (int dir = 0; dir < 2; dir++) {
        void *sh[64];
        for (int ch = 0; ch < nch; ch++) sh[ch] = proxy_step(c.ctx, po[ch][dir], st);
        for (int ph = 0; ph < 3; ph++) {
          int carries = (dir == 0 && ph == 2) || (dir == 1 && ph == 1); /* transSize with SendWait / RecvFlushWait */
          for (int ch = 0; ch < nch; ch++) proxy_record_args(sh[ch], NET_STATES[dir][ph], carries ? NET_CHUNK : 0);
          /* spin from after the last channel entered the phase: every channel then
           * spends at least D in it, even when this thread is preempted mid-loop */
          if (spin) spin_until(mono() + NET_D[dir][ph]);
        }
        for (int ch = 0; ch < nch; ch++) stop(sh[ch]);
        events += 5 * nch;
      }
    }
    int late = i % 2;
    if (!late) for (int ch = 0; ch < nch; ch++) { stop(po[ch][0]); stop(po[ch][1]); }
    for (int ch = 0; ch < nch; ch++) { record(kh[ch], NXP_STATE_KERNEL_CH_STOP, tm + 1000, 0); stop(kh[ch]); }
    if (late) for (int ch = 0; ch < nch; ch++) { stop(po[ch][0]); stop(po[ch][1]); }
  }
  uint64_t t1 = mono();
  printf("netbench ns_per_step_event=%.3f events=%lld n=%d nch=%d steps=%d\n",
         (double)(t1 - t0) / (double)(events ? events : 1), events, n, nch, steps);
  for (int dir = 0; dir < 2; dir++)
    printf("net expect peer=%d direction=%s bytes=%lld wall_ns=%llu,%llu,%llu step_ns=%llu,%llu,%llu\n",
           dir ? 0 : 2, dir ? "recv" : "send", (long long)nch * steps * NET_CHUNK,
           (unsigned long long)(steps * NET_D[dir][0]), (unsigned long long)(steps * NET_D[dir][1]),
           (unsigned long long)(steps * NET_D[dir][2]), (unsigned long long)(nch * steps * NET_D[dir][0]),
           (unsigned long long)(nch * steps * NET_D[dir][1]), (unsigned long long)(nch * steps * NET_D[dir][2]));
  pools(dl, "after");
  print_stats(dl);
  comm_fini(&c);
}

int main(int argc, char **argv) {
  if (argc < 4) { fprintf(stderr, "usage: driver PLUGIN|none VERSION SCENARIO [N]\n"); return 2; }
  VER = atoi(argv[2]);
  const char *scen = argv[3];
  int n = argc > 4 ? atoi(argv[4]) : 100;
  DRIFT_PPM = getenv("DRIVER_DRIFT_PPM") ? atof(getenv("DRIVER_DRIFT_PPM")) : 0;
  T0 = mono();
  void *dl = NULL;
  if (strcmp(argv[1], "none")) {
    dl = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!dl) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
    char sym[32];
    snprintf(sym, sizeof sym, "ncclProfiler_v%d", VER);
    P = dlsym(dl, sym);
    if (!P) { fprintf(stderr, "no %s\n", sym); return 2; }
  }
  if (!strcmp(scen, "net") || !strcmp(scen, "netbench")) { /* N NCH STEPS */
    net(dl, n, argc > 5 ? atoi(argv[5]) : 8, argc > 6 ? atoi(argv[6]) : 4, !strcmp(scen, "net"));
    return 0;
  }
  if (!strcmp(scen, "bench")) {
    bench(n, argc > 5 ? atoi(argv[5]) : 4);
    return 0;
  }
  pthread_t gt;
  pthread_create(&gt, NULL, gpu_thread, NULL);
  int proxy = getenv("DRIVER_PROXY") != NULL;

  if (!strcmp(scen, "ops")) {
    struct comm a, b;
    if (comm_init(&a, 0x1111222233334444ull, 2, 4) || comm_init(&b, 0x5555666677778888ull, 0, 2)) return 1;
    for (int i = 0; i < n; i++) {
      struct work w = {.dur_ns = 100000 + (uint64_t)(i % 7) * 50000, .late = (i % 5 == 3), .proxy = proxy};
      struct comm *c = (i % 3 == 2) ? &b : &a;
      int kind = (i % 4 == 1) ? 1 + (i / 4) % 2 : 0;   /* some Send/Recv */
      /* peers other than itself: NCCL <= 2.30 gives a Send/Recv to self no
       * KernelCh events (docs/plugin.md, "NCCL habits") */
      int peer = kind ? (c->rank + 1 + (i / 8) % (c->nranks - 1)) % c->nranks : -1;
      api_call(c, kind, i % 2, 1024 * (1 + i % 5), peer, 1 + i % 4, &w);
      if (i % 10 == 9) usleep(2000);                 /* some idle time */
    }
    drain();
    comm_fini(&a);
    comm_fini(&b);
  } else if (!strcmp(scen, "pending")) {
    struct comm a;
    if (comm_init(&a, 0xabcdef0123456789ull, 1, 4)) return 1;
    struct work w = {.dur_ns = 50000, .proxy = proxy};
    api_call(&a, 0, 0, 4096, -1, 2, &w);             /* completes */
    drain();
    struct work h = {.dur_ns = 50000, .hang = 1};
    api_call(&a, 0, 0, 4096, -1, 4, &h);             /* started, never stopped */
    drain();
    pthread_mutex_lock(&qm); gpu_paused = 1; pthread_mutex_unlock(&qm);
    struct work q = {.dur_ns = 50000};
    api_call(&a, 0, 1, 4096, -1, 2, &q);             /* queued, never started */
    if (getenv("DRIVER_HOLD_MS")) {  /* hold here so an agent can see the work in flight */
        printf("holding\n");
        fflush(stdout);
        usleep(1000 * atoi(getenv("DRIVER_HOLD_MS")));
    }
    comm_fini(&a);                                   /* destroy purges pending work */
    pthread_mutex_lock(&qm); qdone += qtail - qhead; qhead = qtail; gpu_paused = 0; pthread_mutex_unlock(&qm);
  } else if (!strcmp(scen, "nranks1")) {
    struct comm a;
    if (comm_init(&a, 0x9999, 0, 1)) return 1;       /* NCCL launches locally: no events */
    comm_fini(&a);
  } else if (!strcmp(scen, "pool")) {
    struct comm a;
    if (comm_init(&a, 0x7777, 0, 2)) return 1;
    pthread_mutex_lock(&qm); gpu_paused = 1; pthread_mutex_unlock(&qm);
    for (int i = 0; i < n; i++) {
      struct work w = {.dur_ns = 10000};
      api_call(&a, 0, 0, 256, -1, 2, &w);
    }
    pthread_mutex_lock(&qm); gpu_paused = 0; pthread_cond_broadcast(&qc); pthread_mutex_unlock(&qm);
    drain();
    comm_fini(&a);
  } else {
    fprintf(stderr, "unknown scenario %s\n", scen);
    return 2;
  }
  pthread_mutex_lock(&qm); qclosed = 1; pthread_cond_broadcast(&qc); pthread_mutex_unlock(&qm);
  pthread_join(gt, NULL);
  print_sent();
  print_stats(dl);
  return 0;
}

/* gpu.c -- GPU-like mode (NCCL_SIM_GPU=1): a stream thread per communicator that
 * runs the enqueued collectives (collectives.c, p2p.c) and sends the plugin
 * the events NCCL sends around a kernel, and NCCL's commHash. The plugin's
 * loading, init, gating and network events: profiler.c. Nothing here runs
 * with NCCL_SIM_GPU unset. */
#include "profiler.h"

__thread int tl_gpu_seq_valid;
__thread uint64_t tl_gpu_seq;

/* ================================================ GPU-like mode (opt-in) ==
 * NCCL_SIM_GPU=1: a collective call only *enqueues* (host time: microseconds);
 * each communicator has a "stream" thread that runs the enqueued work in order
 * (the TCP data movement above happens there).  A profiler plugin named by
 * NCCL_PROFILER_PLUGIN is loaded the way NCCL loads one (ncclProfiler_v7, v6,
 * v5, v4; init per communicator with NCCL's commHash; finalize at destroy /
 * abort) and gets NCCL's callbacks, with NCCL's habits.  See docs/simulator.md.
 * With NCCL_SIM_GPU unset nothing here runs. */

/* ---- NCCL's hash (src/include/bitops.h, NCCL >= 2.23; exporter/sources/nccl/hashing.py) */
static void nh_eat(uint64_t acc[2], const void *data, size_t len) {
  uint64_t a0 = acc[0] ^ (uint64_t)len, a1 = acc[1];
  const uint8_t *p = data;
  for (size_t off = 0; off < len; off += 8) {
    a0 += a1; a1 ^= a0;
    a0 = (a0 ^ (a0 >> 31)) * 0x9DE62BBC8CEF3CE3ull;
    a1 = (a1 ^ (a1 >> 32)) * 0x485CD6311B599E79ull;
    uint64_t w = 0;
    memcpy(&w, p + off, len - off < 8 ? len - off : 8);
    a0 += w;
  }
  acc[0] = a0; acc[1] = a1;
}
static uint64_t nh_digest(const uint64_t acc[2]) {
  uint64_t h = (acc[0] ^ (acc[0] >> 31)) * 0xBAC3BD562846DE6Bull;
  h += acc[1];
  return (h ^ (h >> 32)) * 0x995A187A14E7B445ull;
}
uint64_t nccl_root_hash(const ncclUniqueId *id) {
  uint64_t acc[2] = {1, 1};
  nh_eat(acc, id->internal, NCCL_UNIQUE_ID_BYTES);
  return nh_digest(acc);
}
uint64_t nccl_split_hash(uint64_t parent, uint32_t count, uint32_t color) {
  uint64_t acc[2] = {1, 1};
  nh_eat(acc, &parent, 8); nh_eat(acc, &count, 4); nh_eat(acc, &color, 4);
  return nh_digest(acc);
}



/* ---- streams ----------------------------------------------------------- */
typedef struct gpu_op {
  collargs_t a;
  void *h;                 /* the Coll / P2p handle (NULL: no KernelCh events) */
  void **ph;               /* NCCL_SIM_GPU_ALLTOALL_P2P: an AlltoAll's 2 x nranks P2p handles, then their */
  int nph;                 /*   KernelCh handles (ph[nph + j]); NULL: none */
  int nch;
  int stale;               /* NCCL_SIM_GPU_STALE_KCH: its last channel is lost (kch_start) */
} gpu_op_t;
typedef struct gpu_work {
  struct gpu_work *next;
  int n;
  gpu_op_t ops[];
} gpu_work_t;
typedef struct sim_stream {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t th;
  ncclComm_t comm;
  gpu_work_t *head, *tail;
  int qlen, busy, stop, abort, stalled;
  uint64_t ran;            /* works run */
} sim_stream_t;

static const char *func_name(int kind) {
  switch (kind) {
    case K_ALLREDUCE: return "AllReduce"; case K_ALLGATHER: return "AllGather";
    case K_REDUCESCATTER: return "ReduceScatter"; case K_BROADCAST: return "Broadcast";
    case K_REDUCE: return "Reduce"; case K_SEND: return "Send"; case K_RECV: return "Recv";
    case K_ALLTOALL: return "AlltoAll"; case K_GATHER: return "Gather"; case K_SCATTER: return "Scatter";
  }
  return "Unknown";
}
/* NCCL >= 2.29 with NCCL_ALLGATHERV_ENABLE=1 (its default) runs ncclBroadcast
 * on the AllGatherV path without an event activation mask: no Coll event, no
 * KernelCh, and the host's KernelCh timer slots fall one work item behind the
 * GPU per such Broadcast (NVIDIA/nccl#2368).  NCCL_SIM_GPU_BCAST_DESYNC=1:
 * later kernels of that communicator deliver the timers of the kernel
 * `desync` back (start and stop); =2: that kernel's start, their own stop. */
static int bcast_desync(void) {
  static int v = -1;
  if (v < 0) v = env_int("NCCL_SIM_GPU_BCAST_DESYNC", 0);
  return v;
}
static const char *op_name_of(int kind) {
  switch (kind) {
    case K_ALLREDUCE: return "ALL_REDUCE"; case K_ALLGATHER: return "ALL_GATHER";
    case K_REDUCESCATTER: return "REDUCE_SCATTER"; case K_BROADCAST: return "BROADCAST";
    case K_REDUCE: return "REDUCE"; case K_SEND: return "SEND"; case K_RECV: return "RECV";
    case K_ALLTOALL: return "ALL_TO_ALL"; case K_GATHER: return "GATHER"; case K_SCATTER: return "SCATTER";
  }
  return "?";
}
static const char *dt_name(int dt) {
  static const char *n[] = {"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64",
                            "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16", "ncclFloat8e4m3", "ncclFloat8e5m2"};
  return (dt >= 0 && dt < 12) ? n[dt] : "Unknown";
}
static int is_p2p(int kind) { return kind == K_SEND || kind == K_RECV; }

/* Collective calls NCCL runs with no Coll event and no seqNumber: their
 * tasks never enter the plan's collTaskQueue, the only queue
 * ncclProfilerStartTaskEvents walks to start Coll events and bump
 * comm->seqNumber[func] (v2.28.9-1 src/plugin/profiler.cc:393-427).
 *   count 0     taskAppend discards an empty collective before any task
 *               exists (v2.28.9-1 src/enqueue.cc:2554-2555; v2.27.7-1 :2331,
 *               v2.29.7-1 :2893, v2.30.7-1 :3023): always, unless
 *               NCCL_SIM_GPU_DISCARD_EMPTY=0 (the simulator's old numbering)
 *   copy engine NCCL_SIM_GPU_CE_COUNT=N: collectives of N elements are
 *               copy-engine collectives (buffers in symmetric windows,
 *               CTAPolicy zero: v2.28.9-1 src/enqueue.cc:2580-2581
 *               ceCollTaskAppend); their plan carries ceCollArgs and no task
 *               (:1438-1452). NCCL >= 2.29 may give them a CeColl event with
 *               its own ceSeqNum (v2.29.7-1 src/plugin/profiler.cc:764-790),
 *               which the plugin's mask never asks for
 *   symmetric   NCCL_SIM_GPU_SYMK_COUNT=N: collectives of N elements run as
 *               symmetric kernels: ncclSymmetricTaskScheduler takes them off
 *               collSymTaskQueue into kernel args and frees them
 *               (v2.28.9-1 src/scheduler/symmetric_sched.cc:109-212;
 *               v2.27.7-1 src/enqueue.cc:1409-1429)
 *   Broadcast   NCCL_SIM_GPU_BCAST_DESYNC (NCCL >= 2.29, ALLGATHERV_ENABLE):
 *               the Broadcast goes to a peer's bcastQueue as an AllGatherV
 *               task (v2.29.7-1 src/enqueue.cc:2581-2600), never collTaskQueue
 * They still run on the stream (a kernel or a copy), with no KernelCh. */
int gpu_discards(const collargs_t *a) {
  return !is_p2p(a->kind) && a->count == 0 && env_int("NCCL_SIM_GPU_DISCARD_EMPTY", 1);
}
static int gpu_unnumbered(const collargs_t *a) {
  if (is_p2p(a->kind)) return 0;
  int ce = env_int("NCCL_SIM_GPU_CE_COUNT", -1), symk = env_int("NCCL_SIM_GPU_SYMK_COUNT", -1);
  if (ce >= 0 && a->count == (size_t)ce) return 1;
  if (symk >= 0 && a->count == (size_t)symk) return 2;
  if (bcast_desync() && a->kind == K_BROADCAST) return 3;
  return 0;
}

/* seq (coll: per comm and kind; p2p: per comm, peer and direction) and enqueue time, at the call */
void gpu_assign(collargs_t *a) {
  ncclComm_t c = a->comm;
  a->unnumbered = gpu_unnumbered(a);
  if (is_p2p(a->kind)) a->seq = c->p2p_seq ? c->p2p_seq[2 * a->peer + (a->kind == K_RECV)]++ : 0;
  else if (a->unnumbered) a->seq = 0;
  else a->seq = c->coll_seq[a->kind & 15]++;
  a->enq_mono = now_ns(CLOCK_MONOTONIC);
  tl_gpu_seq = a->seq;
  tl_gpu_seq_valid = !a->unnumbered;   /* the call's truth line: NCCL's number, where it has one */
}

static void gpu_truth(ncclComm_t c, const gpu_op_t *o, uint64_t ts, uint64_t te, int late, const char *state, int nstarted) {
  char extra[700];
  snprintf(extra, sizeof extra,
           ",\"coll_fn\":\"%s\",\"coll_op\":\"%s\",\"seq\":%llu,\"comm_hash\":\"%016llx\",\"enqueue_mono_ns\":%llu,"
           "\"gpu_start_mono_ns\":%llu,\"gpu_stop_mono_ns\":%llu,\"gpu_start_timer\":%llu,\"gpu_stop_timer\":%llu,"
           "\"nchannels\":%d,\"kernelch_started\":%d,\"late\":%d,\"profiled\":%d,\"state\":\"%s\",\"desync\":%llu,"
           "\"stale_kch\":%d,\"unnumbered\":%d",
           func_name(o->a.kind), op_name_of(o->a.kind), (unsigned long long)o->a.seq, (unsigned long long)c->nccl_hash,
           (unsigned long long)o->a.enq_mono, (unsigned long long)ts, (unsigned long long)te,
           (unsigned long long)(ts ? gpu_timer(ts) : 0), (unsigned long long)(te ? gpu_timer(te) : 0), o->nch, nstarted,
           late, o->h != NULL, state, (unsigned long long)c->desync, o->stale, o->a.unnumbered);
  int64_t off = (int64_t)now_ns(CLOCK_REALTIME) - (int64_t)now_ns(CLOCK_MONOTONIC); /* wall time of the GPU interval */
  rec_t rec = {"gpuKernel", "GPU_KERNEL", (uint64_t)(uintptr_t)c, c->rank, c->nranks, o->a.count, o->a.dt, o->a.op,
               o->a.root, o->a.peer, 0, ts, te, ts ? (uint64_t)((int64_t)ts + off) : 0, te ? (uint64_t)((int64_t)te + off) : 0,
               0, extra};
  truth_write(&rec);
}

/* NCCL_SIM_GPU_STALE_KCH=N (NCCL <= 2.30; fixed by NVIDIA/nccl PR #2221):
 * in one pass of profilerProxyProgress (2.28.9 src/transport/profiler.cc:35-44)
 * the start check can miss a channel's start and the stop check, a moment
 * later, see its stop. The stop then goes out through sub->kernelEventHandle,
 * which still holds the handle of the operation that used those sub-args
 * before (src/proxy.cc:358-388 never resets it), and the args is done
 * (profiler connections are not shared, transport/profiler.cc:12-13: one sub
 * per args), so the operation's start on that channel never comes. Here every
 * N-th kernel of a communicator loses its last channel that way: no start,
 * and the stop (state and stopEvent) goes to the handle the previous kernel
 * of the communicator had on that channel. */
static int stale_kch_every(void) {
  static int v = -1;
  if (v < 0) v = env_int("NCCL_SIM_GPU_STALE_KCH", 0);
  return v;
}
static int stale_lost(gpu_op_t *o, int ch) { return o->stale && ch == o->nch - 1; }

static void kch_start(ncclComm_t c, gpu_op_t *o, void **kh, uint64_t ts) {
  for (int ch = 0; ch < o->nch; ch++) {
    kh[ch] = NULL;
    if (!o->h || stale_lost(o, ch)) continue;
    sim_descr_t d;
    d_init(&d, EV_KERNEL_CH, o->h, 0);     /* NCCL does not set rank for KernelCh */
    d.kernelCh.channelId = (uint8_t)ch;
    d.kernelCh.pTimer = gpu_timer(ts + (uint64_t)ch * 300);
    kh[ch] = p_start(c, &d);
  }
}
static void kch_stop(ncclComm_t c, gpu_op_t *o, void **kh, uint64_t te) {
  for (int ch = o->nch - 1; ch >= 0; ch--) {
    void *h = kh[ch];
    if (o->h && stale_lost(o, ch)) h = ch < 64 ? c->last_kh[ch] : NULL;  /* the previous operation's handle */
    p_record(h, ST_KERNEL_CH_STOP, gpu_timer(te - (uint64_t)ch * 200), 0);
    p_stop(h);
    if (kh[ch] && ch < 64) c->last_kh[ch] = kh[ch];
  }
}

/* NCCL_SIM_GPU_ALLTOALL_P2P=1: an ncclAlltoAll is 2 x nranks P2P tasks, a
 * Send and a Recv per peer (NCCL v2.28.9-1 src/enqueue.cc:2585-2588), each its
 * own P2p event and KernelCh; on NCCL <= 2.30 the Send/Recv to the rank
 * itself gets no proxy op, so no profiler proxy op and no KernelCh
 * (enqueue.cc:805 `nProxyOps = selfSend ? 0 : 2`, :1010-1019). */
static int alltoall_p2p(void) {
  static int v = -1;
  if (v < 0) v = env_int("NCCL_SIM_GPU_ALLTOALL_P2P", 0) ? 1 : 0;
  return v;
}
static void a2a_kch_start(ncclComm_t c, gpu_op_t *o, uint64_t ts) {
  for (int j = 0; j < o->nph; j++) {
    o->ph[o->nph + j] = NULL;
    if (!o->ph[j] || (j / 2 == c->rank && g_prof_ver <= 6)) continue;
    sim_descr_t d;
    d_init(&d, EV_KERNEL_CH, o->ph[j], 0);
    d.kernelCh.channelId = 0;
    d.kernelCh.pTimer = gpu_timer(ts);
    o->ph[o->nph + j] = p_start(c, &d);
  }
}
static void a2a_kch_stop(gpu_op_t *o, uint64_t te) {
  for (int j = 0; j < o->nph; j++) {
    p_record(o->ph[o->nph + j], ST_KERNEL_CH_STOP, gpu_timer(te), 0);
    p_stop(o->ph[o->nph + j]);
  }
}
static void work_free(gpu_work_t *w) {
  for (int i = 0; i < w->n; i++) free(w->ops[i].ph);
  free(w);
}

/* Run ops[0..n) as one "kernel" (a collective, or a batch of p2p ops run together). */
static void run_kernel(sim_stream_t *s, gpu_op_t *ops, int n) {
  ncclComm_t c = s->comm;
  int nch = 0;
  for (int i = 0; i < n; i++) nch += ops[i].nch;
  void **kh = calloc((size_t)(nch ? nch : 1), sizeof(void *));
  int late_every = env_int("NCCL_SIM_GPU_LATE_EVERY", 5);
  int late = late_every > 0 && (c->ncoll++ % (uint64_t)late_every) == (uint64_t)(late_every - 1);
  uint64_t ts = now_ns(CLOCK_MONOTONIC);
  /* the times whose timers the KernelCh events carry: this kernel's, or with
   * NCCL_SIM_GPU_BCAST_DESYNC an older kernel's (bcast_desync above) */
  uint64_t kslot = c->nkern++ % 64, back = c->desync < 64 ? c->desync : 63;
  c->kts[kslot] = ts;
  uint64_t pts = ts, old = (kslot + 64 - back) % 64;
  if (back && c->nkern > back) pts = c->kts[old];
  int stale = stale_kch_every() > 0 && (c->nkern % (uint64_t)stale_kch_every()) == 0;
  for (int i = 0; i < n; i++) ops[i].stale = stale && ops[i].h;
  if (!late) for (int i = 0, k = 0; i < n; k += ops[i].nch, i++) { kch_start(c, &ops[i], kh + k, pts); a2a_kch_start(c, &ops[i], pts); }
  ncclResult_t res;
  if (!is_p2p(ops[0].a.kind)) {   /* one collective, or a batch of them (NCCL_SIM_GPU_BATCH) */
    res = ncclSuccess;
    for (int i = 0; i < n && res == ncclSuccess; i++) {
      tl_net_parent = ops[i].h; tl_net_kind = ops[i].a.kind; tl_net_seq = ops[i].a.seq;
      res = exec_coll(&ops[i].a);
    }
    tl_net_parent = NULL; tl_net_kind = 0; tl_net_seq = 0;
  } else {
    p2p_t *p = malloc(sizeof(p2p_t) * (size_t)n);
    for (int i = 0; i < n; i++) {
      collargs_t *a = &ops[i].a;
      p[i] = (p2p_t){a->peer, a->kind == K_SEND, a->kind == K_SEND ? (char *)a->sb : (char *)a->rb, a->count * dt_size(a->dt), 0,
                     0, ops[i].h, a->kind, a->seq};
    }
    res = p ? run_p2p(c, p, n) : ncclSystemError;
    free(p);
  }
  /* the kernel's own time beyond the data movement, and room for the channels' timer spread */
  uint64_t min_ns = (uint64_t)env_int("NCCL_SIM_GPU_KERNEL_US", 0) * 1000ull;
  uint64_t spread = (uint64_t)nch * 500 + 1000;
  if (min_ns < spread) min_ns = spread;
  for (;;) {   /* sleep most of it (a spinning "GPU" would starve the host threads of small machines) */
    uint64_t el = now_ns(CLOCK_MONOTONIC) - ts;
    if (el >= min_ns) break;
    if (min_ns - el > 200000) { struct timespec sl = {0, (long)(min_ns - el - 100000)}; nanosleep(&sl, NULL); }
  }
  uint64_t te = now_ns(CLOCK_MONOTONIC);
  pthread_mutex_lock(&s->mu);
  int aborted = s->abort;
  pthread_mutex_unlock(&s->mu);
  if (res != ncclSuccess && !aborted && c->async_err == ncclSuccess) c->async_err = res;
  if (aborted || res != ncclSuccess) {
    /* abort purges pending KernelCh work: no stopEvent.  A kernel whose peers
     * failed never ends on a GPU either: no stopEvent, the communicator carries
     * the async error, and its abort/destroy finalizes the plugin. */
    for (int i = 0, k = 0; i < n; k += ops[i].nch, i++) {
      int started = 0;
      for (int ch = 0; ch < ops[i].nch; ch++) if (kh[k + ch]) { started++; __atomic_fetch_add(&g_prof_purged_kch, 1, __ATOMIC_RELAXED); }
      __atomic_fetch_add(&g_prof_purged_ops, 1, __ATOMIC_RELAXED);
      gpu_truth(c, &ops[i], ts, 0, late, aborted ? "purged" : "error", started);
    }
    free(kh);
    return;
  }
  c->kte[kslot] = te;
  uint64_t pte = (pts != ts && bcast_desync() == 1) ? c->kte[old] : te;
  if (late) for (int i = 0, k = 0; i < n; k += ops[i].nch, i++) { kch_start(c, &ops[i], kh + k, pts); a2a_kch_start(c, &ops[i], pts); }
  for (int i = 0, k = 0; i < n; k += ops[i].nch, i++) {
    kch_stop(c, &ops[i], kh + k, pte);
    a2a_kch_stop(&ops[i], pte);
    gpu_truth(c, &ops[i], ts, te, late, "done", ops[i].h ? ops[i].nch : 0);
  }
  if (bcast_desync() && n == 1 && ops[0].a.kind == K_BROADCAST) c->desync++; /* the GPU ran it; the host never counted it */
  free(kh);
}

static int stall_rank_of(ncclComm_t c) {
  const char *r = getenv("RANK");
  return (r && *r) ? atoi(r) : c->rank;
}

static void *stream_main(void *arg) {
  sim_stream_t *s = arg;
  char name[16];
  snprintf(name, sizeof name, "NCCL Stream %d", s->comm->rank);
  pthread_setname_np(pthread_self(), name);
  int stall_rank = env_int("NCCL_SIM_GPU_STALL_RANK", -1);
  int stall_after = env_int("NCCL_SIM_GPU_STALL_AFTER", 0);
  int me = stall_rank_of(s->comm);
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while ((!s->head || s->stalled) && !s->stop && !s->abort) pthread_cond_wait(&s->cv, &s->mu);
    if (s->abort || (s->stop && !s->head)) break;
    if (stall_rank >= 0 && me == stall_rank && s->ran >= (uint64_t)stall_after) {
      s->stalled = 1;       /* a GPU-side hang: nothing runs any more; the host keeps enqueuing */
      pthread_mutex_unlock(&s->mu);
      char extra[64];
      snprintf(extra, sizeof extra, ",\"after\":%d", stall_after);
      gpu_truth_simple("gpuStall", "GPU_STALL", s->comm, extra);
      pthread_mutex_lock(&s->mu);
      continue;
    }
    gpu_work_t *w = s->head;
    s->head = w->next;
    if (!s->head) s->tail = NULL;
    s->qlen--;
    s->busy = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    int err = s->comm->async_err != ncclSuccess;
    /* collectives in call order, then the p2p ops together (as the blocking mode does) */
    int np = 0;
    /* NCCL_SIM_GPU_BATCH=1: the collectives of one group on a communicator run
     * as one kernel, whose every channel writes one start and one stop timer
     * for all of them (NCCL v2.28.9-1 src/device/common.h:309-327): each
     * Coll's KernelCh events carry the same timers. */
    int batch = env_int("NCCL_SIM_GPU_BATCH", 0), nc = 0;
    gpu_op_t *colls = batch ? malloc(sizeof(gpu_op_t) * (size_t)w->n) : NULL;
    for (int i = 0; i < w->n; i++) {
      if (is_p2p(w->ops[i].a.kind)) { np++; continue; }
      if (err) { gpu_truth(s->comm, &w->ops[i], 0, 0, 0, "skipped", 0); continue; }
      if (colls) colls[nc++] = w->ops[i];
      else run_kernel(s, &w->ops[i], 1);
    }
    if (nc) run_kernel(s, colls, nc);
    free(colls);
    if (np) {
      gpu_op_t *p = malloc(sizeof(gpu_op_t) * (size_t)np);
      int k = 0;
      for (int i = 0; i < w->n; i++) if (is_p2p(w->ops[i].a.kind)) p[k++] = w->ops[i];
      if (s->comm->async_err == ncclSuccess) run_kernel(s, p, np);
      else for (int i = 0; i < np; i++) gpu_truth(s->comm, &p[i], 0, 0, 0, "skipped", 0);
      free(p);
    }
    work_free(w);
    pthread_mutex_lock(&s->mu);
    s->busy = 0;
    s->ran++;
    pthread_cond_broadcast(&s->cv);
  }
  /* abort: queued work is dropped (its Coll/P2p got no KernelCh) */
  while (s->head) {
    gpu_work_t *w = s->head;
    s->head = w->next;
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < w->n; i++) {
      __atomic_fetch_add(&g_prof_purged_ops, 1, __ATOMIC_RELAXED);
      gpu_truth(s->comm, &w->ops[i], 0, 0, 0, "purged", 0);
    }
    work_free(w);
    pthread_mutex_lock(&s->mu);
  }
  s->tail = NULL; s->qlen = 0;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static pthread_mutex_t g_stream_mu = PTHREAD_MUTEX_INITIALIZER;
static sim_stream_t *stream_of(ncclComm_t c) {
  pthread_mutex_lock(&g_stream_mu);
  sim_stream_t *s = c->stream;
  if (!s) {
    s = calloc(1, sizeof *s);
    if (s) {
      pthread_mutex_init(&s->mu, NULL);
      pthread_cond_init(&s->cv, NULL);
      s->comm = c;
      if (pthread_create(&s->th, NULL, stream_main, s) != 0) { free(s); s = NULL; }
      else c->stream = s;
    }
  }
  pthread_mutex_unlock(&g_stream_mu);
  return s;
}

/* Profiler callbacks of one group's ops on one communicator, NCCL's order:
 * GroupApi, its API children (stopped at once), KernelLaunch, Group, then each
 * Coll / P2p started and stopped ("enqueued", not done) -- every parent is
 * stopped before its KernelCh children start on the stream thread. */
static void prof_enqueue(ncclComm_t c, gpu_op_t *ops, int n) {
  if (!g_prof || !c->prof_inited || c->nranks == 1) return;   /* nranks = 1: NCCL gives no events */
  int v7 = g_prof_ver >= 7;
  sim_descr_t d;
  d_init(&d, EV_GROUP_API, NULL, 0);
  d.groupApi.graphCaptured = false; d.groupApi.groupDepth = 1;
  void *gapi = p_start(c, &d);
  p_record(gapi, ST_GROUP_START_API_STOP, 0, v7);
  void **api = calloc((size_t)n, sizeof(void *));
  for (int i = 0; i < n; i++) {
    collargs_t *a = &ops[i].a;
    if (is_p2p(a->kind)) {
      d_init(&d, EV_P2P_API, gapi, 0);
      d.p2pApi.func = func_name(a->kind); d.p2pApi.count = a->count; d.p2pApi.datatype = dt_name(a->dt);
      d.p2pApi.stream = NULL; d.p2pApi.graphCaptured = false; if (v7) d.p2pApi.userTag = 0;
    } else {
      d_init(&d, EV_COLL_API, gapi, 0);
      d.collApi.func = func_name(a->kind); d.collApi.count = a->count; d.collApi.datatype = dt_name(a->dt);
      d.collApi.root = a->root; d.collApi.stream = NULL; d.collApi.graphCaptured = false; if (v7) d.collApi.userTag = 0;
    }
    void *h = p_start(c, &d);
    if (api) api[i] = h;
    p_stop(h);                 /* the API parent stops before its Coll starts */
  }
  p_record(gapi, ST_GROUP_END_API_START, 0, v7);
  d_init(&d, EV_KERNEL_LAUNCH, gapi, 0);
  d.kernelLaunch.stream = NULL;
  p_stop(p_start(c, &d));
  d_init(&d, EV_GROUP, NULL, 0);
  void *grp = p_start(c, &d);
  int nch = env_int("NCCL_SIM_GPU_CHANNELS", 2);
  if (nch < 1) nch = 1;
  if (nch > 32) nch = 32;
  for (int i = 0; i < n; i++) {
    collargs_t *a = &ops[i].a;
    void *parent = g_prof_ver == 4 ? grp : (api ? api[i] : NULL);
    ops[i].nch = nch;
    if (is_p2p(a->kind)) {
      d_init(&d, EV_P2P, parent, c->rank);
      d.p2p.func = func_name(a->kind); d.p2p.buff = a->kind == K_SEND ? (void *)a->sb : a->rb;
      d.p2p.datatype = dt_name(a->dt); d.p2p.count = a->count; d.p2p.peer = a->peer; d.p2p.nChannels = (uint8_t)nch;
      if (g_prof_ver >= 5) d.p2p.parentGroup = grp;
      if (v7) d.p2p.userTag = 0;
    } else {
      d_init(&d, EV_COLL, parent, c->rank);
      d.coll.seqNumber = a->seq; d.coll.func = func_name(a->kind); d.coll.sendBuff = a->sb; d.coll.recvBuff = a->rb;
      d.coll.count = a->count; d.coll.root = a->root; d.coll.datatype = dt_name(a->dt); d.coll.nChannels = (uint8_t)nch;
      /* NCCL_SIM_GPU_COLLNET=1: CollNet/NVLS collectives. NCCL never sets the
       * task's nChannels for them (v2.28.9-1 src/enqueue.cc:568-597: the
       * CollNet branch uses nMaxChannels and adds a profiler proxy op per
       * channel), so the Coll says 0 channels and its KernelCh events still
       * come, one per channel, with the Coll's handle as parent. */
      if (env_int("NCCL_SIM_GPU_COLLNET", 0)) d.coll.nChannels = 0;
      d.coll.nWarps = 16; d.coll.algo = "RING"; d.coll.proto = "SIMPLE";
      if (g_prof_ver >= 5) d.coll.parentGroup = grp;
      if (v7) { d.coll.kernelVariant = "default"; d.coll.isSymColl = false; d.coll.userTag = 0; }
    }
    if (a->unnumbered) { ops[i].h = NULL; continue; } /* no Coll event (gpu_unnumbered) */
    if (alltoall_p2p() && a->kind == K_ALLTOALL) {   /* 2 x nranks P2p events, no Coll (see alltoall_p2p) */
      ops[i].h = NULL;
      ops[i].nph = 2 * c->nranks;
      ops[i].ph = calloc(2 * (size_t)ops[i].nph, sizeof(void *));
      if (!ops[i].ph) { ops[i].nph = 0; continue; }
      for (int j = 0; j < ops[i].nph; j++) {
        int snd = j % 2 == 0, peer = j / 2;
        d_init(&d, EV_P2P, parent, c->rank);
        d.p2p.func = snd ? "Send" : "Recv"; d.p2p.buff = snd ? (void *)a->sb : a->rb;
        d.p2p.datatype = dt_name(a->dt); d.p2p.count = a->count; d.p2p.peer = peer; d.p2p.nChannels = 1;
        if (g_prof_ver >= 5) d.p2p.parentGroup = grp;
        if (v7) d.p2p.userTag = 0;
        ops[i].ph[j] = p_start(c, &d);
        p_stop(ops[i].ph[j]);
      }
      continue;
    }
    ops[i].h = p_start(c, &d);
    p_stop(ops[i].h);          /* "enqueued", not done */
  }
  p_stop(grp);
  p_stop(gapi);
  free(api);
}

/* NCCL_SIM_GPU_GRAPH_REPLAYS=N: every collective call is captured into a CUDA
 * graph and the graph replayed N times. A captured plan's profiler events
 * come at each replay, from its host-function node (hostStreamPlanTask):
 * a Group, then the Coll with no CollApi parent (no API call at a replay);
 * none at the capture. NCCL bumps seqNumber for a persistent plan only when
 * the plugin gave a Group or CollApi handle and KernelCh is on (v2.28.9-1
 * src/plugin/profiler.cc:419-427): a plugin that returns NULL for both sees
 * every replay with the same seqNumber. */
static void prof_replay(ncclComm_t c, gpu_op_t *o) {
  collargs_t *a = &o->a;
  o->h = NULL;
  if (!g_prof || !c->prof_inited || c->nranks == 1) return;
  sim_descr_t d;
  d_init(&d, EV_GROUP, NULL, 0);
  void *grp = p_start(c, &d);
  a->seq = c->coll_seq[a->kind & 15];
  a->enq_mono = now_ns(CLOCK_MONOTONIC);
  d_init(&d, EV_COLL, g_prof_ver == 4 ? grp : NULL, c->rank);
  d.coll.seqNumber = a->seq; d.coll.func = func_name(a->kind); d.coll.sendBuff = a->sb; d.coll.recvBuff = a->rb;
  d.coll.count = a->count; d.coll.root = a->root; d.coll.datatype = dt_name(a->dt); d.coll.nChannels = (uint8_t)o->nch;
  d.coll.nWarps = 16; d.coll.algo = "RING"; d.coll.proto = "SIMPLE";
  if (g_prof_ver >= 5) d.coll.parentGroup = grp;
  if (g_prof_ver >= 7) { d.coll.kernelVariant = "default"; d.coll.isSymColl = false; d.coll.userTag = 0; }
  o->h = p_start(c, &d);
  p_stop(o->h);
  if (grp && (__atomic_load_n(&g_prof_mask, __ATOMIC_RELAXED) & EV_KERNEL_CH)) c->coll_seq[a->kind & 15]++;
  p_stop(grp);
}

ncclResult_t gpu_enqueue(collargs_t *q, int qn) {
  int qmax = env_int("NCCL_SIM_GPU_QUEUE", 1024);
  for (int i = 0; i < qn; i++) {
    ncclComm_t c = q[i].comm;
    int seen = 0;
    for (int j = 0; j < i; j++) if (q[j].comm == c) { seen = 1; break; }
    if (seen) continue;
    int n = 0;
    for (int j = i; j < qn; j++) if (q[j].comm == c) n++;
    gpu_work_t *w = calloc(1, sizeof(gpu_work_t) + sizeof(gpu_op_t) * (size_t)n);
    if (!w) return ncclSystemError;
    w->n = n;
    for (int j = i, k = 0; j < qn; j++) if (q[j].comm == c) { w->ops[k].a = q[j]; w->ops[k].nch = env_int("NCCL_SIM_GPU_CHANNELS", 2); k++; }
    sim_stream_t *s = stream_of(c);
    if (!s) { free(w); return ncclSystemError; }
    int replays = env_int("NCCL_SIM_GPU_GRAPH_REPLAYS", 0);
    if (replays > 0 && n == 1 && !is_p2p(w->ops[0].a.kind) && !w->ops[0].a.unnumbered) {
      c->coll_seq[w->ops[0].a.kind & 15]--; /* the capture: no seqNumber (profiler.cc:419-427 runs at replays) */
      for (int r = 0; r < replays; r++) {
        gpu_work_t *wr = malloc(sizeof(gpu_work_t) + sizeof(gpu_op_t));
        if (!wr) break;
        memcpy(wr, w, sizeof(gpu_work_t) + sizeof(gpu_op_t));
        wr->next = NULL;
        prof_replay(c, &wr->ops[0]);
        pthread_mutex_lock(&s->mu);
        while (s->qlen >= qmax && !s->abort) pthread_cond_wait(&s->cv, &s->mu);
        if (s->abort) { pthread_mutex_unlock(&s->mu); free(wr); break; }
        if (s->tail) s->tail->next = wr; else s->head = wr;
        s->tail = wr;
        s->qlen++;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
      }
      free(w);
      continue;
    }
    prof_enqueue(c, w->ops, n);
    pthread_mutex_lock(&s->mu);
    while (s->qlen >= qmax && !s->abort) pthread_cond_wait(&s->cv, &s->mu);  /* a full launch queue blocks the host */
    if (s->abort) { pthread_mutex_unlock(&s->mu); work_free(w); return ncclInvalidUsage; }
    if (s->tail) s->tail->next = w; else s->head = w;
    s->tail = w;
    s->qlen++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
  }
  return ncclSuccess;
}

/* Wait until the communicator's stream has run everything enqueued (cudaStreamSynchronize). */
ncclResult_t gpu_drain(ncclComm_t c) {
  if (!gpu_on() || !c || !c->stream) return ncclSuccess;
  sim_stream_t *s = c->stream;
  pthread_mutex_lock(&s->mu);
  while ((s->head || s->busy) && !s->abort) pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
  return c->async_err;
}

/* The simulator's stand-in for cudaStreamSynchronize on the stream the
 * communicator's work went to.  Not an NCCL function. */
EXPORT ncclResult_t simStreamSynchronize(ncclComm_t comm) {
  if (!comm_ok(comm)) return ncclInvalidArgument;
  return gpu_drain(comm);
}

/* Destroy (abort = 0: the stream is drained first) or abort (abort = 1: pending
 * work purged; KernelCh events already started get no stopEvent), then the
 * plugin's finalize. */
void gpu_comm_teardown(ncclComm_t c, int abort) {
  if (!c) return;
  sim_stream_t *s = c->stream;
  if (s) {
    if (!abort) gpu_drain(c);
    pthread_mutex_lock(&s->mu);
    if (abort) s->abort = 1; else s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    int busy = s->busy;
    pthread_mutex_unlock(&s->mu);
    if (abort && busy && c->fds)       /* wake a kernel blocked on its peers */
      for (int i = 0; i < c->nranks; i++) if (c->fds[i] >= 0) shutdown(c->fds[i], SHUT_RDWR);
    pthread_join(s->th, NULL);
    c->stream = NULL;
    pthread_cond_destroy(&s->cv); pthread_mutex_destroy(&s->mu); free(s);
  }
  prof_comm_finalize(c, abort);
}

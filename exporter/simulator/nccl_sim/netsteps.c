/* netsteps.c -- GPU-like mode's network data path: the proxy thread moves a batch's
 * sends and receives in steps, as NCCL's proxy progress thread does for a NET
 * transport, and tells the profiler plugin about each step (ProxyOp, ProxyStep).
 *
 * NCCL (src/transport/net.cc, src/proxy.cc; docs/network.md): per channel x
 * network peer x direction one ProxyOp (pid, channelId, peer, nSteps,
 * chunkSize, isSend) under the Coll/P2p handle; under it one ProxyStep per
 * step, at most NCCL_STEPS = 8 of a ProxyOp open at once, each going through
 *   send: SendGPUWait -> SendPeerWait -> SendWait (transSize) -> stop
 *   recv: RecvWait -> RecvFlushWait (transSize) -> RecvGPUWait -> stop.
 * Here a batch's transfer with one peer in one direction is cut into steps of
 * NCCL_SIM_GPU_CHUNK bytes (default 128 KiB), step j on channel j % channels
 * (NCCL_SIM_GPU_CHANNELS), up to 8 steps per transfer in flight:
 *   send step: posted (SendGPUWait) -> the "GPU" produced it (SendPeerWait)
 *              -> the receiver's credit, at once here (SendWait) -> its bytes
 *              were handed to the socket (stop);
 *   recv step: posted (RecvWait) -> its bytes arrived (RecvFlushWait) -> no
 *              flush here (RecvGPUWait) -> consumed at once (stop).
 * One difference from NCCL: its ProxyOps cover a whole collective, ours one
 * batch (one ring step of the algorithms in collectives.c); the plugin's sums
 * per (peer, direction) do not depend on it.
 *
 * Faults, for tests (docs/simulator.md):
 *   NCCL_SIM_SLOW_LINK=FROM:TO:US[:NRANKS]  the data of rank FROM to rank TO
 *       leaves US microseconds late per step (a slow link: FROM's send_wait
 *       and TO's recv_wait grow); communicator ranks, in every communicator
 *       or, with NRANKS, in those of NRANKS ranks;
 *   NCCL_SIM_SLOW_GPU=RANK:US[:NRANKS]  RANK's GPU produces each step's data US late
 *       (a compute straggler: RANK's send_gpu_wait grows, and its receivers'
 *       recv_wait, which includes the sender being late);
 *   NCCL_SIM_GPU_PXN=1  each batch also gets a ProxyOp of another pid (a PXN
 *       proxy's op) with that process's context and a parent shaped like the
 *       plugin's handles, and its steps (pxn_op);
 *   NCCL_SIM_GPU_PXN=2  one process, several GPUs, with PXN: two threads of
 *       this process add ProxyOps to one operation at once (pxn_same_process);
 *   NCCL_SIM_GPU_RECV_RESTART=1  every receive step is started twice before
 *       its first state, as NCCL restarts a step whose irecv was not posted;
 *   NCCL_SIM_GPU_PROXY_NO_STOP=1  ProxyOps are started and never stopped, with
 *       no steps (CollNet, SHM/P2P copy-engine modes).
 * NCCL_SIM_GPU_STEP_TRUTH=1 writes one truth line per step (fn "proxyStep"):
 * when it entered each of its three states and stopped, as this thread saw it. */
#include "nccl_sim.h"
#include <sys/stat.h>

#define NSTEPS_INFLIGHT 8  /* NCCL_STEPS */
enum { ST_SEND_GPU_WAIT = 8, ST_SEND_WAIT = 9, ST_RECV_WAIT = 10, ST_RECV_FLUSH_WAIT = 11, ST_RECV_GPU_WAIT = 12,
       ST_SEND_PEER_WAIT = 20 };

typedef struct {
  int64_t step;           /* step index in the transfer; -1: slot free */
  void *h;                /* ProxyStep handle */
  int phase;              /* 0..2: the state entered last */
  uint64_t t[4];          /* entered phase 0, 1, 2; stopped */
  uint64_t ready;         /* send: data produced (GPU) / may leave (link) */
  size_t len;
} slot_t;

typedef struct {
  p2p_t *o;
  size_t chunk;
  int64_t nsteps, posted, done;
  void *pop[32];          /* ProxyOp per channel */
  slot_t s[NSTEPS_INFLIGHT];
  uint64_t link_us;       /* send: this link's delay per step */
} xfer_t;

/* A fault's optional last field NRANKS: only communicators of that many ranks (ranks are
 * communicator ranks: without it, every communicator where the ranks exist). */
static int parse3(const char *v, int *a, int *b, long *c, int *n) {
  *n = 0;
  return v && sscanf(v, "%d:%d:%ld:%d", a, b, c, n) >= 3;
}
static int parse2(const char *v, int *a, long *c, int *n) {
  *n = 0;
  return v && sscanf(v, "%d:%ld:%d", a, c, n) >= 2;
}

/* NCCL_SIM_FAULTS_FILE=PATH switches the two faults above on or off mid-job
 * (bench/faults: a random onset). Lines NAME=VALUE of that file replace the
 * environment's NCCL_SIM_SLOW_LINK / NCCL_SIM_SLOW_GPU ("NAME=" switches it
 * off); a name the file lacks, or no file, leaves the environment's. The file
 * is read again when its mtime changes, looked at once per 100 ms at most. A
 * test switch like the variables themselves: NCCL reads its own settings once. */
static pthread_mutex_t faults_mu = PTHREAD_MUTEX_INITIALIZER;
static char faults_text[512];
static int faults_have;

static void faults_poll_locked(void) {
  static uint64_t next;
  static struct timespec seen;
  const char *path = getenv("NCCL_SIM_FAULTS_FILE");
  uint64_t now = now_ns(CLOCK_MONOTONIC);
  if (!path || now < next) return;
  next = now + 100000000ull;
  struct stat st;
  if (stat(path, &st) != 0) { faults_have = 0; return; }
  if (faults_have && st.st_mtim.tv_sec == seen.tv_sec && st.st_mtim.tv_nsec == seen.tv_nsec) return;
  FILE *f = fopen(path, "r");
  if (!f) { faults_have = 0; return; }
  size_t n = fread(faults_text, 1, sizeof faults_text - 1, f);
  fclose(f);
  faults_text[n] = 0;
  seen = st.st_mtim;
  faults_have = 1;
}

/* The value of fault variable `name` into buf: the file's, else the environment's; 0 if neither. */
static int fault_value(const char *name, char *buf, size_t len) {
  size_t nl = strlen(name);
  int found = 0;
  pthread_mutex_lock(&faults_mu);
  faults_poll_locked();
  for (const char *l = faults_have ? faults_text : ""; *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : l + strlen(l)) {
    if (strncmp(l, name, nl) == 0 && l[nl] == '=') {
      const char *v = l + nl + 1;
      size_t vl = strcspn(v, "\n");
      snprintf(buf, len, "%.*s", (int)(vl < len ? vl : len - 1), v);
      found = 1;
    }
  }
  pthread_mutex_unlock(&faults_mu);
  if (found) return 1;
  const char *e = getenv(name);
  if (!e) return 0;
  snprintf(buf, len, "%s", e);
  return 1;
}

static uint64_t link_delay_ns(ncclComm_t c, int to) {
  int a, b, n;
  long us;
  char v[64];
  if (fault_value("NCCL_SIM_SLOW_LINK", v, sizeof v) && parse3(v, &a, &b, &us, &n) && a == c->rank && b == to &&
      us > 0 && (n == 0 || n == c->nranks))
    return (uint64_t)us * 1000;
  return 0;
}
static uint64_t gpu_delay_ns(ncclComm_t c) {
  int r, n;
  long us;
  char v[64];
  if (fault_value("NCCL_SIM_SLOW_GPU", v, sizeof v) && parse2(v, &r, &us, &n) && r == c->rank && us > 0 &&
      (n == 0 || n == c->nranks))
    return (uint64_t)us * 1000;
  return 0;
}

static int step_truth(void) {
  static int v = -1;
  if (v < 0) v = env_int("NCCL_SIM_GPU_STEP_TRUTH", 0) && getenv("NCCL_SIM_TRUTH") ? 1 : 0;
  return v;
}

static void truth_step(ncclComm_t c, const xfer_t *x, const slot_t *s, int nch) {
  char extra[512];
  snprintf(extra, sizeof extra,
           ",\"comm_hash\":\"%016llx\",\"coll_kind\":%d,\"seq\":%llu,\"direction\":\"%s\",\"channel\":%d,"
           "\"step\":%lld,\"trans_size\":%zu,\"t0\":%llu,\"t1\":%llu,\"t2\":%llu,\"t_stop\":%llu",
           (unsigned long long)c->nccl_hash, x->o->okind, (unsigned long long)x->o->oseq,
           x->o->is_send ? "send" : "recv", (int)(s->step % nch), (long long)s->step, s->len,
           (unsigned long long)s->t[0], (unsigned long long)s->t[1], (unsigned long long)s->t[2],
           (unsigned long long)s->t[3]);
  rec_t rec = {"proxyStep", "PROXY_STEP", (uint64_t)(uintptr_t)c, c->rank, c->nranks, s->len, -1, -1, -1, x->o->peer, 0,
               s->t[0], s->t[3], 0, 0, 0, extra};
  truth_write(&rec);
}

static void enter(slot_t *s, int phase, int state, size_t trans) {
  uint64_t now = now_ns(CLOCK_MONOTONIC);
  s->phase = phase;
  s->t[phase] = now;
  gpu_proxy_record(s->h, state, trans);
}

static void finish_step(ncclComm_t c, xfer_t *x, slot_t *s, int nch) {
  s->t[3] = now_ns(CLOCK_MONOTONIC);
  gpu_proxy_stop(s->h);
  if (step_truth() && x->o->parent) truth_step(c, x, s, nch); /* steps of an operation the profiler saw */
  s->step = -1;
  x->done++;
}

/* NCCL_SIM_GPU_PXN=1: a ProxyOp another process posted (gpu.c, gpu_proxy_op_start_ctx):
 * that process's context (an inaccessible address here) and parent handle
 * (its plugin's handle, shaped like ours: here this batch's own), its pid,
 * and its steps with each state, whatever the ProxyOp start returned
 * (NCCL 2.28.9 src/plugin/profiler.cc:493, 516-541; src/transport/net.cc
 * records the states and stops through the step handles it got). */
static void pxn_op(ncclComm_t c, p2p_t *o, int pid, int chunk) {
  void *fctx = gpu_foreign_ctx(), *parent = o->parent ? o->parent : (void *)(uintptr_t)0x8;
  void *op = gpu_proxy_op_start_ctx(c, fctx, parent, pid + 1, 0, o->peer, 2, chunk, 1);
  for (int step = 0; step < 2; step++) {
    void *h = gpu_proxy_step_start_ctx(c, fctx, op, step);
    gpu_proxy_record(h, ST_SEND_GPU_WAIT, 0);
    gpu_proxy_record(h, ST_SEND_PEER_WAIT, 0);
    gpu_proxy_record(h, ST_SEND_WAIT, (size_t)chunk);
    gpu_proxy_stop(h);
  }
  gpu_proxy_stop(op);
}

/* NCCL_SIM_GPU_PXN=2: one process driving several GPUs (JAX-style) with PXN.
 * Another communicator's proxy thread of this same process moves part of this
 * operation's data: its ProxyOps carry our pid and this operation's handle
 * (NCCL 2.28.9 src/proxy.cc:385 copies op->pid and op->taskEventHandle into
 * the sub-args whichever proxy progresses them), so two threads fill one
 * operation's network table at once. Here a second thread and this one each
 * start, at the same moment, one ProxyOp with one step per (peer, direction)
 * for 16 peers (more than the plugin names per operation). */
typedef struct { ncclComm_t c; void *parent; int pid, chunk, base; pthread_barrier_t *go; } burst_t;
static void *pxn_burst(void *arg) {
  burst_t *b = arg;
  pthread_barrier_wait(b->go);
  for (int k = 0; k < 16; k++) {
    int send = k & 1;
    void *op = gpu_proxy_op_start(b->c, b->parent, b->pid, k % 2, b->base + k, 1, b->chunk, send);
    void *h = gpu_proxy_step_start(b->c, op, 0);
    gpu_proxy_record(h, send ? ST_SEND_GPU_WAIT : ST_RECV_WAIT, 0);
    gpu_proxy_record(h, send ? ST_SEND_WAIT : ST_RECV_FLUSH_WAIT, (size_t)b->chunk);
    gpu_proxy_stop(h);
    gpu_proxy_stop(op);
  }
  return NULL;
}
static void pxn_same_process(ncclComm_t c, p2p_t *o, int pid, int chunk) {
  if (!o->parent) return;
  pthread_barrier_t go;
  pthread_barrier_init(&go, NULL, 2);
  burst_t a = {c, o->parent, pid, chunk, 100, &go}, b = {c, o->parent, pid, chunk, 100, &go};
  pthread_t th;
  if (pthread_create(&th, NULL, pxn_burst, &a) != 0) { pthread_barrier_destroy(&go); return; }
  pxn_burst(&b);
  pthread_join(th, NULL);
  pthread_barrier_destroy(&go);
}

/* Move ops[0..n) (both directions) in steps, with the profiler's proxy events. */
ncclResult_t net_progress(ncclComm_t c, p2p_t *ops, int n) {
  int nch = env_int("NCCL_SIM_GPU_CHANNELS", 2);
  if (nch < 1) nch = 1;
  if (nch > 32) nch = 32;
  size_t chunk = (size_t)env_int("NCCL_SIM_GPU_CHUNK", 131072);
  if (chunk < 1024) chunk = 1024;
  uint64_t gpu_delay = gpu_delay_ns(c);
  xfer_t *x = calloc((size_t)(n ? n : 1), sizeof *x);
  struct pollfd *pfds = malloc(sizeof(*pfds) * (size_t)(n ? n : 1));
  int *idx = malloc(sizeof(int) * (size_t)(n ? n : 1));
  if (!x || !pfds || !idx) { free(x); free(pfds); free(idx); return ncclSystemError; }
  int pid = (int)getpid();
  int recv_restart = env_int("NCCL_SIM_GPU_RECV_RESTART", 0);
  int no_stop = env_int("NCCL_SIM_GPU_PROXY_NO_STOP", 0);
  int pxn = env_int("NCCL_SIM_GPU_PXN", 0);
  if (pxn == 1 && n) pxn_op(c, &ops[0], pid, (int)chunk);
  if (pxn == 2 && n) pxn_same_process(c, &ops[0], pid, (int)chunk);
  for (int i = 0; i < n; i++) {
    xfer_t *t = &x[i];
    t->o = &ops[i];
    t->chunk = chunk;
    size_t left = ops[i].len - ops[i].off;
    t->nsteps = (int64_t)((left + chunk - 1) / chunk);
    t->link_us = ops[i].is_send ? link_delay_ns(c, ops[i].peer) : 0;
    for (int k = 0; k < NSTEPS_INFLIGHT; k++) t->s[k].step = -1;
    for (int ch = 0; ch < nch && ch < t->nsteps; ch++) {
      int64_t mine = (t->nsteps - ch + nch - 1) / nch;
      t->pop[ch] = gpu_proxy_op_start(c, ops[i].parent, pid, ch, ops[i].peer, (int)mine, (int)chunk, ops[i].is_send);
      /* NCCL_SIM_GPU_PROXY_NO_STOP=1: a transport that never stops its
       * ProxyOps nor sends steps. NCCL 2.28.9 starts a ProxyOp for every
       * non-profiler pattern (src/proxy.cc:427) but only transport/net.cc
       * stops one (:1364, :1635): CollNet (coll_net.cc) and SHM/P2P in their
       * copy-engine modes (NCCL_SHM_USE_CUDA_MEMCPY=1, shm.cc:504;
       * NCCL_P2P_USE_CUDA_MEMCPY=1, p2p.cc:1137) make no profiler call. */
      if (no_stop) t->pop[ch] = NULL;
    }
  }
  ncclResult_t res = ncclSuccess;
  for (;;) {
    uint64_t now = now_ns(CLOCK_MONOTONIC), wake = 0;
    int np = 0, busy = 0;
    for (int i = 0; i < n; i++) {
      xfer_t *t = &x[i];
      if (t->done >= t->nsteps) continue;
      busy = 1;
      /* post steps into the window */
      while (t->posted < t->nsteps && t->posted < t->done + NSTEPS_INFLIGHT) {
        slot_t *s = &t->s[t->posted % NSTEPS_INFLIGHT];
        memset(s, 0, sizeof *s);
        s->step = t->posted;
        size_t lo = t->o->off + (size_t)t->posted * chunk;
        s->len = t->o->len - lo < chunk ? t->o->len - lo : chunk;
        s->h = gpu_proxy_step_start(c, t->pop[t->posted % nch], (int)(t->posted / nch));
        /* NCCL_SIM_GPU_RECV_RESTART=1: NCCL starts a receive step at every
         * progress pass until its irecv is posted, overwriting the step's
         * handle without a stop (2.28.9 src/transport/net.cc:1432; the
         * `continue` at :1443/:1453 and a NULL request at :1475 leave
         * sub->posted where it was): here every receive step starts twice. */
        if (!t->o->is_send && recv_restart)
          s->h = gpu_proxy_step_start(c, t->pop[t->posted % nch], (int)(t->posted / nch));
        if (t->o->is_send) {
          enter(s, 0, ST_SEND_GPU_WAIT, 0);
          s->ready = s->t[0] + gpu_delay;
        } else {
          enter(s, 0, ST_RECV_WAIT, 0);
        }
        t->posted++;
      }
      if (t->o->is_send) {
        now = now_ns(CLOCK_MONOTONIC); /* after the posts: a step with no GPU delay moves on at once */
        /* steps whose data the GPU produced: peer credit at once, then on the wire (in order) */
        for (int64_t j = t->done; j < t->posted; j++) {
          slot_t *s = &t->s[j % NSTEPS_INFLIGHT];
          if (s->phase == 0) {
            if (now < s->ready) { if (!wake || s->ready < wake) wake = s->ready; break; }
            enter(s, 1, ST_SEND_PEER_WAIT, 0);
            enter(s, 2, ST_SEND_WAIT, s->len);
            s->ready = s->t[2] + t->link_us;
          }
        }
        slot_t *h = &t->s[t->done % NSTEPS_INFLIGHT];
        if (h->phase == 2) {
          if (now < h->ready) { if (!wake || h->ready < wake) wake = h->ready; }
          else { pfds[np].fd = c->fds[t->o->peer]; pfds[np].events = POLLOUT; pfds[np].revents = 0; idx[np++] = i; }
        }
      } else {
        pfds[np].fd = c->fds[t->o->peer]; pfds[np].events = POLLIN; pfds[np].revents = 0; idx[np++] = i;
      }
    }
    if (!busy) break;
    struct timespec ts = {0, 0}, *tsp = NULL;
    if (wake) {
      uint64_t d = wake > now ? wake - now : 0;
      ts.tv_sec = (time_t)(d / 1000000000ull);
      ts.tv_nsec = (long)(d % 1000000000ull);
      tsp = &ts;
    }
    int pr = ppoll(pfds, (nfds_t)np, tsp, NULL);
    if (pr < 0) { if (errno == EINTR) continue; res = ncclSystemError; break; }
    for (int k = 0; k < np && res == ncclSuccess; k++) {
      if (!pfds[k].revents) continue;
      xfer_t *t = &x[idx[k]];
      slot_t *s = &t->s[t->done % NSTEPS_INFLIGHT];
      size_t lo = t->o->off + (size_t)t->done * chunk, end = lo + s->len;
      /* bytes of the head step already moved: o->moved counts within the transfer */
      size_t at = lo + t->o->moved;
      ssize_t r = t->o->is_send ? send(pfds[k].fd, t->o->buf + at, end - at, MSG_NOSIGNAL | MSG_DONTWAIT)
                                : recv(pfds[k].fd, t->o->buf + at, end - at, MSG_DONTWAIT);
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        res = ncclRemoteError;
      } else if (r == 0) {
        res = ncclRemoteError;
      } else {
        t->o->moved += (size_t)r;
        if (t->o->moved == s->len) {
          t->o->moved = 0;
          if (!t->o->is_send) {
            enter(s, 1, ST_RECV_FLUSH_WAIT, s->len);
            enter(s, 2, ST_RECV_GPU_WAIT, 0);
          }
          finish_step(c, t, s, nch);
        }
      }
    }
    if (res != ncclSuccess) break;
  }
  for (int i = 0; i < n; i++) {
    xfer_t *t = &x[i];
    if (res == ncclSuccess) t->o->off = t->o->len;
    for (int ch = 0; ch < nch; ch++) if (t->pop[ch]) gpu_proxy_stop(t->pop[ch]);
  }
  free(x); free(pfds); free(idx);
  return res;
}

/* For the faults outside the network steps (enqueue.c: NCCL_SIM_LONG_COLLECTIVE). */
int sim_fault_value(const char *name, char *buf, size_t len) { return fault_value(name, buf, len); }

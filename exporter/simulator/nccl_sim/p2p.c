/* p2p.c -- Point-to-point: the progress engine that moves a step's sends and receives,
 * and the per-communicator proxy thread ("NCCL Proxy <rank>") that does the sends. */
#include "nccl_sim.h"

/* ---------------------------------------------------- p2p progress engine -- */

/* Whether op o still has bytes to move. A framed receive is done once its frame's
 * header and its whole body arrived, whatever its own length. */
static int pending(const p2p_t *o) {
  return o->framed ? o->hoff < sizeof(o->hdr) || o->fgot < o->hdr : o->off < o->len;
}

/* Receive the next bytes of a framed receive: its header, then the frame's body, of
 * which the first o->len bytes go to o->buf and the rest is dropped (as NCCL's
 * receiver reads its own size from a step's slot, whatever the sender wrote). */
static ssize_t recv_framed(int fd, p2p_t *o) {
  if (o->hoff < sizeof(o->hdr)) {
    ssize_t r = recv(fd, (char *)&o->hdr + o->hoff, sizeof(o->hdr) - o->hoff, MSG_DONTWAIT);
    if (r > 0) o->hoff += (size_t)r;
    return r;
  }
  size_t keep = o->hdr < o->len ? o->hdr : o->len;
  char sink[16384];
  size_t rest = o->hdr - o->fgot;
  ssize_t r = o->fgot < keep ? recv(fd, o->buf + o->fgot, keep - o->fgot, MSG_DONTWAIT)
                             : recv(fd, sink, rest < sizeof(sink) ? rest : sizeof(sink), MSG_DONTWAIT);
  if (r > 0) o->fgot += (size_t)r;
  if (!pending(o)) o->off = o->len;
  return r;
}

/* Move bytes of ops[] (dir 1: only the sends, 0: only the receives, -1: all)
 * until they are complete. Per peer and direction, ops go in order. */
static ncclResult_t progress(ncclComm_t c, p2p_t *ops, int n, int dir) {
  struct pollfd *pfds = malloc(sizeof(*pfds) * (n ? n : 1));
  int *idx = malloc(sizeof(int) * (n ? n : 1));
  if (!pfds || !idx) { free(pfds); free(idx); return ncclSystemError; }
  ncclResult_t res = ncclSuccess;
  for (;;) {
    int np = 0;
    for (int i = 0; i < n; i++) {
      if (!pending(&ops[i])) continue;
      if (dir >= 0 && ops[i].is_send != dir) continue;
      int blocked = 0;
      for (int j = 0; j < i; j++)
        if (ops[j].peer == ops[i].peer && ops[j].is_send == ops[i].is_send && pending(&ops[j])) { blocked = 1; break; }
      if (blocked) continue;
      pfds[np].fd = c->fds[ops[i].peer];
      pfds[np].events = ops[i].is_send ? POLLOUT : POLLIN;
      pfds[np].revents = 0;
      idx[np++] = i;
    }
    if (np == 0) break;
    int pr = poll(pfds, np, -1);
    if (pr < 0) { if (errno == EINTR) continue; res = ncclSystemError; break; }
    for (int k = 0; k < np && res == ncclSuccess; k++) {
      if (!pfds[k].revents) continue;
      p2p_t *o = &ops[idx[k]];
      ssize_t r = o->is_send ? send(pfds[k].fd, o->buf + o->off, o->len - o->off, MSG_NOSIGNAL | MSG_DONTWAIT)
                : o->framed  ? recv_framed(pfds[k].fd, o)
                             : recv(pfds[k].fd, o->buf + o->off, o->len - o->off, MSG_DONTWAIT);
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        res = ncclRemoteError;
      } else if (r == 0) {
        res = ncclRemoteError; /* peer closed */
      } else if (!o->framed) {
        o->off += (size_t)r;
      }
    }
    if (res != ncclSuccess) break;
  }
  free(pfds); free(idx);
  return res;
}


/* Real NCCL moves network data in its own threads ("NCCL Progress ...",
 * "NCCL Sock ...") while the calling thread waits. Here one thread per
 * communicator, named "NCCL Proxy <rank>", does the sends of every p2p batch
 * while the caller does the receives and then waits for it. */
typedef struct sim_proxy {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t th;
  ncclComm_t comm;
  p2p_t *ops;
  int n;
  int posted;   /* work handed over, not finished */
  int in_use;   /* a caller owns the proxy for one batch */
  int stop;
  int all;      /* GPU-like mode: the proxy moves both directions in steps (netsteps.c) */
  ncclResult_t res;
} sim_proxy_t;

static void *proxy_main(void *arg) {
  sim_proxy_t *p = arg;
  char name[16];
  snprintf(name, sizeof(name), "NCCL Proxy %d", p->comm->rank);
  pthread_setname_np(pthread_self(), name);
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->posted && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
    if (p->posted) {
      p2p_t *ops = p->ops;
      int n = p->n;
      pthread_mutex_unlock(&p->mu);
      ncclResult_t r = p->all ? net_progress(p->comm, ops, n) : progress(p->comm, ops, n, 1);
      pthread_mutex_lock(&p->mu);
      p->res = r;
      p->posted = 0;
      pthread_cond_broadcast(&p->cv);
      continue;
    }
    if (p->stop) break;
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

static sim_proxy_t *proxy_of(ncclComm_t c) {
  if (c->proxy) return c->proxy;
  if (env_int("NCCL_SIM_NO_PROXY", 0)) return NULL;
  sim_proxy_t *p = calloc(1, sizeof(*p));
  if (!p) return NULL;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  p->comm = c;
  if (pthread_create(&p->th, NULL, proxy_main, p) != 0) {
    pthread_cond_destroy(&p->cv); pthread_mutex_destroy(&p->mu); free(p);
    return NULL;
  }
  c->proxy = p;
  return p;
}

void proxy_stop(ncclComm_t c) {
  sim_proxy_t *p = c->proxy;
  if (!p) return;
  c->proxy = NULL;
  pthread_mutex_lock(&p->mu);
  int busy = p->posted || p->in_use;
  p->stop = 1;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  if (busy) { pthread_detach(p->th); return; } /* aborted mid-call: leave it be */
  pthread_join(p->th, NULL);
  pthread_cond_destroy(&p->cv); pthread_mutex_destroy(&p->mu); free(p);
}

ncclResult_t run_p2p(ncclComm_t c, p2p_t *ops, int n) {
  /* sends to self are matched, in order, with receives from self (memcpy) */
  int nextrecv = 0;
  for (int i = 0; i < n; i++) {
    if (ops[i].peer != c->rank || !ops[i].is_send) continue;
    while (nextrecv < n && (ops[nextrecv].peer != c->rank || ops[nextrecv].is_send)) nextrecv++;
    if (nextrecv >= n || ops[nextrecv].len != ops[i].len) return ncclInvalidUsage;
    memcpy(ops[nextrecv].buf, ops[i].buf, ops[i].len);
    ops[nextrecv].off = ops[nextrecv].len;
    ops[i].off = ops[i].len;
    nextrecv++;
  }
  for (int i = 0; i < n; i++) if (ops[i].peer == c->rank && ops[i].off != ops[i].len) return ncclInvalidUsage;
  int sends = 0, recvs = 0;
  for (int i = 0; i < n; i++) {
    if (!pending(&ops[i])) continue;
    if (ops[i].is_send) sends++; else recvs++;
  }
  int steps = gpu_net_steps() && (sends || recvs);
  if (steps) for (int i = 0; i < n; i++) gpu_net_op(&ops[i]);
  sim_proxy_t *p = (sends || steps) ? proxy_of(c) : NULL;
  if (p) {
    pthread_mutex_lock(&p->mu);
    int taken = p->in_use || p->stop;
    if (!taken) p->in_use = 1;
    pthread_mutex_unlock(&p->mu);
    if (taken) p = NULL; /* another thread's batch on this comm: do it all here */
  }
  ncclResult_t res;
  if (!p) {
    res = progress(c, ops, n, -1);
  } else {
    pthread_mutex_lock(&p->mu);
    p->ops = ops; p->n = n; p->posted = 1; p->res = ncclSuccess; p->all = steps;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    res = recvs && !steps ? progress(c, ops, n, 0) : ncclSuccess;
    pthread_mutex_lock(&p->mu);
    while (p->posted) pthread_cond_wait(&p->cv, &p->mu);
    if (res == ncclSuccess) res = p->res;
    p->in_use = 0;
    pthread_mutex_unlock(&p->mu);
  }
  if (res != ncclSuccess) c->async_err = res;
  return res;
}

/* One step of a ring: sl bytes to rank `to`, rl bytes from rank `from`. NCCL matches
 * a ring's steps by their counters, not by their sizes (docs/simulator.md, "Desync"):
 * with NCCL_SIM_RING_FRAMES=1, in host mode, each step is one frame (its length, then
 * its bytes) and the receiver keeps what fits its own rl, so ranks that disagree on a
 * count stay in step as NCCL's do. Off by default: one byte stream per step, the
 * timing the suite's scenarios were measured with. GPU-like mode: never framed. */
static int ring_frames(void) {
  static int v = -1;
  if (v < 0) v = env_int("NCCL_SIM_RING_FRAMES", 0) ? 1 : 0;
  return v;
}

ncclResult_t sendrecv(ncclComm_t c, int to, const void *sb, size_t sl, int from, void *rb, size_t rl) {
  if (gpu_net_steps() || !ring_frames()) {
    p2p_t ops[2] = {{to, 1, (char *)sb, sl, 0}, {from, 0, (char *)rb, rl, 0}};
    return run_p2p(c, ops, 2);
  }
  p2p_t ops[3] = {{to, 1, NULL, sizeof(uint64_t), 0}, {to, 1, (char *)sb, sl, 0}, {from, 0, (char *)rb, rl, 0}};
  ops[0].hdr = sl;
  ops[0].buf = (char *)&ops[0].hdr;  /* the frame's header: sent before its body (same peer, in order) */
  ops[2].framed = 1;
  return run_p2p(c, ops, 3);
}

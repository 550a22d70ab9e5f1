/* collectives.c -- Collectives: the ring and tree algorithms over p2p.c, and
 * exec_coll, which runs one (on the caller's thread, or in GPU-like mode on the
 * communicator's stream thread, gpu.c). The public entries: enqueue.c. */
#include "nccl_sim.h"

/* ----------------------------------------------------------- collectives -- */
#define CH_LO(i) ((count * (size_t)(i)) / (size_t)n)
#define PREV(r) (((r) - 1 + n) % n)
#define NEXT(r) (((r) + 1) % n)
#define MOD(x) ((((x) % n) + n) % n)

/* One loop of the ring AllReduce over buf's `count` elements (NCCL's runRing, one
 * channel): reduce-scatter then all-gather, n-1 steps each, in chunks of count/n. */
static ncclResult_t allreduce_loop(ncclComm_t c, char *buf, size_t count, int dt, int op, char *tmp) {
  int n = c->nranks, r = c->rank;
  size_t es = dt_size(dt);
  ncclResult_t res = ncclSuccess;
  /* reduce-scatter ring */
  for (int s = 0; s < n - 1 && res == ncclSuccess; s++) {
    int sc = MOD(r - s), rc = MOD(r - s - 1);
    size_t slo = CH_LO(sc), shi = CH_LO(sc + 1), rlo = CH_LO(rc), rhi = CH_LO(rc + 1);
    res = sendrecv(c, NEXT(r), buf + slo * es, (shi - slo) * es, PREV(r), tmp, (rhi - rlo) * es);
    if (res == ncclSuccess) reduce_into(buf + rlo * es, tmp, rhi - rlo, dt, op);
  }
  if (res == ncclSuccess && op == ncclAvg) {
    int oc = MOD(r + 1);
    divide_by(buf + CH_LO(oc) * es, CH_LO(oc + 1) - CH_LO(oc), dt, n);
  }
  /* all-gather ring */
  for (int s = 0; s < n - 1 && res == ncclSuccess; s++) {
    int sc = MOD(r + 1 - s), rc = MOD(r - s);
    size_t slo = CH_LO(sc), shi = CH_LO(sc + 1), rlo = CH_LO(rc), rhi = CH_LO(rc + 1);
    res = sendrecv(c, NEXT(r), buf + slo * es, (shi - slo) * es, PREV(r), buf + rlo * es, (rhi - rlo) * es);
  }
  return res;
}

/* NCCL's ring moves at most chunkSize bytes per rank and channel in one loop
 * (v2.28.9-1 src/enqueue.cc:2023-2026: stepSize = buffSize / NCCL_STEPS, chunkSize =
 * stepSize * chunkSteps; 4 MiB (src/init.cc:699), 8 (src/include/device.h:24) and 4
 * for AllReduce (src/include/collectives.h:18): 2 MiB); nLoops = DIVUP(nBytes,
 * loopSize) (enqueue.cc:2129). Each rank loops over its own count, so a rank whose
 * count takes more loops waits for steps its peers never post (docs/simulator.md,
 * "Desync"). NCCL_SIM_RING_CHUNK sets the bytes per rank and loop. */
#define RING_CHUNK_DEFAULT (2 << 20)  /* also exporter/simulator/faults.py */

static ncclResult_t do_allreduce(ncclComm_t c, const void *sb, void *rb, size_t count, int dt, int op) {
  int n = c->nranks;
  size_t es = dt_size(dt);
  if (sb != rb) memmove(rb, sb, count * es);
  if (n == 1 || count == 0) { if (op == ncclAvg) divide_by(rb, count, dt, n); return ncclSuccess; }
  size_t chunk = (size_t)env_int("NCCL_SIM_RING_CHUNK", RING_CHUNK_DEFAULT) / es;
  size_t loop = (chunk ? chunk : 1) * (size_t)n;
  char *tmp = malloc(((count < loop ? count : loop) / n + 1) * es);
  if (!tmp) return ncclSystemError;
  ncclResult_t res = ncclSuccess;
  for (size_t lo = 0; lo < count && res == ncclSuccess; lo += loop)
    res = allreduce_loop(c, (char *)rb + lo * es, count - lo < loop ? count - lo : loop, dt, op, tmp);
  free(tmp);
  return res;
}

ncclResult_t do_allgather(ncclComm_t c, const void *sb, void *rb, size_t count, int dt) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  char *buf = rb;
  memmove(buf + (size_t)r * bl, sb, bl);
  ncclResult_t res = ncclSuccess;
  for (int s = 0; s < n - 1 && res == ncclSuccess; s++) {
    int sc = MOD(r - s), rc = MOD(r - s - 1);
    res = sendrecv(c, NEXT(r), buf + (size_t)sc * bl, bl, PREV(r), buf + (size_t)rc * bl, bl);
  }
  return res;
}

static ncclResult_t do_reducescatter(ncclComm_t c, const void *sb, void *rb, size_t count, int dt, int op) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  char *work = malloc(bl * n + 1), *tmp = malloc(bl + 1);
  if (!work || !tmp) { free(work); free(tmp); return ncclSystemError; }
  memcpy(work, sb, bl * n);
  ncclResult_t res = ncclSuccess;
  for (int s = 0; s < n - 1 && res == ncclSuccess; s++) {
    int sc = MOD(r - s - 1), rc = MOD(r - s - 2);
    res = sendrecv(c, NEXT(r), work + (size_t)sc * bl, bl, PREV(r), tmp, bl);
    if (res == ncclSuccess) reduce_into(work + (size_t)rc * bl, tmp, count, dt, op);
  }
  if (res == ncclSuccess) {
    if (op == ncclAvg) divide_by(work + (size_t)r * bl, count, dt, n);
    memcpy(rb, work + (size_t)r * bl, bl);
  }
  free(work); free(tmp);
  return res;
}

static ncclResult_t do_broadcast(ncclComm_t c, const void *sb, void *rb, size_t count, int dt, int root) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  ncclResult_t res = ncclSuccess;
  if (r == root) {
    if (sb != rb) memmove(rb, sb, bl);
  } else {
    p2p_t op = {PREV(r), 0, rb, bl, 0};
    res = run_p2p(c, &op, 1);
  }
  if (res == ncclSuccess && NEXT(r) != root && n > 1) {
    p2p_t op = {NEXT(r), 1, rb, bl, 0};
    res = run_p2p(c, &op, 1);
  }
  return res;
}

static ncclResult_t do_reduce(ncclComm_t c, const void *sb, void *rb, size_t count, int dt, int op, int root) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  if (r != root) {
    p2p_t o = {root, 1, (char *)sb, bl, 0};
    return run_p2p(c, &o, 1);
  }
  char *all = malloc(bl * n + 1);
  p2p_t *ops = malloc(sizeof(p2p_t) * n);
  if (!all || !ops) { free(all); free(ops); return ncclSystemError; }
  int k = 0;
  for (int p = 0; p < n; p++)
    if (p != r) ops[k++] = (p2p_t){p, 0, all + (size_t)p * bl, bl, 0};
  ncclResult_t res = run_p2p(c, ops, k);
  if (res == ncclSuccess) {
    memcpy(all + (size_t)r * bl, sb, bl);
    for (int p = 1; p < n; p++) reduce_into(all, all + (size_t)p * bl, count, dt, op);
    if (op == ncclAvg) divide_by(all, count, dt, n);
    memcpy(rb, all, bl);
  }
  free(all); free(ops);
  return res;
}

static ncclResult_t do_gather(ncclComm_t c, const void *sb, void *rb, size_t count, int dt, int root) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  if (r != root) { p2p_t o = {root, 1, (char *)sb, bl, 0}; return run_p2p(c, &o, 1); }
  p2p_t *ops = malloc(sizeof(p2p_t) * n);
  if (!ops) return ncclSystemError;
  int k = 0;
  for (int p = 0; p < n; p++) if (p != r) ops[k++] = (p2p_t){p, 0, (char *)rb + (size_t)p * bl, bl, 0};
  memmove((char *)rb + (size_t)r * bl, sb, bl);
  ncclResult_t res = run_p2p(c, ops, k);
  free(ops);
  return res;
}

static ncclResult_t do_scatter(ncclComm_t c, const void *sb, void *rb, size_t count, int dt, int root) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  if (r != root) { p2p_t o = {root, 0, rb, bl, 0}; return run_p2p(c, &o, 1); }
  p2p_t *ops = malloc(sizeof(p2p_t) * n);
  if (!ops) return ncclSystemError;
  int k = 0;
  for (int p = 0; p < n; p++) if (p != r) ops[k++] = (p2p_t){p, 1, (char *)sb + (size_t)p * bl, bl, 0};
  memmove(rb, (const char *)sb + (size_t)r * bl, bl);
  ncclResult_t res = run_p2p(c, ops, k);
  free(ops);
  return res;
}

static ncclResult_t do_alltoall(ncclComm_t c, const void *sb, void *rb, size_t count, int dt) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  p2p_t *ops = malloc(sizeof(p2p_t) * 2 * n);
  char *src = malloc(bl * n + 1);
  if (!ops || !src) { free(ops); free(src); return ncclSystemError; }
  memcpy(src, sb, bl * n); /* allow in-place */
  int k = 0;
  for (int p = 0; p < n; p++) {
    if (p == r) continue;
    ops[k++] = (p2p_t){p, 1, src + (size_t)p * bl, bl, 0};
    ops[k++] = (p2p_t){p, 0, (char *)rb + (size_t)p * bl, bl, 0};
  }
  memcpy((char *)rb + (size_t)r * bl, src + (size_t)r * bl, bl);
  ncclResult_t res = run_p2p(c, ops, k);
  free(ops); free(src);
  return res;
}

ncclResult_t exec_coll(const collargs_t *a) {
  ncclComm_t c = a->comm;
  switch (a->kind) {
    case K_ALLREDUCE: return do_allreduce(c, a->sb, a->rb, a->count, a->dt, a->op);
    case K_ALLGATHER: return do_allgather(c, a->sb, a->rb, a->count, a->dt);
    case K_REDUCESCATTER: return do_reducescatter(c, a->sb, a->rb, a->count, a->dt, a->op);
    case K_BROADCAST: return do_broadcast(c, a->sb, a->rb, a->count, a->dt, a->root);
    case K_REDUCE: return do_reduce(c, a->sb, a->rb, a->count, a->dt, a->op, a->root);
    case K_ALLTOALL: return do_alltoall(c, a->sb, a->rb, a->count, a->dt);
    case K_GATHER: return do_gather(c, a->sb, a->rb, a->count, a->dt, a->root);
    case K_SCATTER: return do_scatter(c, a->sb, a->rb, a->count, a->dt, a->root);
    case K_SEND: { p2p_t o = {a->peer, 1, (char *)a->sb, a->count * dt_size(a->dt), 0}; return run_p2p(c, &o, 1); }
    case K_RECV: { p2p_t o = {a->peer, 0, a->rb, a->count * dt_size(a->dt), 0}; return run_p2p(c, &o, 1); }
  }
  return ncclInternalError;
}

/* enqueue.c -- the public collective, send/recv and group entries, and the group
 * queue (ncclGroupStart/End): a call runs at once (collectives.c, p2p.c) or,
 * in GPU-like mode, is enqueued on its communicator's stream (gpu.c). */
#include "nccl_sim.h"

/* ----------------------------------------------------------------- groups -- */
static __thread int tl_group_depth;
static __thread collargs_t *tl_q;
static __thread int tl_qn, tl_qcap;
static __thread ncclResult_t tl_group_err;

typedef struct { ncclComm_t comm; collargs_t *q; int qn; ncclResult_t res; } comm_batch_t;

static void *run_batch(void *arg) {
  comm_batch_t *b = arg;
  ncclResult_t res = ncclSuccess;
  int np = 0;
  for (int i = 0; i < b->qn; i++)
    if (b->q[i].comm == b->comm && (b->q[i].kind == K_SEND || b->q[i].kind == K_RECV)) np++;
  /* collectives in call order, then all point-to-point ops concurrently */
  for (int i = 0; i < b->qn && res == ncclSuccess; i++) {
    collargs_t *a = &b->q[i];
    if (a->comm != b->comm || a->kind == K_SEND || a->kind == K_RECV) continue;
    res = exec_coll(a);
  }
  if (res == ncclSuccess && np > 0) {
    p2p_t *ops = malloc(sizeof(p2p_t) * np);
    if (!ops) res = ncclSystemError;
    else {
      int k = 0;
      for (int i = 0; i < b->qn; i++) {
        collargs_t *a = &b->q[i];
        if (a->comm != b->comm || (a->kind != K_SEND && a->kind != K_RECV)) continue;
        ops[k++] = (p2p_t){a->peer, a->kind == K_SEND, a->kind == K_SEND ? (char *)a->sb : (char *)a->rb,
                           a->count * dt_size(a->dt), 0};
      }
      res = run_p2p(b->comm, ops, np);
      free(ops);
    }
  }
  b->res = res;
  return NULL;
}

static ncclResult_t group_flush(void) {
  ncclResult_t res = tl_group_err;
  collargs_t *q = tl_q;
  int qn = tl_qn;
  tl_q = NULL; tl_qn = tl_qcap = 0; tl_group_err = ncclSuccess;
  if (qn == 0) { free(q); return res; }
  if (gpu_on()) { /* GPU-like mode: enqueue on each communicator's stream and return */
    ncclResult_t r2 = gpu_enqueue(q, qn);
    free(q);
    return res != ncclSuccess ? res : r2;
  }
  comm_batch_t *b = calloc(qn, sizeof(*b));
  pthread_t *th = calloc(qn, sizeof(*th));
  if (!b || !th) { free(b); free(th); free(q); return ncclSystemError; }
  int nb = 0;
  for (int i = 0; i < qn; i++) {
    int found = 0;
    for (int j = 0; j < nb; j++) if (b[j].comm == q[i].comm) { found = 1; break; }
    if (!found) b[nb++] = (comm_batch_t){q[i].comm, q, qn, ncclSuccess};
  }
  if (nb == 1) run_batch(&b[0]);
  else {
    for (int j = 0; j < nb; j++)
      if (pthread_create(&th[j], NULL, run_batch, &b[j]) != 0) { th[j] = 0; run_batch(&b[j]); }
    for (int j = 0; j < nb; j++) if (th[j]) pthread_join(th[j], NULL);
  }
  for (int j = 0; j < nb; j++) if (res == ncclSuccess && b[j].res != ncclSuccess) res = b[j].res;
  free(b); free(th); free(q);
  return res;
}

/* NCCL_SIM_LONG_COLLECTIVE=NRANKS:SEQ:MS, from the environment or NCCL_SIM_FAULTS_FILE (mid-job):
 * on every communicator of NRANKS ranks, AllReduce number SEQ (from 0, as the agent's seq counts
 * a communicator's calls of an op) stays inside the call MS ms after its data moved, on every
 * rank alike: a legitimately long collective (bench/faults' healthy control), not a hang. Host
 * mode, an AllReduce outside a group; a test switch, as NCCL_SIM_SLOW_GPU is. */
static void long_collective(const collargs_t *a, uint64_t seq) {
  char v[64];
  int n;
  unsigned long long want;
  long ms;
  if (!sim_fault_value("NCCL_SIM_LONG_COLLECTIVE", v, sizeof v) ||
      sscanf(v, "%d:%llu:%ld", &n, &want, &ms) != 3 || n != a->comm->nranks || seq != want || ms <= 0)
    return;
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&t, &t) != 0 && errno == EINTR) {}
}

static ncclResult_t submit(collargs_t a) {
  if (!comm_ok(a.comm)) return ncclInvalidArgument;
  if (a.kind == K_ALLREDUCE || a.kind == K_REDUCESCATTER || a.kind == K_REDUCE) {
    if (!reducible(a.dt, a.op)) return ncclInvalidArgument;
  } else if (dt_size(a.dt) == 0) {
    return ncclInvalidArgument;
  }
  int n = a.comm->nranks;
  if ((a.kind == K_BROADCAST || a.kind == K_REDUCE || a.kind == K_GATHER || a.kind == K_SCATTER) &&
      (a.root < 0 || a.root >= n)) return ncclInvalidArgument;
  if ((a.kind == K_SEND || a.kind == K_RECV) && (a.peer < 0 || a.peer >= n)) return ncclInvalidArgument;
  if (a.count > 0) {
    int needs_send = a.kind != K_RECV && !(a.kind == K_SCATTER && a.comm->rank != a.root);
    int needs_recv = a.kind != K_SEND && !((a.kind == K_REDUCE || a.kind == K_GATHER) && a.comm->rank != a.root);
    if ((needs_send && !a.sb) || (needs_recv && !a.rb)) return ncclInvalidArgument;
  }
  if (gpu_on()) {
    if (gpu_discards(&a)) return ncclSuccess;  /* NCCL discards an empty collective (gpu.c) */
    gpu_assign(&a);
  }
  uint64_t seq = !gpu_on() && a.kind == K_ALLREDUCE ? a.comm->host_allreduces++ : 0;  /* grouped ones too */
  if (tl_group_depth > 0) {
    if (tl_qn == tl_qcap) {
      int nc = tl_qcap ? tl_qcap * 2 : 16;
      collargs_t *nq = realloc(tl_q, sizeof(*nq) * nc);
      if (!nq) return ncclSystemError;
      tl_q = nq; tl_qcap = nc;
    }
    tl_q[tl_qn++] = a;
    return ncclSuccess;
  }
  if (gpu_on()) return gpu_enqueue(&a, 1);
  ncclResult_t res = exec_coll(&a);
  if (res == ncclSuccess && a.kind == K_ALLREDUCE) long_collective(&a, seq);
  return res;
}

/* ----------------------------------------------------- collective entry -- */
#define COLL_BODY(FN, OP, KIND, SB, RB, CNT, DT, ROP, ROOT, PEER)                       \
  ENTER();                                                                            \
  int rk_ = c_rank(comm), nr_ = c_nranks(comm);                                       \
  tl_gpu_seq_valid = 0;                                                               \
  ncclResult_t res = submit((collargs_t){KIND, SB, RB, CNT, DT, ROP, ROOT, PEER, comm}); \
  LEAVE();                                                                            \
  if (outer_) {                                                                       \
    REC_INIT(FN, OP);                                                                 \
    char gx_[96];                                                                     \
    if (tl_gpu_seq_valid) {                                                           \
      snprintf(gx_, sizeof gx_, ",\"seq\":%llu,\"comm_hash\":\"%016llx\"",           \
               (unsigned long long)tl_gpu_seq, (unsigned long long)comm->nccl_hash);  \
      rec_.extra = gx_;                                                               \
    }                                                                                 \
    rec_.comm = (uint64_t)(uintptr_t)comm; rec_.rank = rk_; rec_.nranks = nr_;        \
    rec_.count = CNT; rec_.datatype = DT; rec_.red_op = ROP; rec_.root = ROOT;        \
    rec_.peer = PEER; rec_.stream = (uint64_t)(uintptr_t)stream; rec_.result = res;   \
    truth_write(&rec_);                                                               \
  }                                                                                   \
  return res

EXPORT ncclResult_t pncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                   ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclAllReduce", "ALL_REDUCE", K_ALLREDUCE, sendbuff, recvbuff, count, datatype, op, -1, -1);
}
EXPORT ncclResult_t pncclAllReduceConfig(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                         ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream,
                                         const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclAllReduceConfig", "ALL_REDUCE", K_ALLREDUCE, sendbuff, recvbuff, count, datatype, op, -1, -1);
}
EXPORT ncclResult_t pncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                       ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                       cudaStream_t stream) {
  COLL_BODY("ncclReduceScatter", "REDUCE_SCATTER", K_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, op, -1, -1);
}
EXPORT ncclResult_t pncclReduceScatterConfig(const void *sendbuff, void *recvbuff, size_t recvcount,
                                             ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                             cudaStream_t stream, const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclReduceScatterConfig", "REDUCE_SCATTER", K_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, op, -1, -1);
}
EXPORT ncclResult_t pncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                                   ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclAllGather", "ALL_GATHER", K_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, -1, -1, -1);
}
EXPORT ncclResult_t pncclAllGatherConfig(const void *sendbuff, void *recvbuff, size_t sendcount,
                                         ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream,
                                         const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclAllGatherConfig", "ALL_GATHER", K_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, -1, -1, -1);
}
EXPORT ncclResult_t pncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclAlltoAll", "ALL_TO_ALL", K_ALLTOALL, sendbuff, recvbuff, count, datatype, -1, -1, -1);
}
EXPORT ncclResult_t pncclAlltoAllConfig(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                        ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclAlltoAllConfig", "ALL_TO_ALL", K_ALLTOALL, sendbuff, recvbuff, count, datatype, -1, -1, -1);
}
EXPORT ncclResult_t pncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                   int root, ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclBroadcast", "BROADCAST", K_BROADCAST, sendbuff, recvbuff, count, datatype, -1, root, -1);
}
EXPORT ncclResult_t pncclBroadcastConfig(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                         int root, ncclComm_t comm, cudaStream_t stream,
                                         const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclBroadcastConfig", "BROADCAST", K_BROADCAST, sendbuff, recvbuff, count, datatype, -1, root, -1);
}
EXPORT ncclResult_t pncclGather(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                int root, ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclGather", "GATHER", K_GATHER, sendbuff, recvbuff, count, datatype, -1, root, -1);
}
EXPORT ncclResult_t pncclGatherConfig(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                      int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclGatherConfig", "GATHER", K_GATHER, sendbuff, recvbuff, count, datatype, -1, root, -1);
}
EXPORT ncclResult_t pncclScatter(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                 int root, ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclScatter", "SCATTER", K_SCATTER, sendbuff, recvbuff, count, datatype, -1, root, -1);
}
EXPORT ncclResult_t pncclScatterConfig(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                       int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclScatterConfig", "SCATTER", K_SCATTER, sendbuff, recvbuff, count, datatype, -1, root, -1);
}
EXPORT ncclResult_t pncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclReduce", "REDUCE", K_REDUCE, sendbuff, recvbuff, count, datatype, op, root, -1);
}
EXPORT ncclResult_t pncclReduceConfig(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                      ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream,
                                      const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclReduceConfig", "REDUCE", K_REDUCE, sendbuff, recvbuff, count, datatype, op, root, -1);
}
EXPORT ncclResult_t pncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                              ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclSend", "SEND", K_SEND, sendbuff, NULL, count, datatype, -1, -1, peer);
}
EXPORT ncclResult_t pncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                              ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclRecv", "RECV", K_RECV, NULL, recvbuff, count, datatype, -1, -1, peer);
}

/* ncclBcast: calls the exported ncclBroadcast through the PLT, like NCCL. */
ncclResult_t ncclBroadcast(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
EXPORT ncclResult_t pncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                               cudaStream_t stream) {
  ENTER();
  int rk_ = c_rank(comm), nr_ = c_nranks(comm);
  tl_gpu_seq_valid = 0;
  ncclResult_t res = ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
  LEAVE();
  if (outer_) {
    REC_INIT("ncclBcast", "BROADCAST");
    char gx_[96];
    if (tl_gpu_seq_valid) { /* GPU-like mode: the seq the inner ncclBroadcast got */
      snprintf(gx_, sizeof gx_, ",\"seq\":%llu,\"comm_hash\":\"%016llx\"", (unsigned long long)tl_gpu_seq,
               (unsigned long long)comm->nccl_hash);
      rec_.extra = gx_;
    }
    rec_.comm = (uint64_t)(uintptr_t)comm; rec_.rank = rk_; rec_.nranks = nr_;
    rec_.count = count; rec_.datatype = datatype; rec_.root = root;
    rec_.stream = (uint64_t)(uintptr_t)stream; rec_.result = res;
    truth_write(&rec_);
  }
  return res;
}

/* --------------------------------------------------------------- groups -- */
EXPORT ncclResult_t pncclGroupStart(void) {
  ENTER();
  tl_group_depth++;
  LEAVE();
  if (outer_) { REC_INIT("ncclGroupStart", "GROUP_START"); truth_write(&rec_); }
  return ncclSuccess;
}
EXPORT ncclResult_t pncclGroupEnd(void) {
  ENTER();
  ncclResult_t res = ncclSuccess;
  if (tl_group_depth <= 0) res = ncclInvalidUsage;
  else if (--tl_group_depth == 0) res = group_flush();
  LEAVE();
  if (outer_) { REC_INIT("ncclGroupEnd", "GROUP_END"); rec_.result = res; truth_write(&rec_); }
  return res;
}


/* the public names: weak aliases of the strong pncclX above, as NCCL's */
EXPORT ncclResult_t ncclGroupStart(void) ALIAS(ncclGroupStart);
EXPORT ncclResult_t ncclGroupEnd(void) ALIAS(ncclGroupEnd);
EXPORT ncclResult_t ncclAllReduce(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) ALIAS(ncclAllReduce);
EXPORT ncclResult_t ncclAllReduceConfig(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclAllReduceConfig);
EXPORT ncclResult_t ncclReduceScatter(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) ALIAS(ncclReduceScatter);
EXPORT ncclResult_t ncclReduceScatterConfig(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclReduceScatterConfig);
EXPORT ncclResult_t ncclAllGather(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) ALIAS(ncclAllGather);
EXPORT ncclResult_t ncclAllGatherConfig(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclAllGatherConfig);
EXPORT ncclResult_t ncclAlltoAll(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) ALIAS(ncclAlltoAll);
EXPORT ncclResult_t ncclAlltoAllConfig(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclAlltoAllConfig);
EXPORT ncclResult_t ncclBroadcast(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclBroadcast);
EXPORT ncclResult_t ncclBroadcastConfig(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclBroadcastConfig);
EXPORT ncclResult_t ncclBcast(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclBcast);
EXPORT ncclResult_t ncclReduce(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclReduce);
EXPORT ncclResult_t ncclReduceConfig(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclReduceConfig);
EXPORT ncclResult_t ncclGather(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclGather);
EXPORT ncclResult_t ncclGatherConfig(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclGatherConfig);
EXPORT ncclResult_t ncclScatter(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclScatter);
EXPORT ncclResult_t ncclScatterConfig(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclScatterConfig);
EXPORT ncclResult_t ncclSend(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclSend);
EXPORT ncclResult_t ncclRecv(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclRecv);

/* lifecycle.c -- Lifecycle entries: ncclCommInitRank(Config/All/Scalable), ncclCommSplit,
 * Finalize/Destroy/Abort, the queries (Count, UserRank, CuDevice, async error)
 * and the version and error strings. */
#include "nccl_sim.h"

/* ---------------------------------------------------- lifecycle entries -- */
static void fmt_uid_extra(char *buf, size_t cap, const ncclUniqueId *id, const char *more) {
  char hex[2 * NCCL_UNIQUE_ID_BYTES + 1];
  if (id) hexid(hex, id); else hex[0] = 0;
  snprintf(buf, cap, ",\"uid\":\"%s\"%s", hex, more ? more : "");
}

EXPORT ncclResult_t pncclGetUniqueId(ncclUniqueId *uniqueId) {
  ENTER();
  ncclResult_t res = get_unique_id_impl(uniqueId);
  LEAVE();
  if (outer_) {
    REC_INIT("ncclGetUniqueId", "GET_UNIQUE_ID");
    char extra[400];
    fmt_uid_extra(extra, sizeof(extra), res == ncclSuccess ? uniqueId : NULL, NULL);
    rec_.extra = extra; rec_.result = res;
    truth_write(&rec_);
  }
  return res;
}

static void rec_init_like(const char *fn, const char *op, uint64_t t0m_, uint64_t t1m_, uint64_t t0r_,
                          uint64_t t1r_, ncclResult_t res, ncclComm_t *comm, int nranks, int rank,
                          const ncclUniqueId *id) {
  REC_INIT(fn, op);
  ncclComm_t c = (comm && res == ncclSuccess) ? *comm : NULL;
  rec_.comm = (uint64_t)(uintptr_t)c;
  rec_.rank = rank; rec_.nranks = nranks; rec_.result = res;
  char extra[400];
  fmt_uid_extra(extra, sizeof(extra), id, NULL);
  rec_.extra = extra;
  truth_write(&rec_);
}

EXPORT ncclResult_t pncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  ENTER();
  ncclResult_t res = init_rank_impl(comm, nranks, &commId, rank);
  LEAVE();
  if (outer_) rec_init_like("ncclCommInitRank", "COMM_INIT_RANK", t0m_, t1m_, t0r_, t1r_, res, comm, nranks, rank, &commId);
  return res;
}
EXPORT ncclResult_t pncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                            ncclConfig_t *config) {
  (void)config;
  ENTER();
  ncclResult_t res = init_rank_impl(comm, nranks, &commId, rank);
  LEAVE();
  if (outer_)
    rec_init_like("ncclCommInitRankConfig", "COMM_INIT_RANK_CONFIG", t0m_, t1m_, t0r_, t1r_, res, comm, nranks, rank, &commId);
  return res;
}
EXPORT ncclResult_t pncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
                                              ncclUniqueId *commIds, ncclConfig_t *config) {
  (void)config;
  ENTER();
  ncclResult_t res = (nId < 1 || !commIds) ? ncclInvalidArgument : init_rank_impl(newcomm, nranks, &commIds[0], myrank);
  if (res != ncclSuccess && newcomm && (nId < 1 || !commIds)) *newcomm = NULL;
  LEAVE();
  if (outer_)
    rec_init_like("ncclCommInitRankScalable", "COMM_INIT_RANK_SCALABLE", t0m_, t1m_, t0r_, t1r_, res, newcomm,
                  nranks, myrank, (nId >= 1 && commIds) ? &commIds[0] : NULL);
  return res;
}

typedef struct { ncclComm_t *out; int nranks, rank; const ncclUniqueId *id; ncclResult_t res; } initall_arg_t;
static void *initall_thread(void *p) {
  initall_arg_t *a = p;
  a->res = init_rank_impl(a->out, a->nranks, a->id, a->rank);
  return NULL;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
EXPORT ncclResult_t pncclCommInitAll(ncclComm_t *comm, int ndev, const int *devlist) {
  ENTER();
  ncclResult_t res = ncclSuccess;
  ncclUniqueId id;
  memset(&id, 0, sizeof(id));
  if (!comm || ndev <= 0) res = ncclInvalidArgument;
  else res = ncclGetUniqueId(&id); /* through the PLT, like NCCL */
  if (res == ncclSuccess) {
    initall_arg_t *args = calloc(ndev, sizeof(*args));
    pthread_t *th = calloc(ndev, sizeof(*th));
    if (!args || !th) res = ncclSystemError;
    else {
      for (int i = 0; i < ndev; i++) {
        args[i] = (initall_arg_t){&comm[i], ndev, i, &id, ncclSuccess};
        if (pthread_create(&th[i], NULL, initall_thread, &args[i]) != 0) { res = ncclSystemError; ndev = i; break; }
      }
      for (int i = 0; i < ndev; i++) pthread_join(th[i], NULL);
      for (int i = 0; i < ndev; i++) if (res == ncclSuccess && args[i].res != ncclSuccess) res = args[i].res;
      for (int i = 0; i < ndev; i++) if (comm[i] && devlist) comm[i]->cudaDev = devlist[i];
      if (res != ncclSuccess)
        for (int i = 0; i < ndev; i++) { free_comm(comm[i]); comm[i] = NULL; }
    }
    free(args); free(th);
  }
  LEAVE();
  if (outer_) {
    REC_INIT("ncclCommInitAll", "COMM_INIT_ALL");
    rec_.nranks = ndev; rec_.result = res;
    size_t cap = 400 + (ndev > 0 ? (size_t)ndev * 24 : 0);
    char *more = malloc(cap), *extra = malloc(cap + 300);
    if (more && extra) {
      size_t o = (size_t)snprintf(more, cap, ",\"comms\":[");
      for (int i = 0; res == ncclSuccess && i < ndev; i++)
        o += (size_t)snprintf(more + o, cap - o, "%s%llu", i ? "," : "", (unsigned long long)(uintptr_t)comm[i]);
      snprintf(more + o, cap - o, "]");
      fmt_uid_extra(extra, cap + 300, &id, more);
      rec_.extra = extra;
    }
    truth_write(&rec_);
    free(more); free(extra);
  }
  return res;
}

typedef struct { int32_t color, key; peer_addr_t addr; } split_info_t;

static ncclResult_t split_impl(ncclComm_t c, int color, int key, ncclComm_t *newcomm, int *out_seq) {
  if (!newcomm) return ncclInvalidArgument;
  *newcomm = NULL;
  if (!comm_ok(c)) return ncclInvalidArgument;
  if (color < 0 && color != NCCL_SPLIT_NOCOLOR) return ncclInvalidArgument;
  if (gpu_on()) gpu_drain(c); /* the parent's enqueued work first: it uses the same connections */
  int seq = c->nsplits++;
  *out_seq = seq;
  int n = c->nranks;
  split_info_t *all = calloc(n, sizeof(*all));
  if (!all) return ncclSystemError;
  int lfd = -1;
  split_info_t mine; memset(&mine, 0, sizeof(mine));
  mine.color = color; mine.key = key;
  if (color != NCCL_SPLIT_NOCOLOR) {
    lfd = make_listener(&mine.addr);
    if (lfd < 0) { free(all); return ncclSystemError; }
  }
  ncclResult_t res = do_allgather(c, &mine, all, sizeof(mine), ncclUint8);
  if (res != ncclSuccess || color == NCCL_SPLIT_NOCOLOR) { if (lfd >= 0) close(lfd); free(all); return res; }
  /* members ordered by (key, parent rank) */
  int *mem = malloc(sizeof(int) * n);
  int m = 0;
  for (int p = 0; p < n; p++) if (all[p].color == color) mem[m++] = p;
  for (int i = 1; i < m; i++) { /* insertion sort, stable on parent rank */
    int v = mem[i], j = i - 1;
    while (j >= 0 && all[mem[j]].key > all[v].key) { mem[j + 1] = mem[j]; j--; }
    mem[j + 1] = v;
  }
  int myr = -1;
  peer_addr_t *tab = calloc(m, sizeof(*tab));
  for (int i = 0; i < m; i++) { tab[i] = all[mem[i]].addr; if (mem[i] == c->rank) myr = i; }
  ncclComm_t nc = alloc_comm(m, myr);
  if (!nc) res = ncclSystemError;
  else {
    nc->cudaDev = c->cudaDev;
    /* child tag: parent nonce mixed with split seq and color */
    memcpy(nc->nonce, c->nonce, 16);
    for (int i = 0; i < 4; i++) { nc->nonce[i] ^= (uint8_t)(seq >> (8 * i)); nc->nonce[4 + i] ^= (uint8_t)(color >> (8 * i)); }
    nc->nonce[15] ^= 0x5a;
    res = build_mesh(nc, lfd, tab, nc->nonce);
    if (res != ncclSuccess) { free_comm(nc); nc = NULL; }
    else if (gpu_on()) { nc->nccl_hash = nccl_split_hash(c->nccl_hash, (uint32_t)(seq + 1), (uint32_t)color); gpu_comm_ready(nc); }
  }
  close(lfd);
  free(tab); free(mem); free(all);
  *newcomm = nc;
  return res;
}

EXPORT ncclResult_t pncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
  (void)config;
  ENTER();
  int seq = comm_ok(comm) ? comm->nsplits : -1;
  int prk = c_rank(comm), pnr = c_nranks(comm);
  ncclResult_t res = split_impl(comm, color, key, newcomm, &seq);
  LEAVE();
  if (outer_) {
    REC_INIT("ncclCommSplit", "COMM_SPLIT");
    ncclComm_t nc = (newcomm && res == ncclSuccess) ? *newcomm : NULL;
    rec_.comm = (uint64_t)(uintptr_t)nc;
    rec_.rank = nc ? nc->rank : -1; rec_.nranks = nc ? nc->nranks : -1; rec_.result = res;
    char extra[300];
    snprintf(extra, sizeof(extra), ",\"parent\":%llu,\"parent_rank\":%d,\"parent_nranks\":%d,\"color\":%d,\"key\":%d,\"split_seq\":%d",
             (unsigned long long)(uintptr_t)comm, prk, pnr, color, key, seq);
    rec_.extra = extra;
    truth_write(&rec_);
  }
  return res;
}

EXPORT ncclResult_t pncclCommFinalize(ncclComm_t comm) {
  COMM_ONLY("ncclCommFinalize", "COMM_FINALIZE", {
    if (!comm_ok(comm)) res = ncclInvalidArgument;
    else { gpu_drain(comm); comm->finalized = 1; res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommDestroy(ncclComm_t comm) {
  COMM_ONLY("ncclCommDestroy", "COMM_DESTROY", {
    if (comm == NULL) res = ncclSuccess; /* NCCL: destroying NULL is a no-op */
    else if (!comm_ok(comm)) res = ncclInvalidArgument;
    else { if (gpu_on()) gpu_comm_teardown(comm, 0); free_comm(comm); res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommAbort(ncclComm_t comm) {
  COMM_ONLY("ncclCommAbort", "COMM_ABORT", {
    if (comm == NULL) res = ncclSuccess;
    else if (!comm_ok(comm)) res = ncclInvalidArgument;
    else { if (gpu_on()) gpu_comm_teardown(comm, 1); free_comm(comm); res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommCount(const ncclComm_t comm, int *count) {
  COMM_ONLY("ncclCommCount", "COMM_COUNT", {
    if (!comm_ok(comm) || !count) res = ncclInvalidArgument;
    else { *count = comm->nranks; res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommUserRank(const ncclComm_t comm, int *rank) {
  COMM_ONLY("ncclCommUserRank", "COMM_USER_RANK", {
    if (!comm_ok(comm) || !rank) res = ncclInvalidArgument;
    else { *rank = comm->rank; res = ncclSuccess; }
  });
}

/* Not in the op vocabulary: no ground truth for these. */
EXPORT ncclResult_t pncclCommCuDevice(const ncclComm_t comm, int *device) {
  if (!comm_ok(comm) || !device) return ncclInvalidArgument;
  *device = comm->cudaDev;
  return ncclSuccess;
}
EXPORT ncclResult_t pncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  if (!comm_ok(comm) || !asyncError) return ncclInvalidArgument;
  *asyncError = comm->async_err;
  return ncclSuccess;
}

/* The banner real NCCL prints at init (VERSION_STRING in src/init.cc); the
 * agent reads the library's version from it without running the library. */
__attribute__((used)) static const char sim_version_banner[] = "NCCL version 2.32.3+sim";
EXPORT ncclResult_t pncclGetVersion(int *version) {
  if (!version) return ncclInvalidArgument;
  *version = SIM_VERSION_CODE;
  return ncclSuccess;
}
EXPORT const char *pncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclTimeout: return "NCCL operation timed out";
    default: return "unknown result code";
  }
}
EXPORT const char *pncclGetLastError(ncclComm_t comm) {
  (void)comm;
  return "";
}


/* the public names: weak aliases of the strong pncclX above, as NCCL's */
EXPORT ncclResult_t ncclGetVersion(int *) ALIAS(ncclGetVersion);
EXPORT const char *ncclGetErrorString(ncclResult_t) ALIAS(ncclGetErrorString);
EXPORT const char *ncclGetLastError(ncclComm_t) ALIAS(ncclGetLastError);
EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *) ALIAS(ncclGetUniqueId);
EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *, int, ncclUniqueId, int) ALIAS(ncclCommInitRank);
EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *) ALIAS(ncclCommInitRankConfig);
EXPORT ncclResult_t ncclCommInitAll(ncclComm_t *, int, const int *) ALIAS(ncclCommInitAll);
EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t *, int, int, int, ncclUniqueId *, ncclConfig_t *) ALIAS(ncclCommInitRankScalable);
EXPORT ncclResult_t ncclCommSplit(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *) ALIAS(ncclCommSplit);
EXPORT ncclResult_t ncclCommFinalize(ncclComm_t) ALIAS(ncclCommFinalize);
EXPORT ncclResult_t ncclCommDestroy(ncclComm_t) ALIAS(ncclCommDestroy);
EXPORT ncclResult_t ncclCommAbort(ncclComm_t) ALIAS(ncclCommAbort);
EXPORT ncclResult_t ncclCommCount(const ncclComm_t, int *) ALIAS(ncclCommCount);
EXPORT ncclResult_t ncclCommUserRank(const ncclComm_t, int *) ALIAS(ncclCommUserRank);
EXPORT ncclResult_t ncclCommCuDevice(const ncclComm_t, int *) ALIAS(ncclCommCuDevice);
EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t, ncclResult_t *) ALIAS(ncclCommGetAsyncError);

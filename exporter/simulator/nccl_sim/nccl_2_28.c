/* nccl_2_28.c -- The calls NCCL 2.28-2.32 added (ncclCommShrink simulated; the rest the
 * smallest stand-ins that keep the ABI). */
#include "nccl_sim.h"

/* ------------------------------- NCCL 2.28-2.32 additions --
 * ncclCommShrink is simulated: the survivors (every rank not excluded) swap
 * listener addresses over the parent's sockets and build a new mesh, ranks
 * renumbered in parent order. The others are the smallest stand-ins that keep
 * the ABI: Revoke/Suspend/Resume/(Window)(De)Register succeed on a valid
 * communicator, Grow and the one-sided signal calls return ncclInvalidUsage
 * (no GPU memory to grow into or to signal through). */
typedef struct ncclWindow_vidmem *ncclWindow_t;
typedef struct ncclWaitSignalDesc ncclWaitSignalDesc_t;

static ncclResult_t shrink_impl(ncclComm_t c, const int *excl, int nexcl, ncclComm_t *newcomm, int *out_seq) {
  if (!newcomm) return ncclInvalidArgument;
  *newcomm = NULL;
  if (!comm_ok(c) || nexcl < 0 || (nexcl > 0 && !excl)) return ncclInvalidArgument;
  int n = c->nranks;
  char *gone = calloc(n, 1);
  if (!gone) return ncclSystemError;
  for (int i = 0; i < nexcl; i++) {
    if (excl[i] < 0 || excl[i] >= n) { free(gone); return ncclInvalidArgument; }
    gone[excl[i]] = 1;
  }
  if (gone[c->rank]) { free(gone); return ncclInvalidArgument; } /* an excluded rank does not call */
  if (gpu_on()) gpu_drain(c);
  int seq = c->nshrinks++;
  *out_seq = seq;
  int m = 0, myr = -1;
  for (int p = 0; p < n; p++) if (!gone[p]) { if (p == c->rank) myr = m; m++; }
  peer_addr_t *all = calloc(n, sizeof(*all));
  p2p_t *ops = calloc(2 * (size_t)n, sizeof(*ops));
  int lfd = (all && ops) ? make_listener(&all[c->rank]) : -1;
  if (lfd < 0) { free(all); free(ops); free(gone); return ncclSystemError; }
  int k = 0;
  for (int p = 0; p < n; p++) {
    if (gone[p] || p == c->rank) continue;
    ops[k++] = (p2p_t){p, 1, (char *)&all[c->rank], sizeof(peer_addr_t), 0};
    ops[k++] = (p2p_t){p, 0, (char *)&all[p], sizeof(peer_addr_t), 0};
  }
  ncclResult_t res = k ? run_p2p(c, ops, k) : ncclSuccess;
  ncclComm_t nc = NULL;
  if (res == ncclSuccess) {
    peer_addr_t *tab = calloc(m, sizeof(*tab));
    int j = 0;
    if (tab) for (int p = 0; p < n; p++) if (!gone[p]) tab[j++] = all[p];
    nc = tab ? alloc_comm(m, myr) : NULL;
    if (!nc) res = ncclSystemError;
    else {
      nc->cudaDev = c->cudaDev;
      memcpy(nc->nonce, c->nonce, 16);
      for (int i = 0; i < 4; i++) nc->nonce[8 + i] ^= (uint8_t)(seq >> (8 * i));
      nc->nonce[14] ^= 0xa5;
      res = build_mesh(nc, lfd, tab, nc->nonce);
      if (res != ncclSuccess) { free_comm(nc); nc = NULL; }
      else if (gpu_on()) { nc->nccl_hash = nccl_split_hash(c->nccl_hash, 0, 0); gpu_comm_ready(nc); }
    }
    free(tab);
  }
  close(lfd);
  free(all); free(ops); free(gone);
  *newcomm = nc;
  return res;
}

EXPORT ncclResult_t pncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount,
                                    ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags) {
  (void)config; (void)shrinkFlags;
  ENTER();
  int seq = comm_ok(comm) ? comm->nshrinks : -1;
  int prk = c_rank(comm), pnr = c_nranks(comm);
  ncclResult_t res = shrink_impl(comm, excludeRanksList, excludeRanksCount, newcomm, &seq);
  LEAVE();
  if (outer_) {
    REC_INIT("ncclCommShrink", "COMM_SHRINK");
    ncclComm_t nc = (newcomm && res == ncclSuccess) ? *newcomm : NULL;
    rec_.comm = (uint64_t)(uintptr_t)nc;
    rec_.rank = nc ? nc->rank : -1; rec_.nranks = nc ? nc->nranks : -1; rec_.result = res;
    char extra[200];
    snprintf(extra, sizeof(extra), ",\"parent\":%llu,\"parent_rank\":%d,\"parent_nranks\":%d,\"excluded\":%d,\"shrink_seq\":%d",
             (unsigned long long)(uintptr_t)comm, prk, pnr, excludeRanksCount, seq);
    rec_.extra = extra;
    truth_write(&rec_);
  }
  return res;
}
EXPORT ncclResult_t pncclCommGrow(ncclComm_t comm, int nRanks, const ncclUniqueId *uniqueId, int rank,
                                  ncclComm_t *newcomm, ncclConfig_t *config) {
  (void)nRanks; (void)uniqueId; (void)rank; (void)config;
  COMM_ONLY("ncclCommGrow", "COMM_GROW", {
    if (newcomm) *newcomm = NULL;
    res = ncclInvalidUsage; /* not simulated */
  });
}
EXPORT ncclResult_t pncclCommRevoke(ncclComm_t comm, int revokeFlags) {
  COMM_ONLY("ncclCommRevoke", "COMM_REVOKE", {
    res = (!comm_ok(comm) || revokeFlags != 0) ? ncclInvalidArgument : ncclSuccess;
  });
}
EXPORT ncclResult_t pncclCommSuspend(ncclComm_t comm, int flags) {
  (void)flags;
  COMM_ONLY("ncclCommSuspend", "COMM_SUSPEND", { res = comm_ok(comm) ? ncclSuccess : ncclInvalidArgument; });
}
EXPORT ncclResult_t pncclCommResume(ncclComm_t comm) {
  COMM_ONLY("ncclCommResume", "COMM_RESUME", { res = comm_ok(comm) ? ncclSuccess : ncclInvalidArgument; });
}
EXPORT ncclResult_t pncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle) {
  (void)size;
  COMM_ONLY("ncclCommRegister", "COMM_REGISTER", {
    if (!comm_ok(comm) || !handle) res = ncclInvalidArgument;
    else { *handle = buff; res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommDeregister(const ncclComm_t comm, void *handle) {
  (void)handle;
  COMM_ONLY("ncclCommDeregister", "COMM_DEREGISTER", { res = comm_ok(comm) ? ncclSuccess : ncclInvalidArgument; });
}
EXPORT ncclResult_t pncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, ncclWindow_t *win, int winFlags) {
  (void)size; (void)winFlags;
  COMM_ONLY("ncclCommWindowRegister", "COMM_WINDOW_REGISTER", {
    if (!comm_ok(comm) || !win) res = ncclInvalidArgument;
    else { *win = (ncclWindow_t)buff; res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win) {
  (void)win;
  COMM_ONLY("ncclCommWindowDeregister", "COMM_WINDOW_DEREGISTER", {
    res = comm_ok(comm) ? ncclSuccess : ncclInvalidArgument;
  });
}
/* One-sided calls: no ground truth (they only fail here). */
EXPORT ncclResult_t pncclPutSignal(const void *localbuff, size_t count, ncclDataType_t datatype, int peer,
                                   ncclWindow_t peerWin, size_t peerWinOffset, int sigIdx, int ctx,
                                   unsigned int flags, ncclComm_t comm, cudaStream_t stream) {
  (void)localbuff; (void)count; (void)datatype; (void)peer; (void)peerWin; (void)peerWinOffset;
  (void)sigIdx; (void)ctx; (void)flags; (void)stream;
  return comm_ok(comm) ? ncclInvalidUsage : ncclInvalidArgument;
}
EXPORT ncclResult_t pncclSignal(int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream) {
  (void)peer; (void)sigIdx; (void)ctx; (void)flags; (void)stream;
  return comm_ok(comm) ? ncclInvalidUsage : ncclInvalidArgument;
}
EXPORT ncclResult_t pncclWaitSignal(int nDesc, ncclWaitSignalDesc_t *signalDescs, ncclComm_t comm, cudaStream_t stream) {
  (void)nDesc; (void)signalDescs; (void)stream;
  return comm_ok(comm) ? ncclInvalidUsage : ncclInvalidArgument;
}


/* the public names: weak aliases of the strong pncclX above, as NCCL's */
EXPORT ncclResult_t ncclCommShrink(ncclComm_t, int *, int, ncclComm_t *, ncclConfig_t *, int) ALIAS(ncclCommShrink);
EXPORT ncclResult_t ncclCommGrow(ncclComm_t, int, const ncclUniqueId *, int, ncclComm_t *, ncclConfig_t *) ALIAS(ncclCommGrow);
EXPORT ncclResult_t ncclCommRevoke(ncclComm_t, int) ALIAS(ncclCommRevoke);
EXPORT ncclResult_t ncclCommSuspend(ncclComm_t, int) ALIAS(ncclCommSuspend);
EXPORT ncclResult_t ncclCommResume(ncclComm_t) ALIAS(ncclCommResume);
EXPORT ncclResult_t ncclCommRegister(const ncclComm_t, void *, size_t, void **) ALIAS(ncclCommRegister);
EXPORT ncclResult_t ncclCommDeregister(const ncclComm_t, void *) ALIAS(ncclCommDeregister);
EXPORT ncclResult_t ncclCommWindowRegister(ncclComm_t, void *, size_t, ncclWindow_t *, int) ALIAS(ncclCommWindowRegister);
EXPORT ncclResult_t ncclCommWindowDeregister(ncclComm_t, ncclWindow_t) ALIAS(ncclCommWindowDeregister);
EXPORT ncclResult_t ncclPutSignal(const void *, size_t, ncclDataType_t, int, ncclWindow_t, size_t, int, int, unsigned int, ncclComm_t, cudaStream_t) ALIAS(ncclPutSignal);
EXPORT ncclResult_t ncclSignal(int, int, int, unsigned int, ncclComm_t, cudaStream_t) ALIAS(ncclSignal);
EXPORT ncclResult_t ncclWaitSignal(int, ncclWaitSignalDesc_t *, ncclComm_t, cudaStream_t) ALIAS(ncclWaitSignal);

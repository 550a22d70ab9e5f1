/*
 * chained.c -- a second profiler plugin for the chain-loading test.
 *
 * Exports ONLY ncclProfiler_v5, asks for GroupApi|ProxyOp, and checks that
 * every handle it is given back (stopEvent, recordEventState, parentObj) is
 * one it created and is still alive.  $CHAINED_MASK (hex) replaces the mask;
 * $CHAINED_NULL_TYPES (hex) lists event types it answers with a NULL handle.  Counts callbacks per event type and
 * writes them at the last finalize to $CHAINED_OUT ("key value" lines).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "profiler_abi.h"

#define MAGIC 0xC4A1ED00u
struct h { uint32_t magic; uint32_t alive; uint64_t type; };

static long long starts[16], stops, records, bad_handle, bad_parent, bad_ctx, bad_type, inits, finals, live_ctx;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int *mask_ptr;
static int ctx_token;

static int bit(uint64_t t) { int i = 0; while (t > 1) { t >>= 1; i++; } return i; }
static int mine(void *p) { struct h *h = p; return h && h->magic == MAGIC; }

static nxp_result_t c_init(void **ctx, uint64_t commId, int *mask, const char *name, int nNodes, int nranks, int rank,
                           nxp_logger_t logfn) {
  (void)commId; (void)name; (void)nNodes; (void)nranks; (void)rank; (void)logfn;
  pthread_mutex_lock(&mu);
  inits++;
  live_ctx++;
  mask_ptr = mask;
  const char *m = getenv("CHAINED_MASK");
  *mask |= m ? (int)strtol(m, NULL, 16) : (NXP_EV_GROUP_API | NXP_EV_PROXY_OP);
  *ctx = &ctx_token;
  pthread_mutex_unlock(&mu);
  return 0;
}

static nxp_result_t c_start(void *ctx, void **eh, nxp_descr_v5 *d) {
  pthread_mutex_lock(&mu);
  if (ctx != &ctx_token) bad_ctx++;
  if (d->type == 0 || d->type > NXP_EV_KERNEL_LAUNCH || (d->type & (d->type - 1))) bad_type++;
  starts[bit(d->type)]++;
  if (d->parentObj && !mine(d->parentObj)) bad_parent++;
  const char *nt = getenv("CHAINED_NULL_TYPES");
  if (nt && (strtoul(nt, NULL, 16) & d->type)) {
    *eh = NULL;
    pthread_mutex_unlock(&mu);
    return 0;
  }
  struct h *h = calloc(1, sizeof *h);
  h->magic = MAGIC; h->alive = 1; h->type = d->type;
  *eh = h;
  pthread_mutex_unlock(&mu);
  return 0;
}

static nxp_result_t c_stop(void *eh) {
  pthread_mutex_lock(&mu);
  stops++;
  struct h *h = eh;
  if (!mine(h) || !h->alive) bad_handle++;
  else h->alive = 0; /* kept (leaked) so a later use as parent is still checkable */
  pthread_mutex_unlock(&mu);
  return 0;
}

static nxp_result_t c_record(void *eh, int state, nxp_state_args *a) {
  (void)a;
  pthread_mutex_lock(&mu);
  records++;
  struct h *h = eh;
  if (!mine(h) || !h->alive) bad_handle++;
  if (state > NXP_STATE_GROUP_END_API_START) bad_type++; /* a v5 plugin never sees v6+ states */
  pthread_mutex_unlock(&mu);
  return 0;
}

static nxp_result_t c_finalize(void *ctx) {
  pthread_mutex_lock(&mu);
  if (ctx != &ctx_token) bad_ctx++;
  finals++;
  live_ctx--;
  if (live_ctx == 0) {
    const char *p = getenv("CHAINED_OUT");
    FILE *f = p ? fopen(p, "w") : stderr;
    static const char *names[16] = {"Group", "Coll", "P2p", "ProxyOp", "ProxyStep", "ProxyCtrl", "KernelCh", "NetPlugin",
                                    "GroupApi", "CollApi", "P2pApi", "KernelLaunch", "CeColl", "CeSync", "CeBatch", "KernelPhase"};
    for (int i = 0; i < 16; i++) fprintf(f, "start_%s %lld\n", names[i], starts[i]);
    fprintf(f, "stops %lld\nrecords %lld\nbad_handle %lld\nbad_parent %lld\nbad_ctx %lld\nbad_type %lld\ninits %lld\nfinals %lld\n",
            stops, records, bad_handle, bad_parent, bad_ctx, bad_type, inits, finals);
    if (f != stderr) fclose(f);
  }
  pthread_mutex_unlock(&mu);
  return 0;
}

__attribute__((visibility("default"))) const nxp_profiler_v5 ncclProfiler_v5 = {"chained-test", c_init, c_start, c_stop, c_record, c_finalize};

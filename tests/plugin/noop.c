/* noop.c -- a profiler plugin that does nothing: the bench's reference cost.
 * Exports ncclProfiler_v7; asks for the same mask as nccl-exporter's plugin
 * (Coll|P2p|KernelCh) so NCCL makes the same callbacks; returns a non-NULL
 * handle for every event so no later call is suppressed. */
#include <stdint.h>
#include "profiler_abi.h"
static int token;
static nxp_result_t n_init(void **ctx, uint64_t id, int *mask, const char *name, int nn, int nr, int r, nxp_logger_t l) {
  (void)id; (void)name; (void)nn; (void)nr; (void)r; (void)l;
  *mask |= NXP_EV_COLL | NXP_EV_P2P | NXP_EV_KERNEL_CH;
  *ctx = &token;
  return 0;
}
static nxp_result_t n_start(void *ctx, void **h, nxp_descr_v7 *d) { (void)d; *h = ctx; return 0; }
static nxp_result_t n_stop(void *h) { (void)h; return 0; }
static nxp_result_t n_record(void *h, int s, nxp_state_args *a) { (void)h; (void)s; (void)a; return 0; }
static nxp_result_t n_fini(void *ctx) { (void)ctx; return 0; }
__attribute__((visibility("default"))) const nxp_profiler_v7 ncclProfiler_v7 = {"noop", n_init, n_start, n_stop, n_record, n_fini};

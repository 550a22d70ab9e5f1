/*
 * clock.c -- the GPU timer -> CLOCK_MONOTONIC mapping, per communicator
 * (records.c maps a record's timers with it; gpu.c feeds it samples).
 */
#include "internal.h" /* first: it includes glibc_floor.h before any system header */

/* ------------------------------------------------------------------------ */
/* Clock mapping                                                           */

/* Every KernelCh delivery gives one upper bound of (mono - gpu timer): the
 * host sees a timer only after the GPU wrote it.  The smallest bound over a
 * sliding window (two windows of window_ns, default 200 ms) is the estimate; it is late by
 * the smallest delivery lag (the poll interval of NCCL's profiler/proxy
 * thread) and follows drift within 2 windows. */
void clk_sample(struct clk *c, uint64_t timer, uint64_t now) {
  int64_t s = (int64_t)(now - timer);
  uint64_t ws = atomic_load_explicit(&c->win_start, memory_order_relaxed);
  if (UNLIKELY(ws == 0 || now - ws > G.window_ns)) {
    int64_t cur = atomic_load_explicit(&c->cur_min, memory_order_relaxed);
    /* after an idle gap the previous window is too old to trust: start afresh */
    atomic_store_explicit(&c->prev_min, (ws && now - ws <= 2 * G.window_ns) ? cur : s, memory_order_relaxed);
    atomic_store_explicit(&c->cur_min, s, memory_order_relaxed);
    atomic_store_explicit(&c->win_start, now, memory_order_relaxed);
  } else {
    int64_t cur = atomic_load_explicit(&c->cur_min, memory_order_relaxed);
    while (s < cur && !atomic_compare_exchange_weak_explicit(&c->cur_min, &cur, s, memory_order_relaxed,
                                                             memory_order_relaxed)) {
    }
  }
  /* only none, one and more than one matter (snapshot(): F_OFFSET_COARSE
   * under two): no atomic add once there are two */
  if (atomic_load_explicit(&c->nsamples, memory_order_relaxed) < 2)
    atomic_fetch_add_explicit(&c->nsamples, 1, memory_order_relaxed);
}

int64_t clk_offset(struct clk *c) {
  int64_t a = atomic_load_explicit(&c->cur_min, memory_order_relaxed);
  int64_t b = atomic_load_explicit(&c->prev_min, memory_order_relaxed);
  return a < b ? a : b;
}

/*
 * pool.c -- the record pool and its ages: a slot per operation (slot_alloc),
 * its release, and the sweep that ends what NCCL will never complete.
 */
#include "internal.h" /* first: it includes glibc_floor.h before any system header */

/* The slot freed last (index + 1; 0: none): slot_alloc takes it first. Its
 * memory is in this core's cache, or a neighbour's, where the rotating
 * cursor's next slot is cold (the pool, its network tables included, is ~6 MiB
 * at 4,096 slots: more than the L2 cache), and a job with few operations in
 * flight then keeps reusing a handful of slots. */
static _Atomic uint32_t last_freed;

/* The caller holds the slot CLOSING: it alone writes gen (no atomic add). */
static void slot_free(struct slot *s) {
  atomic_store_explicit(&s->gen, atomic_load_explicit(&s->gen, memory_order_relaxed) + 1,
                        memory_order_release); /* outstanding handles go stale */
  atomic_store_explicit(&s->state, SLOT_FREE, memory_order_release);
  atomic_store_explicit(&last_freed, (uint32_t)(s - G.slots) + 1, memory_order_relaxed);
}

/* Return a slot to the pool (exactly one caller wins the LIVE->CLOSING CAS). */
void release(struct slot *s, uint32_t abandon_flags, uint64_t now) {
  uint32_t live = SLOT_LIVE;
  if (!atomic_compare_exchange_strong(&s->state, &live, SLOT_CLOSING)) return;
  if (!atomic_load(&s->finished)) finish(s, NCCL_EXPORTER_STATE_ABANDONED, abandon_flags, now ? now : mono_ns());
  slot_free(s);
}

/* Records NCCL will never complete, found by a periodic sweep (at most every
 * 100 ms: from an operation's start at most every 250 ms, from the announcer
 * thread each period, and when the pool is full):
 *  - older than NCCL_EXPORTER_PROFILER_MAX_AGE_S: abandoned (F_AGED) when the
 *    pool is full; without that pressure only if it cannot be a real hang
 *    (aged_out below): a collective whose kernel runs, or waits to start, for
 *    minutes is what the agent's hang alerts must keep seeing in flight
 *    (docs/alerts.md, NcclCollectiveHung and NcclGpuQueueStalled). A
 *    CHANNELS_UNKNOWN operation (CollNet/NVLS) no KernelCh ever ran for is
 *    NCCL giving it nothing to time: counted done, F_UNTIMED, not abandoned;
 *  - a lost channel (NCCL <= 2.30, transport/profiler.cc:35-44 in 2.28.9): in
 *    one pass of profilerProxyProgress the start check can miss a channel's
 *    start and the stop check, a moment later, see its stop; the stop then goes
 *    out through sub->kernelEventHandle, which still holds the handle of the
 *    operation that used those sub-args before (proxy.cc:358-388 never resets
 *    it), and that args is done: the operation never gets that channel's start
 *    or stop. The older operation's second stop is ignored (ch_stopped). An
 *    operation is taken as lost when none of its channels runs, no older one
 *    of its communicator runs, and either some of its channels ended or a
 *    newer operation of its communicator had every channel stop (kernels of
 *    one communicator end in order), all that for
 *    NCCL_EXPORTER_PROFILER_SETTLE_MS: done with F_REJECT_LOST_CHANNEL (its
 *    interval is partial: counted by that reason). One that lost every
 *    channel with nothing after it in its communicator waits for MAX_AGE;
 *  - ProxyOps never stopped (2.28.9: proxy.cc:427 starts one for every non-
 *    profiler pattern, only transport/net.cc:1364,1635 stop them; CollNet and
 *    the SHM/P2P copy-engine modes never do): once the last KernelCh stopped,
 *    open ProxyOps hold the done record back for SETTLE_MS at most, then it
 *    goes out with F_NET_UNFINISHED and the slot is reclaimed;
 *  - while records are in flight (sweep_live, or operations started since
 *    its last sweep: announce.c), the announcer sweeps every
 *    SETTLE_MS / 4 (at least 100 ms), not only once a period: an idle job's
 *    records that waited for a stop end within SETTLE_MS and a quarter of it
 *    after the event that made them wait;
 *  - with the pool full (pressure), the last two end at once: at a job's pace
 *    more records wait for SETTLE_MS than the pool holds, and a new operation
 *    dropped would lose more than these records' missing stops;
 *  - ProxyOp entries whose operation was reclaimed (finalize, age-out, the
 *    cases above) go back to their pool. */

/* The sweep ends a slot it found LIVE with generation gen0: claimed by the
 * LIVE -> CLOSING CAS, unless the operation ended and the slot went to another
 * one meanwhile (then it is put back at once, untouched). Emits the record
 * (state DONE or ABANDONED, with flags) unless it went out already. */
static int sweep_end(struct slot *s, uint32_t gen0, uint8_t state, uint32_t flags, uint64_t now) {
  uint32_t live = SLOT_LIVE;
  if (!atomic_compare_exchange_strong(&s->state, &live, SLOT_CLOSING)) return 0;
  if (atomic_load(&s->gen) != gen0) {
    atomic_store_explicit(&s->state, SLOT_LIVE, memory_order_release);
    return 0;
  }
  if (!atomic_load(&s->finished)) finish(s, state, flags, now);
  slot_free(s);
  return 1;
}

/* A record whose kernel is done and that waits only for ProxyOps NCCL never
 * stops: done, F_NET_UNFINISHED (the sweep after SETTLE_MS, under pressure at
 * once, a communicator's finalize: its GPU interval is whole, it is no
 * abandoned operation). 1 if this call ended it. */
static int end_net_unfinished(struct slot *s, uint32_t gen0, uint64_t now) {
  if (!sweep_end(s, gen0, NCCL_EXPORTER_STATE_DONE, s->done_reject | NCCL_EXPORTER_F_NET_UNFINISHED, now)) return 0;
  atomic_fetch_add_explicit(&G.net_unfinished, 1, memory_order_relaxed);
  return 1;
}

/* A communicator's finalize: its live records end, abandoned (F_FINALIZED)
 * unless only open ProxyOps held them (end_net_unfinished). */
void release_at_finalize(struct slot *s, uint64_t now) {
  uint32_t gen0 = atomic_load_explicit(&s->gen, memory_order_acquire);
  if (atomic_load(&s->kch_done) && !atomic_load(&s->finished) && atomic_load(&s->proxy_open) > 0 &&
      end_net_unfinished(s, gen0, now))
    return;
  release(s, NCCL_EXPORTER_F_FINALIZED, now);
}

/* Under pressure a sweep runs at once, unless the last one under pressure
 * ended nothing: then 10 ms after the last sweep (a pool full of operations
 * in flight is not scanned at every start). One sweep at a time: two at once
 * would both write each communicator's sweep_min_run, and one could then
 * take an operation as lost while an older one runs. */
static atomic_int pressure_ended = 1;
static atomic_flag sweeping = ATOMIC_FLAG_INIT;

int sweep(uint64_t now, int pressure) { /* 1 if it ran (not rate-limited) */
  uint64_t last = atomic_load(&G.last_sweep);
  int again = pressure && (now - last >= 10000000ull || atomic_load_explicit(&pressure_ended, memory_order_relaxed));
  if (last >= now || (now - last < 100000000ull && !again)) return 0;
  if (atomic_flag_test_and_set_explicit(&sweeping, memory_order_acquire)) return 0;
  if (!atomic_compare_exchange_strong(&G.last_sweep, &last, now)) {
    atomic_flag_clear_explicit(&sweeping, memory_order_release);
    return 0;
  }
  int ended = 0, live = 0;
  for (uint32_t i = 0; ctx_arena && i < ctx_used; i++) ctx_arena[i].sweep_min_run = UINT64_MAX;
  for (uint32_t i = 0; i < G.nslots; i++) { /* the oldest running operation per communicator */
    struct slot *s = &G.slots[i];
    if (atomic_load_explicit(&s->state, memory_order_acquire) != SLOT_LIVE) continue;
    live++;
    if (ch_count(s->ch_started) > ch_count(s->ch_stopped) &&
        s->ord < s->ctx->sweep_min_run)
      s->ctx->sweep_min_run = s->ord;
  }
  for (uint32_t i = 0; i < G.nslots; i++) {
    struct slot *s = &G.slots[i];
    uint32_t gen0 = atomic_load_explicit(&s->gen, memory_order_acquire);
    if (atomic_load_explicit(&s->state, memory_order_acquire) != SLOT_LIVE) continue;
    if (older_than(now, s->created, G.max_age_ns + 1)) {
      int untimed = (s->rec.flags & NCCL_EXPORTER_F_CHANNELS_UNKNOWN) && !ch_count(s->ch_started);
      if (untimed) {
        sweep_end(s, gen0, NCCL_EXPORTER_STATE_DONE, NCCL_EXPORTER_F_UNTIMED, now);
        continue;
      }
      if (pressure) {
        sweep_end(s, gen0, NCCL_EXPORTER_STATE_ABANDONED, NCCL_EXPORTER_F_AGED, now);
        continue;
      }
    }
    if (atomic_load(&s->finished)) continue;
    if (atomic_load(&s->kch_done)) {
      if (atomic_load(&s->proxy_open) > 0 && (pressure || older_than(now, s->done_now, G.settle_ns)))
        ended += end_net_unfinished(s, gen0, now);
      continue;
    }
    struct ctx *c = s->ctx;
    uint32_t started = ch_count(s->ch_started), stopped = ch_count(s->ch_stopped);
    /* nothing of it runs, nothing older of its communicator runs, and either
     * some of its channels ended (its kernel ran) or a newer operation of its
     * communicator ended (kernels of one communicator end in order) */
    int lost = started <= stopped && c->sweep_min_run > s->ord &&
               (stopped > 0 || atomic_load_explicit(&c->kch_done_ord, memory_order_relaxed) > s->ord + 1);
    if (!lost) {
      s->lost_since = 0;
      continue;
    }
    if (!s->lost_since) { /* since a newer operation ended, if that is what made it lost; else since now */
      uint64_t at = atomic_load_explicit(&c->kch_done_at, memory_order_relaxed);
      s->lost_since = stopped == 0 && at && at < now ? at : now;
    }
    if ((pressure || older_than(now, s->lost_since, G.settle_ns)) &&
        sweep_end(s, gen0, NCCL_EXPORTER_STATE_DONE, NCCL_EXPORTER_F_REJECT_LOST_CHANNEL, now)) {
      atomic_fetch_add_explicit(&G.lost_channel, 1, memory_order_relaxed);
      atomic_fetch_add_explicit(&G.rejected, 1, memory_order_relaxed);
      ended++;
    }
  }
  if (pressure) atomic_store_explicit(&pressure_ended, ended > 0, memory_order_relaxed);
  atomic_store_explicit(&G.sweep_live, live > 0, memory_order_relaxed);
  if (G.pops) pops_reclaim();
  atomic_flag_clear_explicit(&sweeping, memory_order_release);
  return 1;
}

/* A free slot for the caller (CLOSING until it publishes it LIVE): the one
 * freed last if still free (threads that read the same hint race for it in
 * slot_claim: one gets it), else the next free one from a rotating cursor. */
static inline int slot_claim(uint32_t i) {
  struct slot *s = &G.slots[i];
  uint32_t f = SLOT_FREE;
  return atomic_load_explicit(&s->state, memory_order_relaxed) == SLOT_FREE &&
         atomic_compare_exchange_strong_explicit(&s->state, &f, SLOT_CLOSING, memory_order_acquire,
                                                 memory_order_relaxed);
}

struct slot *slot_alloc(uint64_t now, uint32_t *idx_out) {
  uint32_t hot = atomic_load_explicit(&last_freed, memory_order_relaxed);
  if (hot && hot - 1 < G.nslots && slot_claim(hot - 1)) {
    *idx_out = hot - 1;
    return &G.slots[hot - 1];
  }
  for (int pass = 0; pass < 2; pass++) {
    for (uint32_t tries = 0; tries < G.nslots; tries++) {
      uint32_t i = atomic_fetch_add_explicit(&G.cursor, 1, memory_order_relaxed) % G.nslots;
      if (slot_claim(i)) {
        *idx_out = i;
        return &G.slots[i];
      }
    }
    if (pass == 0) sweep(now, 1);
  }
  if (atomic_fetch_add_explicit(&G.dropped, 1, memory_order_relaxed) == 0)
    logmsg(NXP_LOG_WARN, "nccl-exporter profiler: record pool (%u) exhausted; operations are dropped and counted "
           "(NCCL_EXPORTER_PROFILER_POOL)", G.nslots);
  return NULL;
}

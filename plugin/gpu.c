/*
 * gpu.c -- GPU intervals: the Coll/P2p start (a record slot), the KernelCh
 * starts and stops that bound its interval, and the plausibility check
 * (judge) that feeds the clock mapping (clock.c).
 */
#include "internal.h" /* first: it includes glibc_floor.h before any system header */

/* A channel's word and bit in a channel bitset (ch_started, ch_stopped). */
#define CH_WORD(ch) (((ch) >> 6) & 3)
#define CH_BIT(ch) (1ull << ((ch) & 63))

/* Claim the operation's CLAIM_* work for the one caller that gets it, while
 * the slot still holds the operation of generation gen (the handle's): a
 * thread late on a slot that ended and went to another operation claims
 * nothing there. */
static inline int claim(struct slot *s, uint32_t gen, uint32_t what) {
  uint32_t cur = atomic_load_explicit(&s->claimed, memory_order_relaxed);
  while ((cur >> 2) == (gen & H_GEN) && !(cur & what))
    if (atomic_compare_exchange_weak(&s->claimed, &cur, cur | what)) return 1;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Our event logic (version independent)                                   */

void *ours_start_op(struct ctx *c, const struct ev *e) {
  if (UNLIKELY(atomic_load_explicit(&G.disabled, memory_order_relaxed) || !G.slots)) return NULL;
  unsigned nch = e->nchannels;
  uint32_t fl = 0;
  /* Without KernelCh events (the counts mask, or a RAS override of NCCL's
   * mask) no GPU interval can come: counted, untimed, done at its enqueue. */
  if (UNLIKELY(G.nccl_mask && !(__atomic_load_n(G.nccl_mask, __ATOMIC_RELAXED) & NXP_EV_KERNEL_CH))) {
    nch = 0;
    fl = NCCL_EXPORTER_F_UNTIMED;
  } else if (e->type == NXP_EV_P2P && e->root_or_peer == c->rank && c->iface <= 6) {
    /* NCCL <= 2.30 (interface <= v6): a rank's Send/Recv to itself gets no
     * proxy op, hence no profiler proxy op and no KernelCh events (v2.28.9-1
     * src/enqueue.cc:805 nProxyOps = selfSend ? 0 : 2; :1010-1019). Counted,
     * untimed, done at its enqueue: it must not stay in flight. */
    nch = 0;
    fl = NCCL_EXPORTER_F_UNTIMED;
  } else if (nch == 0) {
    /* CollNet (and NVLS): NCCL never sets the task's nChannels (v2.28.9-1
     * src/enqueue.cc:568-597), yet adds a profiler proxy op per channel whose
     * KernelCh events take this handle as parent: count the channels as they
     * come; done once every one started so far stopped. */
    fl = NCCL_EXPORTER_F_CHANNELS_UNKNOWN;
  }
  uint64_t now = mono_ns();
  if (UNLIKELY(older_than(now, atomic_load_explicit(&G.last_sweep, memory_order_relaxed), 250000000ull))) sweep(now, 0);
  uint32_t idx;
  struct slot *s = slot_alloc(now, &idx);
  if (!s) return NULL;
  /* a new generation (the slot is ours, CLOSING: we alone write gen) */
  uint32_t gen = atomic_load_explicit(&s->gen, memory_order_relaxed) + 1;
  if ((gen & H_GEN) == 0) gen++;
  atomic_store_explicit(&s->gen, gen, memory_order_relaxed);
  s->ctx = c;
  s->theirs = NULL;
  s->created = now;
  /* the event's reference and, unless no KernelCh will come, its channels' one (ch_ref) */
  atomic_store_explicit(&s->refs, 1 + ((nch || (fl & NCCL_EXPORTER_F_CHANNELS_UNKNOWN)) ? 1 : 0), memory_order_relaxed);
  atomic_store_explicit(&s->claimed, (gen & H_GEN) << 2, memory_order_relaxed);
  atomic_store_explicit(&s->finished, 0, memory_order_relaxed);
  atomic_store_explicit(&s->flags, 0, memory_order_relaxed);
  atomic_store_explicit(&s->min_start, UINT64_MAX, memory_order_relaxed);
  atomic_store_explicit(&s->max_stop, 0, memory_order_relaxed);
  atomic_store_explicit(&s->first_start_host, 0, memory_order_relaxed);
  atomic_store_explicit(&s->first_start_timer, 0, memory_order_relaxed);
  atomic_store_explicit(&s->proxy_open, 0, memory_order_relaxed);
  atomic_store_explicit(&s->kch_done, 0, memory_order_relaxed);
  for (int k = 0; k < 4; k++) {
    atomic_store_explicit(&s->ch_started[k], 0, memory_order_relaxed);
    atomic_store_explicit(&s->ch_stopped[k], 0, memory_order_relaxed);
  }
  s->lost_since = 0;
  /* The network table: cleared here, before any ProxyOp (several proxy threads
   * may fill it: net_entry), if the slot's last operation used it (net_used is
   * set before a ProxyOp first writes it; the slot came back to the pool only
   * after its ProxyOps ended) */
  if (atomic_load_explicit(&s->net_used, memory_order_relaxed)) {
    net_clear(idx);
    atomic_store_explicit(&s->net_used, 0, memory_order_relaxed);
  }

  struct nccl_exporter_record *r = &s->rec;
  memset(r, 0, sizeof *r);
  r->version = NCCL_EXPORTER_RECORD_VERSION;
  r->size = sizeof *r;
  r->id = atomic_fetch_add_explicit(&G.next_id, 1, memory_order_relaxed);
  s->ord = r->id;
  r->comm_hash = c->comm_hash;
  r->rank = c->rank;
  r->nranks = c->nranks;
  r->iface_version = (uint8_t)c->iface;
  r->nchannels = (uint8_t)nch;
  r->count = e->count;
  r->host_enqueue_mono_ns = now;
  unsigned esize = 0;
  r->datatype = dtype_code_cached(e->datatype, &esize, &fl);
  r->bytes = (uint64_t)e->count * esize;
  r->op = op_code_cached(e->func);
  if (e->func) {
    size_t n = strnlen(e->func, sizeof r->op_name - 1);
    memcpy(r->op_name, e->func, n);
  }
  if (e->type == NXP_EV_COLL) {
    r->kind = NCCL_EXPORTER_KIND_COLL;
    r->seq = e->seq;
    r->peer = (r->op == 4 || r->op == 5) ? e->root_or_peer : -1; /* Broadcast/Reduce have a root */
  } else {
    r->kind = NCCL_EXPORTER_KIND_P2P;
    r->peer = e->root_or_peer;
    if (c->p2p_seq && e->root_or_peer >= 0) {
      uint32_t k = ((uint32_t)e->root_or_peer % c->p2p_n) * 2 + (r->op == 7);
      r->seq = atomic_fetch_add_explicit(&c->p2p_seq[k], 1, memory_order_relaxed);
    }
  }
  r->flags = fl;
  atomic_store_explicit(&s->state, SLOT_LIVE, memory_order_release);

  struct nccl_exporter_record q;
  snapshot(s, &q, NCCL_EXPORTER_STATE_QUEUED, now);
  q.flags &= ~(NCCL_EXPORTER_F_NO_GPU_TIME | NCCL_EXPORTER_F_OFFSET_COARSE);
  hook_coll_queued(&q);
  return h_make(idx, gen, 0);
}

void *ours_start_kch(struct ctx *c, const struct ev *e) {
  uint32_t sub;
  struct slot *s = h_slot(e->parent, &sub);
  if (!s || sub != 0) return NULL;
  uint32_t idx = (uint32_t)(((uintptr_t)e->parent >> 9) & 0x7fffffu);
  void *h = h_make(idx, (uint32_t)((uintptr_t)e->parent >> 32) & H_GEN, 1 + (e->channel & 0xff));
  /* One atomic per channel: the bit is the channel's start, counted once,
   * and (set bits) the count of channels started (ch_count). */
  unsigned ch = e->channel & 0xff, k = CH_WORD(ch);
  uint64_t old = atomic_fetch_or(&s->ch_started[k], CH_BIT(ch));
  if (old & CH_BIT(ch)) return h; /* this channel started already: counted once */
  uint64_t cur = atomic_load_explicit(&s->min_start, memory_order_relaxed);
  while (e->ptimer < cur && !atomic_compare_exchange_weak_explicit(&s->min_start, &cur, e->ptimer,
                                                                   memory_order_relaxed, memory_order_relaxed)) {
  }
  uint32_t n = bits64(old); /* channels started before it: its word's, then the others' */
  for (unsigned j = 0; j < 4; j++) {
    uint64_t w = j == k ? 0 : atomic_load(&s->ch_started[j]);
    if (w) n += bits64(w);
  }
  /* more children than announced: flagged; the last stop waits for them too */
  if (n >= s->rec.nchannels && s->rec.nchannels)
    atomic_fetch_or_explicit(&s->flags, NCCL_EXPORTER_F_EXTRA_CHANNELS, memory_order_relaxed);
  /* The first start (its word was empty; of several words' firsts, the one
   * that claims it): one host clock read per operation start (not per
   * channel): the RUNNING hook's time, and a clock sample kept until the
   * operation ends (judge(): only a plausible interval's timers feed the
   * offset estimator). */
  if (old == 0 && claim(s, (uint32_t)((uintptr_t)e->parent >> 32), CLAIM_RUNNING)) {
    uint64_t now = mono_ns();
    (void)c;
    atomic_store_explicit(&s->first_start_timer, e->ptimer, memory_order_relaxed);
    atomic_store_explicit(&s->first_start_host, now, memory_order_relaxed);
    struct nccl_exporter_record r;
    snapshot(s, &r, NCCL_EXPORTER_STATE_RUNNING, now);
    r.flags &= ~NCCL_EXPORTER_F_NO_GPU_TIME;
    hook_gpu_start(&r);
  }
  return h;
}

/* Is the finished operation's GPU interval plausible against the host's own
 * times?  0, or the one NCCL_EXPORTER_F_REJECT_* reason (docs/plugin.md,
 * "Implausible GPU intervals").  NCCL >= 2.29 maps KernelCh timers onto the
 * wrong operation after a Broadcast it ran without an activation mask
 * (NCCL_ALLGATHERV_ENABLE=1, the default: NVIDIA/nccl#2368): seconds-long
 * intervals, starts long before the operation was enqueued, stops before
 * starts.  Checked in this order:
 *   REVERSED  latest stop timer < earliest start timer;
 *   LONG      stop - start > (now - host enqueue) + E: the GPU cannot have
 *             worked longer than the host knew of the operation (needs no
 *             clock mapping; drift over one interval is ppm);
 *   EARLY     the start mapped to CLOCK_MONOTONIC lies more than E before the
 *             host enqueue.  The mapping is the offset estimate including this
 *             operation's own two samples: it errs late, never early, except by
 *             drift staleness (2 windows x drift).
 * E = clock_err_ns: 1 ms + 2 windows x 500 ppm (1.2 ms at 200 ms windows), or
 * NCCL_EXPORTER_PROFILER_CLOCK_ERROR_US.  The 1 ms is for the enqueue time:
 * NCCL starts the Coll event on the host thread just after it launched the
 * kernel (enqueue.cc: ncclLaunchKernelAfter_NoCuda -> hostStreamPlanTask), so
 * a kernel may start a little before its "enqueue", more if that thread is
 * preempted in between. */
static uint32_t judge(struct slot *s, uint64_t last_ptimer, uint64_t now) {
  uint64_t a = atomic_load_explicit(&s->min_start, memory_order_relaxed);
  uint64_t b = atomic_load_explicit(&s->max_stop, memory_order_relaxed);
  if (a == UINT64_MAX || !b) return 0; /* nothing to judge (no start timer seen) */
  if (b < a) return NCCL_EXPORTER_F_REJECT_REVERSED;
  uint64_t enq = s->rec.host_enqueue_mono_ns;
  if (b - a > (now - enq) + G.clock_err_ns) return NCCL_EXPORTER_F_REJECT_LONG;
  int64_t off = (int64_t)(now - last_ptimer);
  uint64_t fst = atomic_load_explicit(&s->first_start_timer, memory_order_relaxed);
  uint64_t fsh = atomic_load_explicit(&s->first_start_host, memory_order_relaxed);
  if (fsh && (int64_t)(fsh - fst) < off) off = (int64_t)(fsh - fst);
  struct clk *c = &s->ctx->clk;
  if (atomic_load_explicit(&c->nsamples, memory_order_relaxed)) {
    int64_t est = clk_offset(c);
    if (est < off) off = est;
  }
  uint64_t start_mono = a + (uint64_t)off;
  if (start_mono + G.clock_err_ns < enq) return NCCL_EXPORTER_F_REJECT_EARLY;
  return 0;
}

void ours_kch_stop_state(void *h, uint64_t ptimer) {
  uint32_t sub;
  struct slot *s = h_slot(h, &sub);
  if (!s || sub == 0) return;
  /* A second stop of a channel is another operation's, sent through this
   * operation's stale handle (see sweep()): never counted here. Its timer is
   * taken before the stop is counted (the bit): whoever sees the last bit set
   * sees every counted stop's timer. Only a second stop racing the first one
   * of the same channel could pass this check and leave its timer. */
  unsigned ch = (sub - 1) & 0xff, k = CH_WORD(ch);
  uint64_t started_w = atomic_load(&s->ch_started[k]);
  if (!(started_w & CH_BIT(ch)) || (atomic_load_explicit(&s->ch_stopped[k], memory_order_relaxed) & CH_BIT(ch))) {
    atomic_fetch_add_explicit(&G.dup_stops, 1, memory_order_relaxed);
    return;
  }
  uint64_t cur = atomic_load_explicit(&s->max_stop, memory_order_relaxed);
  while (ptimer > cur && !atomic_compare_exchange_weak_explicit(&s->max_stop, &cur, ptimer, memory_order_relaxed,
                                                               memory_order_relaxed)) {
  }
  uint64_t stopped_w = atomic_fetch_or(&s->ch_stopped[k], CH_BIT(ch));
  if (UNLIKELY(stopped_w & CH_BIT(ch))) { /* that race: the other one counted */
    atomic_fetch_add_explicit(&G.dup_stops, 1, memory_order_relaxed);
    return;
  }
  /* The last channel: every channel started has stopped (the bitsets are
   * equal), at least as many as announced. Of several stops seeing that at
   * once (stops on different words), the one that claims it does its work. */
  int last = (stopped_w | CH_BIT(ch)) == atomic_load(&s->ch_started[k]);
  for (unsigned j = 0; last && j < 4; j++)
    if (j != k) last = atomic_load(&s->ch_stopped[j]) == atomic_load(&s->ch_started[j]);
  if (last && ch_count(s->ch_stopped) >= s->rec.nchannels &&
      claim(s, (uint32_t)((uintptr_t)h >> 32), CLAIM_LAST_STOP)) { /* one clock read per operation end */
    uint64_t now = mono_ns();
    uint32_t reject = judge(s, ptimer, now);
    if (!reject) { /* the operation's two clock samples: its first start and its last stop */
      uint64_t fst = atomic_load_explicit(&s->first_start_timer, memory_order_relaxed);
      uint64_t fsh = atomic_load_explicit(&s->first_start_host, memory_order_relaxed);
      if (fsh) clk_sample(&s->ctx->clk, fst, fsh);
      clk_sample(&s->ctx->clk, ptimer, now);
    } else {
      atomic_fetch_add_explicit(&G.rejected, 1, memory_order_relaxed);
    }
    /* Done now, unless ProxyOps are still open: they can end after the last
     * kernel channel; the last one to stop sends it (proxy_close). */
    s->done_reject = reject;
    s->done_now = now;
    uint64_t mine = s->ord + 1, seen = atomic_load_explicit(&s->ctx->kch_done_ord, memory_order_relaxed);
    while (seen < mine && !atomic_compare_exchange_weak(&s->ctx->kch_done_ord, &seen, mine)) {
    }
    atomic_store_explicit(&s->ctx->kch_done_at, now, memory_order_relaxed);
    atomic_store(&s->kch_done, 1);
    if (atomic_load(&s->proxy_open) == 0) finish(s, NCCL_EXPORTER_STATE_DONE, reject, now);
    /* The channels' reference: channels starting after this are not waited
     * for (CHANNELS_UNKNOWN, or a stale handle: counted) */
    if (ch_ref(s)) unref(s);
  }
}
void ours_stop(void *h) {
  if (h_is_proxy(h)) {
    proxy_stop(h);
    return;
  }
  /* A KernelCh's stopEvent changes nothing: NCCL sends it right after the
   * channel's stop state, which counted the stop (or found it a second one,
   * see sweep()), and the channels hold one reference together, dropped by
   * the last stop (v2.28.9-1 src/plugin/profiler.cc, ncclProfilerStopKernelChEvent:
   * recordEventState(KernelChStop) then stopEvent on one handle, lines 605-612;
   * the same in v2.29.7-1 and v2.30.7-1). */
  if ((uintptr_t)h & 0x1ff) return;
  uint32_t sub;
  struct slot *s = h_slot(h, &sub);
  if (!s) return;
  if (s->rec.flags & NCCL_EXPORTER_F_UNTIMED) /* no KernelCh will come: done when enqueued */
    finish(s, NCCL_EXPORTER_STATE_DONE, 0, mono_ns());
  unref(s);
}

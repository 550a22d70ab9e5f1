/*
 * net.c -- network time per peer: the ProxyOp and ProxyStep events (with
 * proxy accounting on), each step's phases summed into its operation's table.
 * The tables, their pool and the done record's network part: net_table.c.
 */
#include "internal.h" /* first: it includes glibc_floor.h before any system header */

/* A ProxyOp can no longer change the operation: maybe it was the last. */
static void proxy_close(struct slot *s) {
  if (atomic_fetch_sub(&s->proxy_open, 1) == 1 && atomic_load(&s->kch_done))
    finish(s, NCCL_EXPORTER_STATE_DONE, s->done_reject, s->done_now);
}

static inline uint64_t net_key(int peer, uint32_t dir) { return (((uint64_t)(uint32_t)peer << 1) | (dir & 1)) + 1; }

/* The (peer, direction) entry, claimed by CAS if new: safe with several writers. */
static struct net_ent *net_entry(struct net_tab *t, int peer, uint32_t dir) {
  uint64_t k = net_key(peer, dir);
  for (uint32_t i = 0; i < NET_TAB; i++) {
    uint64_t cur = atomic_load_explicit(&t->e[i].key, memory_order_acquire);
    if (cur == k) return &t->e[i];
    if (cur == 0) {
      if (atomic_compare_exchange_strong(&t->e[i].key, &cur, k)) {
        t->e[i].peer = peer;
        t->e[i].dir = dir;
        atomic_fetch_add_explicit(&t->n, 1, memory_order_relaxed);
        return &t->e[i];
      }
      if (cur == k) return &t->e[i]; /* another thread claimed it for the same pair */
    }
  }
  atomic_fetch_or_explicit(&t->flags, NCCL_EXPORTER_NET_F_TABLE_FULL, memory_order_relaxed);
  return &t->over[dir & 1];
}

static inline struct pop *pop_of(void *h, uint32_t *sub) {
  uint64_t v = (uintptr_t)h;
  uint32_t idx = (uint32_t)((v >> 9) & 0x7fffffu);
  if (idx >= G.npops) return NULL;
  struct pop *p = &G.pops[idx];
  if ((atomic_load_explicit(&p->gen, memory_order_acquire) & H_GEN) != (uint32_t)((v >> 32) & H_GEN) ||
      atomic_load_explicit(&p->state, memory_order_acquire) != SLOT_LIVE)
    return NULL;
  *sub = (uint32_t)(v & 0x1ff);
  return p;
}

/* A figure of a table: a plain add while the table has one writer thread (no
 * lock prefix: the common case costs what it did), an atomic one once it has
 * several (see above). Two threads crossing a phase's 0 <-> 1 count at once can
 * misplace one wall interval by the time between their two transitions; a
 * transition already under way when the second thread arrives may use the
 * plain add once. */
static inline uint64_t nadd64(_Atomic uint64_t *a, uint64_t v, int sh) {
  if (UNLIKELY(sh)) return atomic_fetch_add_explicit(a, v, memory_order_relaxed);
  uint64_t old = atomic_load_explicit(a, memory_order_relaxed);
  atomic_store_explicit(a, old + v, memory_order_relaxed);
  return old;
}
static inline uint32_t nadd32(_Atomic uint32_t *a, uint32_t v, int sh) {
  if (UNLIKELY(sh)) return atomic_fetch_add_explicit(a, v, memory_order_relaxed);
  uint32_t old = atomic_load_explicit(a, memory_order_relaxed);
  atomic_store_explicit(a, old + v, memory_order_relaxed);
  return old;
}
static inline int tab_shared(const struct net_tab *t) {
  return (int)atomic_load_explicit(&((struct net_tab *)t)->shared, memory_order_relaxed);
}

static inline void ph_leave(struct net_ent *e, struct pstep *st, uint64_t now, int sh) {
  uint8_t p = st->phase;
  if (p == PH_NONE) return;
  nadd64(&e->step[p], now - st->t, sh);
  if (nadd32(&e->nin[p], (uint32_t)-1, sh) == 1) {
    uint64_t since = atomic_load_explicit(&e->since[p], memory_order_relaxed);
    if (now > since) nadd64(&e->wall[p], now - since, sh);
  }
  st->phase = PH_NONE;
}

static inline void ph_enter(struct net_ent *e, struct pstep *st, uint8_t p, uint64_t now, int sh) {
  if (nadd32(&e->nin[p], 1, sh) == 0) atomic_store_explicit(&e->since[p], now, memory_order_relaxed);
  st->phase = p;
  st->t = now;
}

void *proxy_start_op(const struct ev *e) {
  if (e->pid != G.pid) return NULL; /* PXN: counted in common_start */
  uint32_t sub;
  struct slot *s = h_slot(e->parent, &sub);
  int32_t refs = s && sub == 0 ? atomic_load(&s->refs) : 0;
  do { /* a reference only while the operation is still held by someone */
    if (refs <= 0) {
      atomic_fetch_add_explicit(&G.proxy_orphan, 1, memory_order_relaxed);
      return NULL;
    }
  } while (!atomic_compare_exchange_weak(&s->refs, &refs, refs + 1));
  if ((atomic_load(&s->gen) & H_GEN) != (uint32_t)(((uintptr_t)e->parent >> 32) & H_GEN)) {
    unref(s); /* the slot was reused under us: not our operation */
    atomic_fetch_add_explicit(&G.proxy_orphan, 1, memory_order_relaxed);
    return NULL;
  }
  atomic_fetch_add(&s->proxy_open, 1);
  if (atomic_load(&s->kch_done) && atomic_load(&s->finished)) { /* its done record is out already */
    atomic_fetch_add_explicit(&G.proxy_late, 1, memory_order_relaxed);
    proxy_close(s);
    unref(s);
    return NULL;
  }
  struct pop *p = NULL;
  uint32_t pi = 0;
  for (uint32_t tries = 0; tries < G.npops; tries++) {
    uint32_t i = atomic_fetch_add_explicit(&G.pcursor, 1, memory_order_relaxed) % G.npops;
    uint32_t f = SLOT_FREE;
    if (atomic_load_explicit(&G.pops[i].state, memory_order_relaxed) == SLOT_FREE &&
        atomic_compare_exchange_strong(&G.pops[i].state, &f, SLOT_CLOSING)) {
      p = &G.pops[i];
      pi = i;
      break;
    }
  }
  if (!p) {
    if (atomic_fetch_add_explicit(&G.proxy_dropped, 1, memory_order_relaxed) == 0)
      logmsg(NXP_LOG_WARN, "nccl-exporter profiler: ProxyOp pool (%u) exhausted; network figures of operations are "
             "dropped and counted (NCCL_EXPORTER_PROFILER_PROXY_POOL)", G.npops);
    proxy_close(s);
    unref(s);
    return NULL;
  }
  struct net_tab *t = &G.nets[s - G.slots]; /* cleared when the operation started (ours_start_op) */
  atomic_store_explicit(&s->net_used, 1, memory_order_release);
  atomic_fetch_add_explicit(&t->nops, 1, memory_order_relaxed);
  uintptr_t me = (uintptr_t)pthread_self(), w = 0; /* a second proxy thread makes the table shared */
  if (!atomic_compare_exchange_strong(&t->writer, &w, me) && w != me) atomic_store(&t->shared, 1);
  p->s = s;
  p->sgen = (uint32_t)(((uintptr_t)e->parent >> 32) & H_GEN);
  p->tab = t;
  p->is_send = e->is_send ? 1 : 0;
  p->ent = net_entry(t, e->peer, p->is_send ? NCCL_EXPORTER_NET_SEND : NCCL_EXPORTER_NET_RECV);
  for (int k = 0; k < POP_STEPS; k++) { p->st[k].step = -1; p->st[k].phase = PH_NONE; }
  uint32_t gen = (atomic_fetch_add(&p->gen, 1) + 1) & H_GEN;
  if (!gen) gen = (atomic_fetch_add(&p->gen, 1) + 1) & H_GEN;
  atomic_store_explicit(&p->state, SLOT_LIVE, memory_order_release);
  atomic_fetch_add_explicit(&G.proxy_ops, 1, memory_order_relaxed);
  return (void *)(uintptr_t)(H_OURS | H_PROXY | ((uint64_t)gen << 32) | ((uint64_t)pi << 9));
}

void *proxy_start_step(const struct ev *e) {
  uint32_t sub;
  struct pop *p = h_is_proxy(e->parent) ? pop_of(e->parent, &sub) : NULL;
  if (!p || sub != 0 || e->step < 0 || !pop_slot(p)) return NULL;
  struct pstep *st = &p->st[e->step % POP_STEPS];
  if (UNLIKELY(st->step >= 0)) {
    ph_leave(p->ent, st, mono_ns(), tab_shared(p->tab));
    /* The same step started again is NCCL restarting a receive step whose
     * irecv was not posted yet (2.28.9 src/transport/net.cc:1432: every
     * progress pass starts sub->posted until it is posted): not a reuse.
     * Only the step 8 before it still open is one. */
    if (st->step != e->step)
      atomic_fetch_or_explicit(&p->tab->flags, NCCL_EXPORTER_NET_F_STEP_REUSED, memory_order_relaxed);
  }
  st->step = e->step;
  st->phase = PH_NONE;
  return (void *)(uintptr_t)(((uintptr_t)e->parent & ~(uintptr_t)0x1ff) | (1 + (uint32_t)(e->step % 64)));
}

/* The open step a ProxyStep handle refers to (NULL: stale). */
static inline struct pstep *proxy_step(void *h, struct pop **pp) {
  uint32_t sub;
  struct pop *p = pop_of(h, &sub);
  if (!p || sub == 0) return NULL;
  struct pstep *st = &p->st[(sub - 1) % POP_STEPS];
  if (st->step < 0 || (uint32_t)(st->step % 64) != sub - 1) return NULL;
  *pp = p;
  return st;
}

void proxy_record(void *h, int state, const nxp_state_args *a) {
  struct pop *p;
  struct pstep *st = proxy_step(h, &p);
  if (!st) return;
  int ph;
  if (p->is_send)
    ph = state == NXP_STATE_SEND_GPU_WAIT ? 0 : state == NXP_STATE_SEND_PEER_WAIT ? 1 : state == NXP_STATE_SEND_WAIT ? 2 : -1;
  else
    ph = state == NXP_STATE_RECV_WAIT ? 0 : state == NXP_STATE_RECV_FLUSH_WAIT ? 1 : state == NXP_STATE_RECV_GPU_WAIT ? 2 : -1;
  if (ph < 0) return;
  uint64_t now = mono_ns();
  int sh = tab_shared(p->tab);
  ph_leave(p->ent, st, now, sh);
  ph_enter(p->ent, st, (uint8_t)ph, now, sh);
  if (ph == (p->is_send ? 2 : 1) && a) nadd64(&p->ent->bytes, a->proxyStep.transSize, sh);
}

void proxy_stop(void *h) {
  uint32_t sub;
  struct pop *p = pop_of(h, &sub);
  if (!p) return;
  if (sub) { /* ProxyStep */
    struct pop *q;
    struct pstep *st = proxy_step(h, &q);
    if (!st) return;
    ph_leave(p->ent, st, mono_ns(), tab_shared(p->tab));
    st->step = -1;
    return;
  }
  struct slot *s = pop_slot(p);
  uint64_t now = 0;
  for (int k = 0; k < POP_STEPS; k++) /* steps NCCL never stopped end with their op */
    if (p->st[k].step >= 0) {
      if (!now) now = mono_ns();
      if (s) ph_leave(p->ent, &p->st[k], now, tab_shared(p->tab));
      p->st[k].step = -1;
    }
  uint32_t live = SLOT_LIVE; /* the sweep may be reclaiming it (pops_reclaim) */
  if (!atomic_compare_exchange_strong(&p->state, &live, SLOT_CLOSING)) return;
  atomic_fetch_add(&p->gen, 1); /* its handles go stale */
  atomic_store_explicit(&p->state, SLOT_FREE, memory_order_release);
  if (!s) { /* its operation was reclaimed (finalize, age-out): the slot may be another's now */
    atomic_fetch_add_explicit(&G.proxy_orphan, 1, memory_order_relaxed);
    return;
  }
  proxy_close(s);
  unref(s);
}


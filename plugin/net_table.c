/*
 * net_table.c -- the per-operation network tables (net.c fills them): cleared
 * at the operation's start, read into the done record's network part, and
 * the ProxyOp entries reclaimed when their operation is gone.
 */
#include "internal.h" /* first: it includes glibc_floor.h before any system header */

/* All zero is a clean table (the pool's pages start so): the overflow
 * entries' direction is their index (net_fill), their peer -1. */
void net_clear(uint32_t idx) {
  memset(&G.nets[idx], 0, sizeof G.nets[idx]);
}

/* ProxyOp entries whose operation was reclaimed (finalize, age-out, sweep):
 * NCCL may never stop them (an aborted communicator; CollNet and the SHM/P2P
 * copy-engine modes never do). Their handles go stale. */
void pops_reclaim(void) {
  for (uint32_t i = 0; i < G.npops; i++) {
    struct pop *p = &G.pops[i];
    if (atomic_load_explicit(&p->state, memory_order_acquire) != SLOT_LIVE || pop_slot(p)) continue;
    uint32_t live = SLOT_LIVE;
    if (!atomic_compare_exchange_strong(&p->state, &live, SLOT_CLOSING)) continue;
    atomic_fetch_add(&p->gen, 1);
    atomic_store_explicit(&p->state, SLOT_FREE, memory_order_release);
    atomic_fetch_add_explicit(&G.proxy_reclaimed, 1, memory_order_relaxed);
  }
}

/* The done record's network part: the top K peers by wall wait (both
 * directions), by rank; the rest summed into peer -1 per direction. */
void net_fill(struct slot *s, struct nccl_exporter_net *out) {
  memset(out, 0, sizeof *out);
  out->version = NCCL_EXPORTER_NET_VERSION;
  out->top_k = NCCL_EXPORTER_NET_TOP_K;
  out->foreign_ops = atomic_load_explicit(&G.proxy_foreign, memory_order_relaxed);
  if (!atomic_load_explicit(&s->net_used, memory_order_acquire)) return;
  struct net_tab *t = &G.nets[s - G.slots];
  out->flags = atomic_load_explicit(&t->flags, memory_order_relaxed);
  if (atomic_load_explicit(&s->proxy_open, memory_order_relaxed) > 0) out->flags |= NCCL_EXPORTER_NET_F_UNFINISHED;
  out->proxy_ops = atomic_load_explicit(&t->nops, memory_order_relaxed);
  /* entries are claimed in order (net_entry): the used ones are a prefix */
  uint32_t tn = 0;
  while (tn < NET_TAB && atomic_load_explicit(&t->e[tn].key, memory_order_acquire)) tn++;
  int peers[NET_TAB];
  uint64_t wait[NET_TAB];
  int np = 0;
  for (uint32_t i = 0; i < tn; i++) {
    struct net_ent *e = &t->e[i];
    uint64_t w = e->wall[0] + e->wall[1] + e->wall[2];
    int j = 0;
    while (j < np && peers[j] != e->peer) j++;
    if (j == np) { peers[np] = e->peer; wait[np++] = 0; }
    wait[j] += w;
  }
  out->npeers = (uint32_t)np;
  int keep[NET_TAB] = {0};
  for (int k = 0; k < NCCL_EXPORTER_NET_TOP_K && k < np; k++) { /* selection: np <= 8 */
    int best = -1;
    for (int j = 0; j < np; j++)
      if (!keep[j] && (best < 0 || wait[j] > wait[best] || (wait[j] == wait[best] && peers[j] < peers[best])))
        best = j;
    keep[best] = 1;
  }
  struct nccl_exporter_peer_wait other[2];
  memset(other, 0, sizeof other);
  int have_other[2] = {0, 0};
  uint32_t n = 0;
  for (uint32_t i = 0; i < tn + 2; i++) {
    struct net_ent *e = i < tn ? &t->e[i] : &t->over[i - tn];
    if (i >= tn && !(e->bytes || e->wall[0] || e->wall[1] || e->wall[2] || e->step[0] || e->step[1] || e->step[2]))
      continue; /* an unused overflow entry */
    int j = 0;
    while (i < tn && j < np && peers[j] != e->peer) j++;
    struct nccl_exporter_peer_wait *w;
    uint32_t dir = i < tn ? e->dir : i - tn; /* over[dir] */
    if (i < tn && j < np && keep[j]) {
      w = &out->e[n++];
      w->peer = e->peer;
    } else {
      w = &other[dir];
      w->peer = -1;
      have_other[dir] = 1;
    }
    w->direction = dir;
    w->bytes += e->bytes;
    for (int p = 0; p < NCCL_EXPORTER_NET_PHASES; p++) {
      w->wall_ns[p] += e->wall[p];
      w->step_ns[p] += e->step[p];
    }
  }
  for (int d = 0; d < 2; d++)
    if (have_other[d]) out->e[n++] = other[d];
  out->nentries = n;
}

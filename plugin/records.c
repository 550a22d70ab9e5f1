/*
 * records.c -- the record of one operation: names decoded from NCCL's strings, the
 * snapshot handed to the hooks, the log lines, and finish() (done or abandoned,
 * exactly once).
 */
#include "internal.h" /* first: it includes glibc_floor.h before any system header */

/* ------------------------------------------------------------------------ */
/* Names                                                                   */

/* exporter op codes: exporter/contract.py COLLECTIVE_OPS */
static uint8_t op_code(const char *f) {
  if (!f) return 0;
  switch (f[0]) {
  case 'A':
    if (!strcmp(f, "AllReduce")) return 1;
    if (!strcmp(f, "AllGather")) return 2;
    if (!strcmp(f, "AlltoAll") || !strcmp(f, "AllToAll")) return 8;
    return 0;
  case 'R':
    if (!strcmp(f, "ReduceScatter")) return 3;
    if (!strcmp(f, "Reduce")) return 5;
    if (!strcmp(f, "Recv")) return 7;
    return 0;
  case 'B': return strcmp(f, "Broadcast") ? 0 : 4;
  case 'S':
    if (!strcmp(f, "Send")) return 6;
    if (!strcmp(f, "Scatter")) return 10;
    return 0;
  case 'G': return strcmp(f, "Gather") ? 0 : 9;
  }
  return 0;
}

/* ncclDataType_t from NCCL's datatype string; *size = bytes per element. */
static uint8_t dtype_code(const char *d, unsigned *size, uint32_t *flags) {
  static const struct { const char *n; uint8_t code, size; } T[] = {
    {"ncclInt8", 0, 1},     {"ncclUint8", 1, 1},     {"ncclInt32", 2, 4},  {"ncclUint32", 3, 4},
    {"ncclInt64", 4, 8},    {"ncclUint64", 5, 8},    {"ncclFloat16", 6, 2}, {"ncclFloat32", 7, 4},
    {"ncclFloat64", 8, 8},  {"ncclBfloat16", 9, 2},  {"ncclFloat8e4m3", 10, 1}, {"ncclFloat8e5m2", 11, 1},
  };
  if (d && d[0] == 'n' && d[1] == 'c' && d[2] == 'c' && d[3] == 'l') {
    for (unsigned i = 0; i < sizeof T / sizeof T[0]; i++)
      if (!strcmp(d + 4, T[i].n + 4)) { *size = T[i].size; return T[i].code; }
  }
  /* NCCL's ncclDatatypeToString has no case for ncclUint8: "Unknown". */
  if (d && !strcmp(d, "Unknown")) { *size = 1; *flags |= NCCL_EXPORTER_F_DTYPE_GUESSED; return 1; }
  *size = 0;
  return 255;
}

/* NCCL's func/datatype strings are static literals: remember the decoded
 * value per string address.  One 64-bit word per entry, (address << 16) |
 * (a << 8) | b, so concurrent readers never see a torn entry. */
#define NAME_CACHE 64
static _Atomic uint64_t op_cache[NAME_CACHE], dt_cache[NAME_CACHE];

static inline unsigned name_slot(const char *p) { return (unsigned)(((uintptr_t)p >> 3) * 0x9E3779B1u >> 26) % NAME_CACHE; }

uint8_t op_code_cached(const char *f) {
  uintptr_t a = (uintptr_t)f;
  if (!f || a >> 47) return op_code(f);
  _Atomic uint64_t *e = &op_cache[name_slot(f)];
  uint64_t v = atomic_load_explicit(e, memory_order_relaxed);
  if (v && (v >> 16) == a) return (uint8_t)(v >> 8);
  uint8_t c = op_code(f);
  atomic_store_explicit(e, ((uint64_t)a << 16) | ((uint64_t)c << 8), memory_order_relaxed);
  return c;
}

uint8_t dtype_code_cached(const char *d, unsigned *size, uint32_t *flags) {
  uintptr_t a = (uintptr_t)d;
  if (!d || a >> 47) return dtype_code(d, size, flags);
  _Atomic uint64_t *e = &dt_cache[name_slot(d)];
  uint64_t v = atomic_load_explicit(e, memory_order_relaxed);
  if (v && (v >> 16) == a) {
    uint8_t code = (uint8_t)(v >> 8);
    *size = (unsigned)(v & 0x7f);
    if (v & 0x80) *flags |= NCCL_EXPORTER_F_DTYPE_GUESSED;
    return code;
  }
  uint32_t fl = 0;
  uint8_t c = dtype_code(d, size, &fl);
  *flags |= fl;
  atomic_store_explicit(e, ((uint64_t)a << 16) | ((uint64_t)c << 8) | (fl ? 0x80 : 0) | (*size & 0x7f),
                        memory_order_relaxed);
  return c;
}

/* ------------------------------------------------------------------------ */
/* Records                                                                 */

void snapshot(struct slot *s, struct nccl_exporter_record *r, uint8_t state, uint64_t now) {
  *r = s->rec;
  r->state = state;
  r->host_event_mono_ns = now;
  uint32_t started = ch_count(s->ch_started), stopped = ch_count(s->ch_stopped);
  r->channels_started = started > 255 ? 255 : (uint8_t)started;
  r->channels_stopped = stopped > 255 ? 255 : (uint8_t)stopped;
  r->flags |= atomic_load_explicit(&s->flags, memory_order_relaxed);
  uint64_t a = atomic_load_explicit(&s->min_start, memory_order_relaxed);
  uint64_t b = atomic_load_explicit(&s->max_stop, memory_order_relaxed);
  r->gpu_start_timer = a == UINT64_MAX ? 0 : a;
  r->gpu_stop_timer = b;
  struct clk *c = &s->ctx->clk;
  uint32_t n = atomic_load_explicit(&c->nsamples, memory_order_relaxed);
  if (n) {
    int64_t off = clk_offset(c);
    r->gpu_to_mono_offset_ns = off;
    if (r->gpu_start_timer) r->gpu_start_mono_ns = r->gpu_start_timer + (uint64_t)off;
    if (r->gpu_stop_timer) r->gpu_stop_mono_ns = r->gpu_stop_timer + (uint64_t)off;
    if (n < 2) r->flags |= NCCL_EXPORTER_F_OFFSET_COARSE;
  }
  if (!r->gpu_stop_timer) r->flags |= NCCL_EXPORTER_F_NO_GPU_TIME;
}

static const char *state_name(uint8_t st) {
  switch (st) {
  case NCCL_EXPORTER_STATE_DONE: return "done";
  case NCCL_EXPORTER_STATE_ABANDONED: return "abandoned";
  case NCCL_EXPORTER_STATE_RUNNING: return "running";
  default: return "queued";
  }
}

static const char *const PHASE_NAMES[2][NCCL_EXPORTER_NET_PHASES] = {
  {"send_gpu_wait", "send_peer_wait", "send_wait"},      /* contract.NETWORK_PHASES */
  {"recv_wait", "recv_flush_wait", "recv_gpu_wait"},
};

/* Logging mode: one line per (peer, direction) of a done record's network part. */
static void log_net(const struct nccl_exporter_record *r, const struct nccl_exporter_net *net) {
  for (uint32_t i = 0; i < net->nentries && i < NCCL_EXPORTER_NET_ENTRIES; i++) {
    const struct nccl_exporter_peer_wait *w = &net->e[i];
    const char *const *ph = PHASE_NAMES[w->direction ? 1 : 0];
    char line[640], peer[16] = "other";
    if (w->peer >= 0) snprintf(peer, sizeof peer, "%d", w->peer);
    int n = snprintf(line, sizeof line,
                     "nccl-exporter-profiler event=peer_wait op=%s comm=0x%016" PRIx64 " rank=%d seq=%" PRIu64
                     " id=%" PRIu64 " peer=%s direction=%s bytes=%" PRIu64
                     " %s_wall_ns=%" PRIu64 " %s_wall_ns=%" PRIu64 " %s_wall_ns=%" PRIu64
                     " %s_step_ns=%" PRIu64 " %s_step_ns=%" PRIu64 " %s_step_ns=%" PRIu64 " net_flags=0x%x pid=%d\n",
                     r->op_name[0] ? r->op_name : "?", r->comm_hash, r->rank, r->seq, r->id,
                     peer, w->direction ? "recv" : "send", w->bytes,
                     ph[0], w->wall_ns[0], ph[1], w->wall_ns[1], ph[2], w->wall_ns[2],
                     ph[0], w->step_ns[0], ph[1], w->step_ns[1], ph[2], w->step_ns[2], net->flags, (int)getpid());
    if (n > 0 && write(G.log_fd, line, (size_t)(n < (int)sizeof line ? n : (int)sizeof line - 1)) < 0) { /* best effort */ }
  }
}

static void log_record(const struct nccl_exporter_record *r) {
  if (G.log_fd < 0) return;
  char line[768];
  uint64_t gpu_ns = (r->gpu_stop_timer && r->gpu_start_timer && r->gpu_stop_timer >= r->gpu_start_timer)
                        ? r->gpu_stop_timer - r->gpu_start_timer : 0;
  int n = snprintf(line, sizeof line,
                   "nccl-exporter-profiler event=%s kind=%s op=%s opcode=%u comm=0x%016" PRIx64 " rank=%d nranks=%d"
                   " seq=%" PRIu64 " peer=%d count=%" PRIu64 " bytes=%" PRIu64 " dtype=%u"
                   " enqueue_mono_ns=%" PRIu64 " gpu_start_timer=%" PRIu64 " gpu_stop_timer=%" PRIu64
                   " gpu_ns=%" PRIu64 " gpu_start_mono_ns=%" PRIu64 " gpu_stop_mono_ns=%" PRIu64
                   " offset_ns=%" PRId64 " channels=%u/%u/%u flags=0x%x iface=v%u id=%" PRIu64 " pid=%d\n",
                   state_name(r->state), r->kind == NCCL_EXPORTER_KIND_P2P ? "p2p" : "coll",
                   r->op_name[0] ? r->op_name : "?", r->op, r->comm_hash, r->rank, r->nranks, r->seq, r->peer,
                   r->count, r->bytes, r->datatype, r->host_enqueue_mono_ns, r->gpu_start_timer, r->gpu_stop_timer,
                   gpu_ns, r->gpu_start_mono_ns, r->gpu_stop_mono_ns, r->gpu_to_mono_offset_ns,
                   r->channels_started, r->channels_stopped, r->nchannels, r->flags, r->iface_version, r->id,
                   (int)getpid());
  if (n > 0) {
    ssize_t w = write(G.log_fd, line, (size_t)(n < (int)sizeof line ? n : (int)sizeof line - 1));
    (void)w;
  }
}


/* Batched collectives share one interval: the kernel writes one start and one
 * stop timer for all the work items of a batch on a channel, read in one loop
 * (NCCL v2.28.9-1 src/device/common.h:309-327), so N collectives of one batch
 * report the same interval, within the loop's few ns. A done interval whose
 * start and stop both lie within SHARED_NS of the communicator's last
 * unshared done interval is that one's: flagged F_SHARED, it counts once (the
 * agent leaves it out of sums and histograms). Two operations run one after
 * the other cannot match unless the first lasted under SHARED_NS. */
#define SHARED_NS 1000
static int shared_with_last(struct ctx *c, uint64_t a, uint64_t b) {
  if (!a || !b) return 0;
  uint64_t pa = atomic_load_explicit(&c->batch_a, memory_order_relaxed);
  uint64_t pb = atomic_load_explicit(&c->batch_b, memory_order_relaxed);
  if (pa && (a > pa ? a - pa : pa - a) <= SHARED_NS && (b > pb ? b - pb : pb - b) <= SHARED_NS) return 1;
  atomic_store_explicit(&c->batch_a, a, memory_order_relaxed);
  atomic_store_explicit(&c->batch_b, b, memory_order_relaxed);
  return 0;
}

/* Emit done/abandoned exactly once.  With proxy accounting on, a done record
 * carries the network part (struct nccl_exporter_done). */
void finish(struct slot *s, uint8_t state, uint32_t extra_flags, uint64_t now) {
  if (atomic_exchange_explicit(&s->finished, 1, memory_order_acq_rel)) return;
  struct nccl_exporter_done d;
  struct nccl_exporter_record *rp = &d.r;
#define r (*rp)
  snapshot(s, &r, state, now);
  r.flags |= extra_flags;
  if (state == NCCL_EXPORTER_STATE_DONE) {
    uint64_t fsh = atomic_load_explicit(&s->first_start_host, memory_order_relaxed);
    if (fsh && !(extra_flags & NCCL_EXPORTER_F_REJECTED) && r.gpu_stop_timer > r.gpu_start_timer &&
        (now - fsh) + 20000 < r.gpu_stop_timer - r.gpu_start_timer)
      r.flags |= NCCL_EXPORTER_F_START_LATE;
    if (!(r.flags & NCCL_EXPORTER_F_REJECTED) && shared_with_last(s->ctx, r.gpu_start_timer, r.gpu_stop_timer))
      r.flags |= NCCL_EXPORTER_F_SHARED;
    atomic_fetch_add_explicit(&G.completed, 1, memory_order_relaxed);
    if (G.proxy_on) {
      net_fill(s, &d.net);
      r.size = sizeof d;
    }
    hook_gpu_done(&r);
  } else {
    r.flags &= ~NCCL_EXPORTER_F_OFFSET_COARSE;
    atomic_fetch_add_explicit(&G.abandoned, 1, memory_order_relaxed);
    hook_abandoned(&r);
  }
  log_record(&r);
  if (G.log_fd >= 0 && r.size == sizeof d) log_net(&r, &d.net);
#undef r
}

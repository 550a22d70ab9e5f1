/*
 * announce.c -- the announcer thread: the live communicators, once a period.
 */
#include "internal.h" /* first: it includes glibc_floor.h before any system header */

/* ------------------------------------------------------------------------ */
/* Announcing the live communicators (docs/plugin.md, "Communicators made   */
/* before the agent"). An agent that attaches mid-job missed every          */
/* comm_init: a small thread of ours calls nccl_exporter_comm_live for each */
/* live communicator once a period (NCCL_EXPORTER_PROFILER_ANNOUNCE_MS,     */
/* default 1000; 0: never), so the agent knows them within a period, idle   */
/* or hung ones included. Off NCCL's threads; costs a wake-up every         */
/* quarter of SETTLE_MS (it sweeps too: below) and, with an agent           */
/* attached, one uprobe hit per communicator a period. The thread starts    */
/* with the first communicator and is joined when the last is finalized     */
/* (NCCL dlcloses us after that).                                           */

#define ANNOUNCE_MAX 256 /* communicators announced per process (more: the first 256) */

static struct {
  pthread_mutex_t lock;
  pthread_cond_t wake;
  struct ctx *live[ANNOUNCE_MAX];
  int n;
  uint64_t period_ms;       /* read at the first communicator; 0: off */
  int configured;
  int running;
  uint64_t gen;             /* a thread runs while gen is the one it started with */
  pthread_t thread;
} A = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

struct nccl_exporter_comm comm_record(const struct ctx *c) {
  struct nccl_exporter_comm ci = {.version = NCCL_EXPORTER_RECORD_VERSION, .size = sizeof ci,
                                  .comm_hash = c->comm_hash, .rank = c->rank, .nranks = c->nranks,
                                  .nnodes = c->nnodes, .iface_version = (uint32_t)c->iface,
                                  .dropped = atomic_load(&G.dropped)};
  memcpy(ci.name, c->name, sizeof ci.name);
  return ci;
}

/* Once a period it announces. Every SETTLE_MS / 4 (at least 100 ms; at most
 * the period) it sweeps (records NCCL will never complete, also while the job
 * is idle: pool.c) if the last sweep found records in flight or operations
 * started since; else it only looks at two counters. */
static void *announcer(void *arg) {
  uint64_t mine = (uint64_t)(uintptr_t)arg, period_ns = A.period_ms * 1000000ull;
  uint64_t quarter = G.settle_ns / 4 < 100000000ull ? 100000000ull : G.settle_ns / 4;
  uint64_t next = mono_ns() + period_ns;
  uint64_t seen = 0; /* the next record id at the last sweep: moved, operations started since */
  pthread_mutex_lock(&A.lock);
  while (A.gen == mine) {
    uint64_t wait = quarter, now = mono_ns();
    if (next > now && next - now < wait) wait = next - now;
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    uint64_t ns = (uint64_t)t.tv_nsec + wait;
    t.tv_sec += (time_t)(ns / 1000000000ull);
    t.tv_nsec = (long)(ns % 1000000000ull);
    pthread_cond_timedwait(&A.wake, &A.lock, &t);
    if (A.gen != mine) break;
    now = mono_ns();
    if (now + 1000000ull >= next) { /* a period since the last announcement (1 ms of timer slack) */
      next = now + period_ns;
      for (int i = 0; i < A.n; i++) {
        struct nccl_exporter_comm ci = comm_record(A.live[i]);
        hook_comm_live(&ci);
      }
    }
    /* operations started: the record ids, not the allocation cursor (the
     * slot freed last is taken without moving it: slot_alloc) */
    uint64_t cur = atomic_load_explicit(&G.next_id, memory_order_relaxed);
    if (G.slots && (cur != seen || atomic_load_explicit(&G.sweep_live, memory_order_relaxed)) && sweep(now, 0))
      seen = cur;
  }
  pthread_mutex_unlock(&A.lock);
  return NULL;
}

/* A fork's child has no announcer thread: it must not join one. */
static void announce_forked(void) {
  pthread_mutex_init(&A.lock, NULL);
  A.running = 0;
  A.n = 0;
}

void announce_add(struct ctx *c) {
  pthread_mutex_lock(&A.lock);
  if (!A.configured) {
    A.configured = 1;
    A.period_ms = env_u64("NCCL_EXPORTER_PROFILER_ANNOUNCE_MS", 1000, 0, 3600000);
    pthread_atfork(NULL, NULL, announce_forked);
  }
  if (A.n < ANNOUNCE_MAX) A.live[A.n++] = c;
  if (!A.running && A.period_ms && G.pinned) {
    /* the job's signals stay with the job's threads */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    uint64_t gen = ++A.gen;
    if (pthread_create(&A.thread, NULL, announcer, (void *)(uintptr_t)gen) == 0) {
      A.running = 1;
      pthread_setname_np(A.thread, "nccl-announce"); /* 15 characters at most */
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
  }
  pthread_mutex_unlock(&A.lock);
}

void announce_remove(struct ctx *c) {
  pthread_mutex_lock(&A.lock);
  for (int i = 0; i < A.n; i++)
    if (A.live[i] == c) {
      A.live[i] = A.live[--A.n];
      break;
    }
  if (A.n > 0 || !A.running) {
    pthread_mutex_unlock(&A.lock);
    return;
  }
  pthread_t t = A.thread;
  A.running = 0;
  A.gen++; /* that thread stops */
  pthread_cond_broadcast(&A.wake);
  pthread_mutex_unlock(&A.lock);
  pthread_join(t, NULL);
}

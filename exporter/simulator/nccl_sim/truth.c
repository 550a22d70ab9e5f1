/* truth.c -- Ground truth: one JSON line per outermost public call to $NCCL_SIM_TRUTH
 * (docs/simulator.md), what the tests compare the exporter's counts with. */
#include "nccl_sim.h"

__thread int tl_depth;

/* ----------------------------------------------------------------- truth -- */
static pthread_mutex_t truth_mu = PTHREAD_MUTEX_INITIALIZER;
static int truth_fd = -2;

void hexid(char out[2 * NCCL_UNIQUE_ID_BYTES + 1], const ncclUniqueId *id) {
  static const char hx[] = "0123456789abcdef";
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) {
    uint8_t b = (uint8_t)id->internal[i];
    out[2 * i] = hx[b >> 4]; out[2 * i + 1] = hx[b & 15];
  }
  out[2 * NCCL_UNIQUE_ID_BYTES] = 0;
}

void truth_write(const rec_t *r) {
  pthread_mutex_lock(&truth_mu);
  if (truth_fd == -2) {
    const char *p = getenv("NCCL_SIM_TRUTH");
    truth_fd = (p && *p) ? open(p, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644) : -1;
  }
  int fd = truth_fd;
  pthread_mutex_unlock(&truth_mu);
  if (fd < 0) return;
  const char *extra = r->extra ? r->extra : "";
  size_t cap = 1024 + strlen(extra);
  char *line = malloc(cap);
  if (!line) return;
  size_t dsz = r->datatype >= 0 ? dt_size(r->datatype) : 0;
  int len = snprintf(line, cap,
      "{\"fn\":\"%s\",\"op\":\"%s\",\"pid\":%d,\"tid\":%ld,\"comm\":%llu,\"rank\":%d,\"nranks\":%d,"
      "\"count\":%zu,\"datatype\":%d,\"red_op\":%d,\"root\":%d,\"peer\":%d,\"stream\":%llu,\"bytes\":%llu,"
      "\"start_mono_ns\":%llu,\"end_mono_ns\":%llu,\"start_real_ns\":%llu,\"end_real_ns\":%llu,"
      "\"result\":%d%s}\n",
      r->fn, r->op, (int)getpid(), (long)syscall(SYS_gettid), (unsigned long long)r->comm, r->rank, r->nranks,
      r->count, r->datatype, r->red_op, r->root, r->peer, (unsigned long long)r->stream,
      (unsigned long long)(r->count * dsz), (unsigned long long)r->t0m, (unsigned long long)r->t1m,
      (unsigned long long)r->t0r, (unsigned long long)r->t1r, r->result, extra);
  if (len > 0 && (size_t)len < cap) {
    pthread_mutex_lock(&truth_mu);
    ssize_t w = write(fd, line, (size_t)len);
    (void)w;
    pthread_mutex_unlock(&truth_mu);
  }
  free(line);
}

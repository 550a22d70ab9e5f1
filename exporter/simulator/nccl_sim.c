/*
 * nccl_sim.c -- a host-memory, TCP-only stand-in for libnccl.so.2.
 *
 * Exports a subset of the NCCL 2.32 public API with the exact x86-64 ABI
 * (own minimal declarations below, not nccl.h).  Like real NCCL every public
 * ncclX is a weak alias of a strong pncclX at the same address.  ncclBcast
 * calls ncclBroadcast and ncclCommInitAll calls ncclGetUniqueId through the
 * PLT; all other internal work uses static functions.
 *
 * Every outermost public call appends one JSON line of ground truth to the
 * file named by $NCCL_SIM_TRUTH (if set).  $NCCL_SIM_ADDR is this rank's
 * IPv4/IPv6 address (default 127.0.0.1).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdbool.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ ABI -- */
typedef enum {
  ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2,
  ncclInternalError = 3, ncclInvalidArgument = 4, ncclInvalidUsage = 5,
  ncclRemoteError = 6, ncclInProgress = 7, ncclTimeout = 8, ncclNumResults = 9
} ncclResult_t;
typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5,
               ncclMaxRedOp = 0x7fffffff } ncclRedOp_t;
typedef enum { ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4,
               ncclUint64 = 5, ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8,
               ncclBfloat16 = 9, ncclFloat8e4m3 = 10, ncclFloat8e5m2 = 11, ncclNumTypes = 12 } ncclDataType_t;
#define NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;
typedef struct ncclComm *ncclComm_t;
typedef struct ncclConfig_v ncclConfig_t;      /* opaque here: ignored */
typedef struct ncclCollConfig_v ncclCollConfig_t;
typedef void *cudaStream_t;
#define NCCL_SPLIT_NOCOLOR -1
#define SIM_VERSION_CODE 23203

#define EXPORT __attribute__((visibility("default")))
#define ALIAS(name) __attribute__((weak, alias("p" #name)))

/* --------------------------------------------------------------- helpers -- */
static const uint8_t ID_MAGIC[8] = {0x4e, 0x43, 0x43, 0x4c, 0x53, 0x49, 0x4d, 0x01}; /* "NCCLSIM\1" */
#define COMM_MAGIC 0x636f6d6d53494d31ULL
#define ID_OFF_FAMILY 8
#define ID_OFF_PORT 10
#define ID_OFF_ADDR 12
#define ID_OFF_NONCE 28

static __thread int tl_depth;

static inline uint64_t now_ns(clockid_t c) {
  struct timespec ts;
  clock_gettime(c, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int env_int(const char *name, int dflt) {
  const char *v = getenv(name);
  return (v && *v) ? atoi(v) : dflt;
}

typedef struct {
  uint16_t family;  /* AF_INET / AF_INET6 (host order) */
  uint16_t port;    /* network order */
  uint8_t addr[16];
} peer_addr_t;

struct ncclComm {
  uint64_t magic;
  int rank, nranks, cudaDev;
  int *fds;               /* fds[peer], -1 for self */
  uint8_t nonce[16];
  int nsplits;
  int finalized;
  ncclResult_t async_err;
  struct sim_proxy *proxy; /* "NCCL Proxy <rank>" thread: does the sends (lazily started) */
  /* GPU-like mode (NCCL_SIM_GPU=1) only: */
  uint64_t nccl_hash;       /* NCCL's commHash (eatHash/digestHash of the unique id; splits: of parent, count, color) */
  struct sim_stream *stream;/* the communicator's "CUDA stream": a thread running enqueued work in order */
  void *prof_ctx;           /* profiler plugin context from init */
  int prof_inited;
  uint64_t coll_seq[16];    /* NCCL seqNumber per collective kind, from 0 */
  uint64_t *p2p_seq;        /* [2*nranks]: order per (peer, send/recv), from 0 */
  uint64_t ncoll;           /* collectives run on the stream (for NCCL_SIM_GPU_LATE_EVERY) */
  int nshrinks;             /* ncclCommShrink calls made on this comm */
};

static size_t dt_size(int dt) {
  switch (dt) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

static int comm_ok(ncclComm_t c) { return c != NULL && c->magic == COMM_MAGIC; }

/* ------------------------------------------------------------- sockets -- */
static int local_addr(peer_addr_t *pa) {
  const char *a = getenv("NCCL_SIM_ADDR");
  if (!a || !*a) a = "127.0.0.1";
  memset(pa, 0, sizeof(*pa));
  if (inet_pton(AF_INET, a, pa->addr) == 1) { pa->family = AF_INET; return 0; }
  if (inet_pton(AF_INET6, a, pa->addr) == 1) { pa->family = AF_INET6; return 0; }
  return -1;
}

static socklen_t to_sockaddr(const peer_addr_t *pa, struct sockaddr_storage *ss) {
  memset(ss, 0, sizeof(*ss));
  if (pa->family == AF_INET6) {
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)ss;
    s6->sin6_family = AF_INET6; s6->sin6_port = pa->port;
    memcpy(&s6->sin6_addr, pa->addr, 16);
    return sizeof(*s6);
  }
  struct sockaddr_in *s4 = (struct sockaddr_in *)ss;
  s4->sin_family = AF_INET; s4->sin_port = pa->port;
  memcpy(&s4->sin_addr, pa->addr, 4);
  return sizeof(*s4);
}

static void tune_socket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 10, intvl = 5, cnt = 6;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
  unsigned ut = 120000; /* give up on unacked data after 2 min */
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ut, sizeof(ut));
}

/* Listening socket on $NCCL_SIM_ADDR, ephemeral port; fills *pa. */
static int make_listener(peer_addr_t *pa) {
  if (local_addr(pa) != 0) return -1;
  struct sockaddr_storage ss;
  socklen_t sl = to_sockaddr(pa, &ss);
  int fd = socket(pa->family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, (struct sockaddr *)&ss, sl) != 0 || listen(fd, 128) != 0) { close(fd); return -1; }
  sl = sizeof(ss);
  getsockname(fd, (struct sockaddr *)&ss, &sl);
  pa->port = ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                      : ((struct sockaddr_in *)&ss)->sin_port;
  return fd;
}

/* Connect, retrying for up to timeout_ms (peers start at different times). */
static int connect_retry(const peer_addr_t *pa, int timeout_ms) {
  struct sockaddr_storage ss;
  socklen_t sl = to_sockaddr(pa, &ss);
  uint64_t deadline = now_ns(CLOCK_MONOTONIC) + (uint64_t)timeout_ms * 1000000ull;
  int delay_ms = 10;
  for (;;) {
    int fd = socket(pa->family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&ss, sl) == 0) { tune_socket(fd); return fd; }
    close(fd);
    if (now_ns(CLOCK_MONOTONIC) > deadline) return -1;
    usleep(delay_ms * 1000);
    if (delay_ms < 200) delay_ms *= 2;
  }
}

/* Blocking full send/recv with an optional timeout (timeout_ms < 0: none). */
static int io_all(int fd, void *buf, size_t len, int is_send, int timeout_ms) {
  char *p = buf;
  while (len > 0) {
    struct pollfd pfd = {fd, is_send ? POLLOUT : POLLIN, 0};
    int pr = poll(&pfd, 1, timeout_ms);
    if (pr < 0) { if (errno == EINTR) continue; return -1; }
    if (pr == 0) return -2; /* timeout */
    ssize_t n = is_send ? send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, p, len, MSG_DONTWAIT);
    if (n < 0) { if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue; return -1; }
    if (n == 0) return -1; /* EOF */
    p += n; len -= (size_t)n;
  }
  return 0;
}

static int accept_timeout(int lfd, int timeout_ms) {
  struct pollfd pfd = {lfd, POLLIN, 0};
  for (;;) {
    int pr = poll(&pfd, 1, timeout_ms);
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) return -1;
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0 && (errno == EINTR || errno == ECONNABORTED)) continue;
    if (fd >= 0) tune_socket(fd);
    return fd;
  }
}

/* ---------------------------------------------------- p2p progress engine -- */
typedef struct { int peer; int is_send; char *buf; size_t len; size_t off; } p2p_t;

/* Move bytes of ops[] (dir 1: only the sends, 0: only the receives, -1: all)
 * until they are complete. Per peer and direction, ops go in order. */
static ncclResult_t progress(ncclComm_t c, p2p_t *ops, int n, int dir) {
  struct pollfd *pfds = malloc(sizeof(*pfds) * (n ? n : 1));
  int *idx = malloc(sizeof(int) * (n ? n : 1));
  if (!pfds || !idx) { free(pfds); free(idx); return ncclSystemError; }
  ncclResult_t res = ncclSuccess;
  for (;;) {
    int np = 0;
    for (int i = 0; i < n; i++) {
      if (ops[i].off >= ops[i].len) continue;
      if (dir >= 0 && ops[i].is_send != dir) continue;
      int blocked = 0;
      for (int j = 0; j < i; j++)
        if (ops[j].peer == ops[i].peer && ops[j].is_send == ops[i].is_send && ops[j].off < ops[j].len) { blocked = 1; break; }
      if (blocked) continue;
      pfds[np].fd = c->fds[ops[i].peer];
      pfds[np].events = ops[i].is_send ? POLLOUT : POLLIN;
      pfds[np].revents = 0;
      idx[np++] = i;
    }
    if (np == 0) break;
    int pr = poll(pfds, np, -1);
    if (pr < 0) { if (errno == EINTR) continue; res = ncclSystemError; break; }
    for (int k = 0; k < np && res == ncclSuccess; k++) {
      if (!pfds[k].revents) continue;
      p2p_t *o = &ops[idx[k]];
      ssize_t r = o->is_send ? send(pfds[k].fd, o->buf + o->off, o->len - o->off, MSG_NOSIGNAL | MSG_DONTWAIT)
                             : recv(pfds[k].fd, o->buf + o->off, o->len - o->off, MSG_DONTWAIT);
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        res = ncclRemoteError;
      } else if (r == 0) {
        res = ncclRemoteError; /* peer closed */
      } else {
        o->off += (size_t)r;
      }
    }
    if (res != ncclSuccess) break;
  }
  free(pfds); free(idx);
  return res;
}


/* Real NCCL moves network data in its own threads ("NCCL Progress ...",
 * "NCCL Sock ...") while the calling thread waits. Here one thread per
 * communicator, named "NCCL Proxy <rank>", does the sends of every p2p batch
 * while the caller does the receives and then waits for it. */
typedef struct sim_proxy {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t th;
  ncclComm_t comm;
  p2p_t *ops;
  int n;
  int posted;   /* work handed over, not finished */
  int in_use;   /* a caller owns the proxy for one batch */
  int stop;
  ncclResult_t res;
} sim_proxy_t;

static void *proxy_main(void *arg) {
  sim_proxy_t *p = arg;
  char name[16];
  snprintf(name, sizeof(name), "NCCL Proxy %d", p->comm->rank);
  pthread_setname_np(pthread_self(), name);
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->posted && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
    if (p->posted) {
      p2p_t *ops = p->ops;
      int n = p->n;
      pthread_mutex_unlock(&p->mu);
      ncclResult_t r = progress(p->comm, ops, n, 1);
      pthread_mutex_lock(&p->mu);
      p->res = r;
      p->posted = 0;
      pthread_cond_broadcast(&p->cv);
      continue;
    }
    if (p->stop) break;
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

static sim_proxy_t *proxy_of(ncclComm_t c) {
  if (c->proxy) return c->proxy;
  if (env_int("NCCL_SIM_NO_PROXY", 0)) return NULL;
  sim_proxy_t *p = calloc(1, sizeof(*p));
  if (!p) return NULL;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  p->comm = c;
  if (pthread_create(&p->th, NULL, proxy_main, p) != 0) {
    pthread_cond_destroy(&p->cv); pthread_mutex_destroy(&p->mu); free(p);
    return NULL;
  }
  c->proxy = p;
  return p;
}

static void proxy_stop(ncclComm_t c) {
  sim_proxy_t *p = c->proxy;
  if (!p) return;
  c->proxy = NULL;
  pthread_mutex_lock(&p->mu);
  int busy = p->posted || p->in_use;
  p->stop = 1;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  if (busy) { pthread_detach(p->th); return; } /* aborted mid-call: leave it be */
  pthread_join(p->th, NULL);
  pthread_cond_destroy(&p->cv); pthread_mutex_destroy(&p->mu); free(p);
}

static ncclResult_t run_p2p(ncclComm_t c, p2p_t *ops, int n) {
  /* sends to self are matched, in order, with receives from self (memcpy) */
  int nextrecv = 0;
  for (int i = 0; i < n; i++) {
    if (ops[i].peer != c->rank || !ops[i].is_send) continue;
    while (nextrecv < n && (ops[nextrecv].peer != c->rank || ops[nextrecv].is_send)) nextrecv++;
    if (nextrecv >= n || ops[nextrecv].len != ops[i].len) return ncclInvalidUsage;
    memcpy(ops[nextrecv].buf, ops[i].buf, ops[i].len);
    ops[nextrecv].off = ops[nextrecv].len;
    ops[i].off = ops[i].len;
    nextrecv++;
  }
  for (int i = 0; i < n; i++) if (ops[i].peer == c->rank && ops[i].off != ops[i].len) return ncclInvalidUsage;
  int sends = 0, recvs = 0;
  for (int i = 0; i < n; i++) {
    if (ops[i].off >= ops[i].len) continue;
    if (ops[i].is_send) sends++; else recvs++;
  }
  sim_proxy_t *p = sends ? proxy_of(c) : NULL;
  if (p) {
    pthread_mutex_lock(&p->mu);
    int taken = p->in_use || p->stop;
    if (!taken) p->in_use = 1;
    pthread_mutex_unlock(&p->mu);
    if (taken) p = NULL; /* another thread's batch on this comm: do it all here */
  }
  ncclResult_t res;
  if (!p) {
    res = progress(c, ops, n, -1);
  } else {
    pthread_mutex_lock(&p->mu);
    p->ops = ops; p->n = n; p->posted = 1; p->res = ncclSuccess;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    res = recvs ? progress(c, ops, n, 0) : ncclSuccess;
    pthread_mutex_lock(&p->mu);
    while (p->posted) pthread_cond_wait(&p->cv, &p->mu);
    if (res == ncclSuccess) res = p->res;
    p->in_use = 0;
    pthread_mutex_unlock(&p->mu);
  }
  if (res != ncclSuccess) c->async_err = res;
  return res;
}

static ncclResult_t sendrecv(ncclComm_t c, int to, const void *sb, size_t sl, int from, void *rb, size_t rl) {
  p2p_t ops[2] = {{to, 1, (char *)sb, sl, 0}, {from, 0, (char *)rb, rl, 0}};
  return run_p2p(c, ops, 2);
}

/* ------------------------------------------------------------ reduction -- */
static inline float h2f(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline uint16_t f2h(float f) { _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h; }
static inline float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

#define RED_LOOP(T, UT)                                                            \
  do {                                                                             \
    T *d = (T *)dst; const T *s = (const T *)src;                                  \
    switch (op) {                                                                  \
      case ncclSum: case ncclAvg: for (size_t i = 0; i < n; i++) d[i] = (T)((UT)d[i] + (UT)s[i]); break; \
      case ncclProd: for (size_t i = 0; i < n; i++) d[i] = (T)((UT)d[i] * (UT)s[i]); break;   \
      case ncclMax: for (size_t i = 0; i < n; i++) d[i] = d[i] > s[i] ? d[i] : s[i]; break;   \
      case ncclMin: for (size_t i = 0; i < n; i++) d[i] = d[i] < s[i] ? d[i] : s[i]; break;   \
      default: break;                                                              \
    }                                                                              \
  } while (0)

static inline float redf(float a, float b, int op) {
  switch (op) {
    case ncclProd: return a * b;
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
    default: return a + b;
  }
}

/* dst = dst op src, n elements */
static void reduce_into(void *dst, const void *src, size_t n, int dt, int op) {
  switch (dt) {
    case ncclInt8: RED_LOOP(int8_t, uint8_t); break;
    case ncclUint8: RED_LOOP(uint8_t, uint8_t); break;
    case ncclInt32: RED_LOOP(int32_t, uint32_t); break;
    case ncclUint32: RED_LOOP(uint32_t, uint32_t); break;
    case ncclInt64: RED_LOOP(int64_t, uint64_t); break;
    case ncclUint64: RED_LOOP(uint64_t, uint64_t); break;
    case ncclFloat32: RED_LOOP(float, float); break;
    case ncclFloat64: RED_LOOP(double, double); break;
    case ncclFloat16: {
      uint16_t *d = dst; const uint16_t *s = src;
      for (size_t i = 0; i < n; i++) d[i] = f2h(redf(h2f(d[i]), h2f(s[i]), op));
      break;
    }
    case ncclBfloat16: {
      uint16_t *d = dst; const uint16_t *s = src;
      for (size_t i = 0; i < n; i++) d[i] = f2bf(redf(bf2f(d[i]), bf2f(s[i]), op));
      break;
    }
    default: break;
  }
}

#define DIV_LOOP(T) do { T *d = (T *)buf; for (size_t i = 0; i < n; i++) d[i] = (T)(d[i] / (T)k); } while (0)
static void divide_by(void *buf, size_t n, int dt, int k) {
  switch (dt) {
    case ncclInt8: DIV_LOOP(int8_t); break;
    case ncclUint8: DIV_LOOP(uint8_t); break;
    case ncclInt32: DIV_LOOP(int32_t); break;
    case ncclUint32: DIV_LOOP(uint32_t); break;
    case ncclInt64: DIV_LOOP(int64_t); break;
    case ncclUint64: DIV_LOOP(uint64_t); break;
    case ncclFloat32: DIV_LOOP(float); break;
    case ncclFloat64: DIV_LOOP(double); break;
    case ncclFloat16: { uint16_t *d = buf; for (size_t i = 0; i < n; i++) d[i] = f2h(h2f(d[i]) / (float)k); break; }
    case ncclBfloat16: { uint16_t *d = buf; for (size_t i = 0; i < n; i++) d[i] = f2bf(bf2f(d[i]) / (float)k); break; }
    default: break;
  }
}

static int reducible(int dt, int op) {
  return dt >= 0 && dt <= ncclBfloat16 && op >= 0 && op < ncclNumOps;
}

/* ----------------------------------------------------------- collectives -- */
enum { K_ALLREDUCE = 1, K_ALLGATHER, K_REDUCESCATTER, K_BROADCAST, K_REDUCE, K_SEND, K_RECV,
       K_ALLTOALL, K_GATHER, K_SCATTER };

typedef struct {
  int kind;
  const void *sb; void *rb;
  size_t count; int dt, op, root, peer;
  ncclComm_t comm;
  /* GPU-like mode only (zero otherwise) */
  uint64_t seq;             /* coll: NCCL seqNumber; p2p: order per (peer, op) */
  uint64_t enq_mono;        /* host enqueue time (CLOCK_MONOTONIC) */
} collargs_t;

#define CH_LO(i) ((count * (size_t)(i)) / (size_t)n)
#define PREV(r) (((r) - 1 + n) % n)
#define NEXT(r) (((r) + 1) % n)
#define MOD(x) ((((x) % n) + n) % n)

static ncclResult_t do_allreduce(ncclComm_t c, const void *sb, void *rb, size_t count, int dt, int op) {
  int n = c->nranks, r = c->rank;
  size_t es = dt_size(dt);
  if (sb != rb) memmove(rb, sb, count * es);
  if (n == 1 || count == 0) { if (op == ncclAvg) divide_by(rb, count, dt, n); return ncclSuccess; }
  char *buf = rb;
  size_t maxch = count / n + 1;
  char *tmp = malloc(maxch * es);
  if (!tmp) return ncclSystemError;
  ncclResult_t res = ncclSuccess;
  /* reduce-scatter ring */
  for (int s = 0; s < n - 1 && res == ncclSuccess; s++) {
    int sc = MOD(r - s), rc = MOD(r - s - 1);
    size_t slo = CH_LO(sc), shi = CH_LO(sc + 1), rlo = CH_LO(rc), rhi = CH_LO(rc + 1);
    res = sendrecv(c, NEXT(r), buf + slo * es, (shi - slo) * es, PREV(r), tmp, (rhi - rlo) * es);
    if (res == ncclSuccess) reduce_into(buf + rlo * es, tmp, rhi - rlo, dt, op);
  }
  if (res == ncclSuccess && op == ncclAvg) {
    int oc = MOD(r + 1);
    divide_by(buf + CH_LO(oc) * es, CH_LO(oc + 1) - CH_LO(oc), dt, n);
  }
  /* all-gather ring */
  for (int s = 0; s < n - 1 && res == ncclSuccess; s++) {
    int sc = MOD(r + 1 - s), rc = MOD(r - s);
    size_t slo = CH_LO(sc), shi = CH_LO(sc + 1), rlo = CH_LO(rc), rhi = CH_LO(rc + 1);
    res = sendrecv(c, NEXT(r), buf + slo * es, (shi - slo) * es, PREV(r), buf + rlo * es, (rhi - rlo) * es);
  }
  free(tmp);
  return res;
}

static ncclResult_t do_allgather(ncclComm_t c, const void *sb, void *rb, size_t count, int dt) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  char *buf = rb;
  memmove(buf + (size_t)r * bl, sb, bl);
  ncclResult_t res = ncclSuccess;
  for (int s = 0; s < n - 1 && res == ncclSuccess; s++) {
    int sc = MOD(r - s), rc = MOD(r - s - 1);
    res = sendrecv(c, NEXT(r), buf + (size_t)sc * bl, bl, PREV(r), buf + (size_t)rc * bl, bl);
  }
  return res;
}

static ncclResult_t do_reducescatter(ncclComm_t c, const void *sb, void *rb, size_t count, int dt, int op) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  char *work = malloc(bl * n + 1), *tmp = malloc(bl + 1);
  if (!work || !tmp) { free(work); free(tmp); return ncclSystemError; }
  memcpy(work, sb, bl * n);
  ncclResult_t res = ncclSuccess;
  for (int s = 0; s < n - 1 && res == ncclSuccess; s++) {
    int sc = MOD(r - s - 1), rc = MOD(r - s - 2);
    res = sendrecv(c, NEXT(r), work + (size_t)sc * bl, bl, PREV(r), tmp, bl);
    if (res == ncclSuccess) reduce_into(work + (size_t)rc * bl, tmp, count, dt, op);
  }
  if (res == ncclSuccess) {
    if (op == ncclAvg) divide_by(work + (size_t)r * bl, count, dt, n);
    memcpy(rb, work + (size_t)r * bl, bl);
  }
  free(work); free(tmp);
  return res;
}

static ncclResult_t do_broadcast(ncclComm_t c, const void *sb, void *rb, size_t count, int dt, int root) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  ncclResult_t res = ncclSuccess;
  if (r == root) {
    if (sb != rb) memmove(rb, sb, bl);
  } else {
    p2p_t op = {PREV(r), 0, rb, bl, 0};
    res = run_p2p(c, &op, 1);
  }
  if (res == ncclSuccess && NEXT(r) != root && n > 1) {
    p2p_t op = {NEXT(r), 1, rb, bl, 0};
    res = run_p2p(c, &op, 1);
  }
  return res;
}

static ncclResult_t do_reduce(ncclComm_t c, const void *sb, void *rb, size_t count, int dt, int op, int root) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  if (r != root) {
    p2p_t o = {root, 1, (char *)sb, bl, 0};
    return run_p2p(c, &o, 1);
  }
  char *all = malloc(bl * n + 1);
  p2p_t *ops = malloc(sizeof(p2p_t) * n);
  if (!all || !ops) { free(all); free(ops); return ncclSystemError; }
  int k = 0;
  for (int p = 0; p < n; p++)
    if (p != r) ops[k++] = (p2p_t){p, 0, all + (size_t)p * bl, bl, 0};
  ncclResult_t res = run_p2p(c, ops, k);
  if (res == ncclSuccess) {
    memcpy(all + (size_t)r * bl, sb, bl);
    for (int p = 1; p < n; p++) reduce_into(all, all + (size_t)p * bl, count, dt, op);
    if (op == ncclAvg) divide_by(all, count, dt, n);
    memcpy(rb, all, bl);
  }
  free(all); free(ops);
  return res;
}

static ncclResult_t do_gather(ncclComm_t c, const void *sb, void *rb, size_t count, int dt, int root) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  if (r != root) { p2p_t o = {root, 1, (char *)sb, bl, 0}; return run_p2p(c, &o, 1); }
  p2p_t *ops = malloc(sizeof(p2p_t) * n);
  if (!ops) return ncclSystemError;
  int k = 0;
  for (int p = 0; p < n; p++) if (p != r) ops[k++] = (p2p_t){p, 0, (char *)rb + (size_t)p * bl, bl, 0};
  memmove((char *)rb + (size_t)r * bl, sb, bl);
  ncclResult_t res = run_p2p(c, ops, k);
  free(ops);
  return res;
}

static ncclResult_t do_scatter(ncclComm_t c, const void *sb, void *rb, size_t count, int dt, int root) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  if (r != root) { p2p_t o = {root, 0, rb, bl, 0}; return run_p2p(c, &o, 1); }
  p2p_t *ops = malloc(sizeof(p2p_t) * n);
  if (!ops) return ncclSystemError;
  int k = 0;
  for (int p = 0; p < n; p++) if (p != r) ops[k++] = (p2p_t){p, 1, (char *)sb + (size_t)p * bl, bl, 0};
  memmove(rb, (const char *)sb + (size_t)r * bl, bl);
  ncclResult_t res = run_p2p(c, ops, k);
  free(ops);
  return res;
}

static ncclResult_t do_alltoall(ncclComm_t c, const void *sb, void *rb, size_t count, int dt) {
  int n = c->nranks, r = c->rank;
  size_t bl = count * dt_size(dt);
  p2p_t *ops = malloc(sizeof(p2p_t) * 2 * n);
  char *src = malloc(bl * n + 1);
  if (!ops || !src) { free(ops); free(src); return ncclSystemError; }
  memcpy(src, sb, bl * n); /* allow in-place */
  int k = 0;
  for (int p = 0; p < n; p++) {
    if (p == r) continue;
    ops[k++] = (p2p_t){p, 1, src + (size_t)p * bl, bl, 0};
    ops[k++] = (p2p_t){p, 0, (char *)rb + (size_t)p * bl, bl, 0};
  }
  memcpy((char *)rb + (size_t)r * bl, src + (size_t)r * bl, bl);
  ncclResult_t res = run_p2p(c, ops, k);
  free(ops); free(src);
  return res;
}

static ncclResult_t exec_coll(const collargs_t *a) {
  ncclComm_t c = a->comm;
  switch (a->kind) {
    case K_ALLREDUCE: return do_allreduce(c, a->sb, a->rb, a->count, a->dt, a->op);
    case K_ALLGATHER: return do_allgather(c, a->sb, a->rb, a->count, a->dt);
    case K_REDUCESCATTER: return do_reducescatter(c, a->sb, a->rb, a->count, a->dt, a->op);
    case K_BROADCAST: return do_broadcast(c, a->sb, a->rb, a->count, a->dt, a->root);
    case K_REDUCE: return do_reduce(c, a->sb, a->rb, a->count, a->dt, a->op, a->root);
    case K_ALLTOALL: return do_alltoall(c, a->sb, a->rb, a->count, a->dt);
    case K_GATHER: return do_gather(c, a->sb, a->rb, a->count, a->dt, a->root);
    case K_SCATTER: return do_scatter(c, a->sb, a->rb, a->count, a->dt, a->root);
    case K_SEND: { p2p_t o = {a->peer, 1, (char *)a->sb, a->count * dt_size(a->dt), 0}; return run_p2p(c, &o, 1); }
    case K_RECV: { p2p_t o = {a->peer, 0, a->rb, a->count * dt_size(a->dt), 0}; return run_p2p(c, &o, 1); }
  }
  return ncclInternalError;
}

/* GPU-like mode (defined below, after the truth writer) */
static int gpu_on(void);
static ncclResult_t gpu_enqueue(collargs_t *q, int qn);
static void gpu_assign(collargs_t *a);
static __thread int tl_gpu_seq_valid;
static __thread uint64_t tl_gpu_seq;

/* ----------------------------------------------------------------- groups -- */
static __thread int tl_group_depth;
static __thread collargs_t *tl_q;
static __thread int tl_qn, tl_qcap;
static __thread ncclResult_t tl_group_err;

typedef struct { ncclComm_t comm; collargs_t *q; int qn; ncclResult_t res; } comm_batch_t;

static void *run_batch(void *arg) {
  comm_batch_t *b = arg;
  ncclResult_t res = ncclSuccess;
  int np = 0;
  for (int i = 0; i < b->qn; i++)
    if (b->q[i].comm == b->comm && (b->q[i].kind == K_SEND || b->q[i].kind == K_RECV)) np++;
  /* collectives in call order, then all point-to-point ops concurrently */
  for (int i = 0; i < b->qn && res == ncclSuccess; i++) {
    collargs_t *a = &b->q[i];
    if (a->comm != b->comm || a->kind == K_SEND || a->kind == K_RECV) continue;
    res = exec_coll(a);
  }
  if (res == ncclSuccess && np > 0) {
    p2p_t *ops = malloc(sizeof(p2p_t) * np);
    if (!ops) res = ncclSystemError;
    else {
      int k = 0;
      for (int i = 0; i < b->qn; i++) {
        collargs_t *a = &b->q[i];
        if (a->comm != b->comm || (a->kind != K_SEND && a->kind != K_RECV)) continue;
        ops[k++] = (p2p_t){a->peer, a->kind == K_SEND, a->kind == K_SEND ? (char *)a->sb : (char *)a->rb,
                           a->count * dt_size(a->dt), 0};
      }
      res = run_p2p(b->comm, ops, np);
      free(ops);
    }
  }
  b->res = res;
  return NULL;
}

static ncclResult_t group_flush(void) {
  ncclResult_t res = tl_group_err;
  collargs_t *q = tl_q;
  int qn = tl_qn;
  tl_q = NULL; tl_qn = tl_qcap = 0; tl_group_err = ncclSuccess;
  if (qn == 0) { free(q); return res; }
  if (gpu_on()) { /* GPU-like mode: enqueue on each communicator's stream and return */
    ncclResult_t r2 = gpu_enqueue(q, qn);
    free(q);
    return res != ncclSuccess ? res : r2;
  }
  comm_batch_t *b = calloc(qn, sizeof(*b));
  pthread_t *th = calloc(qn, sizeof(*th));
  if (!b || !th) { free(b); free(th); free(q); return ncclSystemError; }
  int nb = 0;
  for (int i = 0; i < qn; i++) {
    int found = 0;
    for (int j = 0; j < nb; j++) if (b[j].comm == q[i].comm) { found = 1; break; }
    if (!found) b[nb++] = (comm_batch_t){q[i].comm, q, qn, ncclSuccess};
  }
  if (nb == 1) run_batch(&b[0]);
  else {
    for (int j = 0; j < nb; j++)
      if (pthread_create(&th[j], NULL, run_batch, &b[j]) != 0) { th[j] = 0; run_batch(&b[j]); }
    for (int j = 0; j < nb; j++) if (th[j]) pthread_join(th[j], NULL);
  }
  for (int j = 0; j < nb; j++) if (res == ncclSuccess && b[j].res != ncclSuccess) res = b[j].res;
  free(b); free(th); free(q);
  return res;
}

static ncclResult_t submit(collargs_t a) {
  if (!comm_ok(a.comm)) return ncclInvalidArgument;
  if (a.kind == K_ALLREDUCE || a.kind == K_REDUCESCATTER || a.kind == K_REDUCE) {
    if (!reducible(a.dt, a.op)) return ncclInvalidArgument;
  } else if (dt_size(a.dt) == 0) {
    return ncclInvalidArgument;
  }
  int n = a.comm->nranks;
  if ((a.kind == K_BROADCAST || a.kind == K_REDUCE || a.kind == K_GATHER || a.kind == K_SCATTER) &&
      (a.root < 0 || a.root >= n)) return ncclInvalidArgument;
  if ((a.kind == K_SEND || a.kind == K_RECV) && (a.peer < 0 || a.peer >= n)) return ncclInvalidArgument;
  if (a.count > 0) {
    int needs_send = a.kind != K_RECV && !(a.kind == K_SCATTER && a.comm->rank != a.root);
    int needs_recv = a.kind != K_SEND && !((a.kind == K_REDUCE || a.kind == K_GATHER) && a.comm->rank != a.root);
    if ((needs_send && !a.sb) || (needs_recv && !a.rb)) return ncclInvalidArgument;
  }
  if (gpu_on()) gpu_assign(&a);
  if (tl_group_depth > 0) {
    if (tl_qn == tl_qcap) {
      int nc = tl_qcap ? tl_qcap * 2 : 16;
      collargs_t *nq = realloc(tl_q, sizeof(*nq) * nc);
      if (!nq) return ncclSystemError;
      tl_q = nq; tl_qcap = nc;
    }
    tl_q[tl_qn++] = a;
    return ncclSuccess;
  }
  if (gpu_on()) return gpu_enqueue(&a, 1);
  return exec_coll(&a);
}

/* ----------------------------------------------------------------- truth -- */
static pthread_mutex_t truth_mu = PTHREAD_MUTEX_INITIALIZER;
static int truth_fd = -2;

typedef struct {
  const char *fn, *op;
  uint64_t comm; int rank, nranks;
  size_t count; int datatype, red_op, root, peer;
  uint64_t stream;
  uint64_t t0m, t1m, t0r, t1r;
  int result;
  const char *extra; /* ",\"k\":v..." or NULL */
} rec_t;

static void hexid(char out[2 * NCCL_UNIQUE_ID_BYTES + 1], const ncclUniqueId *id) {
  static const char hx[] = "0123456789abcdef";
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) {
    uint8_t b = (uint8_t)id->internal[i];
    out[2 * i] = hx[b >> 4]; out[2 * i + 1] = hx[b & 15];
  }
  out[2 * NCCL_UNIQUE_ID_BYTES] = 0;
}

static void truth_write(const rec_t *r) {
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

#define ENTER()                                                   \
  uint64_t t0m_ = now_ns(CLOCK_MONOTONIC), t0r_ = now_ns(CLOCK_REALTIME); \
  int outer_ = (tl_depth++ == 0)
#define LEAVE()                                                   \
  tl_depth--;                                                     \
  uint64_t t1m_ = now_ns(CLOCK_MONOTONIC), t1r_ = now_ns(CLOCK_REALTIME)
#define REC_INIT(FN, OP) \
  rec_t rec_ = {FN, OP, 0, -1, -1, 0, -1, -1, -1, -1, 0, t0m_, t1m_, t0r_, t1r_, 0, NULL}

static inline int c_rank(ncclComm_t c) { return comm_ok(c) ? c->rank : -1; }
static inline int c_nranks(ncclComm_t c) { return comm_ok(c) ? c->nranks : -1; }

/* ================================================ GPU-like mode (opt-in) ==
 * NCCL_SIM_GPU=1: a collective call only *enqueues* (host time: microseconds);
 * each communicator has a "stream" thread that runs the enqueued work in order
 * (the TCP data movement above happens there).  A profiler plugin named by
 * NCCL_PROFILER_PLUGIN is loaded the way NCCL loads one (ncclProfiler_v7, v6,
 * v5, v4; init per communicator with NCCL's commHash; finalize at destroy /
 * abort) and gets NCCL's callbacks, with NCCL's habits.  See docs/simulator.md.
 * With NCCL_SIM_GPU unset nothing here runs. */
static int gpu_on(void) {
  static int v = -1;
  if (v < 0) v = env_int("NCCL_SIM_GPU", 0) ? 1 : 0;
  return v;
}

/* ---- NCCL's hash (src/include/bitops.h, NCCL >= 2.23; exporter/sources/nccl/hashing.py) */
static void nh_eat(uint64_t acc[2], const void *data, size_t len) {
  uint64_t a0 = acc[0] ^ (uint64_t)len, a1 = acc[1];
  const uint8_t *p = data;
  for (size_t off = 0; off < len; off += 8) {
    a0 += a1; a1 ^= a0;
    a0 = (a0 ^ (a0 >> 31)) * 0x9DE62BBC8CEF3CE3ull;
    a1 = (a1 ^ (a1 >> 32)) * 0x485CD6311B599E79ull;
    uint64_t w = 0;
    memcpy(&w, p + off, len - off < 8 ? len - off : 8);
    a0 += w;
  }
  acc[0] = a0; acc[1] = a1;
}
static uint64_t nh_digest(const uint64_t acc[2]) {
  uint64_t h = (acc[0] ^ (acc[0] >> 31)) * 0xBAC3BD562846DE6Bull;
  h += acc[1];
  return (h ^ (h >> 32)) * 0x995A187A14E7B445ull;
}
static uint64_t nccl_root_hash(const ncclUniqueId *id) {
  uint64_t acc[2] = {1, 1};
  nh_eat(acc, id->internal, NCCL_UNIQUE_ID_BYTES);
  return nh_digest(acc);
}
static uint64_t nccl_split_hash(uint64_t parent, uint32_t count, uint32_t color) {
  uint64_t acc[2] = {1, 1};
  nh_eat(acc, &parent, 8); nh_eat(acc, &count, 4); nh_eat(acc, &color, 4);
  return nh_digest(acc);
}

/* ---- the GPU timer: %globaltimer-like, offset from CLOCK_MONOTONIC and drifting */
static uint64_t g_t0;
static int64_t g_timer_off;
static double g_drift_ppm;
static pthread_once_t g_timer_once = PTHREAD_ONCE_INIT;
static void timer_setup(void) {
  g_t0 = now_ns(CLOCK_MONOTONIC);
  const char *o = getenv("NCCL_SIM_GPU_TIMER_OFFSET_NS");
  g_timer_off = (o && *o) ? strtoll(o, NULL, 0) : 1700000000000000000ll;
  const char *d = getenv("NCCL_SIM_GPU_DRIFT_PPM");
  g_drift_ppm = (d && *d) ? atof(d) : 200.0;
}
static uint64_t gpu_timer(uint64_t mono) {
  pthread_once(&g_timer_once, timer_setup);
  int64_t dt = (int64_t)(mono - g_t0);
  return (uint64_t)((int64_t)mono + g_timer_off + (int64_t)((double)dt * g_drift_ppm * 1e-6));
}

/* ---- our declarations of the profiler interface (v4 .. v7; layouts as in
 * NCCL 2.27 .. 2.32.3, the same facts as plugin/profiler_abi.h) ---------- */
enum { EV_GROUP = 0x1, EV_COLL = 0x2, EV_P2P = 0x4, EV_PROXY_OP = 0x8, EV_PROXY_STEP = 0x10, EV_KERNEL_CH = 0x40,
       EV_NET_PLUGIN = 0x80, EV_GROUP_API = 0x100, EV_COLL_API = 0x200, EV_P2P_API = 0x400, EV_KERNEL_LAUNCH = 0x800 };
enum { ST_KERNEL_CH_STOP = 22, ST_GROUP_START_API_STOP = 23, ST_GROUP_END_API_START = 24 };
typedef struct {
  uint64_t type;        /* v4: uint8_t at @0 (the other 7 bytes are padding) */
  void *parentObj;      /* @8 */
  int rank;             /* @16 */
  union {               /* @24 */
    struct { bool graphCaptured; int groupDepth; } groupApi;
    struct { const char *func; size_t count; const char *datatype; int root; void *stream; bool graphCaptured;
             uint64_t userTag; } collApi;
    struct { const char *func; size_t count; const char *datatype; void *stream; bool graphCaptured;
             uint64_t userTag; } p2pApi;
    struct { void *stream; } kernelLaunch;
    struct { uint64_t seqNumber; const char *func; const void *sendBuff; void *recvBuff; size_t count; int root;
             const char *datatype; uint8_t nChannels; uint8_t nWarps; const char *algo; const char *proto;
             void *parentGroup; const char *kernelVariant; bool isSymColl; uint64_t userTag; } coll; /* v4 ends at proto */
    struct { const char *func; void *buff; const char *datatype; size_t count; int peer; uint8_t nChannels;
             void *parentGroup; uint64_t userTag; } p2p;                                          /* v4 ends at nChannels */
    struct { uint8_t channelId; uint64_t pTimer; } kernelCh;
    char raw[112];
  };
} sim_descr_t;          /* 136 bytes = v7's size; v4 reads 104, v5/v6 112 */
typedef union { struct { uint64_t pTimer; } kernelCh; char raw[8]; } sim_state_args_t;
typedef void (*sim_logger_t)(int level, unsigned long flags, const char *file, int line, const char *fmt, ...);
typedef struct {
  const char *name;
  void *init;
  int (*startEvent)(void *ctx, void **handle, void *descr);
  int (*stopEvent)(void *handle);
  int (*recordEventState)(void *handle, int state, void *args);
  int (*finalize)(void *ctx);
} sim_prof_t;
typedef int (*prof_init_v4_t)(void **, int *, const char *, uint64_t, int, int, int, sim_logger_t);
typedef int (*prof_init_v5_t)(void **, uint64_t, int *, const char *, int, int, int, sim_logger_t);

static sim_prof_t *g_prof;
static int g_prof_ver;
static int g_prof_mask;                 /* NCCL's one process-wide activation mask */
static pthread_once_t g_prof_once = PTHREAD_ONCE_INIT;
static long long g_prof_starts, g_prof_nulls, g_prof_purged_kch, g_prof_purged_ops;

static void sim_logger(int level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags; (void)file; (void)line;
  const char *dbg = getenv("NCCL_DEBUG");
  if (level > 2 && !(dbg && (!strcasecmp(dbg, "INFO") || !strcasecmp(dbg, "TRACE")))) return;
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stderr, "NCCL %s %s\n", level <= 2 ? "WARN" : "INFO", buf);
}

static void prof_load(void) {
  const char *p = getenv("NCCL_PROFILER_PLUGIN");
  if (!gpu_on() || !p || !*p) return;
  void *dl = dlopen(p, RTLD_NOW | RTLD_LOCAL);
  if (!dl) { sim_logger(3, 0, __FILE__, __LINE__, "PROFILER/Plugin: Could not find: %s (%s)", p, dlerror()); return; }
  int maxv = env_int("NCCL_SIM_GPU_PROFILER_VERSION", 7);
  for (int v = 7; v >= 4; v--) {      /* newest first, as NCCL does */
    if (v > maxv) continue;
    char sym[32];
    snprintf(sym, sizeof sym, "ncclProfiler_v%d", v);
    sim_prof_t *t = dlsym(dl, sym);
    if (t) { g_prof = t; g_prof_ver = v; break; }
  }
  if (g_prof) sim_logger(3, 0, __FILE__, __LINE__, "PROFILER/Plugin: Loaded %s (v%d)", g_prof->name ? g_prof->name : "?", g_prof_ver);
  else sim_logger(3, 0, __FILE__, __LINE__, "PROFILER/Plugin: %s has no ncclProfiler_v4..v%d", p, maxv);
}

/* NCCL's gating: is an event of type t started, given the mask? */
static int prof_gated(uint64_t t) {
  const int net = EV_PROXY_OP | EV_PROXY_STEP | EV_KERNEL_CH | EV_NET_PLUGIN;
  int m = __atomic_load_n(&g_prof_mask, __ATOMIC_RELAXED);
  switch (t) {
    case EV_GROUP_API: return (m & (EV_GROUP_API | EV_P2P_API | EV_COLL_API | EV_KERNEL_LAUNCH | EV_GROUP | EV_COLL | EV_P2P | net)) != 0;
    case EV_COLL_API: return (m & (EV_COLL_API | EV_COLL | net)) != 0;
    case EV_P2P_API: return (m & (EV_P2P_API | EV_P2P | net)) != 0;
    case EV_GROUP: return (m & (EV_GROUP | EV_COLL | EV_P2P | net)) != 0;
    case EV_COLL: return (m & (EV_COLL | net)) != 0;
    case EV_P2P: return (m & (EV_P2P | net)) != 0;
    default: return (m & (int)t) != 0;
  }
}

/* v4/v5 descriptors are not zeroed by NCCL: garbage in what the event type does not set. */
static void d_init(sim_descr_t *d, uint64_t type, void *parent, int rank) {
  memset(d, g_prof_ver <= 5 ? 0xA5 : 0, sizeof *d);
  if (g_prof_ver == 4) *(uint8_t *)d = (uint8_t)type; else d->type = type;
  d->parentObj = parent; d->rank = rank;
}
static uint64_t d_type(const sim_descr_t *d) { return g_prof_ver == 4 ? *(const uint8_t *)d : d->type; }

static void *p_start(ncclComm_t c, sim_descr_t *d) {
  uint64_t t = d_type(d);
  if (!g_prof || !c->prof_inited || !prof_gated(t)) return NULL;
  if (g_prof_ver == 4 && (t & (EV_GROUP_API | EV_COLL_API | EV_P2P_API | EV_KERNEL_LAUNCH))) return NULL;
  void *h = (void *)0xdeadbeef; /* NCCL's slot may hold a stale value: the plugin must write it */
  __atomic_fetch_add(&g_prof_starts, 1, __ATOMIC_RELAXED);
  g_prof->startEvent(c->prof_ctx, &h, d);
  if (!h) __atomic_fetch_add(&g_prof_nulls, 1, __ATOMIC_RELAXED);
  return h;                     /* NULL: NCCL makes no further call for this event */
}
static void p_stop(void *h) { if (g_prof && h) g_prof->stopEvent(h); }
static void p_record(void *h, int st, uint64_t ptimer, int null_args) {
  if (!g_prof || !h) return;
  sim_state_args_t a;
  memset(&a, g_prof_ver <= 5 ? 0xA5 : 0, sizeof a);
  a.kernelCh.pTimer = ptimer;
  g_prof->recordEventState(h, st, null_args ? NULL : &a);
}

static void gpu_truth_simple(const char *fn, const char *op, ncclComm_t c, const char *extra) {
  uint64_t m = now_ns(CLOCK_MONOTONIC), r = now_ns(CLOCK_REALTIME);
  rec_t rec = {fn, op, (uint64_t)(uintptr_t)c, c ? c->rank : -1, c ? c->nranks : -1, 0, -1, -1, -1, -1, 0,
               m, m, r, r, 0, extra};
  truth_write(&rec);
}

/* Called once a communicator exists (init, split): profiler init with its identity. */
static void gpu_comm_ready(ncclComm_t c) {
  if (!gpu_on() || !c) return;
  if (!c->p2p_seq) c->p2p_seq = calloc(2 * (size_t)c->nranks, sizeof(uint64_t));
  pthread_once(&g_prof_once, prof_load);
  char extra[160];
  snprintf(extra, sizeof extra, ",\"comm_hash\":\"%016llx\"", (unsigned long long)c->nccl_hash);
  gpu_truth_simple("gpuCommReady", "GPU_COMM_READY", c, extra);
  if (!g_prof) return;
  int r;
  int nnodes = env_int("NCCL_SIM_GPU_NNODES", c->nranks);
  if (g_prof_ver == 4) r = ((prof_init_v4_t)g_prof->init)(&c->prof_ctx, &g_prof_mask, NULL, c->nccl_hash, nnodes, c->nranks, c->rank, sim_logger);
  else r = ((prof_init_v5_t)g_prof->init)(&c->prof_ctx, c->nccl_hash, &g_prof_mask, NULL, nnodes, c->nranks, c->rank, sim_logger);
  if (r != 0) { sim_logger(2, 0, __FILE__, __LINE__, "PROFILER/Plugin: init failed (%d)", r); return; }
  c->prof_inited = 1;
  snprintf(extra, sizeof extra, ",\"comm_hash\":\"%016llx\",\"iface\":%d,\"mask\":%d", (unsigned long long)c->nccl_hash,
           g_prof_ver, __atomic_load_n(&g_prof_mask, __ATOMIC_RELAXED));
  gpu_truth_simple("profilerInit", "PROFILER_INIT", c, extra);
}

/* ---- streams ----------------------------------------------------------- */
typedef struct gpu_op {
  collargs_t a;
  void *h;                 /* the Coll / P2p handle (NULL: no KernelCh events) */
  int nch;
} gpu_op_t;
typedef struct gpu_work {
  struct gpu_work *next;
  int n;
  gpu_op_t ops[];
} gpu_work_t;
typedef struct sim_stream {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t th;
  ncclComm_t comm;
  gpu_work_t *head, *tail;
  int qlen, busy, stop, abort, stalled;
  uint64_t ran;            /* works run */
} sim_stream_t;

static const char *func_name(int kind) {
  switch (kind) {
    case K_ALLREDUCE: return "AllReduce"; case K_ALLGATHER: return "AllGather";
    case K_REDUCESCATTER: return "ReduceScatter"; case K_BROADCAST: return "Broadcast";
    case K_REDUCE: return "Reduce"; case K_SEND: return "Send"; case K_RECV: return "Recv";
    case K_ALLTOALL: return "AlltoAll"; case K_GATHER: return "Gather"; case K_SCATTER: return "Scatter";
  }
  return "Unknown";
}
static const char *op_name_of(int kind) {
  switch (kind) {
    case K_ALLREDUCE: return "ALL_REDUCE"; case K_ALLGATHER: return "ALL_GATHER";
    case K_REDUCESCATTER: return "REDUCE_SCATTER"; case K_BROADCAST: return "BROADCAST";
    case K_REDUCE: return "REDUCE"; case K_SEND: return "SEND"; case K_RECV: return "RECV";
    case K_ALLTOALL: return "ALL_TO_ALL"; case K_GATHER: return "GATHER"; case K_SCATTER: return "SCATTER";
  }
  return "?";
}
static const char *dt_name(int dt) {
  static const char *n[] = {"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64",
                            "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16", "ncclFloat8e4m3", "ncclFloat8e5m2"};
  return (dt >= 0 && dt < 12) ? n[dt] : "Unknown";
}
static int is_p2p(int kind) { return kind == K_SEND || kind == K_RECV; }

/* seq (coll: per comm and kind; p2p: per comm, peer and direction) and enqueue time, at the call */
static void gpu_assign(collargs_t *a) {
  ncclComm_t c = a->comm;
  if (is_p2p(a->kind)) a->seq = c->p2p_seq ? c->p2p_seq[2 * a->peer + (a->kind == K_RECV)]++ : 0;
  else a->seq = c->coll_seq[a->kind & 15]++;
  a->enq_mono = now_ns(CLOCK_MONOTONIC);
  tl_gpu_seq = a->seq;
  tl_gpu_seq_valid = 1;
}

static void gpu_truth(ncclComm_t c, const gpu_op_t *o, uint64_t ts, uint64_t te, int late, const char *state, int nstarted) {
  char extra[640];
  snprintf(extra, sizeof extra,
           ",\"coll_fn\":\"%s\",\"coll_op\":\"%s\",\"seq\":%llu,\"comm_hash\":\"%016llx\",\"enqueue_mono_ns\":%llu,"
           "\"gpu_start_mono_ns\":%llu,\"gpu_stop_mono_ns\":%llu,\"gpu_start_timer\":%llu,\"gpu_stop_timer\":%llu,"
           "\"nchannels\":%d,\"kernelch_started\":%d,\"late\":%d,\"profiled\":%d,\"state\":\"%s\"",
           func_name(o->a.kind), op_name_of(o->a.kind), (unsigned long long)o->a.seq, (unsigned long long)c->nccl_hash,
           (unsigned long long)o->a.enq_mono, (unsigned long long)ts, (unsigned long long)te,
           (unsigned long long)(ts ? gpu_timer(ts) : 0), (unsigned long long)(te ? gpu_timer(te) : 0), o->nch, nstarted,
           late, o->h != NULL, state);
  int64_t off = (int64_t)now_ns(CLOCK_REALTIME) - (int64_t)now_ns(CLOCK_MONOTONIC); /* wall time of the GPU interval */
  rec_t rec = {"gpuKernel", "GPU_KERNEL", (uint64_t)(uintptr_t)c, c->rank, c->nranks, o->a.count, o->a.dt, o->a.op,
               o->a.root, o->a.peer, 0, ts, te, ts ? (uint64_t)((int64_t)ts + off) : 0, te ? (uint64_t)((int64_t)te + off) : 0,
               0, extra};
  truth_write(&rec);
}

static void kch_start(ncclComm_t c, gpu_op_t *o, void **kh, uint64_t ts) {
  for (int ch = 0; ch < o->nch; ch++) {
    kh[ch] = NULL;
    if (!o->h) continue;
    sim_descr_t d;
    d_init(&d, EV_KERNEL_CH, o->h, 0);     /* NCCL does not set rank for KernelCh */
    d.kernelCh.channelId = (uint8_t)ch;
    d.kernelCh.pTimer = gpu_timer(ts + (uint64_t)ch * 300);
    kh[ch] = p_start(c, &d);
  }
}
static void kch_stop(gpu_op_t *o, void **kh, uint64_t te) {
  for (int ch = o->nch - 1; ch >= 0; ch--) {
    p_record(kh[ch], ST_KERNEL_CH_STOP, gpu_timer(te - (uint64_t)ch * 200), 0);
    p_stop(kh[ch]);
  }
}

/* Run ops[0..n) as one "kernel" (a collective, or a batch of p2p ops run together). */
static void run_kernel(sim_stream_t *s, gpu_op_t *ops, int n) {
  ncclComm_t c = s->comm;
  int nch = 0;
  for (int i = 0; i < n; i++) nch += ops[i].nch;
  void **kh = calloc((size_t)(nch ? nch : 1), sizeof(void *));
  int late_every = env_int("NCCL_SIM_GPU_LATE_EVERY", 5);
  int late = late_every > 0 && (c->ncoll++ % (uint64_t)late_every) == (uint64_t)(late_every - 1);
  uint64_t ts = now_ns(CLOCK_MONOTONIC);
  if (!late) for (int i = 0, k = 0; i < n; k += ops[i].nch, i++) kch_start(c, &ops[i], kh + k, ts);
  ncclResult_t res;
  if (n == 1 && !is_p2p(ops[0].a.kind)) res = exec_coll(&ops[0].a);
  else {
    p2p_t *p = malloc(sizeof(p2p_t) * (size_t)n);
    for (int i = 0; i < n; i++) {
      collargs_t *a = &ops[i].a;
      p[i] = (p2p_t){a->peer, a->kind == K_SEND, a->kind == K_SEND ? (char *)a->sb : (char *)a->rb, a->count * dt_size(a->dt), 0};
    }
    res = p ? run_p2p(c, p, n) : ncclSystemError;
    free(p);
  }
  /* the kernel's own time beyond the data movement, and room for the channels' timer spread */
  uint64_t min_ns = (uint64_t)env_int("NCCL_SIM_GPU_KERNEL_US", 0) * 1000ull;
  uint64_t spread = (uint64_t)nch * 500 + 1000;
  if (min_ns < spread) min_ns = spread;
  for (;;) {   /* sleep most of it (a spinning "GPU" would starve the host threads of small machines) */
    uint64_t el = now_ns(CLOCK_MONOTONIC) - ts;
    if (el >= min_ns) break;
    if (min_ns - el > 200000) { struct timespec sl = {0, (long)(min_ns - el - 100000)}; nanosleep(&sl, NULL); }
  }
  uint64_t te = now_ns(CLOCK_MONOTONIC);
  pthread_mutex_lock(&s->mu);
  int aborted = s->abort;
  pthread_mutex_unlock(&s->mu);
  if (res != ncclSuccess && !aborted && c->async_err == ncclSuccess) c->async_err = res;
  if (aborted || res != ncclSuccess) {
    /* abort purges pending KernelCh work: no stopEvent.  A kernel whose peers
     * failed never ends on a GPU either: no stopEvent, the communicator carries
     * the async error, and its abort/destroy finalizes the plugin. */
    for (int i = 0, k = 0; i < n; k += ops[i].nch, i++) {
      int started = 0;
      for (int ch = 0; ch < ops[i].nch; ch++) if (kh[k + ch]) { started++; __atomic_fetch_add(&g_prof_purged_kch, 1, __ATOMIC_RELAXED); }
      __atomic_fetch_add(&g_prof_purged_ops, 1, __ATOMIC_RELAXED);
      gpu_truth(c, &ops[i], ts, 0, late, aborted ? "purged" : "error", started);
    }
    free(kh);
    return;
  }
  if (late) for (int i = 0, k = 0; i < n; k += ops[i].nch, i++) kch_start(c, &ops[i], kh + k, ts);
  for (int i = 0, k = 0; i < n; k += ops[i].nch, i++) {
    kch_stop(&ops[i], kh + k, te);
    gpu_truth(c, &ops[i], ts, te, late, "done", ops[i].h ? ops[i].nch : 0);
  }
  free(kh);
}

static int stall_rank_of(ncclComm_t c) {
  const char *r = getenv("RANK");
  return (r && *r) ? atoi(r) : c->rank;
}

static void *stream_main(void *arg) {
  sim_stream_t *s = arg;
  char name[16];
  snprintf(name, sizeof name, "NCCL Stream %d", s->comm->rank);
  pthread_setname_np(pthread_self(), name);
  int stall_rank = env_int("NCCL_SIM_GPU_STALL_RANK", -1);
  int stall_after = env_int("NCCL_SIM_GPU_STALL_AFTER", 0);
  int me = stall_rank_of(s->comm);
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while ((!s->head || s->stalled) && !s->stop && !s->abort) pthread_cond_wait(&s->cv, &s->mu);
    if (s->abort || (s->stop && !s->head)) break;
    if (stall_rank >= 0 && me == stall_rank && s->ran >= (uint64_t)stall_after) {
      s->stalled = 1;       /* a GPU-side hang: nothing runs any more; the host keeps enqueuing */
      pthread_mutex_unlock(&s->mu);
      char extra[64];
      snprintf(extra, sizeof extra, ",\"after\":%d", stall_after);
      gpu_truth_simple("gpuStall", "GPU_STALL", s->comm, extra);
      pthread_mutex_lock(&s->mu);
      continue;
    }
    gpu_work_t *w = s->head;
    s->head = w->next;
    if (!s->head) s->tail = NULL;
    s->qlen--;
    s->busy = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    int err = s->comm->async_err != ncclSuccess;
    /* collectives in call order, then the p2p ops together (as the blocking mode does) */
    int np = 0;
    for (int i = 0; i < w->n; i++) {
      if (is_p2p(w->ops[i].a.kind)) { np++; continue; }
      if (err) { gpu_truth(s->comm, &w->ops[i], 0, 0, 0, "skipped", 0); continue; }
      run_kernel(s, &w->ops[i], 1);
    }
    if (np) {
      gpu_op_t *p = malloc(sizeof(gpu_op_t) * (size_t)np);
      int k = 0;
      for (int i = 0; i < w->n; i++) if (is_p2p(w->ops[i].a.kind)) p[k++] = w->ops[i];
      if (s->comm->async_err == ncclSuccess) run_kernel(s, p, np);
      else for (int i = 0; i < np; i++) gpu_truth(s->comm, &p[i], 0, 0, 0, "skipped", 0);
      free(p);
    }
    free(w);
    pthread_mutex_lock(&s->mu);
    s->busy = 0;
    s->ran++;
    pthread_cond_broadcast(&s->cv);
  }
  /* abort: queued work is dropped (its Coll/P2p got no KernelCh) */
  while (s->head) {
    gpu_work_t *w = s->head;
    s->head = w->next;
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < w->n; i++) {
      __atomic_fetch_add(&g_prof_purged_ops, 1, __ATOMIC_RELAXED);
      gpu_truth(s->comm, &w->ops[i], 0, 0, 0, "purged", 0);
    }
    free(w);
    pthread_mutex_lock(&s->mu);
  }
  s->tail = NULL; s->qlen = 0;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static pthread_mutex_t g_stream_mu = PTHREAD_MUTEX_INITIALIZER;
static sim_stream_t *stream_of(ncclComm_t c) {
  pthread_mutex_lock(&g_stream_mu);
  sim_stream_t *s = c->stream;
  if (!s) {
    s = calloc(1, sizeof *s);
    if (s) {
      pthread_mutex_init(&s->mu, NULL);
      pthread_cond_init(&s->cv, NULL);
      s->comm = c;
      if (pthread_create(&s->th, NULL, stream_main, s) != 0) { free(s); s = NULL; }
      else c->stream = s;
    }
  }
  pthread_mutex_unlock(&g_stream_mu);
  return s;
}

/* Profiler callbacks of one group's ops on one communicator, NCCL's order:
 * GroupApi, its API children (stopped at once), KernelLaunch, Group, then each
 * Coll / P2p started and stopped ("enqueued", not done) -- every parent is
 * stopped before its KernelCh children start on the stream thread. */
static void prof_enqueue(ncclComm_t c, gpu_op_t *ops, int n) {
  if (!g_prof || !c->prof_inited || c->nranks == 1) return;   /* nranks = 1: NCCL gives no events */
  int v7 = g_prof_ver >= 7;
  sim_descr_t d;
  d_init(&d, EV_GROUP_API, NULL, 0);
  d.groupApi.graphCaptured = false; d.groupApi.groupDepth = 1;
  void *gapi = p_start(c, &d);
  p_record(gapi, ST_GROUP_START_API_STOP, 0, v7);
  void **api = calloc((size_t)n, sizeof(void *));
  for (int i = 0; i < n; i++) {
    collargs_t *a = &ops[i].a;
    if (is_p2p(a->kind)) {
      d_init(&d, EV_P2P_API, gapi, 0);
      d.p2pApi.func = func_name(a->kind); d.p2pApi.count = a->count; d.p2pApi.datatype = dt_name(a->dt);
      d.p2pApi.stream = NULL; d.p2pApi.graphCaptured = false; if (v7) d.p2pApi.userTag = 0;
    } else {
      d_init(&d, EV_COLL_API, gapi, 0);
      d.collApi.func = func_name(a->kind); d.collApi.count = a->count; d.collApi.datatype = dt_name(a->dt);
      d.collApi.root = a->root; d.collApi.stream = NULL; d.collApi.graphCaptured = false; if (v7) d.collApi.userTag = 0;
    }
    void *h = p_start(c, &d);
    if (api) api[i] = h;
    p_stop(h);                 /* the API parent stops before its Coll starts */
  }
  p_record(gapi, ST_GROUP_END_API_START, 0, v7);
  d_init(&d, EV_KERNEL_LAUNCH, gapi, 0);
  d.kernelLaunch.stream = NULL;
  p_stop(p_start(c, &d));
  d_init(&d, EV_GROUP, NULL, 0);
  void *grp = p_start(c, &d);
  int nch = env_int("NCCL_SIM_GPU_CHANNELS", 2);
  if (nch < 1) nch = 1;
  if (nch > 32) nch = 32;
  for (int i = 0; i < n; i++) {
    collargs_t *a = &ops[i].a;
    void *parent = g_prof_ver == 4 ? grp : (api ? api[i] : NULL);
    ops[i].nch = nch;
    if (is_p2p(a->kind)) {
      d_init(&d, EV_P2P, parent, c->rank);
      d.p2p.func = func_name(a->kind); d.p2p.buff = a->kind == K_SEND ? (void *)a->sb : a->rb;
      d.p2p.datatype = dt_name(a->dt); d.p2p.count = a->count; d.p2p.peer = a->peer; d.p2p.nChannels = (uint8_t)nch;
      if (g_prof_ver >= 5) d.p2p.parentGroup = grp;
      if (v7) d.p2p.userTag = 0;
    } else {
      d_init(&d, EV_COLL, parent, c->rank);
      d.coll.seqNumber = a->seq; d.coll.func = func_name(a->kind); d.coll.sendBuff = a->sb; d.coll.recvBuff = a->rb;
      d.coll.count = a->count; d.coll.root = a->root; d.coll.datatype = dt_name(a->dt); d.coll.nChannels = (uint8_t)nch;
      d.coll.nWarps = 16; d.coll.algo = "RING"; d.coll.proto = "SIMPLE";
      if (g_prof_ver >= 5) d.coll.parentGroup = grp;
      if (v7) { d.coll.kernelVariant = "default"; d.coll.isSymColl = false; d.coll.userTag = 0; }
    }
    ops[i].h = p_start(c, &d);
    p_stop(ops[i].h);          /* "enqueued", not done */
  }
  p_stop(grp);
  p_stop(gapi);
  free(api);
}

static ncclResult_t gpu_enqueue(collargs_t *q, int qn) {
  int qmax = env_int("NCCL_SIM_GPU_QUEUE", 1024);
  for (int i = 0; i < qn; i++) {
    ncclComm_t c = q[i].comm;
    int seen = 0;
    for (int j = 0; j < i; j++) if (q[j].comm == c) { seen = 1; break; }
    if (seen) continue;
    int n = 0;
    for (int j = i; j < qn; j++) if (q[j].comm == c) n++;
    gpu_work_t *w = calloc(1, sizeof(gpu_work_t) + sizeof(gpu_op_t) * (size_t)n);
    if (!w) return ncclSystemError;
    w->n = n;
    for (int j = i, k = 0; j < qn; j++) if (q[j].comm == c) { w->ops[k].a = q[j]; w->ops[k].nch = env_int("NCCL_SIM_GPU_CHANNELS", 2); k++; }
    sim_stream_t *s = stream_of(c);
    if (!s) { free(w); return ncclSystemError; }
    prof_enqueue(c, w->ops, n);
    pthread_mutex_lock(&s->mu);
    while (s->qlen >= qmax && !s->abort) pthread_cond_wait(&s->cv, &s->mu);  /* a full launch queue blocks the host */
    if (s->abort) { pthread_mutex_unlock(&s->mu); free(w); return ncclInvalidUsage; }
    if (s->tail) s->tail->next = w; else s->head = w;
    s->tail = w;
    s->qlen++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
  }
  return ncclSuccess;
}

/* Wait until the communicator's stream has run everything enqueued (cudaStreamSynchronize). */
static ncclResult_t gpu_drain(ncclComm_t c) {
  if (!gpu_on() || !c || !c->stream) return ncclSuccess;
  sim_stream_t *s = c->stream;
  pthread_mutex_lock(&s->mu);
  while ((s->head || s->busy) && !s->abort) pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
  return c->async_err;
}

/* The simulator's stand-in for cudaStreamSynchronize on the stream the
 * communicator's work went to.  Not an NCCL function. */
EXPORT ncclResult_t simStreamSynchronize(ncclComm_t comm) {
  if (!comm_ok(comm)) return ncclInvalidArgument;
  return gpu_drain(comm);
}

/* Destroy (abort = 0: the stream is drained first) or abort (abort = 1: pending
 * work purged; KernelCh events already started get no stopEvent), then the
 * plugin's finalize. */
static void gpu_comm_teardown(ncclComm_t c, int abort) {
  if (!c) return;
  sim_stream_t *s = c->stream;
  if (s) {
    if (!abort) gpu_drain(c);
    pthread_mutex_lock(&s->mu);
    if (abort) s->abort = 1; else s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    int busy = s->busy;
    pthread_mutex_unlock(&s->mu);
    if (abort && busy && c->fds)       /* wake a kernel blocked on its peers */
      for (int i = 0; i < c->nranks; i++) if (c->fds[i] >= 0) shutdown(c->fds[i], SHUT_RDWR);
    pthread_join(s->th, NULL);
    c->stream = NULL;
    pthread_cond_destroy(&s->cv); pthread_mutex_destroy(&s->mu); free(s);
  }
  if (c->prof_inited) {
    c->prof_inited = 0;
    char extra[256];
    snprintf(extra, sizeof extra, ",\"comm_hash\":\"%016llx\",\"abort\":%d,\"starts\":%lld,\"null_handles\":%lld,"
             "\"purged_kernelch\":%lld,\"purged_ops\":%lld", (unsigned long long)c->nccl_hash, abort,
             __atomic_load_n(&g_prof_starts, __ATOMIC_RELAXED), __atomic_load_n(&g_prof_nulls, __ATOMIC_RELAXED),
             __atomic_load_n(&g_prof_purged_kch, __ATOMIC_RELAXED), __atomic_load_n(&g_prof_purged_ops, __ATOMIC_RELAXED));
    g_prof->finalize(c->prof_ctx);
    c->prof_ctx = NULL;
    gpu_truth_simple("profilerFinalize", "PROFILER_FINALIZE", c, extra);
  }
}

/* ----------------------------------------------------- collective entry -- */
#define COLL_BODY(FN, OP, KIND, SB, RB, CNT, DT, ROP, ROOT, PEER)                       \
  ENTER();                                                                            \
  int rk_ = c_rank(comm), nr_ = c_nranks(comm);                                       \
  tl_gpu_seq_valid = 0;                                                               \
  ncclResult_t res = submit((collargs_t){KIND, SB, RB, CNT, DT, ROP, ROOT, PEER, comm}); \
  LEAVE();                                                                            \
  if (outer_) {                                                                       \
    REC_INIT(FN, OP);                                                                 \
    char gx_[96];                                                                     \
    if (tl_gpu_seq_valid) {                                                           \
      snprintf(gx_, sizeof gx_, ",\"seq\":%llu,\"comm_hash\":\"%016llx\"",           \
               (unsigned long long)tl_gpu_seq, (unsigned long long)comm->nccl_hash);  \
      rec_.extra = gx_;                                                               \
    }                                                                                 \
    rec_.comm = (uint64_t)(uintptr_t)comm; rec_.rank = rk_; rec_.nranks = nr_;        \
    rec_.count = CNT; rec_.datatype = DT; rec_.red_op = ROP; rec_.root = ROOT;        \
    rec_.peer = PEER; rec_.stream = (uint64_t)(uintptr_t)stream; rec_.result = res;   \
    truth_write(&rec_);                                                               \
  }                                                                                   \
  return res

EXPORT ncclResult_t pncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                   ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclAllReduce", "ALL_REDUCE", K_ALLREDUCE, sendbuff, recvbuff, count, datatype, op, -1, -1);
}
EXPORT ncclResult_t pncclAllReduceConfig(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                         ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream,
                                         const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclAllReduceConfig", "ALL_REDUCE", K_ALLREDUCE, sendbuff, recvbuff, count, datatype, op, -1, -1);
}
EXPORT ncclResult_t pncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                       ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                       cudaStream_t stream) {
  COLL_BODY("ncclReduceScatter", "REDUCE_SCATTER", K_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, op, -1, -1);
}
EXPORT ncclResult_t pncclReduceScatterConfig(const void *sendbuff, void *recvbuff, size_t recvcount,
                                             ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                             cudaStream_t stream, const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclReduceScatterConfig", "REDUCE_SCATTER", K_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, op, -1, -1);
}
EXPORT ncclResult_t pncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                                   ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclAllGather", "ALL_GATHER", K_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, -1, -1, -1);
}
EXPORT ncclResult_t pncclAllGatherConfig(const void *sendbuff, void *recvbuff, size_t sendcount,
                                         ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream,
                                         const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclAllGatherConfig", "ALL_GATHER", K_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, -1, -1, -1);
}
EXPORT ncclResult_t pncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclAlltoAll", "ALL_TO_ALL", K_ALLTOALL, sendbuff, recvbuff, count, datatype, -1, -1, -1);
}
EXPORT ncclResult_t pncclAlltoAllConfig(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                        ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclAlltoAllConfig", "ALL_TO_ALL", K_ALLTOALL, sendbuff, recvbuff, count, datatype, -1, -1, -1);
}
EXPORT ncclResult_t pncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                   int root, ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclBroadcast", "BROADCAST", K_BROADCAST, sendbuff, recvbuff, count, datatype, -1, root, -1);
}
EXPORT ncclResult_t pncclBroadcastConfig(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                         int root, ncclComm_t comm, cudaStream_t stream,
                                         const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclBroadcastConfig", "BROADCAST", K_BROADCAST, sendbuff, recvbuff, count, datatype, -1, root, -1);
}
EXPORT ncclResult_t pncclGather(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                int root, ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclGather", "GATHER", K_GATHER, sendbuff, recvbuff, count, datatype, -1, root, -1);
}
EXPORT ncclResult_t pncclGatherConfig(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                      int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclGatherConfig", "GATHER", K_GATHER, sendbuff, recvbuff, count, datatype, -1, root, -1);
}
EXPORT ncclResult_t pncclScatter(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                 int root, ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclScatter", "SCATTER", K_SCATTER, sendbuff, recvbuff, count, datatype, -1, root, -1);
}
EXPORT ncclResult_t pncclScatterConfig(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                       int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclScatterConfig", "SCATTER", K_SCATTER, sendbuff, recvbuff, count, datatype, -1, root, -1);
}
EXPORT ncclResult_t pncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclReduce", "REDUCE", K_REDUCE, sendbuff, recvbuff, count, datatype, op, root, -1);
}
EXPORT ncclResult_t pncclReduceConfig(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                      ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream,
                                      const ncclCollConfig_t *config) {
  (void)config;
  COLL_BODY("ncclReduceConfig", "REDUCE", K_REDUCE, sendbuff, recvbuff, count, datatype, op, root, -1);
}
EXPORT ncclResult_t pncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                              ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclSend", "SEND", K_SEND, sendbuff, NULL, count, datatype, -1, -1, peer);
}
EXPORT ncclResult_t pncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                              ncclComm_t comm, cudaStream_t stream) {
  COLL_BODY("ncclRecv", "RECV", K_RECV, NULL, recvbuff, count, datatype, -1, -1, peer);
}

/* ncclBcast: calls the exported ncclBroadcast through the PLT, like NCCL. */
ncclResult_t ncclBroadcast(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
EXPORT ncclResult_t pncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                               cudaStream_t stream) {
  ENTER();
  int rk_ = c_rank(comm), nr_ = c_nranks(comm);
  tl_gpu_seq_valid = 0;
  ncclResult_t res = ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
  LEAVE();
  if (outer_) {
    REC_INIT("ncclBcast", "BROADCAST");
    char gx_[96];
    if (tl_gpu_seq_valid) { /* GPU-like mode: the seq the inner ncclBroadcast got */
      snprintf(gx_, sizeof gx_, ",\"seq\":%llu,\"comm_hash\":\"%016llx\"", (unsigned long long)tl_gpu_seq,
               (unsigned long long)comm->nccl_hash);
      rec_.extra = gx_;
    }
    rec_.comm = (uint64_t)(uintptr_t)comm; rec_.rank = rk_; rec_.nranks = nr_;
    rec_.count = count; rec_.datatype = datatype; rec_.root = root;
    rec_.stream = (uint64_t)(uintptr_t)stream; rec_.result = res;
    truth_write(&rec_);
  }
  return res;
}

/* --------------------------------------------------------------- groups -- */
EXPORT ncclResult_t pncclGroupStart(void) {
  ENTER();
  tl_group_depth++;
  LEAVE();
  if (outer_) { REC_INIT("ncclGroupStart", "GROUP_START"); truth_write(&rec_); }
  return ncclSuccess;
}
EXPORT ncclResult_t pncclGroupEnd(void) {
  ENTER();
  ncclResult_t res = ncclSuccess;
  if (tl_group_depth <= 0) res = ncclInvalidUsage;
  else if (--tl_group_depth == 0) res = group_flush();
  LEAVE();
  if (outer_) { REC_INIT("ncclGroupEnd", "GROUP_END"); rec_.result = res; truth_write(&rec_); }
  return res;
}

/* ---------------------------------------------------------- bootstrap -- */
typedef struct {
  uint8_t magic[8];
  uint8_t nonce[16];
  int32_t nranks, rank;
  peer_addr_t addr;
} hello_t;

typedef struct { int lfd; uint8_t nonce[16]; } root_arg_t;

/* One-shot bootstrap root: collect nranks hellos, send everyone the table. */
static void *root_thread(void *arg) {
  root_arg_t ra = *(root_arg_t *)arg;
  free(arg);
  int nranks = -1, got = 0;
  int *fds = NULL;
  peer_addr_t *tab = NULL;
  for (;;) {
    int fd = accept_timeout(ra.lfd, -1);
    if (fd < 0) { if (errno == EINTR) continue; break; }
    hello_t h;
    if (io_all(fd, &h, sizeof(h), 0, 30000) != 0 || memcmp(h.magic, ID_MAGIC, 8) != 0 ||
        memcmp(h.nonce, ra.nonce, 16) != 0 || h.nranks <= 0 || h.nranks > 4096 || h.rank < 0 ||
        h.rank >= h.nranks || (nranks > 0 && h.nranks != nranks)) {
      close(fd);
      continue;
    }
    if (nranks < 0) {
      nranks = h.nranks;
      fds = malloc(sizeof(int) * nranks);
      tab = calloc(nranks, sizeof(peer_addr_t));
      if (!fds || !tab) break;
      for (int i = 0; i < nranks; i++) fds[i] = -1;
    }
    if (fds[h.rank] >= 0) close(fds[h.rank]); else got++;
    fds[h.rank] = fd;
    tab[h.rank] = h.addr;
    if (got == nranks) {
      for (int i = 0; i < nranks; i++) { io_all(fds[i], tab, sizeof(peer_addr_t) * nranks, 1, 30000); }
      for (int i = 0; i < nranks; i++) close(fds[i]);
      break;
    }
  }
  close(ra.lfd);
  free(fds); free(tab);
  return NULL;
}

static ncclResult_t get_unique_id_impl(ncclUniqueId *id) {
  if (!id) return ncclInvalidArgument;
  peer_addr_t pa;
  int lfd = make_listener(&pa);
  if (lfd < 0) return ncclSystemError;
  memset(id, 0, sizeof(*id));
  memcpy(id->internal, ID_MAGIC, 8);
  memcpy(id->internal + ID_OFF_FAMILY, &pa.family, 2);
  memcpy(id->internal + ID_OFF_PORT, &pa.port, 2);
  memcpy(id->internal + ID_OFF_ADDR, pa.addr, 16);
  uint8_t nonce[16];
  if (getrandom(nonce, 16, 0) != 16) {
    uint64_t t = now_ns(CLOCK_MONOTONIC) ^ ((uint64_t)getpid() << 32);
    for (int i = 0; i < 16; i++) nonce[i] = (uint8_t)(t >> ((i % 8) * 8)) ^ (uint8_t)(i * 37);
  }
  memcpy(id->internal + ID_OFF_NONCE, nonce, 16);
  root_arg_t *ra = malloc(sizeof(*ra));
  if (!ra) { close(lfd); return ncclSystemError; }
  ra->lfd = lfd;
  memcpy(ra->nonce, nonce, 16);
  pthread_t th;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&th, &at, root_thread, ra);
  pthread_attr_destroy(&at);
  if (rc != 0) { close(lfd); free(ra); return ncclSystemError; }
  return ncclSuccess;
}

static void free_comm(ncclComm_t c) {
  if (!c) return;
  if (c->stream || c->prof_inited) gpu_comm_teardown(c, 1);
  free(c->p2p_seq);
  c->p2p_seq = NULL;
  proxy_stop(c);
  if (c->fds) for (int i = 0; i < c->nranks; i++) if (c->fds[i] >= 0) close(c->fds[i]);
  free(c->fds);
  c->magic = 0;
  free(c);
}

/* Build the full mesh: connect to lower ranks, accept from higher ranks. */
static ncclResult_t build_mesh(ncclComm_t c, int lfd, const peer_addr_t *tab, const uint8_t tag[16]) {
  int n = c->nranks, r = c->rank;
  int tmo = env_int("NCCL_SIM_CONNECT_TIMEOUT_MS", 60000);
  for (int p = 0; p < r; p++) {
    int fd = connect_retry(&tab[p], tmo);
    if (fd < 0) return ncclRemoteError;
    hello_t h; memset(&h, 0, sizeof(h));
    memcpy(h.magic, ID_MAGIC, 8); memcpy(h.nonce, tag, 16); h.nranks = n; h.rank = r;
    if (io_all(fd, &h, sizeof(h), 1, tmo) != 0) { close(fd); return ncclRemoteError; }
    c->fds[p] = fd;
  }
  for (int k = r + 1; k < n;) {
    int fd = accept_timeout(lfd, tmo);
    if (fd < 0) return ncclRemoteError;
    hello_t h;
    if (io_all(fd, &h, sizeof(h), 0, tmo) != 0 || memcmp(h.magic, ID_MAGIC, 8) || memcmp(h.nonce, tag, 16) ||
        h.rank <= r || h.rank >= n || c->fds[h.rank] >= 0) {
      close(fd);
      continue;
    }
    c->fds[h.rank] = fd;
    k++;
  }
  return ncclSuccess;
}

static ncclComm_t alloc_comm(int nranks, int rank) {
  ncclComm_t c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  c->magic = COMM_MAGIC; c->nranks = nranks; c->rank = rank; c->cudaDev = rank;
  c->fds = malloc(sizeof(int) * nranks);
  if (!c->fds) { free(c); return NULL; }
  for (int i = 0; i < nranks; i++) c->fds[i] = -1;
  return c;
}

static ncclResult_t init_rank_impl(ncclComm_t *out, int nranks, const ncclUniqueId *id, int rank) {
  if (!out) return ncclInvalidArgument;
  *out = NULL;
  if (nranks <= 0 || rank < 0 || rank >= nranks || !id || memcmp(id->internal, ID_MAGIC, 8) != 0)
    return ncclInvalidArgument;
  peer_addr_t root;
  memset(&root, 0, sizeof(root));
  memcpy(&root.family, id->internal + ID_OFF_FAMILY, 2);
  memcpy(&root.port, id->internal + ID_OFF_PORT, 2);
  memcpy(root.addr, id->internal + ID_OFF_ADDR, 16);
  ncclComm_t c = alloc_comm(nranks, rank);
  if (!c) return ncclSystemError;
  memcpy(c->nonce, id->internal + ID_OFF_NONCE, 16);
  peer_addr_t me;
  int lfd = make_listener(&me);
  if (lfd < 0) { free_comm(c); return ncclSystemError; }
  int tmo = env_int("NCCL_SIM_CONNECT_TIMEOUT_MS", 60000);
  int init_tmo = env_int("NCCL_SIM_INIT_TIMEOUT_MS", 120000);
  ncclResult_t res = ncclSuccess;
  peer_addr_t *tab = calloc(nranks, sizeof(peer_addr_t));
  int rfd = tab ? connect_retry(&root, tmo) : -1;
  if (rfd < 0) res = tab ? ncclRemoteError : ncclSystemError;
  if (res == ncclSuccess) {
    hello_t h; memset(&h, 0, sizeof(h));
    memcpy(h.magic, ID_MAGIC, 8); memcpy(h.nonce, c->nonce, 16);
    h.nranks = nranks; h.rank = rank; h.addr = me;
    if (io_all(rfd, &h, sizeof(h), 1, tmo) != 0 ||
        io_all(rfd, tab, sizeof(peer_addr_t) * nranks, 0, init_tmo) != 0)
      res = ncclRemoteError;
  }
  if (rfd >= 0) close(rfd);
  if (res == ncclSuccess) res = build_mesh(c, lfd, tab, c->nonce);
  close(lfd);
  free(tab);
  if (res != ncclSuccess) { free_comm(c); return res; }
  if (gpu_on()) { c->nccl_hash = nccl_root_hash(id); gpu_comm_ready(c); }
  *out = c;
  return ncclSuccess;
}

/* ---------------------------------------------------- lifecycle entries -- */
static void fmt_uid_extra(char *buf, size_t cap, const ncclUniqueId *id, const char *more) {
  char hex[2 * NCCL_UNIQUE_ID_BYTES + 1];
  if (id) hexid(hex, id); else hex[0] = 0;
  snprintf(buf, cap, ",\"uid\":\"%s\"%s", hex, more ? more : "");
}

EXPORT ncclResult_t pncclGetUniqueId(ncclUniqueId *uniqueId) {
  ENTER();
  ncclResult_t res = get_unique_id_impl(uniqueId);
  LEAVE();
  if (outer_) {
    REC_INIT("ncclGetUniqueId", "GET_UNIQUE_ID");
    char extra[400];
    fmt_uid_extra(extra, sizeof(extra), res == ncclSuccess ? uniqueId : NULL, NULL);
    rec_.extra = extra; rec_.result = res;
    truth_write(&rec_);
  }
  return res;
}

static void rec_init_like(const char *fn, const char *op, uint64_t t0m_, uint64_t t1m_, uint64_t t0r_,
                          uint64_t t1r_, ncclResult_t res, ncclComm_t *comm, int nranks, int rank,
                          const ncclUniqueId *id) {
  REC_INIT(fn, op);
  ncclComm_t c = (comm && res == ncclSuccess) ? *comm : NULL;
  rec_.comm = (uint64_t)(uintptr_t)c;
  rec_.rank = rank; rec_.nranks = nranks; rec_.result = res;
  char extra[400];
  fmt_uid_extra(extra, sizeof(extra), id, NULL);
  rec_.extra = extra;
  truth_write(&rec_);
}

EXPORT ncclResult_t pncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  ENTER();
  ncclResult_t res = init_rank_impl(comm, nranks, &commId, rank);
  LEAVE();
  if (outer_) rec_init_like("ncclCommInitRank", "COMM_INIT_RANK", t0m_, t1m_, t0r_, t1r_, res, comm, nranks, rank, &commId);
  return res;
}
EXPORT ncclResult_t pncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                            ncclConfig_t *config) {
  (void)config;
  ENTER();
  ncclResult_t res = init_rank_impl(comm, nranks, &commId, rank);
  LEAVE();
  if (outer_)
    rec_init_like("ncclCommInitRankConfig", "COMM_INIT_RANK_CONFIG", t0m_, t1m_, t0r_, t1r_, res, comm, nranks, rank, &commId);
  return res;
}
EXPORT ncclResult_t pncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
                                              ncclUniqueId *commIds, ncclConfig_t *config) {
  (void)config;
  ENTER();
  ncclResult_t res = (nId < 1 || !commIds) ? ncclInvalidArgument : init_rank_impl(newcomm, nranks, &commIds[0], myrank);
  if (res != ncclSuccess && newcomm && (nId < 1 || !commIds)) *newcomm = NULL;
  LEAVE();
  if (outer_)
    rec_init_like("ncclCommInitRankScalable", "COMM_INIT_RANK_SCALABLE", t0m_, t1m_, t0r_, t1r_, res, newcomm,
                  nranks, myrank, (nId >= 1 && commIds) ? &commIds[0] : NULL);
  return res;
}

typedef struct { ncclComm_t *out; int nranks, rank; const ncclUniqueId *id; ncclResult_t res; } initall_arg_t;
static void *initall_thread(void *p) {
  initall_arg_t *a = p;
  a->res = init_rank_impl(a->out, a->nranks, a->id, a->rank);
  return NULL;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
EXPORT ncclResult_t pncclCommInitAll(ncclComm_t *comm, int ndev, const int *devlist) {
  ENTER();
  ncclResult_t res = ncclSuccess;
  ncclUniqueId id;
  memset(&id, 0, sizeof(id));
  if (!comm || ndev <= 0) res = ncclInvalidArgument;
  else res = ncclGetUniqueId(&id); /* through the PLT, like NCCL */
  if (res == ncclSuccess) {
    initall_arg_t *args = calloc(ndev, sizeof(*args));
    pthread_t *th = calloc(ndev, sizeof(*th));
    if (!args || !th) res = ncclSystemError;
    else {
      for (int i = 0; i < ndev; i++) {
        args[i] = (initall_arg_t){&comm[i], ndev, i, &id, ncclSuccess};
        if (pthread_create(&th[i], NULL, initall_thread, &args[i]) != 0) { res = ncclSystemError; ndev = i; break; }
      }
      for (int i = 0; i < ndev; i++) pthread_join(th[i], NULL);
      for (int i = 0; i < ndev; i++) if (res == ncclSuccess && args[i].res != ncclSuccess) res = args[i].res;
      for (int i = 0; i < ndev; i++) if (comm[i] && devlist) comm[i]->cudaDev = devlist[i];
      if (res != ncclSuccess)
        for (int i = 0; i < ndev; i++) { free_comm(comm[i]); comm[i] = NULL; }
    }
    free(args); free(th);
  }
  LEAVE();
  if (outer_) {
    REC_INIT("ncclCommInitAll", "COMM_INIT_ALL");
    rec_.nranks = ndev; rec_.result = res;
    size_t cap = 400 + (ndev > 0 ? (size_t)ndev * 24 : 0);
    char *more = malloc(cap), *extra = malloc(cap + 300);
    if (more && extra) {
      size_t o = (size_t)snprintf(more, cap, ",\"comms\":[");
      for (int i = 0; res == ncclSuccess && i < ndev; i++)
        o += (size_t)snprintf(more + o, cap - o, "%s%llu", i ? "," : "", (unsigned long long)(uintptr_t)comm[i]);
      snprintf(more + o, cap - o, "]");
      fmt_uid_extra(extra, cap + 300, &id, more);
      rec_.extra = extra;
    }
    truth_write(&rec_);
    free(more); free(extra);
  }
  return res;
}

typedef struct { int32_t color, key; peer_addr_t addr; } split_info_t;

static ncclResult_t split_impl(ncclComm_t c, int color, int key, ncclComm_t *newcomm, int *out_seq) {
  if (!newcomm) return ncclInvalidArgument;
  *newcomm = NULL;
  if (!comm_ok(c)) return ncclInvalidArgument;
  if (color < 0 && color != NCCL_SPLIT_NOCOLOR) return ncclInvalidArgument;
  if (gpu_on()) gpu_drain(c); /* the parent's enqueued work first: it uses the same connections */
  int seq = c->nsplits++;
  *out_seq = seq;
  int n = c->nranks;
  split_info_t *all = calloc(n, sizeof(*all));
  if (!all) return ncclSystemError;
  int lfd = -1;
  split_info_t mine; memset(&mine, 0, sizeof(mine));
  mine.color = color; mine.key = key;
  if (color != NCCL_SPLIT_NOCOLOR) {
    lfd = make_listener(&mine.addr);
    if (lfd < 0) { free(all); return ncclSystemError; }
  }
  ncclResult_t res = do_allgather(c, &mine, all, sizeof(mine), ncclUint8);
  if (res != ncclSuccess || color == NCCL_SPLIT_NOCOLOR) { if (lfd >= 0) close(lfd); free(all); return res; }
  /* members ordered by (key, parent rank) */
  int *mem = malloc(sizeof(int) * n);
  int m = 0;
  for (int p = 0; p < n; p++) if (all[p].color == color) mem[m++] = p;
  for (int i = 1; i < m; i++) { /* insertion sort, stable on parent rank */
    int v = mem[i], j = i - 1;
    while (j >= 0 && all[mem[j]].key > all[v].key) { mem[j + 1] = mem[j]; j--; }
    mem[j + 1] = v;
  }
  int myr = -1;
  peer_addr_t *tab = calloc(m, sizeof(*tab));
  for (int i = 0; i < m; i++) { tab[i] = all[mem[i]].addr; if (mem[i] == c->rank) myr = i; }
  ncclComm_t nc = alloc_comm(m, myr);
  if (!nc) res = ncclSystemError;
  else {
    nc->cudaDev = c->cudaDev;
    /* child tag: parent nonce mixed with split seq and color */
    memcpy(nc->nonce, c->nonce, 16);
    for (int i = 0; i < 4; i++) { nc->nonce[i] ^= (uint8_t)(seq >> (8 * i)); nc->nonce[4 + i] ^= (uint8_t)(color >> (8 * i)); }
    nc->nonce[15] ^= 0x5a;
    res = build_mesh(nc, lfd, tab, nc->nonce);
    if (res != ncclSuccess) { free_comm(nc); nc = NULL; }
    else if (gpu_on()) { nc->nccl_hash = nccl_split_hash(c->nccl_hash, (uint32_t)(seq + 1), (uint32_t)color); gpu_comm_ready(nc); }
  }
  close(lfd);
  free(tab); free(mem); free(all);
  *newcomm = nc;
  return res;
}

EXPORT ncclResult_t pncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
  (void)config;
  ENTER();
  int seq = comm_ok(comm) ? comm->nsplits : -1;
  int prk = c_rank(comm), pnr = c_nranks(comm);
  ncclResult_t res = split_impl(comm, color, key, newcomm, &seq);
  LEAVE();
  if (outer_) {
    REC_INIT("ncclCommSplit", "COMM_SPLIT");
    ncclComm_t nc = (newcomm && res == ncclSuccess) ? *newcomm : NULL;
    rec_.comm = (uint64_t)(uintptr_t)nc;
    rec_.rank = nc ? nc->rank : -1; rec_.nranks = nc ? nc->nranks : -1; rec_.result = res;
    char extra[300];
    snprintf(extra, sizeof(extra), ",\"parent\":%llu,\"parent_rank\":%d,\"parent_nranks\":%d,\"color\":%d,\"key\":%d,\"split_seq\":%d",
             (unsigned long long)(uintptr_t)comm, prk, pnr, color, key, seq);
    rec_.extra = extra;
    truth_write(&rec_);
  }
  return res;
}

#define COMM_ONLY(FN, OP, BODY)                                     \
  ENTER();                                                          \
  int rk_ = c_rank(comm), nr_ = c_nranks(comm);                     \
  ncclResult_t res;                                                 \
  BODY;                                                             \
  LEAVE();                                                          \
  if (outer_) {                                                     \
    REC_INIT(FN, OP);                                               \
    rec_.comm = (uint64_t)(uintptr_t)comm; rec_.rank = rk_; rec_.nranks = nr_; rec_.result = res; \
    truth_write(&rec_);                                             \
  }                                                                 \
  return res

EXPORT ncclResult_t pncclCommFinalize(ncclComm_t comm) {
  COMM_ONLY("ncclCommFinalize", "COMM_FINALIZE", {
    if (!comm_ok(comm)) res = ncclInvalidArgument;
    else { gpu_drain(comm); comm->finalized = 1; res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommDestroy(ncclComm_t comm) {
  COMM_ONLY("ncclCommDestroy", "COMM_DESTROY", {
    if (comm == NULL) res = ncclSuccess; /* NCCL: destroying NULL is a no-op */
    else if (!comm_ok(comm)) res = ncclInvalidArgument;
    else { if (gpu_on()) gpu_comm_teardown(comm, 0); free_comm(comm); res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommAbort(ncclComm_t comm) {
  COMM_ONLY("ncclCommAbort", "COMM_ABORT", {
    if (comm == NULL) res = ncclSuccess;
    else if (!comm_ok(comm)) res = ncclInvalidArgument;
    else { if (gpu_on()) gpu_comm_teardown(comm, 1); free_comm(comm); res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommCount(const ncclComm_t comm, int *count) {
  COMM_ONLY("ncclCommCount", "COMM_COUNT", {
    if (!comm_ok(comm) || !count) res = ncclInvalidArgument;
    else { *count = comm->nranks; res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommUserRank(const ncclComm_t comm, int *rank) {
  COMM_ONLY("ncclCommUserRank", "COMM_USER_RANK", {
    if (!comm_ok(comm) || !rank) res = ncclInvalidArgument;
    else { *rank = comm->rank; res = ncclSuccess; }
  });
}

/* Not in the op vocabulary: no ground truth for these. */
EXPORT ncclResult_t pncclCommCuDevice(const ncclComm_t comm, int *device) {
  if (!comm_ok(comm) || !device) return ncclInvalidArgument;
  *device = comm->cudaDev;
  return ncclSuccess;
}
EXPORT ncclResult_t pncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  if (!comm_ok(comm) || !asyncError) return ncclInvalidArgument;
  *asyncError = comm->async_err;
  return ncclSuccess;
}
EXPORT ncclResult_t pncclGetVersion(int *version) {
  if (!version) return ncclInvalidArgument;
  *version = SIM_VERSION_CODE;
  return ncclSuccess;
}
EXPORT const char *pncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclTimeout: return "NCCL operation timed out";
    default: return "unknown result code";
  }
}
EXPORT const char *pncclGetLastError(ncclComm_t comm) {
  (void)comm;
  return "";
}

/* ------------------------------- NCCL 2.28-2.32 additions (issue 11, §3) --
 * ncclCommShrink is simulated: the survivors (every rank not excluded) swap
 * listener addresses over the parent's sockets and build a new mesh, ranks
 * renumbered in parent order. The others are the smallest stand-ins that keep
 * the ABI: Revoke/Suspend/Resume/(Window)(De)Register succeed on a valid
 * communicator, Grow and the one-sided signal calls return ncclInvalidUsage
 * (no GPU memory to grow into or to signal through). */
typedef struct ncclWindow_vidmem *ncclWindow_t;
typedef struct ncclWaitSignalDesc ncclWaitSignalDesc_t;

static ncclResult_t shrink_impl(ncclComm_t c, const int *excl, int nexcl, ncclComm_t *newcomm, int *out_seq) {
  if (!newcomm) return ncclInvalidArgument;
  *newcomm = NULL;
  if (!comm_ok(c) || nexcl < 0 || (nexcl > 0 && !excl)) return ncclInvalidArgument;
  int n = c->nranks;
  char *gone = calloc(n, 1);
  if (!gone) return ncclSystemError;
  for (int i = 0; i < nexcl; i++) {
    if (excl[i] < 0 || excl[i] >= n) { free(gone); return ncclInvalidArgument; }
    gone[excl[i]] = 1;
  }
  if (gone[c->rank]) { free(gone); return ncclInvalidArgument; } /* an excluded rank does not call */
  if (gpu_on()) gpu_drain(c);
  int seq = c->nshrinks++;
  *out_seq = seq;
  int m = 0, myr = -1;
  for (int p = 0; p < n; p++) if (!gone[p]) { if (p == c->rank) myr = m; m++; }
  peer_addr_t *all = calloc(n, sizeof(*all));
  p2p_t *ops = calloc(2 * (size_t)n, sizeof(*ops));
  int lfd = (all && ops) ? make_listener(&all[c->rank]) : -1;
  if (lfd < 0) { free(all); free(ops); free(gone); return ncclSystemError; }
  int k = 0;
  for (int p = 0; p < n; p++) {
    if (gone[p] || p == c->rank) continue;
    ops[k++] = (p2p_t){p, 1, (char *)&all[c->rank], sizeof(peer_addr_t), 0};
    ops[k++] = (p2p_t){p, 0, (char *)&all[p], sizeof(peer_addr_t), 0};
  }
  ncclResult_t res = k ? run_p2p(c, ops, k) : ncclSuccess;
  ncclComm_t nc = NULL;
  if (res == ncclSuccess) {
    peer_addr_t *tab = calloc(m, sizeof(*tab));
    int j = 0;
    if (tab) for (int p = 0; p < n; p++) if (!gone[p]) tab[j++] = all[p];
    nc = tab ? alloc_comm(m, myr) : NULL;
    if (!nc) res = ncclSystemError;
    else {
      nc->cudaDev = c->cudaDev;
      memcpy(nc->nonce, c->nonce, 16);
      for (int i = 0; i < 4; i++) nc->nonce[8 + i] ^= (uint8_t)(seq >> (8 * i));
      nc->nonce[14] ^= 0xa5;
      res = build_mesh(nc, lfd, tab, nc->nonce);
      if (res != ncclSuccess) { free_comm(nc); nc = NULL; }
      else if (gpu_on()) { nc->nccl_hash = nccl_split_hash(c->nccl_hash, 0, 0); gpu_comm_ready(nc); }
    }
    free(tab);
  }
  close(lfd);
  free(all); free(ops); free(gone);
  *newcomm = nc;
  return res;
}

EXPORT ncclResult_t pncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount,
                                    ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags) {
  (void)config; (void)shrinkFlags;
  ENTER();
  int seq = comm_ok(comm) ? comm->nshrinks : -1;
  int prk = c_rank(comm), pnr = c_nranks(comm);
  ncclResult_t res = shrink_impl(comm, excludeRanksList, excludeRanksCount, newcomm, &seq);
  LEAVE();
  if (outer_) {
    REC_INIT("ncclCommShrink", "COMM_SHRINK");
    ncclComm_t nc = (newcomm && res == ncclSuccess) ? *newcomm : NULL;
    rec_.comm = (uint64_t)(uintptr_t)nc;
    rec_.rank = nc ? nc->rank : -1; rec_.nranks = nc ? nc->nranks : -1; rec_.result = res;
    char extra[200];
    snprintf(extra, sizeof(extra), ",\"parent\":%llu,\"parent_rank\":%d,\"parent_nranks\":%d,\"excluded\":%d,\"shrink_seq\":%d",
             (unsigned long long)(uintptr_t)comm, prk, pnr, excludeRanksCount, seq);
    rec_.extra = extra;
    truth_write(&rec_);
  }
  return res;
}
EXPORT ncclResult_t pncclCommGrow(ncclComm_t comm, int nRanks, const ncclUniqueId *uniqueId, int rank,
                                  ncclComm_t *newcomm, ncclConfig_t *config) {
  (void)nRanks; (void)uniqueId; (void)rank; (void)config;
  COMM_ONLY("ncclCommGrow", "COMM_GROW", {
    if (newcomm) *newcomm = NULL;
    res = ncclInvalidUsage; /* not simulated */
  });
}
EXPORT ncclResult_t pncclCommRevoke(ncclComm_t comm, int revokeFlags) {
  COMM_ONLY("ncclCommRevoke", "COMM_REVOKE", {
    res = (!comm_ok(comm) || revokeFlags != 0) ? ncclInvalidArgument : ncclSuccess;
  });
}
EXPORT ncclResult_t pncclCommSuspend(ncclComm_t comm, int flags) {
  (void)flags;
  COMM_ONLY("ncclCommSuspend", "COMM_SUSPEND", { res = comm_ok(comm) ? ncclSuccess : ncclInvalidArgument; });
}
EXPORT ncclResult_t pncclCommResume(ncclComm_t comm) {
  COMM_ONLY("ncclCommResume", "COMM_RESUME", { res = comm_ok(comm) ? ncclSuccess : ncclInvalidArgument; });
}
EXPORT ncclResult_t pncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle) {
  (void)size;
  COMM_ONLY("ncclCommRegister", "COMM_REGISTER", {
    if (!comm_ok(comm) || !handle) res = ncclInvalidArgument;
    else { *handle = buff; res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommDeregister(const ncclComm_t comm, void *handle) {
  (void)handle;
  COMM_ONLY("ncclCommDeregister", "COMM_DEREGISTER", { res = comm_ok(comm) ? ncclSuccess : ncclInvalidArgument; });
}
EXPORT ncclResult_t pncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, ncclWindow_t *win, int winFlags) {
  (void)size; (void)winFlags;
  COMM_ONLY("ncclCommWindowRegister", "COMM_WINDOW_REGISTER", {
    if (!comm_ok(comm) || !win) res = ncclInvalidArgument;
    else { *win = (ncclWindow_t)buff; res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win) {
  (void)win;
  COMM_ONLY("ncclCommWindowDeregister", "COMM_WINDOW_DEREGISTER", {
    res = comm_ok(comm) ? ncclSuccess : ncclInvalidArgument;
  });
}
/* One-sided calls: no ground truth (they only fail here). */
EXPORT ncclResult_t pncclPutSignal(const void *localbuff, size_t count, ncclDataType_t datatype, int peer,
                                   ncclWindow_t peerWin, size_t peerWinOffset, int sigIdx, int ctx,
                                   unsigned int flags, ncclComm_t comm, cudaStream_t stream) {
  (void)localbuff; (void)count; (void)datatype; (void)peer; (void)peerWin; (void)peerWinOffset;
  (void)sigIdx; (void)ctx; (void)flags; (void)stream;
  return comm_ok(comm) ? ncclInvalidUsage : ncclInvalidArgument;
}
EXPORT ncclResult_t pncclSignal(int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream) {
  (void)peer; (void)sigIdx; (void)ctx; (void)flags; (void)stream;
  return comm_ok(comm) ? ncclInvalidUsage : ncclInvalidArgument;
}
EXPORT ncclResult_t pncclWaitSignal(int nDesc, ncclWaitSignalDesc_t *signalDescs, ncclComm_t comm, cudaStream_t stream) {
  (void)nDesc; (void)signalDescs; (void)stream;
  return comm_ok(comm) ? ncclInvalidUsage : ncclInvalidArgument;
}

/* ---------------------------------------------------- weak public names -- */
EXPORT ncclResult_t ncclGetVersion(int *) ALIAS(ncclGetVersion);
EXPORT const char *ncclGetErrorString(ncclResult_t) ALIAS(ncclGetErrorString);
EXPORT const char *ncclGetLastError(ncclComm_t) ALIAS(ncclGetLastError);
EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *) ALIAS(ncclGetUniqueId);
EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *, int, ncclUniqueId, int) ALIAS(ncclCommInitRank);
EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *) ALIAS(ncclCommInitRankConfig);
EXPORT ncclResult_t ncclCommInitAll(ncclComm_t *, int, const int *) ALIAS(ncclCommInitAll);
EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t *, int, int, int, ncclUniqueId *, ncclConfig_t *) ALIAS(ncclCommInitRankScalable);
EXPORT ncclResult_t ncclCommSplit(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *) ALIAS(ncclCommSplit);
EXPORT ncclResult_t ncclCommFinalize(ncclComm_t) ALIAS(ncclCommFinalize);
EXPORT ncclResult_t ncclCommDestroy(ncclComm_t) ALIAS(ncclCommDestroy);
EXPORT ncclResult_t ncclCommAbort(ncclComm_t) ALIAS(ncclCommAbort);
EXPORT ncclResult_t ncclCommCount(const ncclComm_t, int *) ALIAS(ncclCommCount);
EXPORT ncclResult_t ncclCommUserRank(const ncclComm_t, int *) ALIAS(ncclCommUserRank);
EXPORT ncclResult_t ncclCommCuDevice(const ncclComm_t, int *) ALIAS(ncclCommCuDevice);
EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t, ncclResult_t *) ALIAS(ncclCommGetAsyncError);
EXPORT ncclResult_t ncclGroupStart(void) ALIAS(ncclGroupStart);
EXPORT ncclResult_t ncclGroupEnd(void) ALIAS(ncclGroupEnd);
EXPORT ncclResult_t ncclAllReduce(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) ALIAS(ncclAllReduce);
EXPORT ncclResult_t ncclAllReduceConfig(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclAllReduceConfig);
EXPORT ncclResult_t ncclReduceScatter(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) ALIAS(ncclReduceScatter);
EXPORT ncclResult_t ncclReduceScatterConfig(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclReduceScatterConfig);
EXPORT ncclResult_t ncclAllGather(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) ALIAS(ncclAllGather);
EXPORT ncclResult_t ncclAllGatherConfig(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclAllGatherConfig);
EXPORT ncclResult_t ncclAlltoAll(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) ALIAS(ncclAlltoAll);
EXPORT ncclResult_t ncclAlltoAllConfig(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclAlltoAllConfig);
EXPORT ncclResult_t ncclBroadcast(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclBroadcast);
EXPORT ncclResult_t ncclBroadcastConfig(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclBroadcastConfig);
EXPORT ncclResult_t ncclBcast(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclBcast);
EXPORT ncclResult_t ncclReduce(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclReduce);
EXPORT ncclResult_t ncclReduceConfig(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclReduceConfig);
EXPORT ncclResult_t ncclGather(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclGather);
EXPORT ncclResult_t ncclGatherConfig(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclGatherConfig);
EXPORT ncclResult_t ncclScatter(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclScatter);
EXPORT ncclResult_t ncclScatterConfig(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t, const ncclCollConfig_t *) ALIAS(ncclScatterConfig);
EXPORT ncclResult_t ncclSend(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclSend);
EXPORT ncclResult_t ncclRecv(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclRecv);
EXPORT ncclResult_t ncclCommShrink(ncclComm_t, int *, int, ncclComm_t *, ncclConfig_t *, int) ALIAS(ncclCommShrink);
EXPORT ncclResult_t ncclCommGrow(ncclComm_t, int, const ncclUniqueId *, int, ncclComm_t *, ncclConfig_t *) ALIAS(ncclCommGrow);
EXPORT ncclResult_t ncclCommRevoke(ncclComm_t, int) ALIAS(ncclCommRevoke);
EXPORT ncclResult_t ncclCommSuspend(ncclComm_t, int) ALIAS(ncclCommSuspend);
EXPORT ncclResult_t ncclCommResume(ncclComm_t) ALIAS(ncclCommResume);
EXPORT ncclResult_t ncclCommRegister(const ncclComm_t, void *, size_t, void **) ALIAS(ncclCommRegister);
EXPORT ncclResult_t ncclCommDeregister(const ncclComm_t, void *) ALIAS(ncclCommDeregister);
EXPORT ncclResult_t ncclCommWindowRegister(ncclComm_t, void *, size_t, ncclWindow_t *, int) ALIAS(ncclCommWindowRegister);
EXPORT ncclResult_t ncclCommWindowDeregister(ncclComm_t, ncclWindow_t) ALIAS(ncclCommWindowDeregister);
EXPORT ncclResult_t ncclPutSignal(const void *, size_t, ncclDataType_t, int, ncclWindow_t, size_t, int, int, unsigned int, ncclComm_t, cudaStream_t) ALIAS(ncclPutSignal);
EXPORT ncclResult_t ncclSignal(int, int, int, unsigned int, ncclComm_t, cudaStream_t) ALIAS(ncclSignal);
EXPORT ncclResult_t ncclWaitSignal(int, ncclWaitSignalDesc_t *, ncclComm_t, cudaStream_t) ALIAS(ncclWaitSignal);

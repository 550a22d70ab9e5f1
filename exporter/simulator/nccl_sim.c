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

/* ----------------------------------------------------- collective entry -- */
#define COLL_BODY(FN, OP, KIND, SB, RB, CNT, DT, ROP, ROOT, PEER)                       \
  ENTER();                                                                            \
  int rk_ = c_rank(comm), nr_ = c_nranks(comm);                                       \
  ncclResult_t res = submit((collargs_t){KIND, SB, RB, CNT, DT, ROP, ROOT, PEER, comm}); \
  LEAVE();                                                                            \
  if (outer_) {                                                                       \
    REC_INIT(FN, OP);                                                                 \
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
  ncclResult_t res = ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
  LEAVE();
  if (outer_) {
    REC_INIT("ncclBcast", "BROADCAST");
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
    else { comm->finalized = 1; res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommDestroy(ncclComm_t comm) {
  COMM_ONLY("ncclCommDestroy", "COMM_DESTROY", {
    if (comm == NULL) res = ncclSuccess; /* NCCL: destroying NULL is a no-op */
    else if (!comm_ok(comm)) res = ncclInvalidArgument;
    else { free_comm(comm); res = ncclSuccess; }
  });
}
EXPORT ncclResult_t pncclCommAbort(ncclComm_t comm) {
  COMM_ONLY("ncclCommAbort", "COMM_ABORT", {
    if (comm == NULL) res = ncclSuccess;
    else if (!comm_ok(comm)) res = ncclInvalidArgument;
    else { free_comm(comm); res = ncclSuccess; }
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

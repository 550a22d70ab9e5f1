/* bootstrap.c -- Sockets and bootstrap: this rank's address, listeners and connections,
 * ncclGetUniqueId's root thread and the full mesh every communicator builds. */
#include "nccl_sim.h"

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
int make_listener(peer_addr_t *pa) {
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

ncclResult_t get_unique_id_impl(ncclUniqueId *id) {
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

void free_comm(ncclComm_t c) {
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
ncclResult_t build_mesh(ncclComm_t c, int lfd, const peer_addr_t *tab, const uint8_t tag[16]) {
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

ncclComm_t alloc_comm(int nranks, int rank) {
  ncclComm_t c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  c->magic = COMM_MAGIC; c->nranks = nranks; c->rank = rank; c->cudaDev = rank;
  c->fds = malloc(sizeof(int) * nranks);
  if (!c->fds) { free(c); return NULL; }
  for (int i = 0; i < nranks; i++) c->fds[i] = -1;
  return c;
}

ncclResult_t init_rank_impl(ncclComm_t *out, int nranks, const ncclUniqueId *id, int rank) {
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

/*
 * nccl_sim.h -- what the files of the simulated libnccl.so.2 share.
 *
 * The simulator is a host-memory, TCP-only stand-in for libnccl.so.2. It
 * exports a subset of the NCCL 2.32 public API with the exact x86-64 ABI
 * (own minimal declarations below, not nccl.h).  Like real NCCL every public
 * ncclX is a weak alias of a strong pncclX at the same address (the alias sits
 * beside its pncclX: an alias must be in the same file).  ncclBcast calls
 * ncclBroadcast and ncclCommInitAll calls ncclGetUniqueId through the PLT.
 *
 * Every outermost public call appends one JSON line of ground truth to the
 * file named by $NCCL_SIM_TRUTH (if set).  $NCCL_SIM_ADDR is this rank's
 * IPv4/IPv6 address (default 127.0.0.1).
 *
 * The files, by concern (exporter/simulator/build.py compiles them all into
 * one library with -fvisibility=hidden, so only EXPORT names are exported),
 * from the public entries down: a file calls only files below it, never
 * one above (tests/test_c_layout.py checks that from the object files):
 *   nccl_sim.h     the ABI, the communicator, shared declarations
 *   lifecycle.c    init, split, finalize, destroy, abort, queries
 *   nccl_2_28.c    the calls NCCL 2.28-2.32 added
 *   enqueue.c      the public collective, send/recv and group entries; groups
 *   bootstrap.c    sockets, unique id, the mesh
 *   gpu.c          GPU-like mode's streams: enqueued work run, kernel events (docs/simulator.md)
 *   collectives.c  the algorithms over p2p.c (exec_coll)
 *   p2p.c          the progress engine and the proxy thread
 *   netsteps.c     GPU-like mode's network steps on the proxy thread (ProxyOp/ProxyStep)
 *   profiler.c     GPU-like mode's switch and timer; the profiler plugin as NCCL drives it
 *                  (profiler.h: its interface, shared with gpu.c only)
 *   reduce.c       reductions over every data type
 *   truth.c        the ground-truth JSON lines
 */
#ifndef NCCL_SIM_H
#define NCCL_SIM_H

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
#include <sys/mman.h>
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

extern __thread int tl_depth;   /* public calls on this thread's stack (truth.c): only the outermost is recorded */

static inline uint64_t now_ns(clockid_t c) {
  struct timespec ts;
  clock_gettime(c, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline int env_int(const char *name, int dflt) {
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
  uint64_t kts[64], kte[64];/* NCCL_SIM_GPU_BCAST_DESYNC: start/stop of the last 64 kernels run (ring) */
  uint64_t nkern;           /*   kernels run, index into that ring */
  uint64_t desync;          /*   unprofiled Broadcasts run: how far the host's timer slots lag */
  int nshrinks;             /* ncclCommShrink calls made on this comm */
  uint64_t host_allreduces; /* host mode: AllReduce calls made on this comm (NCCL_SIM_LONG_COLLECTIVE) */
  void *last_kh[64];        /* NCCL_SIM_GPU_STALE_KCH: the KernelCh handle last used per channel */
};

static inline size_t dt_size(int dt) {
  switch (dt) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

static inline int comm_ok(ncclComm_t c) { return c != NULL && c->magic == COMM_MAGIC; }

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
  int unnumbered;           /* NCCL makes no Coll event and no seqNumber for it (gpu.c gpu_unnumbered) */
} collargs_t;


extern __thread int tl_gpu_seq_valid;   /* set by gpu_assign: the call's seq for the truth line */
extern __thread uint64_t tl_gpu_seq;

typedef struct {
  const char *fn, *op;
  uint64_t comm; int rank, nranks;
  size_t count; int datatype, red_op, root, peer;
  uint64_t stream;
  uint64_t t0m, t1m, t0r, t1r;
  int result;
  const char *extra; /* ",\"k\":v..." or NULL */
} rec_t;


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

/* one point-to-point transfer of a step (p2p.c) */
typedef struct {
  int peer; int is_send; char *buf; size_t len; size_t off;
  /* GPU-like mode's network steps (netsteps.c) only */
  size_t moved;             /* bytes of the current step moved */
  void *parent;             /* the Coll/P2p profiler handle (NULL: the stream thread's current op) */
  int okind; uint64_t oseq; /* the operation, for the per-step truth */
  /* host mode's framed ring steps (sendrecv in p2p.c) only: a receive that takes one
   * frame, its 8-byte length hdr then hdr bytes, and keeps the first len of them */
  int framed; uint64_t hdr; size_t hoff, fgot;
} p2p_t;

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


/* ---------------------------------------- shared between the files -- */
/* bootstrap.c */
int make_listener(peer_addr_t *pa);
void free_comm(ncclComm_t c);
ncclResult_t build_mesh(ncclComm_t c, int lfd, const peer_addr_t *tab, const uint8_t tag[16]);
ncclComm_t alloc_comm(int nranks, int rank);
ncclResult_t init_rank_impl(ncclComm_t *out, int nranks, const ncclUniqueId *id, int rank);
ncclResult_t get_unique_id_impl(ncclUniqueId *id);
/* collectives.c */
ncclResult_t exec_coll(const collargs_t *a);
/* A fault variable's value: NCCL_SIM_FAULTS_FILE's line NAME=..., else the environment's (netsteps.c). */
int sim_fault_value(const char *name, char *buf, size_t len);
ncclResult_t do_allgather(ncclComm_t c, const void *sb, void *rb, size_t count, int dt);
/* gpu.c */
uint64_t nccl_split_hash(uint64_t parent, uint32_t count, uint32_t color);
ncclResult_t gpu_drain(ncclComm_t c);
void gpu_comm_teardown(ncclComm_t c, int abort);
uint64_t nccl_root_hash(const ncclUniqueId *id);
ncclResult_t gpu_enqueue(collargs_t *q, int qn);
void gpu_assign(collargs_t *a);
int gpu_discards(const collargs_t *a);
/* profiler.c */
int gpu_on(void);
void gpu_comm_ready(ncclComm_t c);
int gpu_net_steps(void);
void gpu_net_op(p2p_t *o);
void *gpu_proxy_op_start(ncclComm_t c, void *parent, int pid, int ch, int peer, int nsteps, int chunk, int is_send);
void *gpu_proxy_step_start(ncclComm_t c, void *op, int step);
void gpu_proxy_record(void *h, int state, size_t trans_size);
void gpu_proxy_stop(void *h);
void *gpu_foreign_ctx(void);
void *gpu_proxy_op_start_ctx(ncclComm_t c, void *ctx, void *parent, int pid, int ch, int peer, int nsteps, int chunk,
                             int is_send);
void *gpu_proxy_step_start_ctx(ncclComm_t c, void *ctx, void *op, int step);
/* netsteps.c */
ncclResult_t net_progress(ncclComm_t c, p2p_t *ops, int n);
/* p2p.c */
ncclResult_t run_p2p(ncclComm_t c, p2p_t *ops, int n);
ncclResult_t sendrecv(ncclComm_t c, int to, const void *sb, size_t sl, int from, void *rb, size_t rl);
void proxy_stop(ncclComm_t c);
/* reduce.c */
int reducible(int dt, int op);
void reduce_into(void *dst, const void *src, size_t n, int dt, int op);
void divide_by(void *buf, size_t n, int dt, int k);
/* truth.c */
void truth_write(const rec_t *r);
void hexid(char out[2 * NCCL_UNIQUE_ID_BYTES + 1], const ncclUniqueId *id);

#endif /* NCCL_SIM_H */

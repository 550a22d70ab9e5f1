/* Probe-overhead driver: dlopen a libnccl.so.2, call ncclAllReduce N times in a
 * tight loop and print the time per call (CLOCK_MONOTONIC).
 *
 *   driver LIB N null   ncclAllReduce(..., comm=NULL, ...): a real NCCL (and the
 *                       simulator) return ncclInvalidArgument at once, no GPU needed
 *   driver LIB N comm   ncclGetUniqueId + ncclCommInitRank(nranks=1, rank=0) first,
 *                       then ncclAllReduce on that 1-rank communicator (simulator)
 *
 * Output, one line: "ns_per_call=F calls=N result=R elapsed_ns=E" (R: the result
 * of the last call). With DRIVER_WAIT set in the environment it prints "ready"
 * after the set-up and waits for a line on stdin before the timed loop.
 *
 * Built by bench/probe_overhead.py with: gcc -O2 -o driver driver.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int ncclResult_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef ncclResult_t (*allreduce_fn)(const void *, void *, size_t, int, int, void *, void *);
typedef ncclResult_t (*get_id_fn)(ncclUniqueId *);
typedef ncclResult_t (*init_rank_fn)(void **, int, ncclUniqueId, int);
typedef ncclResult_t (*destroy_fn)(void *);

#define NCCL_FLOAT32 7
#define NCCL_SUM 0

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void *need(void *h, const char *name) {
  void *f = dlsym(h, name);
  if (!f) {
    fprintf(stderr, "driver: %s not found: %s\n", name, dlerror());
    exit(2);
  }
  return f;
}

int main(int argc, char **argv) {
  if (argc != 4 || (strcmp(argv[3], "null") && strcmp(argv[3], "comm"))) {
    fprintf(stderr, "usage: %s LIB N null|comm\n", argv[0]);
    return 2;
  }
  long n = atol(argv[2]);
  if (n <= 0) {
    fprintf(stderr, "driver: N must be > 0\n");
    return 2;
  }
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "driver: dlopen %s: %s\n", argv[1], dlerror());
    return 2;
  }
  allreduce_fn allreduce = (allreduce_fn)need(h, "ncclAllReduce");
  void *comm = NULL;
  if (!strcmp(argv[3], "comm")) {
    get_id_fn get_id = (get_id_fn)need(h, "ncclGetUniqueId");
    init_rank_fn init_rank = (init_rank_fn)need(h, "ncclCommInitRank");
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    ncclResult_t r = get_id(&id);
    if (r != 0) { fprintf(stderr, "driver: ncclGetUniqueId -> %d\n", r); return 3; }
    r = init_rank(&comm, 1, id, 0);
    if (r != 0 || !comm) { fprintf(stderr, "driver: ncclCommInitRank(1 rank) -> %d\n", r); return 3; }
  }
  float buf[4] = {1, 2, 3, 4};
  /* One untimed call: page faults, lazy binding, first-call paths. */
  ncclResult_t res = allreduce(buf, buf, 4, NCCL_FLOAT32, NCCL_SUM, comm, NULL);
  if (getenv("DRIVER_WAIT")) {
    char line[16];
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof(line), stdin)) return 4;
  }
  uint64_t t0 = now_ns();
  for (long i = 0; i < n; i++)
    res = allreduce(buf, buf, 4, NCCL_FLOAT32, NCCL_SUM, comm, NULL);
  uint64_t t1 = now_ns();
  printf("ns_per_call=%.2f calls=%ld result=%d elapsed_ns=%llu\n",
         (double)(t1 - t0) / (double)n, n + 1, res, (unsigned long long)(t1 - t0));
  fflush(stdout);
  if (comm) {
    destroy_fn destroy = (destroy_fn)dlsym(h, "ncclCommDestroy");
    if (destroy) destroy(comm);
  }
  return 0;
}

/*
 * sim_harness.c -- the simulated libnccl.so.2 (exporter/simulator/nccl_sim)
 * driven from C instead of Python, for an architecture this host runs only
 * under emulation (tests/test_plugin_platforms.py: qemu-aarch64, where no
 * Python of that architecture exists).
 *
 * NRANKS threads of one process each join one communicator
 * (ncclGetUniqueId, ncclCommInitRank), run N AllReduces of COUNT floats,
 * wait for the communicator's stream (simStreamSynchronize: GPU-like mode)
 * and destroy it.  With NCCL_SIM_GPU=1 and NCCL_PROFILER_PLUGIN set, the
 * simulator loads the plugin and makes NCCL's callbacks (docs/simulator.md).
 * Every rank checks its AllReduce result (the sum of the ranks' values).
 *
 * Usage: sim_harness LIBNCCL NRANKS N [COUNT]; exit 0 and "ok ..." on stdout.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { char internal[128]; } ncclUniqueId; /* NCCL_UNIQUE_ID_BYTES */
typedef void *ncclComm_t;
enum { ncclFloat32 = 7, ncclSum = 0 };

static int (*GetUniqueId)(ncclUniqueId *);
static int (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
static int (*AllReduce)(const void *, void *, size_t, int, int, ncclComm_t, void *);
static int (*StreamSync)(ncclComm_t);
static int (*CommDestroy)(ncclComm_t);

static ncclUniqueId ID;
static int NRANKS, N;
static size_t COUNT = 1024;

static void *rank_main(void *arg) {
  int rank = (int)(long)arg;
  char stream[64]; /* an opaque "stream": host memory stands in for the GPU */
  float *send = malloc(COUNT * sizeof *send), *recv = malloc(COUNT * sizeof *recv);
  ncclComm_t comm;
  if (CommInitRank(&comm, NRANKS, ID, rank) != 0) {
    fprintf(stderr, "rank %d: ncclCommInitRank failed\n", rank);
    return (void *)1;
  }
  float want = (float)(NRANKS * (NRANKS + 1) / 2);
  for (int i = 0; i < N; i++) {
    for (size_t k = 0; k < COUNT; k++) send[k] = (float)(rank + 1);
    if (AllReduce(send, recv, COUNT, ncclFloat32, ncclSum, comm, stream) != 0 ||
        (StreamSync && StreamSync(comm) != 0)) {
      fprintf(stderr, "rank %d: AllReduce %d failed\n", rank, i);
      return (void *)1;
    }
    for (size_t k = 0; k < COUNT; k++)
      if (recv[k] != want) {
        fprintf(stderr, "rank %d: AllReduce %d: element %zu is %g, not %g\n", rank, i, k, recv[k], want);
        return (void *)1;
      }
  }
  if (CommDestroy(comm) != 0) return (void *)1;
  free(send);
  free(recv);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s LIBNCCL NRANKS N [COUNT]\n", argv[0]);
    return 2;
  }
  NRANKS = atoi(argv[2]);
  N = atoi(argv[3]);
  if (argc > 4) COUNT = (size_t)atol(argv[4]);
  void *dl = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!dl) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  GetUniqueId = (int (*)(ncclUniqueId *))dlsym(dl, "ncclGetUniqueId");
  CommInitRank = (int (*)(ncclComm_t *, int, ncclUniqueId, int))dlsym(dl, "ncclCommInitRank");
  AllReduce = (int (*)(const void *, void *, size_t, int, int, ncclComm_t, void *))dlsym(dl, "ncclAllReduce");
  StreamSync = (int (*)(ncclComm_t))dlsym(dl, "simStreamSynchronize");
  CommDestroy = (int (*)(ncclComm_t))dlsym(dl, "ncclCommDestroy");
  if (!GetUniqueId || !CommInitRank || !AllReduce || !CommDestroy || GetUniqueId(&ID) != 0) {
    fprintf(stderr, "%s: not a usable libnccl\n", argv[1]);
    return 1;
  }
  pthread_t t[64];
  if (NRANKS < 1 || NRANKS > 64) return 2;
  for (int r = 0; r < NRANKS; r++) pthread_create(&t[r], NULL, rank_main, (void *)(long)r);
  int bad = 0;
  for (int r = 0; r < NRANKS; r++) {
    void *rc;
    pthread_join(t[r], &rc);
    bad |= rc != NULL;
  }
  if (bad) return 1;
  printf("ok nranks=%d allreduces=%d count=%zu\n", NRANKS, N, COUNT);
  return 0;
}

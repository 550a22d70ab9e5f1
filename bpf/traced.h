// Shared by every BPF program of nccl-exporter: who is traced, the counters,
// and the per-thread NCCL call slot.
//
// Each program (bpf/nccl.c, bpf/tcp.c, bpf/sched.c) is compiled on its own by
// BCC (exporter/sources/bpf.py), after a generated header of constants from
// exporter/records/contract.py (OP_*, MAX_*, CNT_*, record kinds) and
// exporter/records/histogram.py (the histogram layouts). The maps below have
// one owner, bpf/nccl.c, which defines
// TRACED_OWNER before including this file and so exports them
// (BPF_TABLE_PUBLIC); the others import the same maps by name ("extern"
// tables, resolved by BCC in the agent's process when they are compiled).
// So nccl.c must be loaded first, and tcp.c and sched.c cannot be loaded
// without it: without the NCCL source no process is traced, and they would
// have nothing to report.

#ifndef NCCL_EXPORTER_TRACED_H
#define NCCL_EXPORTER_TRACED_H

#ifdef TRACED_OWNER
#define SHARED_TABLE(type, key, leaf, name, size) BPF_TABLE_PUBLIC(type, key, leaf, name, size)
#else
#define SHARED_TABLE(type, key, leaf, name, size) BPF_TABLE("extern", key, leaf, name, size)
#endif

// One outermost NCCL call in progress on a thread (bpf/nccl.c fills it;
// bpf/sched.c reads `op` and adds to `runq_wait_ns`).
struct call {
    u64 owner;       // inflight_fast: the thread id holding the slot (0: free)
    u64 start_ns;
    u64 comm;
    u64 comm_hash;
    u64 nccl_hash;
    u64 count;
    u64 stream;
    u64 out;         // ncclComm_t* / int* the call writes its result to
    u64 nested_out;  // ncclUniqueId* of an inner ncclGetUniqueId
    u64 seq;         // this rank's n-th call of this op on this comm (from 1)
    u64 nccl_seq;    // NCCL's seqNumber of this collective + 1, from the profiler
                     // plugin's record while the call runs (bpf/plugin.c); 0: none
    u64 aux;         // split: parent's split sequence number
    u64 sp;          // stack pointer at entry: stack arguments are read lazily
    // The communicator this thread used last, valid while comm_generation is
    // unchanged: most calls skip the communicators lookup. Kept across calls.
    u64 cached_comm;
    u64 cached_gen;
    u64 cached_hash;
    u64 cached_nccl_hash;
    s32 cached_rank;
    s32 cached_nranks;
    u32 stream_arg;  // 0: stream is in .stream; n: the n-th stack argument
    u32 series_by_op[OP_COUNT];  // series_stats slot + 1 per op, for cached_comm
    u64 runq_wait_ns;  // time this thread waited runnable during the call (bpf/sched.c)
    u64 proxy_wait_start;  // the process's proxy threads' total run-queue wait at entry
    s32 rank;
    s32 nranks;
    u32 op;
    u32 depth;       // inner public calls made by this one (not counted)
    s32 datatype;
    s32 red_op;
    s32 root;
    s32 peer;
    s32 color;
};

// Per thread that has called NCCL (op != 0: inside a call), until it exits:
// the slot of inflight_fast at the thread id's low bits, if the thread holds
// it (most do: an array read the verifier inlines, ~65 ns cheaper per call
// than the hash lookup on this VM), else its entry in `inflight`. User space
// reads both (exporter/sources/nccl/maps.py).
SHARED_TABLE("hash", u32, struct call, inflight, MAX_THREADS);
SHARED_TABLE("array", u32, struct call, inflight_fast, FAST_THREADS);
// Traced processes: those that use NCCL. Value: the process's rank (launcher
// RANK/SLURM_PROCID/..., else its world communicator rank; -1 unknown),
// written by user space; a process is added here by its first NCCL call too.
SHARED_TABLE("hash", u32, s32, traced_processes, MAX_PROCESSES);
// One bit per thread id of a traced process: the cheap test that lets the
// scheduler and socket probes return at once for everything else.
SHARED_TABLE("array", u32, u64, traced_threads, PID_WORDS);
// Cumulative run-queue wait (ns) of each traced process's NCCL proxy threads:
// added to by bpf/sched.c, read at NCCL call entry and return by bpf/nccl.c.
SHARED_TABLE("hash", u32, u64, proxy_wait, MAX_PROCESSES);
// Drops and losses, one slot per CNT_* (exporter/records/contract.py).
SHARED_TABLE("array", u32, u64, counters, CNT_SLOTS);

// The communicators the agent knows, per process and ncclComm_t pointer:
// filled by bpf/nccl.c when it sees one made, by user space for one first
// seen mid-job (a local id, docs/communicators.md), and by bpf/plugin.c from
// the profiler plugin's records (NCCL's own commHash, rank and size).
struct comm_key {
    u32 tgid;
    u32 pad;
    u64 comm;  // the ncclComm_t pointer value in that process
};

struct comm_info {
    u64 comm_hash;  // the agent's id of the communicator: input of its children's ids
    u64 nccl_hash;  // NCCL's commHash, the `comm` label; 0: unknown (a local id,
                    // a grown communicator, a split of a parent never seen made)
    u64 splits;     // ncclCommSplit calls made on this comm (child id input)
    u64 shrinks;    // ncclCommShrink / ncclCommGrow calls made on this comm (child id input)
    s32 rank;
    s32 nranks;
};

SHARED_TABLE("hash", struct comm_key, struct comm_info, communicators, MAX_COMMS);
// Bumped whenever a communicator or a launcher rank is learnt or forgotten:
// threads cache their communicator's identity until it changes.
SHARED_TABLE("array", u32, u64, comm_generation, 1);

static __always_inline void bump_generation(void) {
    u32 zero = 0;
    u64 *g = comm_generation.lookup(&zero);
    if (g)
        __sync_fetch_and_add(g, 1);
}

// The `comm` label of a communicator (docs/communicators.md): NCCL's commHash
// where known, which every agent computes alike from the unique id and the
// plugin reports, else the agent's own id (a local id, a grown communicator).
static __always_inline u64 comm_label(u64 comm_hash, u64 nccl_hash) {
    return nccl_hash ? nccl_hash : comm_hash;
}

// The inflight_fast slot for a thread id's low bits, whoever holds it.
static __always_inline struct call *fast_slot(u32 tid) {
    u32 i = tid & (FAST_THREADS - 1);
    return inflight_fast.lookup(&i);
}

// The call slot of a thread that has called NCCL, else NULL.
static __always_inline struct call *call_slot(u32 tid) {
    struct call *c = fast_slot(tid);
    if (c && c->owner == tid)
        return c;
    return inflight.lookup(&tid);
}

static __always_inline void count_up(u32 slot) {
    u64 *v = counters.lookup(&slot);
    if (v)
        __sync_fetch_and_add(v, 1);
}

static __always_inline int thread_traced(u32 tid) {
    u32 word = tid / 64;
    u64 *bits = traced_threads.lookup(&word);
    return bits && (*bits & (1ULL << (tid % 64)));
}

static __always_inline void set_thread_traced(u32 tid, int on) {
    u32 word = tid / 64;
    u64 *bits = traced_threads.lookup(&word);
    if (!bits)
        return;
    if (on)
        __sync_fetch_and_or(bits, 1ULL << (tid % 64));
    else
        __sync_fetch_and_and(bits, ~(1ULL << (tid % 64)));
}

// Fibonacci hashing of a kernel pointer (a task_struct or a sock, used as
// an identity, never dereferenced) to one of 2^bits array slots: slab
// objects are kilobytes apart, and the product's top bits spread them.
static __always_inline u32 pointer_slot(u64 p, u32 bits) {
    return (p * 0x9E3779B97F4A7C15ULL) >> (64 - bits);
}

// The duration histogram (host time in bpf/nccl.c, GPU time in bpf/plugin.c):
// schema-3 buckets, HIST_SLOTS per series (bpf/histogram.h; the layout is
// exporter/records/histogram.py's DURATION).
#include "histogram.h"

static __always_inline u32 bucket_of(u64 d) {
    return SCHEMA3_SLOT(HIST, d);
}

#endif

// NCCL call surface: uprobes on libnccl's public API, aggregated in the kernel.
//
// Loaded by exporter/sources/nccl/probes.py with BCC. Op codes (OP_*), map
// sizes (MAX_*), record kinds and the per-function entry stubs are generated
// from exporter/records/contract.py, so the names live in one place. This
// program owns the maps of bpf/traced.h that bpf/tcp.c and bpf/sched.c share.
//
// Per call, nothing crosses to user space: the return probe folds the call
// into `series_stats` (count, bytes, latency histogram). Only rare
// lifecycle calls, and calls the user asked for (slow ones, or every call
// while recording), are sent as events on the `events` ring buffer.

#include <uapi/linux/ptrace.h>

#define TRACED_OWNER  // this program owns the maps shared in traced.h
#include "traced.h"

// The duration histogram's layout (HIST_*, bucket_of) is in bpf/traced.h.

// Series capacity: `run --series-capacity N` (-DSERIES_CAPACITY=N from
// exporter/sources/nccl/probes.py). Slots SERIES_CAPACITY + op of
// series_stats are fixed: for a collective op, its overflow series, where
// calls go when series_index is full (user space reads it as comm_hash
// SERIES_OVERFLOW_COMM: comm="overflow"); for a lifecycle op, its one series.
#ifndef SERIES_CAPACITY
#define SERIES_CAPACITY MAX_SERIES
#endif
#define SERIES_SLOTS (SERIES_CAPACITY + OP_COUNT)

#define NCCL_SUCCESS 0
#define NCCL_IN_PROGRESS 7
#define MAX_INIT_ALL 16

struct series_key {
    u64 comm_hash;  // 0: communicator unknown to the agent
    s32 rank;       // -1: unknown
    s32 nranks;     // -1: unknown
    u32 op;
    u32 pid;        // the calling process when rank is unknown (else 0): such
                    // series are never merged across processes
};

struct series_stats {
    // The series this slot holds (all zero: free). A thread's cached slot is
    // used only while this still matches: user space recycles slots.
    struct series_key key;
    u64 calls;
    u64 bytes;
    u64 sum_ns;
    u64 last_ns;    // CLOCK_MONOTONIC of the latest return counted here (`hang`,
                    // nccl_collective_last_return_timestamp_seconds)
    u64 next_seq;   // NCCL's seqNumber + 1 of the latest call the plugin numbered (0:
                    // none): an agent that attached mid-job counts from NCCL's numbers
    u64 buckets[HIST_SLOTS];
};

struct error_key {
    u32 op;
    s32 result;
};

// The last ncclCommGetAsyncError result of a communicator (docs/metrics.md,
// "NCCL 2.28–2.32 calls"). The
// watchdog of PyTorch polls it many times a second: each poll only updates
// this entry (no event); user space exports the result and the poll count.
struct async_state {
    u64 comm_hash;   // the communicator's `comm` label at the last poll (0: unknown)
    u64 nccl_hash;
    s32 rank;
    s32 nranks;
    s32 result;      // *asyncError of the last successful poll (ncclResult_t)
    u32 pad;
    u64 polls;       // successful polls
    u64 changes;     // times the result changed
    u64 changed_ns;  // CLOCK_MONOTONIC of the last change (first poll: its time)
    u64 last_ns;     // CLOCK_MONOTONIC of the last poll
};

// Inputs of the ids of communicators made by ncclCommShrink / ncclCommGrow
// (exporter/sources/nccl/hashing.py shrink_agent_comm_hash, grow_agent_comm_hash).
#define SHRINK_TAG 0x5348524E4B434F4DULL  // "SHRNKCOM"
#define GROW_TAG 0x47524F57434F4D4DULL    // "GROWCOMM"
#define MAX_SHRINK_EXCLUDE 64             // excludeRanksList entries read (more: new rank unknown)

struct event {
    u64 start_ns;    // CLOCK_MONOTONIC
    u64 end_ns;
    u64 comm;
    u64 comm_hash;
    u64 nccl_hash;
    u64 count;
    u64 bytes;
    u64 stream;
    u64 seq;
    u32 kind;
    u32 pid;
    u32 tid;
    u32 op;
    s32 rank;
    s32 nranks;
    s32 datatype;
    s32 red_op;
    s32 root;
    s32 peer;
    s32 result;
    s32 color;
    u64 runq_wait_ns;  // the calling thread's run-queue wait during the call
    u64 proxy_wait_ns;  // the same process's NCCL proxy threads' wait during it
};

// Series live in an array (a lookup the verifier inlines); the hash only maps
// a series' labels to its slot, and each thread caches that slot per op.
// Free slots wait in `series_free` (filled by user space at load; a slot
// goes back when the agent's loop expires its series, see
// exporter/sources/nccl/maps.py expire_series): popping is atomic.
BPF_HASH(series_index, struct series_key, u32, SERIES_CAPACITY);
BPF_ARRAY(series_stats, struct series_stats, SERIES_SLOTS);
BPF_QUEUE(series_free, u32, SERIES_CAPACITY);
// Relative slow-call threshold per series (k x its recent p50), written by
// user space; 0: use the op's absolute threshold in event_config.
BPF_ARRAY(series_threshold, u64, SERIES_SLOTS);
// Failed calls by (op, result): NCCL's results in an array (an inlined read
// on the error path, ~65 ns cheaper than the hash), any other value in the hash.
BPF_ARRAY(call_errors_fast, u64, OP_COUNT * ERROR_RESULTS);
BPF_HASH(call_errors, struct error_key, u64, MAX_ERRORS);
// (process, communicator pointer) -> its async error state (ncclCommGetAsyncError).
BPF_HASH(async_errors, struct comm_key, struct async_state, MAX_COMMS);
// Traced processes that exited, until the agent's loop reads them
// (exporter/sources/nccl/exits.py): when, and the signal that ended it (0:
// none, an exit). The signal is the first fatal one delivered to the
// process (`fatal_signals`), read from the signal_deliver tracepoint, whose
// fields the kernel describes at load: no kernel struct layout is assumed.
struct process_exit {
    u64 ktime_ns;
    u32 code;
    u32 pad;
};
BPF_HASH(process_exits, u32, struct process_exit, MAX_PROCESSES);
BPF_HASH(fatal_signals, u32, u32, MAX_PROCESSES);
// Per-op slow-call threshold in ns (0: off); index OP_COUNT: 1 = every call.
BPF_ARRAY(event_config, u64, OP_COUNT + 1);
// All zeros, never written: a new thread's slot (too big for the stack).
BPF_ARRAY(empty_call, struct call, 1);
BPF_RINGBUF_OUTPUT(events, EVENT_PAGES);
// Scratch for the 128-byte ncclUniqueId (too big for the BPF stack next to a call).
struct unique_id { u64 words[16]; };
BPF_PERCPU_ARRAY(uid_scratch, struct unique_id, 1);

static __always_inline u32 datatype_size(s32 dt) {
    switch (dt) {
    case 0: case 1: case 10: case 11: return 1;  // int8 uint8 fp8e4m3 fp8e5m2
    case 6: case 9: return 2;                    // float16 bfloat16
    case 2: case 3: case 7: return 4;            // int32 uint32 float32
    case 4: case 5: case 8: return 8;            // int64 uint64 float64
    }
    return 0;
}

static __always_inline u64 splitmix64(u64 x) {
    u64 z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// NCCL's own hash (eatHash/digestHash of NCCL >= 2.23, exporter/hashing.py):
// a two-word state; eating n bytes xors n into a0, then runs one round per
// 8-byte little-endian chunk.
static __always_inline void nccl_eat_round(u64 *a0, u64 *a1, u64 chunk) {
    *a0 += *a1;
    *a1 ^= *a0;
    *a0 = (*a0 ^ (*a0 >> 31)) * 0x9DE62BBC8CEF3CE3ULL;
    *a1 = (*a1 ^ (*a1 >> 32)) * 0x485CD6311B599E79ULL;
    *a0 += chunk;
}

static __always_inline u64 nccl_digest(u64 a0, u64 a1) {
    u64 h = (a0 ^ (a0 >> 31)) * 0xBAC3BD562846DE6BULL;
    h += a1;
    return (h ^ (h >> 32)) * 0x995A187A14E7B445ULL;
}

// NCCL's commHash of a split child: eat the parent's commHash (8 bytes), the
// parent's split counter after this split (int) and the color (int).
static __always_inline u64 nccl_split_hash(u64 parent, u32 count, u32 color) {
    u64 a0 = 1 ^ 8, a1 = 1;
    nccl_eat_round(&a0, &a1, parent);
    a0 ^= 4;
    nccl_eat_round(&a0, &a1, count);
    a0 ^= 4;
    nccl_eat_round(&a0, &a1, color);
    return nccl_digest(a0, a1);
}

// Hash a ncclUniqueId at user address `uid` into c->comm_hash / c->nccl_hash
// (see exporter/hashing.py for the definitions).
static __always_inline void hash_unique_id(struct call *c, const void *uid) {
    u32 zero = 0;
    struct unique_id *id = uid_scratch.lookup(&zero);
    if (!id || bpf_probe_read_user(id, sizeof(*id), uid) != 0)
        return;
    u64 *w = id->words;
    u64 h = 0;
    u64 a0 = 1 ^ 128, a1 = 1;  // NCCL: getHash(id, 128)
    #pragma unroll
    for (int i = 0; i < 16; i++) {
        h = splitmix64(h ^ w[i]);
        nccl_eat_round(&a0, &a1, w[i]);
    }
    c->comm_hash = h;
    c->nccl_hash = nccl_digest(a0, a1);
}

// Stack argument n (1-based) at a uprobe on the first instruction: [sp] holds
// the return address, so the 7th integer argument is at sp+8, the 8th at sp+16.
static __always_inline u64 stack_arg_at(u64 sp, int n) {
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(sp + 8 * n));
    return v;
}

static __always_inline u64 stack_arg(struct pt_regs *ctx, int n) {
    return stack_arg_at(PT_REGS_SP(ctx), n);
}

// Cumulative run-queue wait of a process's proxy threads (ns), kept by
// bpf/sched.c: snapshot at a call's entry and return; the difference is what
// the proxies waited during the call (see docs/sched.md). 0 without sched.c.
static __always_inline u64 proxy_wait_ns(u32 tgid) {
    u64 *w = proxy_wait.lookup(&tgid);
    return w ? *w : 0;
}

// Lifecycle calls sent as events on every return (init, split, destroy, ...);
// the frequent ones (group, count/user rank, async-error polls, registration)
// are events only when recording or slow.
static __always_inline int is_rare_lifecycle(u32 op) {
    return (op >= OP_GET_UNIQUE_ID && op <= OP_COMM_ABORT) ||
           (op >= OP_COMM_SHRINK && op <= OP_COMM_RESUME);
}

// Does this call's return look at the event path (slow-call or record-all)?
static __always_inline int events_wanted(u32 op) {
    u32 all = OP_COUNT;
    u64 *record_all = event_config.lookup(&all);
    u64 *threshold = event_config.lookup(&op);
    return (record_all && *record_all) || (threshold && *threshold) || is_rare_lifecycle(op);
}

// Whether a call entering now is made from inside the thread's call in slot c
// (NCCL calling its own public API: an inner ncclGetUniqueId, say). Such a call
// enters with a lower stack pointer than the outer one did (the stack grows
// down). One at or above it is a new outermost call: the slot's call ended
// without its return probe firing (it entered while only the entry probe was
// attached, or it was left by longjmp). Without this test every later call of
// the thread would count as nested and none be seen again.
static __always_inline bool nested_in(struct pt_regs *ctx, struct call *c) {
    return c->op && PT_REGS_SP(ctx) < c->sp;
}

// Start tracking a call on this thread. Returns 0 when the call is nested in
// another public NCCL call of the same thread: it only deepens the outer one.
// A thread's slot is made at its first NCCL call and reused (op == 0: idle)
// until the thread exits: no map insert or delete on the per-call path.
static __always_inline struct call *begin(struct pt_regs *ctx, u32 op, u32 *tid_out) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    *tid_out = tid;
    struct call *c = call_slot(tid);
    if (!c) {
        // The thread's first call: its inflight_fast slot if free (taken
        // atomically: two new threads may share the low bits), else a hash entry.
        c = fast_slot(tid);
        if (c && __sync_val_compare_and_swap(&c->owner, 0, (u64)tid) == 0) {
            c->op = 0;  // a slot freed at a thread's exit keeps its old fields
            c->depth = 0;
        } else {
            u32 zero = 0;
            struct call *idle = empty_call.lookup(&zero);
            if (!idle || inflight.insert(&tid, idle) != 0) {
                count_up(CNT_INFLIGHT_FULL);
                return 0;
            }
            c = inflight.lookup(&tid);
            if (!c)
                return 0;
        }
        c->cached_gen = ~0ULL;  // nothing cached yet
        // The first NCCL call of a thread: its process is traced from now on.
        u32 tgid = bpf_get_current_pid_tgid() >> 32;
        s32 unknown = -1;
        traced_processes.insert(&tgid, &unknown);
        set_thread_traced(tid, 1);
    } else if (c->op) {
        if (nested_in(ctx, c)) {
            c->depth++;
            return 0;
        }
        count_up(CNT_RETURNS_MISSED);  // the slot's call ended unseen: this one replaces it
    }
    c->depth = 0;
    c->sp = PT_REGS_SP(ctx);  // at entry: the return address (stack arguments are read from here)
    c->start_ns = 0;  // set last by the caller, after the argument work
    c->comm = 0;
    c->comm_hash = 0;
    c->nccl_hash = 0;
    c->count = 0;
    c->stream = 0;
    c->out = 0;
    c->nested_out = 0;
    c->seq = 0;
    c->nccl_seq = 0;
    c->aux = 0;
    c->stream_arg = 0;
    c->runq_wait_ns = 0;
    // Only calls that may become events pay for this lookup (spans, recording).
    c->proxy_wait_start = events_wanted(op) ? proxy_wait_ns(bpf_get_current_pid_tgid() >> 32) : 0;
    c->rank = -1;
    c->nranks = -1;
    c->depth = 0;
    c->datatype = -1;
    c->red_op = -1;
    c->root = -1;
    c->peer = -1;
    c->color = -1;
    c->op = op;
    return c;
}

// Attach the communicator's identity to a call, from the thread's cache when
// nothing changed since it last looked this communicator up.
static __always_inline void resolve_comm(struct call *c, u64 comm) {
    u32 zero = 0;
    u64 *gen = comm_generation.lookup(&zero);
    u64 g = gen ? *gen : 0;
    c->comm = comm;
    if (comm != c->cached_comm || g != c->cached_gen) {
        u32 tgid = bpf_get_current_pid_tgid() >> 32;
        struct comm_key k = {.tgid = tgid, .comm = comm};
        struct comm_info *info = communicators.lookup(&k);
        c->cached_comm = comm;
        c->cached_gen = g;
        #pragma unroll
        for (int i = 0; i < OP_COUNT; i++)
            c->series_by_op[i] = 0;
        if (info) {
            c->cached_hash = info->comm_hash;
            c->cached_nccl_hash = info->nccl_hash;
            c->cached_rank = info->rank;
            c->cached_nranks = info->nranks;
        } else {
            s32 *launcher_rank = traced_processes.lookup(&tgid);
            c->cached_hash = 0;
            c->cached_nccl_hash = 0;
            c->cached_rank = launcher_rank ? *launcher_rank : -1;
            c->cached_nranks = -1;
        }
    }
    c->comm_hash = c->cached_hash;
    c->nccl_hash = c->cached_nccl_hash;
    c->rank = c->cached_rank;
    c->nranks = c->cached_nranks;
}

static __always_inline int collective(struct pt_regs *ctx, u32 op, u64 count, s32 dt,
                                      s32 red_op, s32 root, s32 peer, u64 comm,
                                      u64 stream, u32 stream_arg) {
    u32 tid;
    struct call *c = begin(ctx, op, &tid);
    if (!c)
        return 0;
    c->count = count;
    c->datatype = dt;
    c->red_op = red_op;
    c->root = root;
    c->peer = peer;
    c->stream = stream;
    c->stream_arg = stream_arg;
    resolve_comm(c, comm);
    c->start_ns = bpf_ktime_get_ns();  // last, so map work is not timed
    return 0;
}

// ---- Entry decoders, one per signature shape (x86-64 System V) --------------
// Integer arguments: rdi rsi rdx rcx r8 r9 (PARM1..6), then the stack.

// ncclAllReduce / ncclReduceScatter (+Config):
//   (sendbuff, recvbuff, count, datatype, op, comm, stream[, config])
static __always_inline int enter_reduce_like(struct pt_regs *ctx, u32 op) {
    return collective(ctx, op, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx),
                      -1, -1, PT_REGS_PARM6(ctx), 0, 1);
}

// ncclAllGather / ncclAlltoAll (+Config):
//   (sendbuff, recvbuff, count, datatype, comm, stream[, config])
static __always_inline int enter_gather_like(struct pt_regs *ctx, u32 op) {
    return collective(ctx, op, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), -1, -1, -1,
                      PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx), 0);
}

// ncclBroadcast / ncclGather / ncclScatter (+Config):
//   (sendbuff, recvbuff, count, datatype, root, comm, stream[, config])
static __always_inline int enter_rooted(struct pt_regs *ctx, u32 op) {
    return collective(ctx, op, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), -1,
                      PT_REGS_PARM5(ctx), -1, PT_REGS_PARM6(ctx), 0, 1);
}

// ncclReduce (+Config): (sendbuff, recvbuff, count, datatype, op, root, comm, stream[, config])
// comm and stream are the 7th and 8th arguments: on the stack.
static __always_inline int enter_reduce(struct pt_regs *ctx, u32 op) {
    return collective(ctx, op, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx),
                      PT_REGS_PARM6(ctx), -1, stack_arg(ctx, 1), 0, 2);
}

// ncclBcast: (buff, count, datatype, root, comm, stream)
static __always_inline int enter_bcast(struct pt_regs *ctx, u32 op) {
    return collective(ctx, op, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), -1,
                      PT_REGS_PARM4(ctx), -1, PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx), 0);
}

// ncclSend / ncclRecv: (buff, count, datatype, peer, comm, stream)
static __always_inline int enter_p2p(struct pt_regs *ctx, u32 op) {
    return collective(ctx, op, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), -1, -1,
                      PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx), 0);
}

// ncclGetUniqueId(ncclUniqueId* out)
static __always_inline int enter_get_unique_id(struct pt_regs *ctx, u32 op) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct call *outer = call_slot(tid);
    if (outer && nested_in(ctx, outer)) {
        // Inside ncclCommInitAll: remember where the id it makes will be.
        outer->depth++;
        if (outer->op == OP_COMM_INIT_ALL)
            outer->nested_out = PT_REGS_PARM1(ctx);
        return 0;
    }
    struct call *c = begin(ctx, op, &tid);
    if (!c)
        return 0;
    c->out = PT_REGS_PARM1(ctx);
    c->start_ns = bpf_ktime_get_ns();
    return 0;
}

// ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank)
// ncclCommInitRankConfig(..., int rank, ncclConfig_t* config)
// The 128-byte commId is a MEMORY-class argument: it is copied onto the
// stack at sp+8 and takes no register, so `rank` arrives in rdx.
static __always_inline int enter_init_rank(struct pt_regs *ctx, u32 op) {
    u32 tid;
    struct call *c = begin(ctx, op, &tid);
    if (!c)
        return 0;
    c->out = PT_REGS_PARM1(ctx);
    c->nranks = PT_REGS_PARM2(ctx);
    c->rank = PT_REGS_PARM3(ctx);
    hash_unique_id(c, (void *)(PT_REGS_SP(ctx) + 8));
    c->start_ns = bpf_ktime_get_ns();
    return 0;
}

// ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist)
static __always_inline int enter_init_all(struct pt_regs *ctx, u32 op) {
    u32 tid;
    struct call *c = begin(ctx, op, &tid);
    if (!c)
        return 0;
    c->out = PT_REGS_PARM1(ctx);
    c->nranks = PT_REGS_PARM2(ctx);
    c->start_ns = bpf_ktime_get_ns();
    return 0;
}

// ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank,
//                          int nId, ncclUniqueId* commIds, ncclConfig_t* config)
static __always_inline int enter_init_scalable(struct pt_regs *ctx, u32 op) {
    u32 tid;
    struct call *c = begin(ctx, op, &tid);
    if (!c)
        return 0;
    c->out = PT_REGS_PARM1(ctx);
    c->nranks = PT_REGS_PARM2(ctx);
    c->rank = PT_REGS_PARM3(ctx);
    hash_unique_id(c, (void *)PT_REGS_PARM5(ctx));  // the first of nId ids
    c->start_ns = bpf_ktime_get_ns();
    return 0;
}

// A child communicator is being made from `parent` (ncclCommSplit, Shrink,
// Grow): the call carries the parent's identity until its return, and the
// parent's count of such children numbers this one (`splits` for Split,
// `shrinks` for Shrink and Grow; children of one parent are made
// collectively, never concurrently). NULL when the parent is unknown.
static __always_inline struct comm_info *from_parent(struct call *c, u64 parent, int split) {
    struct comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32, .comm = parent};
    c->comm = parent;
    struct comm_info *info = communicators.lookup(&k);
    if (!info)
        return 0;
    c->comm_hash = info->comm_hash;
    c->nccl_hash = info->nccl_hash;
    c->rank = info->rank;
    c->nranks = info->nranks;
    if (split) {
        c->aux = info->splits;
        info->splits++;
    } else {
        c->aux = info->shrinks;
        info->shrinks++;
    }
    return info;
}

// ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config)
static __always_inline int enter_split(struct pt_regs *ctx, u32 op) {
    u32 tid;
    struct call *c = begin(ctx, op, &tid);
    if (!c)
        return 0;
    c->color = PT_REGS_PARM2(ctx);
    c->out = PT_REGS_PARM4(ctx);
    from_parent(c, PT_REGS_PARM1(ctx), 1);
    c->start_ns = bpf_ktime_get_ns();
    return 0;
}

// ncclCommFinalize / ncclCommDestroy / ncclCommAbort(ncclComm_t comm)
static __always_inline int enter_comm_only(struct pt_regs *ctx, u32 op) {
    u32 tid;
    struct call *c = begin(ctx, op, &tid);
    if (!c)
        return 0;
    resolve_comm(c, PT_REGS_PARM1(ctx));
    c->start_ns = bpf_ktime_get_ns();
    return 0;
}

// ncclCommCount / ncclCommUserRank(const ncclComm_t comm, int* out)
static __always_inline int enter_comm_query(struct pt_regs *ctx, u32 op) {
    u32 tid;
    struct call *c = begin(ctx, op, &tid);
    if (!c)
        return 0;
    resolve_comm(c, PT_REGS_PARM1(ctx));  // its event names the communicator asked about
    c->out = PT_REGS_PARM2(ctx);
    c->start_ns = bpf_ktime_get_ns();
    return 0;
}

// ncclGroupStart / ncclGroupEnd (void)
static __always_inline int enter_no_args(struct pt_regs *ctx, u32 op) {
    u32 tid;
    struct call *c = begin(ctx, op, &tid);
    if (!c)
        return 0;
    c->start_ns = bpf_ktime_get_ns();
    return 0;
}

// ncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
//                ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags)
// The child's rank is known here: the parent rank minus the excluded ranks
// below it (NCCL fills the gaps in order). Kept in root/peer until the return.
static __always_inline int enter_shrink(struct pt_regs *ctx, u32 op) {
    u32 tid;
    struct call *c = begin(ctx, op, &tid);
    if (!c)
        return 0;
    u64 list = PT_REGS_PARM2(ctx);
    s32 excluded = PT_REGS_PARM3(ctx);
    c->out = PT_REGS_PARM4(ctx);
    c->count = excluded > 0 ? excluded : 0;
    from_parent(c, PT_REGS_PARM1(ctx), 0);
    s32 below = 0, out = 0, known = excluded >= 0 && excluded <= MAX_SHRINK_EXCLUDE;
    #pragma unroll
    for (int i = 0; i < MAX_SHRINK_EXCLUDE; i++) {
        if (i >= excluded || !known)
            break;
        s32 r = 0;
        if (bpf_probe_read_user(&r, sizeof(r), (void *)(list + 4 * i)) != 0) {
            known = 0;
            break;
        }
        if (r < c->rank)
            below++;
        else if (r == c->rank)
            out = 1;
    }
    c->root = (known && !out && c->rank >= 0) ? c->rank - below : -1;  // the child's rank
    c->peer = (known && c->nranks > 0) ? c->nranks - excluded : -1;   // the child's size
    c->start_ns = bpf_ktime_get_ns();
    return 0;
}

// ncclCommGrow(ncclComm_t comm, int nRanks, const ncclUniqueId* uniqueId, int rank,
//              ncclComm_t* newcomm, ncclConfig_t* config)
// Existing ranks: comm, rank -1 (uniqueId only on the root); new ranks: comm
// NULL, the id and their rank.
static __always_inline int enter_grow(struct pt_regs *ctx, u32 op) {
    u32 tid;
    struct call *c = begin(ctx, op, &tid);
    if (!c)
        return 0;
    u64 parent = PT_REGS_PARM1(ctx);
    s32 rank = PT_REGS_PARM4(ctx);
    c->comm = parent;
    c->out = PT_REGS_PARM5(ctx);
    c->peer = PT_REGS_PARM2(ctx);  // the child's size, until the return
    c->root = rank;
    if (parent) {
        struct comm_info *info = from_parent(c, parent, 0);
        if (info && rank < 0)
            c->root = info->rank;  // an existing rank keeps its rank
    } else if (PT_REGS_PARM3(ctx)) {
        hash_unique_id(c, (void *)PT_REGS_PARM3(ctx));
        c->aux = ~0ULL;  // the id names the child
    }
    c->start_ns = bpf_ktime_get_ns();
    return 0;
}

// ncclPutSignal(localbuff, count, datatype, peer, peerWin, peerWinOffset,
//               sigIdx, ctx, flags, comm, stream): comm and stream are the
// 10th and 11th arguments (stack arguments 4 and 5).
static __always_inline int enter_put_signal(struct pt_regs *ctx, u32 op) {
    return collective(ctx, op, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), -1, -1,
                      PT_REGS_PARM4(ctx), stack_arg(ctx, 4), 0, 5);
}

// ncclSignal(int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream)
static __always_inline int enter_signal(struct pt_regs *ctx, u32 op) {
    return collective(ctx, op, 0, -1, -1, -1, PT_REGS_PARM1(ctx), PT_REGS_PARM5(ctx),
                      PT_REGS_PARM6(ctx), 0);
}

// ncclWaitSignal(int nDesc, ncclWaitSignalDesc_t* signalDescs, ncclComm_t comm, cudaStream_t stream)
// count = nDesc (no datatype: no bytes).
static __always_inline int enter_wait_signal(struct pt_regs *ctx, u32 op) {
    return collective(ctx, op, (u32)PT_REGS_PARM1(ctx), -1, -1, -1, -1, PT_REGS_PARM3(ctx),
                      PT_REGS_PARM4(ctx), 0);
}

// ---- Return: communicator bookkeeping ---------------------------------------

static __always_inline void remember_comm(u64 comm, u64 hash, u64 nccl_hash,
                                          s32 rank, s32 nranks) {
    if (!comm)
        return;
    struct comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32, .comm = comm};
    struct comm_info info = {.comm_hash = hash, .nccl_hash = nccl_hash,
                             .rank = rank, .nranks = nranks};
    if (communicators.update(&k, &info) != 0)
        count_up(CNT_COMMS_FULL);
    async_errors.delete(&k);  // a new communicator at a reused address: no stale state
    bump_generation();
}

static __always_inline u64 read_user_u64(u64 addr) {
    u64 v = 0;
    if (addr)
        bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

// ncclCommGetAsyncError returned ncclSuccess: keep *asyncError per communicator.
static __always_inline void async_update(struct call *c) {
    s32 v = 0;
    if (!c->out || bpf_probe_read_user(&v, sizeof(v), (void *)c->out) != 0)
        return;
    u64 now = bpf_ktime_get_ns();
    struct comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32, .comm = c->comm};
    struct async_state *st = async_errors.lookup(&k);
    if (!st) {
        struct async_state fresh = {.comm_hash = comm_label(c->comm_hash, c->nccl_hash), .nccl_hash = c->nccl_hash,
                                    .rank = c->rank, .nranks = c->nranks, .result = v,
                                    .polls = 1, .changed_ns = now, .last_ns = now};
        if (async_errors.insert(&k, &fresh) != 0) {
            st = async_errors.lookup(&k);  // another thread of the process polled first
            if (!st) {
                count_up(CNT_ASYNC_FULL);
                return;
            }
        } else {
            return;
        }
    }
    __sync_fetch_and_add(&st->polls, 1);
    if (st->result != v) {
        st->result = v;
        st->changes++;
        st->changed_ns = now;
    }
    st->last_ns = now;
    st->comm_hash = comm_label(c->comm_hash, c->nccl_hash);  // learnt since (a split child's rank, ...)
    st->nccl_hash = c->nccl_hash;
    st->rank = c->rank;
    st->nranks = c->nranks;
}

// ncclCommShrink / ncclCommGrow returned: name the child (equal on every rank).
static __always_inline void shrink_grow_return(struct call *c, s32 result) {
    s32 child_rank = c->root, child_nranks = c->peer;
    c->root = -1;
    c->peer = -1;
    if (result != NCCL_SUCCESS && result != NCCL_IN_PROGRESS)
        return;
    u64 child = read_user_u64(c->out);
    if (c->op == OP_COMM_SHRINK) {
        if (!c->comm_hash)
            return;
        // Same as exporter/sources/nccl/hashing.py shrink_agent_comm_hash().
        c->comm_hash = splitmix64(splitmix64(c->comm_hash ^ SHRINK_TAG) ^ (c->aux << 32));
        // NCCL names a shrink child as a split with count 0 and color 0.
        c->nccl_hash = c->nccl_hash ? nccl_split_hash(c->nccl_hash, 0, 0) : 0;
    } else if (c->aux != ~0ULL) {  // grow, an existing rank: from the parent
        if (!c->comm_hash)
            return;
        c->comm_hash = splitmix64(splitmix64(c->comm_hash ^ GROW_TAG) ^ (c->aux << 32));
        c->nccl_hash = 0;  // NCCL's derivation for grow is not reproduced
    } else {  // grow, a new rank: the id it was given
        if (!c->comm_hash)
            return;
        c->comm_hash = splitmix64(c->comm_hash ^ GROW_TAG);
        c->nccl_hash = 0;
    }
    c->comm = child;
    c->rank = child_rank;
    c->nranks = child_nranks;
    remember_comm(child, c->comm_hash, c->nccl_hash, child_rank, child_nranks);
}

static __always_inline void lifecycle_return(struct call *c, s32 result) {
    u32 op = c->op;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (op == OP_COMM_INIT_RANK || op == OP_COMM_INIT_RANK_CONFIG ||
        op == OP_COMM_INIT_RANK_SCALABLE) {
        if (result != NCCL_SUCCESS && result != NCCL_IN_PROGRESS)
            return;
        c->comm = read_user_u64(c->out);
        remember_comm(c->comm, c->comm_hash, c->nccl_hash, c->rank, c->nranks);
    } else if (op == OP_COMM_INIT_ALL) {
        if (result != NCCL_SUCCESS)
            return;
        #pragma unroll
        for (int i = 0; i < MAX_INIT_ALL; i++) {
            if (i >= c->nranks)
                break;
            u64 comm = read_user_u64(c->out + 8 * i);
            if (i == 0)
                c->comm = comm;
            remember_comm(comm, c->comm_hash, c->nccl_hash, i, c->nranks);
        }
    } else if (op == OP_COMM_SPLIT) {
        if (result != NCCL_SUCCESS || !c->comm_hash)
            return;
        u64 child = read_user_u64(c->out);
        // Same derivation as exporter/hashing.py split_agent_comm_hash().
        u64 mixed = splitmix64(c->comm_hash ^ SPLIT_TAG);
        c->comm_hash = splitmix64(mixed ^ (((c->aux & 0xFFFFFFFFULL) << 32) |
                                           ((u64)(u32)c->color)));
        // NCCL counts splits on the parent from 1 (aux counts from 0). A parent
        // the agent did not see made (named from the profiler plugin: its own
        // id is NCCL's hash) may have been split before: the count is unknown,
        // and so is the child's hash until the plugin names the child too.
        int counted = c->nccl_hash && c->comm_hash != c->nccl_hash;
        c->nccl_hash = counted ? nccl_split_hash(c->nccl_hash, c->aux + 1, c->color) : 0;
        c->comm = child;
        c->rank = -1;  // the child's rank and size depend on every rank's key:
        c->nranks = -1;  // learnt when the program asks (ncclCommUserRank/Count)
        remember_comm(child, c->comm_hash, c->nccl_hash, -1, -1);
    } else if (op == OP_COMM_DESTROY || op == OP_COMM_ABORT) {
        struct comm_key k = {.tgid = tgid, .comm = c->comm};
        communicators.delete(&k);
        if (op == OP_COMM_DESTROY)  // an aborted one keeps its error until its process exits
            async_errors.delete(&k);
        bump_generation();
    } else if (op == OP_COMM_COUNT || op == OP_COMM_USER_RANK) {
        if (result != NCCL_SUCCESS)
            return;
        s32 v = 0;
        if (bpf_probe_read_user(&v, sizeof(v), (void *)c->out) != 0)
            return;
        struct comm_key k = {.tgid = tgid, .comm = c->comm};
        struct comm_info *info = communicators.lookup(&k);
        if (!info)
            return;
        if (op == OP_COMM_COUNT)
            info->nranks = v;
        else
            info->rank = v;
        bump_generation();
    } else if (op == OP_GET_UNIQUE_ID) {
        if (result == NCCL_SUCCESS)
            hash_unique_id(c, (void *)c->out);
    } else if (op == OP_COMM_GET_ASYNC_ERROR) {
        if (result == NCCL_SUCCESS)
            async_update(c);
    } else if (op == OP_COMM_SHRINK || op == OP_COMM_GROW) {
        shrink_grow_return(c, result);
    }
}

static __always_inline void emit(struct call *c, u32 kind, u32 tid, u64 end, s32 result) {
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        count_up(CNT_EVENTS_LOST);
        return;
    }
    e->kind = kind;
    e->start_ns = c->start_ns;
    e->end_ns = end;
    e->comm = c->comm;
    e->comm_hash = comm_label(c->comm_hash, c->nccl_hash);  // the `comm` label
    e->nccl_hash = c->nccl_hash;
    e->count = c->count;
    e->bytes = c->count * datatype_size(c->datatype);
    // A stack argument is still in the caller's frame when the call returns.
    e->stream = c->stream_arg ? stack_arg_at(c->sp, c->stream_arg) : c->stream;
    e->seq = c->seq;
    e->pid = bpf_get_current_pid_tgid() >> 32;
    e->tid = tid;
    e->op = c->op;
    e->rank = c->rank;
    e->nranks = c->nranks;
    e->datatype = c->datatype;
    e->red_op = c->red_op;
    e->root = c->root;
    e->peer = c->peer;
    e->result = result;
    e->color = c->color;
    e->runq_wait_ns = c->runq_wait_ns;
    u64 proxy_now = proxy_wait_ns(e->pid);
    e->proxy_wait_ns = proxy_now > c->proxy_wait_start ? proxy_now - c->proxy_wait_start : 0;
    events.ringbuf_submit(e, 0);
}

// The series_stats slot of a series, allocated on first use; -1 when full.
static __always_inline s32 series_slot(struct series_key *key) {
    u32 *found = series_index.lookup(key);
    if (found)
        return *found;
    u32 slot = 0;
    if (series_free.pop(&slot) != 0 || slot >= SERIES_CAPACITY) {
        count_up(CNT_STATS_FULL);
        return -1;
    }
    struct series_stats *s = series_stats.lookup(&slot);
    if (!s)
        return -1;
    s->key = *key;  // the slot was cleared when it was freed
    if (series_index.insert(key, &slot) != 0) {
        // Another CPU added the same series first: give this slot back.
        struct series_key none = {};
        s->key = none;
        series_free.push(&slot, 0);
        found = series_index.lookup(key);
        return found ? *found : -1;
    }
    return slot;
}

static __always_inline int same_key(struct series_key *a, struct series_key *b) {
    return a->comm_hash == b->comm_hash && a->rank == b->rank && a->nranks == b->nranks &&
           a->op == b->op && a->pid == b->pid;
}

// Returns the series' slot (-1: none) so the caller can check its threshold.
// When series_index is full the call is counted in its op's overflow series.
static __always_inline s32 account(struct call *c, u64 duration) {
    u32 op = c->op & (OP_COUNT - 1);
    struct series_key key = {.comm_hash = comm_label(c->comm_hash, c->nccl_hash), .rank = c->rank,
                             .nranks = c->nranks, .op = op};
    if (c->rank < 0)
        key.pid = bpf_get_current_pid_tgid() >> 32;
    s32 slot = -1;
    struct series_stats *s = 0;
    if (op >= OP_GET_UNIQUE_ID) {
        // Lifecycle calls: one series per op (nccl_lifecycle_duration_seconds),
        // in its fixed slot: never in series_index, never expired.
        u32 i = SERIES_CAPACITY + op;
        s = series_stats.lookup(&i);
        if (!s)
            return -1;
    } else if (c->series_by_op[op]) {
        u32 cached = c->series_by_op[op] - 1;  // cached for this communicator
        s = series_stats.lookup(&cached);
        if (s && same_key(&s->key, &key))
            slot = cached;
        else
            s = 0;  // the slot was recycled since: look the series up again
    }
    if (!s) {
        slot = series_slot(&key);
        if (slot >= 0)
            c->series_by_op[op] = slot + 1;
        u32 i = slot >= 0 ? (u32)slot : SERIES_CAPACITY + op;  // full: the overflow series
        s = series_stats.lookup(&i);
        if (!s)
            return -1;
    }
    u32 b = bucket_of(duration);
    if (b >= HIST_SLOTS)
        b = HIST_SLOTS - 1;
    // The count before this call is this rank's sequence number for (comm, op),
    // from 0 like NCCL's seqNumber: every rank of a communicator makes the same
    // sequence of collectives on it. The fetch-and-add returns it, so two
    // threads on one series never share a number.
    c->seq = __sync_fetch_and_add(&s->calls, 1);
    if (c->nccl_seq) {  // NCCL's own number (the plugin, bpf/plugin.c): equal on every
        c->seq = c->nccl_seq - 1;  // rank whenever its agent attached
        if (c->nccl_seq > s->next_seq)
            s->next_seq = c->nccl_seq;
    }
    __sync_fetch_and_add(&s->bytes, c->count * datatype_size(c->datatype));
    __sync_fetch_and_add(&s->sum_ns, duration);
    __sync_fetch_and_add(&s->buckets[b], 1);
    s->last_ns = c->start_ns + duration;  // one plain store: a later return may win, as it should
    return slot;
}

int on_return(struct pt_regs *ctx) {
    u64 end = bpf_ktime_get_ns();
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct call *c = call_slot(tid);
    if (!c || !c->op)
        return 0;
    if (c->depth > 0) {  // an inner public call returned; the outer one goes on
        c->depth--;
        // The first inner return after ncclCommInitAll's inner ncclGetUniqueId
        // entered is that call's own: the id it wrote is the new comms' id.
        if (c->op == OP_COMM_INIT_ALL && c->nested_out && !c->comm_hash)
            hash_unique_id(c, (void *)c->nested_out);
        return 0;
    }
    s32 result = (s32)PT_REGS_RC(ctx);
    u64 duration = end - c->start_ns;
    u32 op = c->op;

    if (op >= OP_GET_UNIQUE_ID)
        lifecycle_return(c, result);
    s32 slot = account(c, duration);
    if (result != NCCL_SUCCESS) {
        u64 *n = 0;
        if (result > 0 && result < ERROR_RESULTS) {
            u32 i = (op & (OP_COUNT - 1)) * ERROR_RESULTS + result;
            n = call_errors_fast.lookup(&i);
        }
        if (n) {
            __sync_fetch_and_add(n, 1);
        } else {
            struct error_key ek = {.op = op, .result = result};
            u64 one = 1;
            n = call_errors.lookup(&ek);
            if (n)
                __sync_fetch_and_add(n, 1);
            else if (call_errors.insert(&ek, &one) != 0)
                count_up(CNT_ERRORS_FULL);
        }
    }

    if (is_rare_lifecycle(op)) {
        emit(c, EVENT_LIFECYCLE, tid, end, result);
    } else {
        u32 all = OP_COUNT;
        u64 *record_all = event_config.lookup(&all);
        u64 *threshold = event_config.lookup(&op);
        u64 limit = threshold ? *threshold : 0;
        if (slot >= 0) {
            u32 i = slot;
            u64 *relative = series_threshold.lookup(&i);
            if (relative && *relative)
                limit = *relative;
        }
        if ((record_all && *record_all) || (limit && duration >= limit))
            emit(c, EVENT_CALL, tid, end, result);
    }
    c->start_ns = 0;
    c->op = 0;  // idle: the slot stays for this thread's next call
    return 0;
}

// User space asks for a thread to be traced (a process it found by its
// mapped libnccl, with threads made before): the agent calls getpgid(tid)
// itself, and this sets the thread's bit with the same atomic OR as every
// other update. User space never read-modify-writes traced_threads, so it
// cannot undo a bit the kernel set or cleared meanwhile. Only the agent's own
// process (agent_tgid, written at load) is listened to, and only while it
// asks: NcclProbes.trace_threads() attaches this tracepoint around its
// getpgid calls (an attached syscall tracepoint sends every syscall of the
// node through the kernel's slow syscall path).
BPF_ARRAY(agent_tgid, u32, 1);

TRACEPOINT_PROBE(syscalls, sys_enter_getpgid) {
    u32 zero = 0;
    u32 *agent = agent_tgid.lookup(&zero);
    if (!agent || *agent != (u32)(bpf_get_current_pid_tgid() >> 32))
        return 0;
    u64 tid = args->pid;
    if (tid && tid < (u64)PID_WORDS * 64)
        set_thread_traced((u32)tid, 1);
    return 0;
}

// A thread created by a traced process is traced too (NCCL's proxy threads).
TRACEPOINT_PROBE(sched, sched_process_fork) {
    u32 parent_tgid = bpf_get_current_pid_tgid() >> 32;
    if (traced_processes.lookup(&parent_tgid))
        set_thread_traced(args->child_pid, 1);
    return 0;
}

// A signal delivered to a thread of a traced process with its default
// action (no handler: sa_handler SIG_DFL, 0; the kernel's SIGKILL path passes
// none) that terminates: the first one is the signal that ends the process
// (the other threads then take SIGKILL). Stop, continue and ignore-by-default
// signals are not fatal.
TRACEPOINT_PROBE(signal, signal_deliver) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!traced_processes.lookup(&tgid) || args->sa_handler != 0)
        return 0;
    u32 sig = args->sig;
    if (sig == 17 || sig == 18 || sig == 19 || sig == 20 || sig == 21 || sig == 22 || sig == 23 || sig == 28)
        return 0;  // SIGCHLD SIGCONT SIGSTOP SIGTSTP SIGTTIN SIGTTOU SIGURG SIGWINCH
    fatal_signals.insert(&tgid, &sig);  // the first only
    return 0;
}

// A thread that exits inside a call (killed, crashed, longjmp'd) never
// returns: drop its entry so it shows no phantom hang and leaks nothing.
TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    if (!thread_traced(tid))
        return 0;
    set_thread_traced(tid, 0);
    inflight.delete(&tid);
    struct call *f = fast_slot(tid);
    if (f && f->owner == tid) {  // free the slot for the next thread with these low bits
        f->op = 0;
        f->owner = 0;
    }
    if ((u32)id == (u32)(id >> 32)) {
        u32 tgid = id >> 32;
        if (traced_processes.lookup(&tgid)) {
            struct process_exit e = {.ktime_ns = bpf_ktime_get_ns()};
            u32 *sig = fatal_signals.lookup(&tgid);
            if (sig)
                e.code = *sig;
            process_exits.update(&tgid, &e);
        }
        fatal_signals.delete(&tgid);
        traced_processes.delete(&tgid);
        proxy_wait.delete(&tgid);
    }
    return 0;
}

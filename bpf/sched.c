// Scheduler view of traced processes: run-queue delay and off-CPU time.
//
// Compiled on its own (exporter/sources/sched.py) after bpf/nccl.c, whose
// maps it imports through bpf/traced.h: `traced_threads` (thread_traced),
// `inflight` slots, `proxy_wait` and the counters. Data come only from tracepoint arguments, never from kernel
// struct layouts (the build host's headers are not the running kernel's).
//
// Raw tracepoints. sched_switch and sched_wakeup fire for every task on the
// node, so what a program costs there is paid by everything: a classic
// tracepoint first fills its perf record (two 16-byte comm strings for
// sched_switch) and then runs the program; a raw tracepoint runs the program
// with the tracepoint's own C arguments in ctx->args[] and fills nothing
// (bench/KERNEL.md: an empty program costs about half as much). The
// arguments (TP_PROTO; exporter/sources/sched.py checks them against the
// running kernel's BTF before loading):
//   sched_switch(bool preempt, struct task_struct *prev,
//                struct task_struct *next, unsigned int prev_state)
//   sched_wakeup(struct task_struct *p), sched_wakeup_new(struct task_struct *p)
// The task_struct pointers are used as identities only, never dereferenced:
// a traced thread's pointer is learnt at its switch-out, where `prev` is the
// current task and its tid is known from bpf_get_current_pid_tgid().
// `thread_sched` is keyed by that pointer, so a wakeup or switch-in finds a
// traced thread's state with one hash lookup; in front of it `task_filter`,
// an array of counts indexed by a hash of the pointer, lets every other
// task's wakeup or switch-in return after one array read.
//
// Per traced thread, `thread_sched` remembers since when it is runnable
// (woken, or preempted while runnable) and since when it sleeps. At each
// switch-in the wait since "runnable" is one run-queue delay sample:
//   - a log2 histogram per (process, thread kind)        -> sched_stats
//   - added to the thread's inflight slot's runq_wait_ns when the thread is
//     inside an NCCL call (op != 0)                        -> struct call
//   - an event in the `sched_events` ring buffer when the delay is at least
//     sched_config[0] ns (0, the default: none; recordings turn it on)
//                                                          -> exporter/sched.py
// Off-CPU time (switch-out while not runnable .. wakeup) is kept in the
// thread's state and added to the same sched_stats entry at that switch-in,
// so a traced thread's round of sleep, wakeup and run costs five hash
// lookups (its state three times, its inflight slot, its sched_stats
// entry). Every other task costs one array read per wakeup, and one bitmap
// test and one array read per switch.

#include "traced.h"

// SCHED_KIND_* (thread kinds) come from the contract:
//   caller: the thread has an inflight slot: it called NCCL
//   proxy:  its name starts with "NCCL " (proxy/progress threads)

// Histogram of run-queue delay: schema-3 buckets of nanoseconds, RUNQ_SLOTS
// per series (bpf/histogram.h; exporter/records/histogram.py's RUNQ: up to 4 s).

// prev_state of the raw sched_switch is the task's __state as __schedule()
// read it: TASK_RUNNING (0) when it stays runnable (it yields), sleep bits
// otherwise, TASK_DEAD (0x80, include/linux/sched.h since 4.14) at an
// exiting task's last switch. A preempted task (preempt = 1) stays runnable
// whatever its state says.
#define TASK_RUNNING_STATE 0
#define TASK_DEAD_STATE 0x80

#ifndef MAX_SCHED_KEYS
#define MAX_SCHED_KEYS (MAX_PROCESSES * SCHED_KINDS)
#endif

// A traced thread, keyed by its task_struct pointer.
struct sched_state {
    u64 runnable_since;  // ktime ns; 0: not waiting on a run queue
    u64 offcpu_since;    // ktime ns; 0: not sleeping (or unknown)
    u64 offcpu_ns;       // slept since its last switch-in: added to sched_stats at the next one
    u32 tid;
    u32 tgid;            // learnt when the thread switches out (it is current then)
    char comm[16];       // its name as of the last switch-out
};

struct sched_key {
    u32 tgid;
    u32 kind;
};

struct sched_stats {
    u64 count;      // run-queue delay samples
    u64 sum_ns;     // their total: for kind proxy, the process's cumulative proxy wait
    u64 offcpu_ns;  // time asleep (switched out not runnable, until woken)
    u64 buckets[RUNQ_SLOTS];
};

// One run-queue wait of a traced thread, for recordings (sched_events table).
struct sched_event {
    u64 runnable_ns;  // ktime when it became runnable (woken or preempted)
    u64 wait_ns;      // until it was switched in
    u32 pid;          // tgid; 0: not learnt yet (user space asks /proc)
    u32 tid;
    u32 kind;         // SCHED_KIND_*
    u32 cpu;          // the CPU it was switched in on
    u32 op;           // the NCCL op the thread is inside (OP_*), 0: none
    u32 pad;
    char comm[16];    // the thread's name
};

// Traced threads' task_struct pointers (identities only) -> their state.
BPF_HASH(thread_sched, u64, struct sched_state, MAX_SCHED_THREADS);
// Counts of thread_sched's pointers per hash slot: 0 = no traced task hashes here.
#define TASK_FILTER_SLOTS 65536
BPF_ARRAY(task_filter, u32, TASK_FILTER_SLOTS);
// [0]: the shortest run-queue wait that becomes an event, ns; 0: no events.
BPF_ARRAY(sched_config, u64, 1);
BPF_RINGBUF_OUTPUT(sched_events, SCHED_EVENT_PAGES);
BPF_HASH(sched_stats, struct sched_key, struct sched_stats, MAX_SCHED_KEYS);
// All zeros, never written: a new sched_stats entry (too big for the stack
// next to everything else).
BPF_ARRAY(sched_empty, struct sched_stats, 1);

static __always_inline u32 runq_bucket(u64 ns) {
    return SCHEMA3_SLOT(RUNQ, ns);
}

static __always_inline int comm_is_proxy(const char *comm) {
    // "NCCL " : NCCL names its helper threads "NCCL Progress..", "NCCL Sock..",
    // "NCCL Service..", "NCCL Proxy.."
    return comm[0] == 'N' && comm[1] == 'C' && comm[2] == 'C' && comm[3] == 'L' &&
           comm[4] == ' ';
}

static __always_inline struct sched_stats *sched_stats_of(u32 tgid, u32 kind) {
    struct sched_key k = {.tgid = tgid, .kind = kind};
    struct sched_stats *s = sched_stats.lookup(&k);
    if (s)
        return s;
    u32 zero = 0;
    struct sched_stats *empty = sched_empty.lookup(&zero);
    if (!empty)
        return 0;
    if (sched_stats.insert(&k, empty) != 0) {
        s = sched_stats.lookup(&k);  // another CPU made it first, or the map is full
        if (!s)
            count_up(CNT_SCHED_FULL);
        return s;
    }
    return sched_stats.lookup(&k);
}

// Add a proxy thread's run-queue wait to its process's total in the shared
// `proxy_wait` map, which bpf/nccl.c reads at a call's entry and return.
static __always_inline void proxy_wait_add(u32 tgid, u64 delay) {
    u64 *w = proxy_wait.lookup(&tgid);
    if (w) {
        __sync_fetch_and_add(w, delay);
        return;
    }
    if (proxy_wait.insert(&tgid, &delay) != 0) {
        w = proxy_wait.lookup(&tgid);  // another CPU made it first, or full
        if (w)
            __sync_fetch_and_add(w, delay);
    }
}

// One switch-in of a traced thread: its run-queue delay, and the sleep
// before it (0 when it was preempted, not asleep).
static __always_inline void runq_record(u32 tgid, u32 kind, u64 delay, u64 offcpu) {
    struct sched_stats *s = sched_stats_of(tgid, kind);
    if (!s)
        return;
    u32 b = runq_bucket(delay);
    if (b >= RUNQ_SLOTS)
        b = RUNQ_SLOTS - 1;
    __sync_fetch_and_add(&s->count, 1);
    __sync_fetch_and_add(&s->sum_ns, delay);
    __sync_fetch_and_add(&s->buckets[b], 1);
    if (offcpu)
        __sync_fetch_and_add(&s->offcpu_ns, offcpu);
    if (kind == SCHED_KIND_PROXY)
        proxy_wait_add(tgid, delay);
}

static __always_inline u32 *filter_slot(u64 task) {
    u32 slot = pointer_slot(task, 16);  // task_filter's 65,536 slots
    return task_filter.lookup(&slot);
}

// The state of a task pointer if it is a traced thread's; 0 for every other
// task, which costs one array read when its filter slot is empty (nearly
// always).
static __always_inline struct sched_state *known_state(u64 task) {
    u32 *n = filter_slot(task);
    if (!n || *n == 0)
        return 0;
    return thread_sched.lookup(&task);
}

// ... and only while its thread is still traced.
static __always_inline struct sched_state *traced_state(u64 task) {
    struct sched_state *st = known_state(task);
    return st && thread_traced(st->tid) ? st : 0;
}

// A fresh state for the current task (at its switch-out), or one whose
// pointer belonged to a thread whose exit was missed: now this thread's.
static __always_inline struct sched_state *new_state(u64 task, u32 tid, struct sched_state *old) {
    struct sched_state fresh = {.tid = tid};
    if (old) {
        *old = fresh;
        return old;
    }
    if (thread_sched.insert(&task, &fresh) != 0) {
        count_up(CNT_SCHED_FULL);  // full (or another CPU made it first: not for current)
        return 0;
    }
    u32 *n = filter_slot(task);
    if (n)
        __sync_fetch_and_add(n, 1);
    return thread_sched.lookup(&task);
}

// An exiting thread's last switch: forget its pointer (the memory is freed
// and reused). One filter read for every other exiting thread.
static __always_inline void forget_task(u64 task) {
    u32 *n = filter_slot(task);
    if (!n || *n == 0)
        return;
    if (thread_sched.delete(&task) == 0)
        __sync_fetch_and_add(n, -1);
}

// A thread became runnable.
static __always_inline void sched_woken(u64 task) {
    struct sched_state *st = traced_state(task);
    if (!st)
        return;  // known from its first switch-out on
    u64 now = bpf_ktime_get_ns();
    if (st->offcpu_since) {
        st->offcpu_ns += now - st->offcpu_since;
        st->offcpu_since = 0;
    }
    if (!st->runnable_since)
        st->runnable_since = now;
}

RAW_TRACEPOINT_PROBE(sched_wakeup) {
    sched_woken(ctx->args[0]);
    return 0;
}

RAW_TRACEPOINT_PROBE(sched_wakeup_new) {
    sched_woken(ctx->args[0]);
    return 0;
}

// The current task (prev, traced thread `tid`) switches out: learn its
// process and name, and whether it waits on a run queue (preempted, or
// yielding) or sleeps.
static __always_inline void switched_out(u64 task, u32 tid, int runnable, u64 now) {
    struct sched_state *st = known_state(task);
    if (!st || st->tid != tid) {
        st = new_state(task, tid, st);
        if (!st)
            return;
    }
    st->tgid = bpf_get_current_pid_tgid() >> 32;
    bpf_get_current_comm(st->comm, sizeof(st->comm));
    if (runnable) {
        st->runnable_since = now;  // preempted: waits on the run queue
        st->offcpu_since = 0;
    } else {
        st->runnable_since = 0;    // goes to sleep
        st->offcpu_since = now;
    }
}

// A traced thread (next) switches in: the wait since it became runnable.
// Its kind is decided here: proxy by name, caller when it has an inflight
// slot (it has called NCCL), other otherwise.
static __always_inline void switched_in(struct sched_state *st, u64 now) {
    if (!st->runnable_since)
        return;
    u64 delay = now - st->runnable_since;
    u64 offcpu = st->offcpu_ns;
    u32 tid = st->tid;
    st->runnable_since = 0;
    st->offcpu_since = 0;
    st->offcpu_ns = 0;
    struct call *c = call_slot(tid);
    u32 kind = comm_is_proxy(st->comm) ? SCHED_KIND_PROXY : c ? SCHED_KIND_CALLER : SCHED_KIND_OTHER;
    if (c && c->op)
        __sync_fetch_and_add(&c->runq_wait_ns, delay);
    runq_record(st->tgid, kind, delay, offcpu);
    u32 zero = 0;
    u64 *min_wait = sched_config.lookup(&zero);
    if (!min_wait || !*min_wait || delay < *min_wait)
        return;
    struct sched_event *e = sched_events.ringbuf_reserve(sizeof(struct sched_event));
    if (!e) {
        count_up(CNT_SCHED_EVENTS_LOST);
        return;
    }
    e->runnable_ns = now - delay;
    e->wait_ns = delay;
    e->pid = st->tgid;
    e->tid = tid;
    e->kind = kind;
    e->cpu = bpf_get_smp_processor_id();
    e->op = c ? c->op : 0;
    e->pad = 0;
    __builtin_memcpy(e->comm, st->comm, sizeof(e->comm));
    sched_events.ringbuf_submit(e, 0);
}

RAW_TRACEPOINT_PROBE(sched_switch) {
    u64 preempt = ctx->args[0];
    u64 prev_task = ctx->args[1];
    u64 next_task = ctx->args[2];
    u32 state = ctx->args[3];
    u32 prev = bpf_get_current_pid_tgid();  // prev is the current task here
    u64 now = 0;
    if (state & TASK_DEAD_STATE) {
        // nccl.c clears an exiting thread's traced bit at sched_process_exit,
        // before this switch.
        forget_task(prev_task);
    } else if (prev && thread_traced(prev)) {
        now = bpf_ktime_get_ns();
        switched_out(prev_task, prev, preempt || state == TASK_RUNNING_STATE, now);
    }
    struct sched_state *next = traced_state(next_task);
    if (next)
        switched_in(next, now ? now : bpf_ktime_get_ns());
    return 0;
}

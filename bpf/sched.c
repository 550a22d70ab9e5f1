// Scheduler view of traced processes: run-queue delay and off-CPU time.
//
// Compiled on its own (exporter/sources/sched.py) after bpf/nccl.c, whose
// maps it imports through bpf/traced.h: `traced_threads` (thread_traced),
// `inflight` slots, `proxy_wait` and the counters. Data come only from tracepoint arguments, never from kernel
// struct layouts (the build host's headers are not the running kernel's).
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
// Off-CPU time (switch-out while not runnable .. wakeup) is summed per
// (process, thread kind) too. Every other thread costs one bitmap test per
// event (two for sched_switch).

#include "traced.h"

// SCHED_KIND_* (thread kinds) and RUNQ_MAX_LOG2 come from the contract:
//   caller: the thread has an inflight slot: it called NCCL
//   proxy:  its name starts with "NCCL " (proxy/progress threads)

// Histogram of run-queue delay in µs: bucket 0: d <= 1 µs; bucket k
// (1..RUNQ_MAX_LOG2): 2^(k-1) < d <= 2^k µs; the last one: above 2^22 µs (~4.2 s).
#define RUNQ_SLOTS (RUNQ_MAX_LOG2 + 2)

// prev_state of sched_switch: TASK_REPORT bits 0x01..0x80 (S D T t X Z P I);
// a preempted task is reported as TASK_REPORT_MAX (0x100), a task that
// yields as 0. Either way it stays runnable.
#define SCHED_STATE_MASK 0xff
#define SCHED_EXIT_STATES 0x30  // EXIT_DEAD (X) | EXIT_ZOMBIE (Z): its last switch

#ifndef MAX_SCHED_KEYS
#define MAX_SCHED_KEYS (MAX_PROCESSES * SCHED_KINDS)
#endif

struct sched_state {
    u64 runnable_since;  // ktime ns; 0: not waiting on a run queue
    u64 offcpu_since;    // ktime ns; 0: not sleeping (or unknown)
    u64 pending_runq_ns; // a delay seen before the thread's process was known
    u32 tgid;            // learnt when the thread switches out (it is current then)
    u32 kind;            // SCHED_KIND_* as of the last switch
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

BPF_HASH(thread_sched, u32, struct sched_state, MAX_SCHED_THREADS);
// [0]: the shortest run-queue wait that becomes an event, ns; 0: no events.
BPF_ARRAY(sched_config, u64, 1);
BPF_RINGBUF_OUTPUT(sched_events, SCHED_EVENT_PAGES);
BPF_HASH(sched_stats, struct sched_key, struct sched_stats, MAX_SCHED_KEYS);
// All zeros, never written: a new sched_stats entry (too big for the stack
// next to everything else).
BPF_ARRAY(sched_empty, struct sched_stats, 1);

static __always_inline u32 runq_bucket(u64 ns) {
    u64 us = (ns + 999) / 1000;  // ceil: d <= 2^k µs exactly when ceil(ns/1000) <= 2^k
    if (us <= 1)
        return 0;
    u32 k = log2_floor(us - 1) + 1;
    return k > RUNQ_MAX_LOG2 ? RUNQ_MAX_LOG2 + 1 : k;
}

static __always_inline int comm_is_proxy(const char *comm) {
    // "NCCL " : NCCL names its helper threads "NCCL Progress..", "NCCL Sock..",
    // "NCCL Service..", "NCCL Proxy.."
    return comm[0] == 'N' && comm[1] == 'C' && comm[2] == 'C' && comm[3] == 'L' &&
           comm[4] == ' ';
}

static __always_inline u32 sched_kind(u32 tid, const char *comm) {
    if (comm_is_proxy(comm))
        return SCHED_KIND_PROXY;
    if (inflight.lookup(&tid))
        return SCHED_KIND_CALLER;
    return SCHED_KIND_OTHER;
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

static __always_inline void runq_record(u32 tgid, u32 kind, u64 delay) {
    struct sched_stats *s = sched_stats_of(tgid, kind);
    if (!s)
        return;
    u32 b = runq_bucket(delay);
    if (b >= RUNQ_SLOTS)
        b = RUNQ_SLOTS - 1;
    __sync_fetch_and_add(&s->count, 1);
    __sync_fetch_and_add(&s->sum_ns, delay);
    __sync_fetch_and_add(&s->buckets[b], 1);
    if (kind == SCHED_KIND_PROXY)
        proxy_wait_add(tgid, delay);
}

static __always_inline struct sched_state *sched_state_of(u32 tid) {
    struct sched_state *st = thread_sched.lookup(&tid);
    if (st)
        return st;
    struct sched_state fresh = {};
    if (thread_sched.insert(&tid, &fresh) != 0) {
        st = thread_sched.lookup(&tid);
        if (!st)
            count_up(CNT_SCHED_FULL);
        return st;
    }
    return thread_sched.lookup(&tid);
}

// Forget a thread. Called from sched_switch at an exiting thread's last
// switch (prev_state X or Z), which covers every exit; nccl.c's
// sched_process_exit handler may call it too (see docs/sched.md).
static __always_inline void sched_forget(u32 tid) {
    thread_sched.delete(&tid);
}


// A thread became runnable.
static __always_inline void sched_woken(u32 tid) {
    if (!thread_traced(tid))
        return;
    struct sched_state *st = sched_state_of(tid);
    if (!st)
        return;
    u64 now = bpf_ktime_get_ns();
    if (st->offcpu_since) {
        // tgid and kind were learnt when it switched out to sleep.
        struct sched_stats *s = sched_stats_of(st->tgid, st->kind);
        if (s)
            __sync_fetch_and_add(&s->offcpu_ns, now - st->offcpu_since);
        st->offcpu_since = 0;
    }
    if (!st->runnable_since)
        st->runnable_since = now;
}

TRACEPOINT_PROBE(sched, sched_wakeup) {
    sched_woken(args->pid);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup_new) {
    sched_woken(args->pid);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_switch) {
    u32 prev = args->prev_pid;
    u32 next = args->next_pid;
    int prev_traced = prev && thread_traced(prev);
    int next_traced = next && thread_traced(next);
    long state = args->prev_state;
    if (!prev_traced) {
        // A traced thread's bit is cleared by nccl.c at its exit, before this
        // last switch: drop its state here (one delete per thread exit on the
        // node; nothing for a switch of a live untraced thread).
        if (prev && (state & SCHED_EXIT_STATES))
            thread_sched.delete(&prev);
        if (!next_traced)
            return 0;
    }
    u64 now = bpf_ktime_get_ns();

    if (prev_traced) {
        if (state & SCHED_EXIT_STATES) {
            sched_forget(prev);
        } else {
            struct sched_state *st = sched_state_of(prev);
            if (st) {
                // prev is current here: its process is known now.
                u32 tgid = bpf_get_current_pid_tgid() >> 32;
                u32 kind = sched_kind(prev, args->prev_comm);
                st->tgid = tgid;
                st->kind = kind;
                if (st->pending_runq_ns) {
                    runq_record(tgid, kind, st->pending_runq_ns);
                    st->pending_runq_ns = 0;
                }
                if ((state & SCHED_STATE_MASK) == 0) {
                    st->runnable_since = now;  // preempted: waits on the run queue
                    st->offcpu_since = 0;
                } else {
                    st->runnable_since = 0;    // goes to sleep
                    st->offcpu_since = now;
                }
            }
        }
    }

    if (next_traced) {
        struct sched_state *st = thread_sched.lookup(&next);
        if (st && st->runnable_since) {
            u64 delay = now - st->runnable_since;
            st->runnable_since = 0;
            st->offcpu_since = 0;
            u32 kind = sched_kind(next, args->next_comm);
            struct call *c = inflight.lookup(&next);
            if (c && c->op)
                __sync_fetch_and_add(&c->runq_wait_ns, delay);
            if (st->tgid)
                runq_record(st->tgid, kind, delay);
            else
                st->pending_runq_ns += delay;  // recorded at its first switch-out
            u32 zero = 0;
            u64 *min_wait = sched_config.lookup(&zero);
            if (min_wait && *min_wait && delay >= *min_wait) {
                struct sched_event *e = sched_events.ringbuf_reserve(sizeof(struct sched_event));
                if (!e) {
                    count_up(CNT_SCHED_EVENTS_LOST);
                } else {
                    e->runnable_ns = now - delay;
                    e->wait_ns = delay;
                    e->pid = st->tgid;
                    e->tid = next;
                    e->kind = kind;
                    e->cpu = bpf_get_smp_processor_id();
                    e->op = c ? c->op : 0;
                    e->pad = 0;
                    // A copy from the tracepoint record (a plain memcpy would
                    // dereference a moved ctx pointer, which the verifier refuses).
                    bpf_probe_read_kernel(e->comm, sizeof(e->comm), args->next_comm);
                    sched_events.ringbuf_submit(e, 0);
                }
            }
        }
    }
    return 0;
}

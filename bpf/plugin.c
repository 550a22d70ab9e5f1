// GPU time from nccl-exporter's NCCL profiler plugin (plugin/: the hooks in plugin/hooks.c).
//
// The plugin calls empty exported hook functions with a pointer to a
// fixed-layout record (plugin/nccl_exporter_plugin.h); the agent attaches
// uprobes on them by file path (exporter/sources/plugin/source.py), so every
// process that loaded that plugin file is covered. Each handler copies the
// record with one bpf_probe_read_user of PARM1 and:
//   gpu_done       folds gpu_stop_mono_ns - gpu_start_mono_ns into the
//                  (op, comm_hash, rank, nranks) histogram gpu_series, with
//                  the host histogram's layout (HIST_* from the generated
//                  header, exporter/records/histogram.py); forgets in-flight;
//                  a slow one (gpu_config[op]) -> gpu_events, for spans
//   coll_queued    in-flight entry (pid, id) state QUEUED since enqueue
//   gpu_start      the entry becomes RUNNING since the GPU start
//   abandoned      forgets the in-flight entry
//                  the record's network part (proxy accounting, version
//                  NX_NET_VERSION after the 144 bytes): per (peer,
//                  direction) wall/step time per phase and bytes summed into
//                  net_series; the process's PXN count into net_foreign; a
//                  slow op's gpu_event carries the entries (spans, recordings)
//   comm_init/fini the process has the plugin (plugin_procs: pid -> comms,
//                  drops; every record hook makes sure the entry exists);
//                  plugin_comms: its live communicators (NCCL's identity)
//   comm_live      the plugin's periodic announcement of a live one:
//                  plugin_comms (an agent that attached mid-job)
// In-flight entries of processes that died without a hook are dropped by the
// agent's loop (forget_dead); the exit tracepoint drops plugin_procs.
//
// Compiled on its own after bpf/nccl.c (it owns the maps of traced.h; this
// program needs only log2_floor and bucket_of from it). GPU_MAX_SERIES, GPU_MAX_INFLIGHT
// and PLUGIN_MAX_PROCS come as -D from exporter/records/contract.py.
#include <uapi/linux/ptrace.h>
#include "traced.h"

// GPU durations use the host histogram's layout: HIST_SLOTS and bucket_of
// of bpf/traced.h.

#define NX_RECORD_VERSION 1   // NCCL_EXPORTER_RECORD_VERSION
#define NX_RECORD_SIZE 144    // sizeof(struct nccl_exporter_record), version 1
#define NX_COMM_SIZE 80       // sizeof(struct nccl_exporter_comm), version 1
#define NX_STATE_QUEUED 1
#define NX_STATE_RUNNING 2
#define NX_STATE_DONE 3
#define NX_STATE_ABANDONED 4
// record flags: the plugin's verdict on an implausible GPU interval
// (NCCL_EXPORTER_F_REJECT_*; docs/plugin.md, "Implausible GPU intervals")
#define NX_F_REJECT_LONG 0x80
#define NX_F_REJECT_EARLY 0x100
#define NX_F_REJECT_REVERSED 0x200
#define NX_F_SHARED 0x400000  // NCCL_EXPORTER_F_SHARED
#define NX_F_REJECT_LOST_CHANNEL 0x1000  // a KernelCh NCCL <= 2.30 never sent ("NCCL habits")

// struct nccl_exporter_record, version 1 (plugin/nccl_exporter_plugin.h).
// Offsets relied on are commented; the struct is the plugin's byte for byte
// (natural alignment, no padding: checked by the size assertion below and by
// tests/test_plugin_abi.py on the plugin side).
struct nx_record {
    u32 version;               //   0  must be 1
    u32 size;                  //   4  >= 144
    u64 id;                    //   8  in-flight key with the pid
    u64 comm_hash;             //  16  NCCL's commHash (series key)
    u64 seq;                   //  24  kept in the in-flight entry
    u64 count;                 //  32
    u64 bytes;                 //  40  summed per series
    u64 host_enqueue_mono_ns;  //  48  queued since (CLOCK_MONOTONIC)
    u64 host_event_mono_ns;    //  56  when the hook fired (fallback "running since")
    u64 gpu_start_timer;       //  64
    u64 gpu_stop_timer;        //  72
    u64 gpu_start_mono_ns;     //  80  running since; duration start
    u64 gpu_stop_mono_ns;      //  88  duration end
    s64 gpu_to_mono_offset_ns; //  96
    s32 rank;                  // 104  series key
    s32 nranks;                // 108  series key
    s32 peer;                  // 112
    u32 flags;                 // 116
    u8 kind;                   // 120
    u8 op;                     // 121  exporter op code (contract.COLLECTIVE_OPS), 0 = other
    u8 datatype;               // 122
    u8 state;                  // 123  NX_STATE_*
    u8 nchannels;              // 124
    u8 channels_started;       // 125
    u8 channels_stopped;       // 126
    u8 iface_version;          // 127  kept per process
    char op_name[16];          // 128
};                             // 144
_Static_assert(sizeof(struct nx_record) == NX_RECORD_SIZE, "nccl_exporter_record v1 is 144 bytes");

// struct nccl_exporter_comm, version 1.
struct nx_comm {
    u32 version;        //  0  must be 1
    u32 size;           //  4  >= 80
    u64 comm_hash;      //  8
    s32 rank;           // 16
    s32 nranks;         // 20
    s32 nnodes;         // 24
    u32 iface_version;  // 28  kept per process
    u64 pending;        // 32
    u64 dropped;        // 40  kept per process (pool drops, process-wide)
    char name[32];      // 48
};                      // 80
_Static_assert(sizeof(struct nx_comm) == NX_COMM_SIZE, "nccl_exporter_comm v1 is 80 bytes");

// The network part of a done record (struct nccl_exporter_net, version 1),
// right after the 144 bytes when r.size >= NX_RECORD_SIZE + NX_NET_SIZE.
#define NX_NET_VERSION 1
#define NX_NET_ENTRIES 10     // NCCL_EXPORTER_NET_ENTRIES (2 * top K + 2)
#define NX_NET_SIZE 672
struct nx_peer_wait {
    s32 peer;          //  0 communicator rank; -1 = other
    u32 direction;     //  4 0 send, 1 recv
    u64 bytes;         //  8
    u64 wall_ns[3];    // 16 per phase, contract.NETWORK_PHASES order
    u64 step_ns[3];    // 40
};                     // 64
struct nx_net {
    u32 version;       //  0 must be 1
    u32 top_k;         //  4
    u32 nentries;      //  8
    u32 npeers;        // 12
    u32 flags;         // 16
    u32 proxy_ops;     // 20
    u64 foreign_ops;   // 24 process-wide PXN ProxyOps ignored
    struct nx_peer_wait e[NX_NET_ENTRIES];  // 32
};                     // 672
_Static_assert(sizeof(struct nx_net) == NX_NET_SIZE, "nccl_exporter_net v1 is 672 bytes");

// Network figures per (communicator, rank, peer, direction): counters.
struct net_key {
    u64 comm_hash;
    s32 rank;
    s32 peer;          // -1: other (the plugin's, or this map's overflow)
    u32 direction;
    u32 pad;
};
struct net_val {
    u64 ops;           // done records that carried this pair
    u64 bytes;
    u64 wall_ns[3];
    u64 step_ns[3];
};

struct gpu_key {
    u64 comm_hash;  // NCCL's commHash
    s32 rank;
    s32 nranks;
    u32 op;
    u32 pad;
};

struct gpu_hist {
    u64 count;
    u64 sum_ns;
    u64 bytes;
    u64 buckets[HIST_SLOTS];
};

struct gpu_flight_key {
    u32 tgid;
    u32 pad;
    u64 id;
};

struct gpu_flight {
    u64 comm_hash;
    u64 seq;
    u64 enqueue_ns;  // CLOCK_MONOTONIC: host enqueue
    u64 start_ns;    // CLOCK_MONOTONIC: GPU start (mapped), 0 while queued
    s32 rank;
    s32 nranks;
    u32 op;
    u32 state;       // NX_STATE_QUEUED | NX_STATE_RUNNING
};

struct plugin_proc {
    u64 first_seen_ns;
    u64 last_seen_ns;  // its last comm_init/fini (or its first record)
    u64 dropped;     // plugin's pool drops, as of the last comm_init/fini
    s64 comms;       // comm_init - comm_fini seen
    u32 iface_version;
    u32 pad;
};

// A live communicator of a process with the plugin, as the plugin announced
// it (comm_init, and comm_live once a period: an agent that attached
// mid-job learns communicators made before it, idle ones included).
struct plugin_comm_key {
    u32 tgid;
    u32 pad;
    u64 comm_hash;  // NCCL's commHash
};

struct plugin_comm {
    s32 rank;
    s32 nranks;
    s32 nnodes;
    u32 pad;
    u64 last_ns;  // CLOCK_MONOTONIC of its last init/announce
};

// Why something was not counted: slots of plugin_drops.
#define PD_SERIES_FULL 0
#define PD_INFLIGHT_FULL 1
#define PD_BAD_RECORD 2
#define PD_PROCS_FULL 3
#define PD_NO_GPU_TIME 4
#define PD_REJECT_LONG 5      // nccl_exporter_gpu_intervals_rejected_total{reason=...}
#define PD_REJECT_EARLY 6
#define PD_REJECT_REVERSED 7
#define PD_COMMS_FULL 8
#define PD_NET_FULL 9         // net_series full even for the "other" entry
#define PD_SHARED 10          // done records whose GPU interval is another's (a batch): not histogrammed
#define PD_REJECT_LOST_CHANNEL 11  // contract.GPU_REJECT_SLOTS
#define PD_SLOTS 12

BPF_HASH(gpu_series, struct gpu_key, struct gpu_hist, GPU_MAX_SERIES);
BPF_HASH(gpu_inflight, struct gpu_flight_key, struct gpu_flight, GPU_MAX_INFLIGHT);
BPF_HASH(plugin_procs, u32, struct plugin_proc, PLUGIN_MAX_PROCS);
BPF_HASH(plugin_comms, struct plugin_comm_key, struct plugin_comm, MAX_COMMS);
BPF_ARRAY(plugin_drops, u64, PD_SLOTS);
BPF_ARRAY(gpu_zero, struct gpu_hist, 1);  // all zeros, never written
BPF_HASH(net_series, struct net_key, struct net_val, NET_MAX_SERIES);
BPF_HASH(net_foreign, u32, u64, PLUGIN_MAX_PROCS);  // tgid -> PXN ProxyOps its plugin ignored
BPF_PERCPU_ARRAY(net_scratch, struct nx_net, 1);    // one record's network part (too big for the stack)

// One slow GPU operation for user space (spans bounded by GPU time): sent by
// on_gpu_done when its GPU time is at least gpu_config[op] ns (0, the
// default: never). Lost records: counters[CNT_GPU_EVENTS_LOST].
struct gpu_event {
    u64 comm_hash;   // NCCL's commHash
    u64 seq;         // NCCL's seqNumber (per communicator and op, from 0)
    u64 bytes;
    u64 enqueue_ns;  // CLOCK_MONOTONIC: the host enqueue
    u64 start_ns;    // CLOCK_MONOTONIC: GPU start (the plugin's mapping)
    u64 stop_ns;     // CLOCK_MONOTONIC: GPU stop
    u32 pid;
    u32 tid;         // the thread that saw the kernel finish (the plugin's)
    s32 rank;
    s32 nranks;
    s32 peer;
    u32 op;          // exporter op code
    u32 kind;        // the record's kind (coll / p2p, plugin/nccl_exporter_plugin.h)
    u32 nnet;        // entries in net[] (0: no network figures)
    // the record's struct nx_peer_wait entries as 8 u64 words each (BCC's
    // decoder does not take arrays of structs): peer | direction << 32,
    // bytes, wall_ns[3], step_ns[3]
    u64 net[NX_NET_ENTRIES * 8];
};
_Static_assert(sizeof(struct nx_peer_wait) == 8 * sizeof(u64), "gpu_event.net: 8 words an entry");
BPF_ARRAY(gpu_config, u64, OP_COUNT);
BPF_RINGBUF_OUTPUT(gpu_events, GPU_EVENT_PAGES);

static __always_inline void drop(u32 slot) {
    u64 *v = plugin_drops.lookup(&slot);
    if (v)
        __sync_fetch_and_add(v, 1);
}

// The process has the plugin: an entry in plugin_procs. A record hook only
// makes sure the entry exists (one lookup; the agent may have started after
// the process's comm_init); comm_init/fini also keep the communicator
// count, the pool drops and when they were last seen.
static __always_inline struct plugin_proc *proc_entry(u32 tgid, u32 iface) {
    struct plugin_proc *p = plugin_procs.lookup(&tgid);
    if (p)
        return p;
    u64 now = bpf_ktime_get_ns();
    struct plugin_proc n = {.first_seen_ns = now, .last_seen_ns = now, .iface_version = iface};
    if (plugin_procs.insert(&tgid, &n) && !plugin_procs.lookup(&tgid)) {
        drop(PD_PROCS_FULL);
        return NULL;
    }
    return plugin_procs.lookup(&tgid);
}

// One copy of the record (PARM1 of every record hook) and its in-flight key;
// the calling process is marked as having the plugin. 0 when it is not a
// version-1 record.
static __always_inline int read_record(struct pt_regs *ctx, struct nx_record *r,
                                       struct gpu_flight_key *k) {
    if (bpf_probe_read_user(r, sizeof(*r), (void *)PT_REGS_PARM1(ctx)) ||
        r->version != NX_RECORD_VERSION || r->size < NX_RECORD_SIZE) {
        drop(PD_BAD_RECORD);
        return 0;
    }
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    proc_entry(tgid, r->iface_version);
    k->tgid = tgid;
    k->id = r->id;
    return 1;
}

// The collective is queued (start_ns 0) or running on the GPU since start_ns.
static __always_inline void set_flight(struct gpu_flight_key *k, struct nx_record *r, u32 state,
                                       u64 enqueue_ns, u64 start_ns) {
    struct gpu_flight f = {
        .comm_hash = r->comm_hash, .seq = r->seq, .enqueue_ns = enqueue_ns, .start_ns = start_ns,
        .rank = r->rank, .nranks = r->nranks, .op = r->op, .state = state,
    };
    if (gpu_inflight.update(k, &f))
        drop(PD_INFLIGHT_FULL);
}

#define NX_KIND_COLL 1

// The record of an operation being enqueued names its communicator as NCCL
// knows it (commHash, rank, size), and for a collective its seqNumber; the
// plugin makes it on the thread that is inside the NCCL call enqueuing it
// (an eager call: NCCL's hostStreamPlanTask runs before the call returns),
// whose ncclComm_t pointer that thread's call slot holds (bpf/nccl.c). A
// communicator the agent did not see made (no entry, or a local id: the agent
// attached mid-job) gets NCCL's identity from this call on, and the call is
// numbered with NCCL's seqNumber (docs/communicators.md, "Communicators made
// before the agent"). Calls inside ncclGroupStart/End are not matched (the
// thread is in ncclGroupEnd, another op).
static __always_inline void bind_call(struct nx_record *r) {
    u64 id = bpf_get_current_pid_tgid();
    struct call *c = call_slot((u32)id);
    if (!c || c->op != r->op || !c->op || !c->start_ns || !c->comm || !r->comm_hash || r->nranks <= 0)
        return;
    if (r->kind == NX_KIND_COLL)
        c->nccl_seq = r->seq + 1;
    if (c->nccl_hash == r->comm_hash)
        return;  // named already: the common case, one compare
    struct comm_key k = {.tgid = id >> 32, .comm = c->comm};
    struct comm_info *info = communicators.lookup(&k);
    // Seen made (its own id beside NCCL's): the agent's derivation stands.
    // Else (a local id, or a guess from the process's only announced
    // communicator, exporter/sources/nccl/maps.py): NCCL's record wins.
    if (info && info->nccl_hash && info->comm_hash != info->nccl_hash)
        return;
    struct comm_info n = {.comm_hash = r->comm_hash, .nccl_hash = r->comm_hash,
                          .rank = r->rank, .nranks = r->nranks};
    // comm_hash == nccl_hash marks it as named by NCCL's record, not seen
    // made: its split count since its init is unknown (bpf/nccl.c).
    if (info) {
        n.splits = info->splits;
        n.shrinks = info->shrinks;
    }
    communicators.update(&k, &n);
    bump_generation();  // every thread re-reads its cached identity
    // this call too: it is accounted at its return
    c->comm_hash = n.comm_hash;
    c->nccl_hash = n.nccl_hash;
    c->rank = n.rank;
    c->nranks = n.nranks;
}

int on_coll_queued(struct pt_regs *ctx) {
    struct nx_record r = {};
    struct gpu_flight_key k = {};
    if (!read_record(ctx, &r, &k))
        return 0;
    bind_call(&r);
    u64 enqueue = r.host_enqueue_mono_ns ? r.host_enqueue_mono_ns : r.host_event_mono_ns;
    set_flight(&k, &r, NX_STATE_QUEUED, enqueue, 0);
    return 0;
}

int on_gpu_start(struct pt_regs *ctx) {
    struct nx_record r = {};
    struct gpu_flight_key k = {};
    if (!read_record(ctx, &r, &k))
        return 0;
    // The mapped GPU start; the hook's own time when there is none or the
    // estimate lies in the future (a coarse offset).
    u64 since = r.gpu_start_mono_ns;
    if (!since || since > r.host_event_mono_ns)
        since = r.host_event_mono_ns;
    struct gpu_flight *f = gpu_inflight.lookup(&k);
    if (f) {  // in place: the common case, no new element
        f->start_ns = since;  // before the state: a reader never sees RUNNING since 0
        f->state = NX_STATE_RUNNING;
        return 0;
    }
    // no queued entry (the agent attached after the enqueue, or the map was full)
    set_flight(&k, &r, NX_STATE_RUNNING, r.host_enqueue_mono_ns, since);
    return 0;
}

// Fold a done record's network part into net_series; the part, or NULL.
static __always_inline struct nx_net *net_account(struct pt_regs *ctx, struct nx_record *r, u32 tgid) {
    if (r->size < NX_RECORD_SIZE + NX_NET_SIZE)
        return NULL;
    u32 zero = 0;
    struct nx_net *n = net_scratch.lookup(&zero);
    if (!n || bpf_probe_read_user(n, sizeof(*n), (void *)(PT_REGS_PARM1(ctx) + NX_RECORD_SIZE)) ||
        n->version != NX_NET_VERSION) {
        drop(PD_BAD_RECORD);
        return NULL;
    }
    u64 *f = net_foreign.lookup(&tgid);
    if (f) {
        if (n->foreign_ops > *f)
            *f = n->foreign_ops;
    } else if (n->foreign_ops) {
        u64 v = n->foreign_ops;
        net_foreign.update(&tgid, &v);
    }
    u32 cnt = n->nentries;
    for (int i = 0; i < NX_NET_ENTRIES; i++) {  // a bounded loop (the verifier follows it; no unrolling)
        if (i >= cnt)
            break;
        struct nx_peer_wait *w = &n->e[i];
        struct net_key k = {.comm_hash = r->comm_hash, .rank = r->rank, .peer = w->peer < 0 ? -1 : w->peer,
                            .direction = w->direction ? 1 : 0};
        struct net_val *v = net_series.lookup(&k);
        if (!v) {
            struct net_val z = {};
            if (net_series.insert(&k, &z)) {
                k.peer = -1;  // full: summed as other
                net_series.insert(&k, &z);
            }
            v = net_series.lookup(&k);
            if (!v) {
                drop(PD_NET_FULL);
                continue;
            }
        }
        __sync_fetch_and_add(&v->ops, 1);
        __sync_fetch_and_add(&v->bytes, w->bytes);
        __sync_fetch_and_add(&v->wall_ns[0], w->wall_ns[0]);
        __sync_fetch_and_add(&v->wall_ns[1], w->wall_ns[1]);
        __sync_fetch_and_add(&v->wall_ns[2], w->wall_ns[2]);
        __sync_fetch_and_add(&v->step_ns[0], w->step_ns[0]);
        __sync_fetch_and_add(&v->step_ns[1], w->step_ns[1]);
        __sync_fetch_and_add(&v->step_ns[2], w->step_ns[2]);
    }
    return n;
}

int on_gpu_done(struct pt_regs *ctx) {
    struct nx_record r = {};
    struct gpu_flight_key fk = {};
    if (!read_record(ctx, &r, &fk))
        return 0;
    gpu_inflight.delete(&fk);
    // what the network waited for counts whatever the GPU interval's verdict
    struct nx_net *net = net_account(ctx, &r, fk.tgid);
    // An interval the plugin judged implausible is counted by reason, not
    // histogrammed; a stop before the start is one whichever plugin sent it.
    if (r.flags & NX_F_REJECT_LONG) {
        drop(PD_REJECT_LONG);
        return 0;
    }
    if (r.flags & NX_F_REJECT_EARLY) {
        drop(PD_REJECT_EARLY);
        return 0;
    }
    if (r.flags & NX_F_REJECT_LOST_CHANNEL) {
        drop(PD_REJECT_LOST_CHANNEL);
        return 0;
    }
    if ((r.flags & NX_F_REJECT_REVERSED) ||
        (r.gpu_start_timer && r.gpu_stop_timer && r.gpu_stop_timer < r.gpu_start_timer)) {
        drop(PD_REJECT_REVERSED);
        return 0;
    }
    if (!r.gpu_start_mono_ns || !r.gpu_stop_mono_ns || r.gpu_stop_mono_ns < r.gpu_start_mono_ns) {
        drop(PD_NO_GPU_TIME);
        return 0;
    }
    u64 d = r.gpu_stop_mono_ns - r.gpu_start_mono_ns;
    struct gpu_key k = {.comm_hash = r.comm_hash, .rank = r.rank, .nranks = r.nranks, .op = r.op};
    struct gpu_hist *h = gpu_series.lookup(&k);
    if (!h) {
        u32 zero = 0;
        struct gpu_hist *z = gpu_zero.lookup(&zero);
        if (!z)
            return 0;
        gpu_series.insert(&k, z);  // -EEXIST: another CPU made it first
        h = gpu_series.lookup(&k);
        if (!h) {
            drop(PD_SERIES_FULL);
            return 0;
        }
    }
    u32 b = bucket_of(d);
    if (b >= HIST_SLOTS)
        b = HIST_SLOTS - 1;
    if (r.flags & NX_F_SHARED) {
        // One start/stop for a batch of collectives (docs/metrics.md): its
        // interval is in the histogram once, with the batch's first record.
        drop(PD_SHARED);
    } else {
        __sync_fetch_and_add(&h->count, 1);
        __sync_fetch_and_add(&h->sum_ns, d);
        __sync_fetch_and_add(&h->bytes, r.bytes);
        __sync_fetch_and_add(&h->buckets[b], 1);
    }

    u32 op = r.op;
    u64 *slow = gpu_config.lookup(&op);
    if (!slow || !*slow || d < *slow)
        return 0;
    struct gpu_event *e = gpu_events.ringbuf_reserve(sizeof(struct gpu_event));
    if (!e) {
        count_up(CNT_GPU_EVENTS_LOST);
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    e->comm_hash = r.comm_hash;
    e->seq = r.seq;
    e->bytes = r.bytes;
    e->enqueue_ns = r.host_enqueue_mono_ns;
    e->start_ns = r.gpu_start_mono_ns;
    e->stop_ns = r.gpu_stop_mono_ns;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->rank = r.rank;
    e->nranks = r.nranks;
    e->peer = r.peer;
    e->op = r.op;
    e->kind = r.kind;
    e->nnet = 0;
    if (net) {
        e->nnet = net->nentries < NX_NET_ENTRIES ? net->nentries : NX_NET_ENTRIES;
        bpf_probe_read_kernel(e->net, sizeof(e->net), net->e);
    } else {
        __builtin_memset(e->net, 0, sizeof(e->net));
    }
    gpu_events.ringbuf_submit(e, 0);
    return 0;
}

int on_abandoned(struct pt_regs *ctx) {
    struct nx_record r = {};
    struct gpu_flight_key k = {};
    if (!read_record(ctx, &r, &k))
        return 0;
    gpu_inflight.delete(&k);
    return 0;
}

// delta: 1 init, -1 finalize, 0 an announcement of a live one.
static __always_inline int on_comm(struct pt_regs *ctx, int delta) {
    struct nx_comm c = {};
    if (bpf_probe_read_user(&c, sizeof(c), (void *)PT_REGS_PARM1(ctx)) ||
        c.version != NX_RECORD_VERSION || c.size < NX_COMM_SIZE) {
        drop(PD_BAD_RECORD);
        return 0;
    }
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 now = bpf_ktime_get_ns();
    struct plugin_comm_key ck = {.tgid = tgid, .comm_hash = c.comm_hash};
    if (delta < 0) {
        plugin_comms.delete(&ck);
    } else {
        struct plugin_comm pc = {.rank = c.rank, .nranks = c.nranks, .nnodes = c.nnodes, .last_ns = now};
        if (plugin_comms.update(&ck, &pc))
            drop(PD_COMMS_FULL);
    }
    struct plugin_proc *p = proc_entry(tgid, c.iface_version);
    if (!p)
        return 0;
    if (delta == 0)
        return 0;  // the count is of inits and finalizes seen
    p->last_seen_ns = now;
    if (c.iface_version)
        p->iface_version = c.iface_version;
    __sync_fetch_and_add(&p->comms, delta);
    if (c.dropped > p->dropped)
        p->dropped = c.dropped;
    return 0;
}

int on_comm_init(struct pt_regs *ctx) { return on_comm(ctx, 1); }
int on_comm_fini(struct pt_regs *ctx) { return on_comm(ctx, -1); }
int on_comm_live(struct pt_regs *ctx) { return on_comm(ctx, 0); }

// A process that is gone no longer has the plugin. (Its in-flight entries
// cannot be found without a map walk: the agent's loop drops them.)
TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if ((u32)id != tgid)
        return 0;  // a thread, not the process
    plugin_procs.delete(&tgid);
    net_foreign.delete(&tgid);
    return 0;
}

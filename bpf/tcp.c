// TCP health of NCCL's sockets: retransmits, resets and smoothed RTT, from
// the tcp/ and sock/ tracepoints only (no kprobes, no struct sock layouts:
// every kernel datum here is a tracepoint argument).
//
// Compiled on its own (exporter/sources/tcp.py) after bpf/nccl.c, whose maps
// it imports through bpf/traced.h: traced_threads (thread_traced()) and the
// counters (count_up()). MAX_SOCKETS, MAX_LINKS, TCP_EVENT_PAGES,
// EPHEMERAL_PORT_LO/HI, HAVE_RETRANSMIT_ERR, TCP_EV_*, SRTT_* and CNT_*
// come from the generated header (exporter/records/contract.py).
//
// Attribution: retransmits, resets and tcp_probe mostly run in softirq or
// timer context, where the current task is whoever was interrupted. So the
// owner of a socket is learnt only in process context -- send/recv on it,
// or connect() -- by a thread of a traced process, and kept in sock_owner
// until the socket is closed or destroyed. The send/recv tracepoints fire
// for every socket call of the node: `run` attaches them only in windows
// (TcpSource.owner_duty), opened by user space when a socket may have an
// owner it does not know yet -- among them a connection accepted on a
// traced process's listening port, which this program counts
// (CNT_OWNERS_WANTED).

// tcp_send_reset's `reason` field is an `enum sk_rst_reason` (kernel >= 6.10)
// that the build's kernel headers may lack: BCC copies the field's type from
// the tracepoint format, so give that name a complete 4-byte enum of our own.
#include "traced.h"

#define sk_rst_reason tcp_rst_reason_compat
enum tcp_rst_reason_compat { TCP_RST_REASON_COMPAT_ = 0 };

#define TCP_AF_INET 2
#define TCP_AF_INET6 10
#define TCP_IPPROTO 6
#define TCP_ST_ESTABLISHED 1
#define TCP_ST_SYN_SENT 2
#define TCP_ST_CLOSE 7
#define TCP_ST_LISTEN 10

// Event kinds on tcp_events (TCP_EV_*, from the contract) also say which
// tcp_link_stats field counts it.

// srtt histogram: schema-3 buckets of microseconds, SRTT_SLOTS per link
// (bpf/histogram.h; exporter/records/histogram.py's SRTT: up to 8 s).

struct sock_owner_t {
    u32 tgid;
    u32 tid;
    u64 srtt_sampled_ns;  // ktime of the socket's last srtt sample (tcp_probe)
};

// One link: a local address, a remote one, the service port (see
// link_port) and the socket's owner (tgid, 0 = untraced or unknown).
// IPv4 addresses fill the first 4 bytes; the rest is zero.
struct tcp_link_key {
    u8 saddr[16];
    u8 daddr[16];
    u32 owner;
    u16 family;
    u16 port;
};

struct tcp_link_stats {
    u64 retransmits;      // tcp_retransmit_skb hits (skbs, not segments), err == 0
    u64 failures;         // tcp_retransmit_skb hits with err != 0
    u64 resets_sent;
    u64 resets_received;
};

struct tcp_srtt_hist {
    u64 count;
    u64 sum_us;
    u64 buckets[SRTT_SLOTS];
};

struct tcp_event {
    u64 ts_ns;   // bpf_ktime_get_ns(): CLOCK_MONOTONIC
    u64 seq;     // skb sequence number: not a tracepoint argument here, 0
    u8 saddr[16];
    u8 daddr[16];
    u32 kind;    // TCP_EV_*
    u32 pid;     // owner tgid
    u32 tid;     // owner thread (the one that connected/sent/received first)
    s32 state;   // TCP state (TCP_ESTABLISHED = 1 ...)
    u16 family;
    u16 sport;
    u16 dport;
    u16 pad;
};

// What a tracepoint told us about one socket.
struct tcp_flow {
    u64 sk;
    s32 state;
    u16 family;
    u16 sport;
    u16 dport;
    u8 saddr[16];
    u8 daddr[16];
};

BPF_HASH(sock_owner, u64, struct sock_owner_t, MAX_SOCKETS);
BPF_HASH(tcp_links, struct tcp_link_key, struct tcp_link_stats, MAX_LINKS);
BPF_HASH(tcp_srtt, struct tcp_link_key, struct tcp_srtt_hist, MAX_LINKS);
BPF_RINGBUF_OUTPUT(tcp_events, TCP_EVENT_PAGES);
BPF_ARRAY(tcp_srtt_zero, struct tcp_srtt_hist, 1);  // all zeros, never written

// Sockets already in sock_owner, direct-mapped by pointer in front of the
// hash: a send or receive on a known socket (nearly every one of a traced
// thread) costs one inlined array read instead of a hash lookup. A slot
// only ever claims "this pointer is in sock_owner": tcp_destroy_sock clears
// it before deleting the entry, so a pointer reused by a new socket is never
// taken for a known one. Collisions just fall through to the hash.
#define KNOWN_SOCK_BITS 12
BPF_ARRAY(known_sock, u64, 1 << KNOWN_SOCK_BITS);

static __always_inline u64 *known_slot(u64 sk) {
    u32 slot = pointer_slot(sk, KNOWN_SOCK_BITS);
    return known_sock.lookup(&slot);
}

// Local ports a thread of a traced process listens on (listen() runs in
// its context), so that a connection accepted there -- which becomes
// ESTABLISHED in softirq, its owner unknown until its first send/recv --
// can ask for an owner window. Keyed by port alone: the same port in
// another network namespace only opens a window for nothing. LRU: never
// full, a listener closed without our seeing it just ages out.
BPF_TABLE("lru_hash", u32, u8, traced_listeners, 1024);

static __always_inline int traced_listener(u16 port) {
    u32 key = port;
    return traced_listeners.lookup(&key) != NULL;
}

// ---- socket owners (process context only) ---------------------------------

static __always_inline void tcp_remember_owner(u64 sk) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    if (!thread_traced(tid))
        return;
    u64 *known = known_slot(sk);
    if (known && *known == sk)
        return;
    if (!sock_owner.lookup(&sk)) {  // fires per send/recv: insert only when absent
        struct sock_owner_t o = {.tgid = id >> 32, .tid = tid, .srtt_sampled_ns = 0};
        int err = sock_owner.insert(&sk, &o);
        if (err && err != -17) {  // -EEXIST: another thread of ours won the race
            count_up(CNT_SOCKETS_FULL);
            return;
        }
    }
    if (known)
        *known = sk;
}

TRACEPOINT_PROBE(sock, sock_send_length) {
    if (args->protocol != TCP_IPPROTO)
        return 0;
    tcp_remember_owner((u64)args->sk);
    return 0;
}

TRACEPOINT_PROBE(sock, sock_recv_length) {
    if (args->protocol != TCP_IPPROTO)
        return 0;
    tcp_remember_owner((u64)args->sk);
    return 0;
}

TRACEPOINT_PROBE(sock, inet_sock_set_state) {
    // connect() moves CLOSE -> SYN_SENT, and listen() CLOSE -> LISTEN, in
    // the caller's context. The other changes (an accepted child becoming
    // ESTABLISHED, FIN handling) happen in softirq where the current task
    // is unrelated: accepted sockets are learnt at their first send/recv.
    if (args->protocol != TCP_IPPROTO)
        return 0;
    int to = args->newstate;
    if (to == TCP_ST_SYN_SENT) {
        tcp_remember_owner((u64)args->skaddr);
    } else if (to == TCP_ST_LISTEN) {
        if (thread_traced((u32)bpf_get_current_pid_tgid())) {
            u32 key = args->sport;
            u8 one = 1;
            traced_listeners.update(&key, &one);
        }
    } else if (args->oldstate == TCP_ST_LISTEN && to == TCP_ST_CLOSE) {
        // (not LISTEN -> SYN_RECV: that is a new child, cloned from the listener)
        u32 key = args->sport;
        traced_listeners.delete(&key);
    } else if (to == TCP_ST_ESTABLISHED && args->oldstate != TCP_ST_SYN_SENT &&
               traced_listener(args->sport)) {
        // accepted on a traced listener: its owner is wanted (see the top)
        u64 sk = (u64)args->skaddr;
        if (!sock_owner.lookup(&sk))
            count_up(CNT_OWNERS_WANTED);
    }
    return 0;
}

// A socket's last tracepoint: the owner is forgotten here, not at TCP_CLOSE,
// because the kernel moves a socket to TCP_CLOSE *before* sending the RST of
// an abortive close (unread data, SO_LINGER 0, tcp_disconnect), and that
// reset must still be attributed. Every TCP socket a user thread touched
// ends here (close, orphan timeout, or its TIME_WAIT hand-off).
TRACEPOINT_PROBE(tcp, tcp_destroy_sock) {
    u64 sk = (u64)args->skaddr;
    u64 *known = known_slot(sk);
    if (known && *known == sk)
        *known = 0;  // first: see known_sock
    sock_owner.delete(&sk);
    return 0;
}

// ---- links -------------------------------------------------------------------

// The port that names the service: of sport/dport the one outside the
// ephemeral range if exactly one is, else the lower. NCCL listens on
// ephemeral ports, so its links get the listener's port (always the lower
// one only by chance): cardinality is bounded by listeners, not connections.
static __always_inline u16 tcp_link_port(u16 sport, u16 dport) {
    int s_eph = sport >= EPHEMERAL_PORT_LO && sport <= EPHEMERAL_PORT_HI;
    int d_eph = dport >= EPHEMERAL_PORT_LO && dport <= EPHEMERAL_PORT_HI;
    if (s_eph && !d_eph)
        return dport;
    if (d_eph && !s_eph)
        return sport;
    return sport < dport ? sport : dport;
}

static __always_inline void tcp_link_key_of(struct tcp_link_key *k, struct tcp_flow *f, u32 owner) {
    __builtin_memset(k, 0, sizeof(*k));
    __builtin_memcpy(k->saddr, f->saddr, 16);
    __builtin_memcpy(k->daddr, f->daddr, 16);
    k->owner = owner;
    k->family = f->family;
    k->port = tcp_link_port(f->sport, f->dport);
}

// Count one retransmit/reset on its link; an event if the socket is traced.
static __always_inline void tcp_account(struct tcp_flow *f, u32 kind) {
    struct sock_owner_t *o = sock_owner.lookup(&f->sk);
    struct tcp_link_key k;
    tcp_link_key_of(&k, f, o ? o->tgid : 0);
    struct tcp_link_stats zero = {};
    struct tcp_link_stats *s = tcp_links.lookup_or_try_init(&k, &zero);
    if (!s) {
        count_up(CNT_LINKS_FULL);
    } else if (kind == TCP_EV_RETRANSMIT) {
        __sync_fetch_and_add(&s->retransmits, 1);
    } else if (kind == TCP_EV_RETRANSMIT_FAILED) {
        __sync_fetch_and_add(&s->failures, 1);
    } else if (kind == TCP_EV_SEND_RESET) {
        __sync_fetch_and_add(&s->resets_sent, 1);
    } else {
        __sync_fetch_and_add(&s->resets_received, 1);
    }
    if (!o) {
        // A socket of a traced listener whose owner was missed (no owner
        // window when it was used): ask for one, for its next events.
        if (traced_listener(f->sport))
            count_up(CNT_OWNERS_WANTED);
        return;
    }
    struct tcp_event *e = tcp_events.ringbuf_reserve(sizeof(struct tcp_event));
    if (!e) {
        count_up(CNT_TCP_EVENTS_LOST);
        return;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->seq = 0;
    __builtin_memcpy(e->saddr, f->saddr, 16);
    __builtin_memcpy(e->daddr, f->daddr, 16);
    e->kind = kind;
    e->pid = o->tgid;
    e->tid = o->tid;
    e->state = f->state;
    e->family = f->family;
    e->sport = f->sport;
    e->dport = f->dport;
    e->pad = 0;
    tcp_events.ringbuf_submit(e, 0);
}

// The 28-byte sockaddr_in / sockaddr_in6 buffers of tcp_send_reset and
// tcp_probe: family (host order), port (network order), address.
static __always_inline void tcp_from_sockaddrs(struct tcp_flow *f, const void *src, const void *dst) {
    u8 sa[28], da[28];
    bpf_probe_read_kernel(sa, sizeof(sa), src);
    bpf_probe_read_kernel(da, sizeof(da), dst);
    u16 family;
    __builtin_memcpy(&family, sa, 2);
    f->family = family;
    f->sport = ((u16)sa[2] << 8) | sa[3];
    f->dport = ((u16)da[2] << 8) | da[3];
    if (family == TCP_AF_INET6) {
        __builtin_memcpy(f->saddr, sa + 8, 16);
        __builtin_memcpy(f->daddr, da + 8, 16);
    } else {
        __builtin_memcpy(f->saddr, sa + 4, 4);
        __builtin_memcpy(f->daddr, da + 4, 4);
    }
}

// Tracepoints with family, sport, dport, saddr[4]/daddr[4], saddr_v6/daddr_v6.
#define FLOW_FROM_ARGS(f, args)                                                    \
    do {                                                                           \
        __builtin_memset(&(f), 0, sizeof(f));                                      \
        (f).sk = (u64)(args)->skaddr;                                              \
        (f).family = (args)->family;                                               \
        (f).sport = (args)->sport;                                                 \
        (f).dport = (args)->dport;                                                 \
        if ((f).family == TCP_AF_INET6) {                                          \
            bpf_probe_read_kernel((f).saddr, 16, (args)->saddr_v6);                \
            bpf_probe_read_kernel((f).daddr, 16, (args)->daddr_v6);                \
        } else {                                                                   \
            bpf_probe_read_kernel((f).saddr, 4, (args)->saddr);                    \
            bpf_probe_read_kernel((f).daddr, 4, (args)->daddr);                    \
        }                                                                          \
    } while (0)

// Every hit of tcp_retransmit_skb, counted beside the program below. The
// kernel skips a classic tracepoint's programs whenever another tracing
// program is running on that CPU (a softirq retransmit that interrupts a
// uprobe or a send/recv program: the programs' recursion_misses), and can
// drop a hit before them without a count; a raw tracepoint program is
// skipped only if it re-enters itself. HITS - SEEN is the retransmits in no
// link count and no event: nccl_exporter_retransmits_missed_total. Defined
// first so that BCC attaches it first: a hit between the two attaches
// counts as missed, not as seen-but-unhit.
RAW_TRACEPOINT_PROBE(tcp_retransmit_skb) {
    count_up(CNT_RETRANSMIT_HITS);
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb) {
    count_up(CNT_RETRANSMIT_SEEN);
    struct tcp_flow f;
    FLOW_FROM_ARGS(f, args);
    f.state = args->state;
    u32 kind = TCP_EV_RETRANSMIT;
#if HAVE_RETRANSMIT_ERR
    if (args->err != 0)  // the attempt failed (kernel >= 6.17): nothing was sent
        kind = TCP_EV_RETRANSMIT_FAILED;
#endif
    tcp_account(&f, kind);
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_send_reset) {
    struct tcp_flow f;
    __builtin_memset(&f, 0, sizeof(f));
    f.sk = (u64)args->skaddr;  // NULL for a reset answering a packet of no socket
    f.state = args->state;
    // The kernel fills saddr with the resetting (local) side, also when it
    // builds them from the offending packet.
    tcp_from_sockaddrs(&f, args->saddr, args->daddr);
    tcp_account(&f, TCP_EV_SEND_RESET);
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_receive_reset) {
    struct tcp_flow f;
    FLOW_FROM_ARGS(f, args);
    f.state = 0;  // not an argument of this tracepoint
    tcp_account(&f, TCP_EV_RECEIVE_RESET);
    return 0;
}

// ---- smoothed RTT of traced sockets ----------------------------------------

TRACEPOINT_PROBE(tcp, tcp_probe) {
    u64 sk = (u64)args->skaddr;
    struct sock_owner_t *o = sock_owner.lookup(&sk);
    if (!o)
        return 0;
    u32 srtt = args->srtt;  // us (the kernel's srtt_us >> 3)
    if (srtt == 0)          // no RTT sample yet
        return 0;
    // One sample per socket per SRTT_SAMPLE_NS: a busy socket gets a segment
    // every few µs, and the rest of this program (two address copies, a
    // 40-byte key, its hash lookup) is most of the cost per segment.
    u64 now = bpf_ktime_get_ns();
    if (now - o->srtt_sampled_ns < SRTT_SAMPLE_NS)
        return 0;
    o->srtt_sampled_ns = now;
    struct tcp_flow f;
    __builtin_memset(&f, 0, sizeof(f));
    tcp_from_sockaddrs(&f, args->saddr, args->daddr);
    struct tcp_link_key k;
    tcp_link_key_of(&k, &f, o->tgid);
    struct tcp_srtt_hist *h = tcp_srtt.lookup(&k);
    if (!h) {
        // too big for the BPF stack: take the zero value from the map itself
        u32 zero_key = 0;
        struct tcp_srtt_hist *zero = tcp_srtt_zero.lookup(&zero_key);
        if (!zero)
            return 0;
        tcp_srtt.insert(&k, zero);
        h = tcp_srtt.lookup(&k);
        if (!h) {
            count_up(CNT_LINKS_FULL);
            return 0;
        }
    }
    u32 b = SCHEMA3_SLOT(SRTT, srtt);
    if (b >= SRTT_SLOTS)
        b = SRTT_SLOTS - 1;
    __sync_fetch_and_add(&h->count, 1);
    __sync_fetch_and_add(&h->sum_us, srtt);
    __sync_fetch_and_add(&h->buckets[b], 1);
    return 0;
}

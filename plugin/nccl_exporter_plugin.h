/*
 * nccl_exporter_plugin.h -- what the nccl-exporter profiler plugin hands to
 * the agent.
 *
 * The plugin calls one of the hook functions below with a pointer to a
 * record on its stack.  The hooks are empty, exported, never inlined; the
 * agent's BPF program attaches uprobes to them by file path and copies the
 * record with one bpf_probe_read_user(sizeof(struct nccl_exporter_record)).
 * With no uprobe attached a hook costs one call/return.
 *
 * Layout rules (the BPF side depends on them): fixed size, no pointers,
 * every field naturally aligned, little-endian x86-64/aarch64, `version`
 * bumped on any incompatible change, new fields only appended (and `size`
 * grows).  Offsets are asserted at compile time below and printed by
 * `tests/plugin/abi_dump`.
 *
 * Clocks:
 *   *_mono_ns  CLOCK_MONOTONIC ns (= bpf_ktime_get_ns() in the agent).
 *   gpu_*_timer  raw GPU %globaltimer ns as NCCL delivers it in KernelCh
 *              pTimer; epoch unspecified by NCCL.
 *   gpu_*_mono_ns  those timers mapped to CLOCK_MONOTONIC with
 *              gpu_to_mono_offset_ns (mono = timer + offset); the offset is
 *              estimated per communicator (see docs/plugin.md).
 */
#ifndef NCCL_EXPORTER_PLUGIN_H
#define NCCL_EXPORTER_PLUGIN_H

#include <stdint.h>

#define NCCL_EXPORTER_RECORD_VERSION 1

/* kind */
#define NCCL_EXPORTER_KIND_COLL 1
#define NCCL_EXPORTER_KIND_P2P 2

/* state, i.e. which hook delivered the record */
#define NCCL_EXPORTER_STATE_QUEUED 1    /* enqueued on the host, GPU not started */
#define NCCL_EXPORTER_STATE_RUNNING 2   /* first channel started on the GPU */
#define NCCL_EXPORTER_STATE_DONE 3      /* every expected channel stopped */
#define NCCL_EXPORTER_STATE_ABANDONED 4 /* reclaimed without completing */

/* flags */
#define NCCL_EXPORTER_F_START_LATE 0x1     /* a KernelCh start was delivered after its kernel had ended */
#define NCCL_EXPORTER_F_DTYPE_GUESSED 0x2  /* NCCL said "Unknown" datatype: counted as 1-byte (ncclUint8) */
#define NCCL_EXPORTER_F_NO_GPU_TIME 0x4    /* no KernelCh stop seen (abandoned records) */
#define NCCL_EXPORTER_F_EXTRA_CHANNELS 0x8 /* more KernelCh children than nChannels announced */
#define NCCL_EXPORTER_F_OFFSET_COARSE 0x10 /* fewer than 2 clock samples behind the mapping */
#define NCCL_EXPORTER_F_FINALIZED 0x20     /* abandoned because the communicator was finalized */
#define NCCL_EXPORTER_F_AGED 0x40          /* abandoned because it exceeded the maximum age */
/* A done record whose GPU interval is implausible against the host's own
 * times (docs/plugin.md, "Implausible GPU intervals"); the agent counts it by
 * reason instead of putting it in the histograms.  At most one is set. */
#define NCCL_EXPORTER_F_REJECT_LONG 0x80     /* GPU interval longer than host enqueue .. delivery + clock error */
#define NCCL_EXPORTER_F_REJECT_EARLY 0x100   /* GPU start before the host enqueue by more than the clock error */
#define NCCL_EXPORTER_F_REJECT_REVERSED 0x200 /* latest stop timer before the earliest start timer */
/* A channel whose KernelCh start and stop NCCL <= 2.30 never sends (its stop
 * went out through an older operation's handle; docs/plugin.md "NCCL habits"):
 * the interval lacks that channel. Counted by this reason, not histogrammed. */
#define NCCL_EXPORTER_F_REJECT_LOST_CHANNEL 0x1000
#define NCCL_EXPORTER_F_REJECTED \
  (NCCL_EXPORTER_F_REJECT_LONG | NCCL_EXPORTER_F_REJECT_EARLY | NCCL_EXPORTER_F_REJECT_REVERSED | \
   NCCL_EXPORTER_F_REJECT_LOST_CHANNEL)
/* Done although ProxyOps of it are still open: NCCL never stops them for
 * CollNet and the SHM/P2P copy-engine modes (docs/plugin.md "NCCL habits");
 * the network part (if any) is what was seen until then. */
#define NCCL_EXPORTER_F_NET_UNFINISHED 0x2000
/* NCCL habits (docs/plugin.md, "NCCL habits"); high bits, so that flags other
 * habits add below them stay apart. */
#define NCCL_EXPORTER_F_UNTIMED 0x100000          /* no GPU interval exists for it (a rank's Send/Recv to itself on \
                                                     NCCL <= 2.30, counts-only mask): done at its enqueue, counted */
#define NCCL_EXPORTER_F_CHANNELS_UNKNOWN 0x200000 /* NCCL announced 0 channels (CollNet, NVLS): done once every \
                                                     KernelCh started so far stopped */
#define NCCL_EXPORTER_F_SHARED 0x400000           /* its GPU interval is the one of the operation done before it \
                                                     on this communicator (one batch): count it once */

struct nccl_exporter_record {
  uint32_t version;            /*   0 NCCL_EXPORTER_RECORD_VERSION */
  uint32_t size;               /*   4 sizeof(struct nccl_exporter_record) */
  uint64_t id;                 /*   8 unique per process, key for in-flight maps */
  uint64_t comm_hash;          /*  16 NCCL commHash / commId given at init */
  uint64_t seq;                /*  24 coll: NCCL seqNumber (per comm+op, from 0);
                                       p2p: order per (comm, peer, op), from 0 */
  uint64_t count;              /*  32 elements */
  uint64_t bytes;              /*  40 count * datatype size (per rank, like the uprobe path) */
  uint64_t host_enqueue_mono_ns; /* 48 CLOCK_MONOTONIC at startEvent(Coll/P2p) */
  uint64_t host_event_mono_ns; /*  56 CLOCK_MONOTONIC when this hook fired */
  uint64_t gpu_start_timer;    /*  64 earliest KernelCh start pTimer (0 = none yet) */
  uint64_t gpu_stop_timer;     /*  72 latest KernelCh stop pTimer (0 = none yet) */
  uint64_t gpu_start_mono_ns;  /*  80 gpu_start_timer mapped to CLOCK_MONOTONIC (0 = none) */
  uint64_t gpu_stop_mono_ns;   /*  88 gpu_stop_timer mapped to CLOCK_MONOTONIC (0 = none) */
  int64_t gpu_to_mono_offset_ns; /* 96 mono = timer + offset, estimate at this hook */
  int32_t rank;                /* 104 comm rank given at init */
  int32_t nranks;              /* 108 */
  int32_t peer;                /* 112 p2p peer; coll root (-1 when the op has none) */
  uint32_t flags;              /* 116 NCCL_EXPORTER_F_* */
  uint8_t kind;                /* 120 NCCL_EXPORTER_KIND_* */
  uint8_t op;                  /* 121 exporter op code (contract.COLLECTIVE_OPS), 0 = other */
  uint8_t datatype;            /* 122 ncclDataType_t, 255 = unknown */
  uint8_t state;               /* 123 NCCL_EXPORTER_STATE_* */
  uint8_t nchannels;           /* 124 KernelCh children expected */
  uint8_t channels_started;    /* 125 */
  uint8_t channels_stopped;    /* 126 */
  uint8_t iface_version;       /* 127 profiler interface NCCL called us through (4..7) */
  char op_name[16];            /* 128 NCCL's func string, NUL-terminated, truncated */
};                             /* 144 bytes */

/* ---- the network part of a done record (proxy accounting) --------------
 *
 * With proxy accounting on (NCCL_EXPORTER_PROFILER_PROXY, docs/plugin.md
 * "Network time per peer") a done record carries, right after the 144 bytes
 * above, what the operation's network transfers waited for: the plugin sums
 * NCCL's ProxyStep states per (peer, direction) and keeps the
 * NCCL_EXPORTER_NET_TOP_K peers that waited most (wall time, both directions)
 * by rank; the rest are summed into peer = -1 ("other").  `size` covers it
 * (144 + sizeof(struct nccl_exporter_net)); a record of size 144 has none.
 * The part has its own version; version 1 of the base record is unchanged,
 * so an agent that knows only the base reads the first 144 bytes as before.
 *
 * Phases, per direction, in NCCL's order (contract.NETWORK_PHASES):
 *   send: 0 send_gpu_wait, 1 send_peer_wait, 2 send_wait
 *   recv: 0 recv_wait, 1 recv_flush_wait, 2 recv_gpu_wait
 * wall_ns: time with at least one step of that (peer, direction) in the phase
 * (over every channel); step_ns: the same summed over steps.  bytes: the sum of
 * transSize (given at send_wait / recv_flush_wait): bytes on the wire, the size
 * NCCL hands to isend/irecv, LL/LL128 flag lines included (NCCL 2.28.9
 * src/transport/net.cc:1325, 1520), not the payload.  For "other", each figure
 * is the sum over the peers folded into it. */
#define NCCL_EXPORTER_NET_VERSION 1
#define NCCL_EXPORTER_NET_TOP_K 4
#define NCCL_EXPORTER_NET_ENTRIES (2 * NCCL_EXPORTER_NET_TOP_K + 2)
#define NCCL_EXPORTER_NET_PHASES 3
#define NCCL_EXPORTER_NET_SEND 0
#define NCCL_EXPORTER_NET_RECV 1
/* net flags */
#define NCCL_EXPORTER_NET_F_TABLE_FULL 0x1 /* more (peer, direction) pairs than the plugin tracks per op: summed as other */
#define NCCL_EXPORTER_NET_F_STEP_REUSED 0x2 /* a step started while the step 8 before it was still open (closed then) */
#define NCCL_EXPORTER_NET_F_UNFINISHED 0x4 /* ProxyOps still open when the record went out (F_NET_UNFINISHED) */

struct nccl_exporter_peer_wait {
  int32_t peer;                /*  0 communicator rank; -1 = other */
  uint32_t direction;          /*  4 NCCL_EXPORTER_NET_SEND / _RECV */
  uint64_t bytes;              /*  8 */
  uint64_t wall_ns[NCCL_EXPORTER_NET_PHASES]; /* 16 */
  uint64_t step_ns[NCCL_EXPORTER_NET_PHASES]; /* 40 */
};                             /* 64 bytes */

struct nccl_exporter_net {
  uint32_t version;            /*  0 NCCL_EXPORTER_NET_VERSION */
  uint32_t top_k;              /*  4 NCCL_EXPORTER_NET_TOP_K */
  uint32_t nentries;           /*  8 entries used in e[] */
  uint32_t npeers;             /* 12 distinct peers with figures (before the top-K cut) */
  uint32_t flags;              /* 16 NCCL_EXPORTER_NET_F_* */
  uint32_t proxy_ops;          /* 20 ProxyOps of this operation */
  uint64_t foreign_ops;        /* 24 process-wide: ProxyOps of another pid (PXN) ignored so far */
  struct nccl_exporter_peer_wait e[NCCL_EXPORTER_NET_ENTRIES]; /* 32 */
};                             /* 672 bytes */

/* What nccl_exporter_gpu_done gets with proxy accounting on. */
struct nccl_exporter_done {
  struct nccl_exporter_record r; /*   0 r.size = sizeof(struct nccl_exporter_done) */
  struct nccl_exporter_net net;  /* 144 */
};                               /* 816 bytes */

/* Comm identity, delivered at init and finalize. */
struct nccl_exporter_comm {
  uint32_t version;            /*  0 NCCL_EXPORTER_RECORD_VERSION */
  uint32_t size;               /*  4 */
  uint64_t comm_hash;          /*  8 */
  int32_t rank;                /* 16 */
  int32_t nranks;              /* 20 */
  int32_t nnodes;              /* 24 */
  uint32_t iface_version;      /* 28 */
  uint64_t pending;            /* 32 finalize: records still open (abandoned now) */
  uint64_t dropped;            /* 40 process-wide: events dropped for lack of pool slots */
  char name[32];               /* 48 config.commName or "" */
};                             /* 80 bytes */

#ifdef __cplusplus
extern "C" {
#endif
/* The hooks.  They do nothing; they exist to be uprobed. */
void nccl_exporter_coll_queued(const struct nccl_exporter_record *r);
void nccl_exporter_gpu_start(const struct nccl_exporter_record *r);
void nccl_exporter_gpu_done(const struct nccl_exporter_record *r);
void nccl_exporter_abandoned(const struct nccl_exporter_record *r);
void nccl_exporter_comm_init(const struct nccl_exporter_comm *c);
void nccl_exporter_comm_fini(const struct nccl_exporter_comm *c);
/* Every live communicator, once per NCCL_EXPORTER_PROFILER_ANNOUNCE_MS
 * (default 1 s), from the plugin's own thread: an agent that attached after
 * the init learns it (docs/plugin.md, "Communicators made before the agent"). */
void nccl_exporter_comm_live(const struct nccl_exporter_comm *c);
#ifdef __cplusplus
}
#endif

#endif

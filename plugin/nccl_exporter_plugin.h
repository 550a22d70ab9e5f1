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
#define NCCL_EXPORTER_F_REJECTED \
  (NCCL_EXPORTER_F_REJECT_LONG | NCCL_EXPORTER_F_REJECT_EARLY | NCCL_EXPORTER_F_REJECT_REVERSED)

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

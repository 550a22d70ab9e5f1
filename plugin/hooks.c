/*
 * hooks.c -- the hook functions the agent uprobes, and the record layout it reads
 * (nccl_exporter_plugin.h).  Their names and their first bytes are an ABI:
 * tests/test_plugin_abi.py checks both in the built library.
 */
#include "internal.h" /* first: it includes glibc_floor.h before any system header */

_Static_assert(sizeof(struct nccl_exporter_record) == 144, "record layout");
_Static_assert(offsetof(struct nccl_exporter_record, comm_hash) == 16, "record layout");
_Static_assert(offsetof(struct nccl_exporter_record, gpu_start_timer) == 64, "record layout");
_Static_assert(offsetof(struct nccl_exporter_record, rank) == 104, "record layout");
_Static_assert(offsetof(struct nccl_exporter_record, kind) == 120, "record layout");
_Static_assert(offsetof(struct nccl_exporter_record, op_name) == 128, "record layout");
_Static_assert(sizeof(struct nccl_exporter_comm) == 80, "comm layout");
_Static_assert(sizeof(struct nccl_exporter_peer_wait) == 64, "peer wait layout");
_Static_assert(offsetof(struct nccl_exporter_net, e) == 32 && sizeof(struct nccl_exporter_net) == 672, "net layout");
_Static_assert(offsetof(struct nccl_exporter_done, net) == 144 && sizeof(struct nccl_exporter_done) == 816,
               "done record layout");
_Static_assert(sizeof(nxp_descr_v4) == 104 && sizeof(nxp_descr_v5) == 112 &&
               sizeof(nxp_descr_v6) == 112 && sizeof(nxp_descr_v7) == 136, "descriptor sizes");

/* ------------------------------------------------------------------------ */
/* Hooks: empty on purpose, exported, opaque to the compiler (noipa: every   */
/* call is kept and the record is in memory before it).                     */
/*                                                                          */
/* On x86-64 a hook is a 5-byte nop and a ret, and the agent's uprobe sits  */
/* on the nop. A kernel that optimizes uprobes (this project's 6.18 does)   */
/* rewrites that nop into a call to its uprobe trampoline after the first   */
/* hit: ~0.2 us a hit on this VM, against ~14 us for an int3 trap followed  */
/* by a single-step of a `ret`, which x86 uprobes cannot emulate            */
/* (bench/plugin_cost.py, docs/plugin.md "Cost"). That call pushes a return */
/* address below rsp; at a function's entry nothing lives there. A kernel   */
/* without the optimization single-steps the nop as it did the ret.         */
/* tests/test_plugin_abi.py checks the bytes of the built library.          */

#if defined(__x86_64__)
#define HOOK __attribute__((visibility("default"), naked, noipa, used))
#define HOOK_BODY { __asm__ volatile(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00\n\tret"); }
#else
#define HOOK __attribute__((visibility("default"), noipa, used))
#define HOOK_BODY { __asm__ volatile("" ::: "memory"); }
#endif

HOOK void nccl_exporter_coll_queued(const struct nccl_exporter_record *r) HOOK_BODY
HOOK void nccl_exporter_gpu_start(const struct nccl_exporter_record *r) HOOK_BODY
HOOK void nccl_exporter_gpu_done(const struct nccl_exporter_record *r) HOOK_BODY
HOOK void nccl_exporter_abandoned(const struct nccl_exporter_record *r) HOOK_BODY
HOOK void nccl_exporter_comm_init(const struct nccl_exporter_comm *r) HOOK_BODY
HOOK void nccl_exporter_comm_fini(const struct nccl_exporter_comm *r) HOOK_BODY
HOOK void nccl_exporter_comm_live(const struct nccl_exporter_comm *r) HOOK_BODY
/* Direct (non-PLT) calls to the same addresses the uprobes attach to. */
extern void hook_coll_queued(const struct nccl_exporter_record *r) __attribute__((visibility("hidden"), alias("nccl_exporter_coll_queued")));
extern void hook_gpu_start(const struct nccl_exporter_record *r) __attribute__((visibility("hidden"), alias("nccl_exporter_gpu_start")));
extern void hook_gpu_done(const struct nccl_exporter_record *r) __attribute__((visibility("hidden"), alias("nccl_exporter_gpu_done")));
extern void hook_abandoned(const struct nccl_exporter_record *r) __attribute__((visibility("hidden"), alias("nccl_exporter_abandoned")));
extern void hook_comm_init(const struct nccl_exporter_comm *r) __attribute__((visibility("hidden"), alias("nccl_exporter_comm_init")));
extern void hook_comm_fini(const struct nccl_exporter_comm *r) __attribute__((visibility("hidden"), alias("nccl_exporter_comm_fini")));
extern void hook_comm_live(const struct nccl_exporter_comm *r) __attribute__((visibility("hidden"), alias("nccl_exporter_comm_live")));

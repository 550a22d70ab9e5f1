// Library discovery without polling: the dynamic loader calls
// _dl_debug_state() (the r_debug protocol that debuggers use) every time a
// process's list of loaded objects changes -- at start-up after the
// DT_NEEDED libraries are mapped, and before and after every dlopen and
// dlclose. A uprobe there says "this process just mapped or unmapped a
// library"; user space (exporter/sources/loader.py) then reads that one
// process's /proc/<pid>/maps and attaches to any new libnccl (or plugin).
//
// Also: sched_process_exec, so a process started from another loader file
// (a container's own ld.so) is looked at once, and its loader probed.
//
// No NCCL state here and no maps of bpf/traced.h: this program works on its
// own. Read by exporter/sources/loader.py.

#include <uapi/linux/ptrace.h>

// LOADER_EV_LINK_MAP: _dl_debug_state(), a library was (un)mapped;
// LOADER_EV_EXEC: a process exec'd a new program (from the contract).

struct loader_event {
    u32 pid;   // tgid
    u32 kind;  // LOADER_EV_*
    u64 ts_ns; // bpf_ktime_get_ns()
};

BPF_RINGBUF_OUTPUT(loader_events, 16);  // 64 KiB: an event is 16 bytes
BPF_ARRAY(loader_lost, u64, 1);

static __always_inline void loader_emit(u32 kind) {
    struct loader_event *e = loader_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        u32 zero = 0;
        u64 *lost = loader_lost.lookup(&zero);
        if (lost)
            __sync_fetch_and_add(lost, 1);
        return;
    }
    e->pid = bpf_get_current_pid_tgid() >> 32;
    e->kind = kind;
    e->ts_ns = bpf_ktime_get_ns();
    // Wake the agent now: it has a library to attach before the first call.
    loader_events.ringbuf_submit(e, 0);
}

// uprobe on the loader's _dl_debug_state (void; no arguments to read).
int on_link_map_change(struct pt_regs *ctx) {
    loader_emit(LOADER_EV_LINK_MAP);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec) {
    loader_emit(LOADER_EV_EXEC);
    return 0;
}

"""The plugin source: bpf/plugin.c loaded, attached to profiler plugin files,
and its maps as records (GpuSeries, GpuInflight, PluginProcess).

nccl-exporter's NCCL profiler plugin (plugin/, docs/plugin.md) calls empty
hook functions with a fixed-layout record; uprobes on them, by file path,
cover every process that loaded that file. The files: the plugin this
installation builds (exporter/sources/plugin/build.py) and any
libnccl-profiler*.so that running processes have mapped and that exports the
hooks (a copy placed on a hostPath, say). Needs bpf/nccl.c loaded first
(Program). Reading never writes kernel state; `forget_dead_processes` is for
the agent's loop.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from exporter.records import contract
from exporter.records.events import GpuCall, GpuInflight, GpuSeries, NetworkSeries, PeerWait, PluginComm, PluginProcess
from exporter.sources.base import Source
from exporter.sources.bpf import ClockOffset, Program, ProbeError, forget_dead
from exporter.sources.nccl import elf

# hook symbol -> BPF function of bpf/plugin.c
HOOKS = {
    "nccl_exporter_coll_queued": "on_coll_queued",
    "nccl_exporter_gpu_start": "on_gpu_start",
    "nccl_exporter_gpu_done": "on_gpu_done",
    "nccl_exporter_abandoned": "on_abandoned",
    "nccl_exporter_comm_init": "on_comm_init",
    "nccl_exporter_comm_fini": "on_comm_fini",
    "nccl_exporter_comm_live": "on_comm_live",
}
# Hooks a plugin file built before them lacks: attached where present.
OPTIONAL_HOOKS = {"nccl_exporter_comm_live"}
STATES = {1: "queued", 2: "running"}
KINDS = {1: "coll", 2: "p2p"}  # NCCL_EXPORTER_KIND_* (plugin/nccl_exporter_plugin.h)
# Slots of plugin_drops (PD_* in bpf/plugin.c)
DROPS = {"gpu_series_full": 0, "gpu_inflight_full": 1, "bad_record": 2, "plugin_procs_full": 3,
         "no_gpu_time": 4,
         **{f"rejected_{reason}": contract.GPU_REJECT_SLOTS[reason] for reason in contract.GPU_REJECT_REASONS},
         "plugin_comms_full": 8, "net_series_full": 9, "shared": 10}
DIRECTIONS = ("send", "recv")  # NCCL_EXPORTER_NET_SEND / _RECV
# Capacity of each map this program owns, for nccl_exporter_map_capacity.
MAP_CAPACITY = {
    "gpu_series": contract.GPU_MAX_SERIES,
    "gpu_inflight": contract.GPU_MAX_INFLIGHT,
    "plugin_procs": contract.PLUGIN_MAX_PROCS,
    "plugin_comms": contract.MAX_COMMS,
    "net_series": contract.NET_MAX_SERIES,
}
# (drop slot, map) as exported by nccl_exporter_map_full_total{map=...}
MAP_FULL = (("gpu_series_full", "gpu_series"), ("gpu_inflight_full", "gpu_inflight"),
            ("plugin_procs_full", "plugin_procs"), ("plugin_comms_full", "plugin_comms"),
            ("net_series_full", "net_series"))
NAME_PREFIX = "libnccl-profiler"


def built_plugin() -> str | None:
    """The plugin this installation builds: the existing file, else built now
    (needs gcc); None when neither works."""
    from exporter.sources.plugin import build

    lib = build.default_outdir() / build.LIB_NAME
    if lib.is_file():
        return str(lib.resolve())
    try:
        return str(build.build_plugin())
    except Exception:  # noqa: BLE001 - no plugin when it cannot be built
        return None


def mapped_plugins(pids=None, proc: str = "/proc") -> dict[str, set[int]]:
    """libnccl-profiler*.so files mapped by processes (all, or `pids`): path -> pids."""
    out: dict[str, set[int]] = {}
    if pids is None:
        pids = [int(d) for d in os.listdir(proc) if d.isdigit()]
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/maps") as f:
                for line in f:
                    if NAME_PREFIX not in line:
                        continue
                    path = line.split(None, 5)[-1].strip()
                    if path.startswith("/") and os.path.basename(path).startswith(NAME_PREFIX) \
                            and ".so" in os.path.basename(path):
                        # the process's view of the file (containers: its mount namespace)
                        out.setdefault(f"{proc}/{pid}/root{path}" if proc != "/" else path, set()).add(pid)
        except OSError:
            continue
    return out


def has_hooks(path: str) -> bool:
    """Does the file export the plugin's hooks (ours, possibly renamed), in
    code for this machine's CPU (elf.runs_here)?"""
    try:
        return elf.runs_here(path) and "nccl_exporter_gpu_done" in elf.exported_functions(path)
    except Exception:  # noqa: BLE001 - unreadable or not an ELF: not ours
        return False


class PluginSource(Program, Source):
    """bpf/plugin.c: GPU histograms, GPU in-flight collectives, processes with the plugin.

    live_comms() -> the NCCL commHashes of the communicators the NCCL source
    knows now: network series expire with their communicator (prune;
    docs/network.md). None: they are never expired."""

    def __init__(self, clock: ClockOffset | None = None, live_comms=None):
        self.clock = clock or ClockOffset()
        self.live_comms = live_comms
        super().__init__("plugin", extra_cflags=(
            f"-DGPU_MAX_SERIES={contract.GPU_MAX_SERIES}",
            f"-DGPU_MAX_INFLIGHT={contract.GPU_MAX_INFLIGHT}",
            f"-DPLUGIN_MAX_PROCS={contract.PLUGIN_MAX_PROCS}",
            f"-DGPU_EVENT_PAGES={contract.GPU_EVENT_PAGES}",
            f"-DNET_MAX_SERIES={contract.NET_MAX_SERIES}",
        ))
        self.net_seen: dict[int, float] = {}  # NCCL commHash -> monotonic s it was last live (expire_network)
        self.net_ops: dict[int, int] = {}  # NCCL commHash -> operations counted, at the last expire_network
        self.attached: dict[str, tuple[int, int]] = {}  # path -> (st_dev, st_ino)
        self.paths: list[str] = []

    # --- slow GPU operations ---------------------------------------------------

    def set_slow_threshold(self, op: str, ns: int) -> None:
        """GPU operations of `op` at least `ns` long become GpuCall events; 0: none."""
        cfg = self["gpu_config"]
        cfg[cfg.Key(contract.OP_CODES[op])] = cfg.Leaf(int(ns))

    def decode_event(self, data) -> GpuCall:
        e = self["gpu_events"].event(data)
        return GpuCall(op=contract.op_name(e.op), pid=e.pid, tid=e.tid, comm=e.comm_hash, seq=e.seq,
                       rank=e.rank, nranks=e.nranks, peer=e.peer, kind=KINDS.get(e.kind, f"kind{e.kind}"),
                       bytes=e.bytes, enqueue_ns=e.enqueue_ns, start_ns=e.start_ns,
                       duration_ns=e.stop_ns - e.start_ns,
                       enqueue_real_ns=self.clock.to_realtime(e.enqueue_ns) if e.enqueue_ns else 0,
                       start_real_ns=self.clock.to_realtime(e.start_ns),
                       peer_waits=peer_waits(e.net, e.nnet))

    def on_event(self, callback) -> None:
        """Call `callback(GpuCall)` for each slow GPU operation, from the ring buffer poll."""
        self.open_ring("gpu_events", self.decode_event, callback)

    # --- attaching ---------------------------------------------------------------

    def attach(self, path: str) -> bool:
        """Uprobes on every hook of the plugin file `path`; False when that file
        (the same inode) is attached already. ProbeError when it has no hooks."""
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except OSError as e:
            raise ProbeError(f"cannot attach to the profiler plugin {path}: {e.strerror}") from None
        ident = (st.st_dev, st.st_ino)
        if ident in self.attached.values():
            return False
        if not elf.runs_here(real):  # another architecture's build (qemu-user maps it): never probed
            raise ProbeError(f"cannot attach to the profiler plugin {path}: not code for this machine's CPU")
        done = []
        exported = set()
        try:
            exported = elf.exported_functions(real)
        except Exception:  # noqa: BLE001 - exports unreadable: attach the hooks that are not optional
            pass
        try:
            for sym, fn in HOOKS.items():
                if sym in OPTIONAL_HOOKS and sym not in exported:
                    continue
                self.bpf.attach_uprobe(name=real, sym=sym, fn_name=fn)
                done.append(sym)
        except Exception as e:  # noqa: BLE001 - undone and raised as ProbeError below
            for sym in done:
                try:
                    self.bpf.detach_uprobe(name=real, sym=sym)
                except Exception:  # noqa: BLE001 - best effort while undoing
                    pass
            raise ProbeError(f"cannot attach to the profiler plugin {path}: {e}".splitlines()[0]) from None
        self.attached[real] = ident
        self.paths.append(real)
        return True

    def discover(self, pids=None, proc: str = "/proc") -> list[str]:
        """Attach to plugin files mapped by processes (all, or `pids`) not yet
        attached; returns the paths attached now."""
        new = []
        for path in sorted(mapped_plugins(pids, proc)):
            try:
                st = os.stat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in self.attached.values() or not has_hooks(path):
                continue
            try:
                if self.attach(path):
                    new.append(path)
            except ProbeError:
                continue
        return new

    # --- reading -----------------------------------------------------------------

    def series(self) -> list[GpuSeries]:
        return [
            GpuSeries(op=contract.op_name(k.op), comm=k.comm_hash, rank=k.rank, nranks=k.nranks,
                      calls=v.count, bytes=v.bytes, sum_ns=v.sum_ns, buckets=tuple(v.buckets))
            for k, v in self["gpu_series"].items()
        ]

    def inflight(self) -> list[GpuInflight]:
        out = []
        for k, v in self["gpu_inflight"].items():
            state = STATES.get(v.state)
            if state is None:
                continue
            out.append(GpuInflight(
                pid=k.tgid, id=k.id, op=contract.op_name(v.op), comm=v.comm_hash, rank=v.rank,
                nranks=v.nranks, seq=v.seq, state=state,
                since_ns=v.start_ns if state == "running" else v.enqueue_ns))
        return out

    def processes(self) -> list[PluginProcess]:
        return [
            PluginProcess(pid=k.value, first_seen_ns=v.first_seen_ns, last_seen_ns=v.last_seen_ns,
                          comms=v.comms, dropped=v.dropped,
                          iface_version=v.iface_version)
            for k, v in self["plugin_procs"].items()
        ]

    def comms(self) -> list[PluginComm]:
        """The live communicators the plugins announced (init, and once a period)."""
        return [PluginComm(pid=k.tgid, comm=k.comm_hash, rank=v.rank, nranks=v.nranks, nnodes=v.nnodes,
                           last_ns=v.last_ns)
                for k, v in self["plugin_comms"].items()]

    def network(self) -> list[NetworkSeries]:
        """Per (communicator, rank, peer, direction): what the network waited for."""
        return [
            NetworkSeries(comm=k.comm_hash, rank=k.rank, peer=k.peer, direction=DIRECTIONS[k.direction & 1],
                          ops=v.ops, bytes=v.bytes, wall_ns=tuple(v.wall_ns), step_ns=tuple(v.step_ns))
            for k, v in self["net_series"].items()
        ]

    def foreign_proxy_ops(self) -> dict[int, int]:
        """pid -> ProxyOps of another process (PXN) its plugin ignored."""
        return {k.value: v.value for k, v in self["net_foreign"].items()}

    def expire_network(self, live_hashes, ttl: float, now: float | None = None) -> int:
        """Delete the network series of communicators not live (NCCL commHash
        not in `live_hashes`) for `ttl` seconds; returns how many. For the
        agent's loop: the series expire with their communicator."""
        now = time.monotonic() if now is None else now
        for h in live_hashes:
            self.net_seen[h] = now
        table = self["net_series"]
        items = list(table.items())
        ops: dict[int, int] = {}
        for k, v in items:  # a communicator still counting is live too (the agent may not have seen it made)
            ops[k.comm_hash] = ops.get(k.comm_hash, 0) + v.ops
        for h, n in ops.items():
            if self.net_ops.get(h) != n:
                self.net_seen[h] = now
        self.net_ops = ops
        gone = 0
        for k, _v in items:
            seen = self.net_seen.setdefault(k.comm_hash, now)
            if now - seen >= ttl:
                try:
                    del table[k]
                    gone += 1
                except KeyError:
                    pass
        live = {k.comm_hash for k in table.keys()}
        for h in [h for h in self.net_seen if h not in live and now - self.net_seen[h] >= ttl]:
            del self.net_seen[h]
        return gone

    def drops(self) -> dict[str, int]:
        table = self["plugin_drops"]
        return {name: table[table.Key(slot)].value for name, slot in DROPS.items()}

    def rejected(self) -> dict[str, int]:
        """GPU intervals left out of the histograms as implausible, by reason
        (contract.GPU_REJECT_REASONS)."""
        drops = self.drops()
        return {reason: drops[f"rejected_{reason}"] for reason in contract.GPU_REJECT_REASONS}

    def shared(self) -> int:
        """Done records whose GPU interval is the one of the operation before
        them in a batch (docs/metrics.md): counted once, not histogrammed."""
        return self.drops()["shared"]

    def untimed(self) -> int:
        """Done records with no GPU interval (docs/metrics.md)."""
        return self.drops()["no_gpu_time"]

    def prune(self, ttl: float, rank_label) -> None:
        self.forget_dead_processes()
        if self.live_comms is not None:
            self.expire_network(set(self.live_comms()), ttl)

    def forget_dead_processes(self, proc: str = "/proc") -> int:
        """Drop in-flight entries and process entries of processes that are gone."""
        return (forget_dead(self["gpu_inflight"], proc) + forget_dead(self["plugin_procs"], proc)
                + forget_dead(self["plugin_comms"], proc) + forget_dead(self["net_foreign"], proc))


def peer_waits(words, n: int) -> tuple[PeerWait, ...]:
    """gpu_event.net (bpf/plugin.c): n entries of 8 u64 words each -- peer
    (s32) | direction << 32, bytes, wall_ns[3], step_ns[3]."""
    out = []
    for i in range(min(n, len(words) // 8)):
        w = words[8 * i:8 * i + 8]
        peer = w[0] & 0xFFFFFFFF
        out.append(PeerWait(peer=peer - (1 << 32) if peer >= 1 << 31 else peer,
                            direction=DIRECTIONS[(w[0] >> 32) & 1], bytes=w[1],
                            wall_ns=(w[2], w[3], w[4]), step_ns=(w[5], w[6], w[7])))
    return tuple(out)


def plugin_paths() -> list[str]:
    """The plugin files to attach at start: the built one, if any."""
    p = built_plugin()
    return [p] if p and Path(p).is_file() else []

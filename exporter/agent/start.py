"""Starting the agent of `run` and `trace` from its Config: the host checks
(capabilities, tracefs), the pod resolver, the Agent with its libraries
attached, and the signals that stop it. Bad input or an unusable host is a
SetupError (one line from the CLI, exit 2)."""

from __future__ import annotations

import logging
import os
import signal
import threading

from exporter.agent.config import Config, SetupError


def require_privileges() -> None:
    """The capabilities of preflight.CAPABILITIES (docs/deploy.md): without
    CAP_SYS_ADMIN nothing can load, a one-line error; without the others
    `run` works for some processes only, and says which it cannot see."""
    from exporter.agent.preflight import missing_capabilities

    missing = dict(missing_capabilities())
    if "CAP_SYS_ADMIN" in missing:
        raise SetupError("needs CAP_SYS_ADMIN (load BPF programs, attach uprobes; it includes CAP_BPF and "
                         "CAP_PERFMON): run it as root, or grant the capabilities in docs/deploy.md")
    for cap, why in missing.items():
        logging.getLogger("nccl_exporter").warning(
            "without %s this agent cannot %s; grant it (docs/deploy.md)", cap, why)


def require_tracefs() -> None:
    for path in ("/sys/kernel/tracing/events", "/sys/kernel/debug/tracing/events"):
        if os.path.isdir(path):
            return
    raise SetupError("tracefs is not mounted: mount -t tracefs nodev /sys/kernel/tracing")


def stop_on_signals() -> threading.Event:
    """An event set by SIGINT or SIGTERM: the loop ends, and everything is flushed."""
    stop = threading.Event()

    def handler(signum, _frame):
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def pod_resolver(cfg: Config):
    """The PodResolver of `run`/`trace`: with a KubeletPods when --kubelet-url is given."""
    from exporter.sources.pods import KubeletPods, PodResolver

    if not cfg.kubelet_url:
        return PodResolver()
    return PodResolver(KubeletPods(cfg.kubelet_url, cfg.kubelet_token_file, cfg.kubelet_ca_file,
                                   insecure=cfg.kubelet_insecure_tls))


# The Config settings that are AgentConfig fields of the same name, where the
# command has them (trace keeps AgentConfig's defaults: everything attached).
_LIFECYCLE = ("series_ttl", "series_capacity", "histogram_resolution", "idle_detach", "srtt_sampling",
              "owner_window")


def start_agent(cfg: Config):
    """The agent of `run` and `trace`, its libraries attached. It sends every
    call to user space when recording (--db) or tracing; --sched waits loads
    bpf/sched.c, otherwise the scheduler totals come from /proc (docs/sched.md,
    "Two modes")."""
    from exporter.agent.config import settings
    from exporter.agent.loop import Agent, AgentConfig, AgentError
    from exporter.sources.bpf import ProbeError

    pods = pod_resolver(cfg)
    require_privileges()
    require_tracefs()
    record_all = cfg.command == "trace" or bool(cfg.db)
    waits = cfg.sched == "waits"
    names = {s.name for s in settings(cfg.command)}
    lifecycle = {name: getattr(cfg, name) for name in _LIFECYCLE if name in names}
    try:
        agent = Agent(AgentConfig(node=cfg.node, nccl_libs=list(cfg.nccl_lib), record_all=record_all,
                                  sched_waits=waits,
                                  runq_event_min_ns=cfg.runq_wait_min if waits and cfg.db else 0, **lifecycle))
    except ProbeError as e:
        raise SetupError(str(e)) from None
    agent.processes.pods = pods  # before discovery: the first processes get it
    try:
        agent.start_discovery()
    except AgentError as e:
        agent.close()
        raise SetupError(str(e)) from None
    return agent

"""What every command shares: the error type, argument parsers, options
defined once, logging, signals, and starting the agent."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading

from exporter.records import contract


class CliError(Exception):
    """Bad input or an unusable host: printed as one line, exit 2."""


# --- argument helpers -------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h)?\s*$")


def parse_duration(text: str) -> float:
    """'2m' -> 120.0 seconds; plain numbers are seconds."""
    m = _DURATION.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 30s, 2m, 1h, 500ms)")
    value, unit = float(m.group(1)), m.group(2) or "s"
    return value * {"us": 1e-6, "ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


def positive_int(text):
    """argparse type: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return n


def positive_duration(text):
    """argparse type: a duration > 0, in seconds."""
    seconds = parse_duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0: {text!r}")
    return seconds


DEFAULT_RUNQ_WAIT_MIN = "100us"
DEFAULT_IDLE_DETACH = 30.0  # s: `run --idle-detach`


def parse_idle_detach(text: str) -> float:
    """--idle-detach: a duration in s; 'off' -> infinity (never detached)."""
    if str(text).strip().lower() == "off":
        return float("inf")
    return parse_duration(text)


DEFAULT_SRTT_SAMPLING = "250ms/5s"  # `run --srtt-sampling`


def parse_srtt_sampling(text: str) -> tuple[float, float] | None:
    """--srtt-sampling: 'W/P' -> (W, P) in s, 0 < W <= P; 'always' -> None."""
    if str(text).strip().lower() == "always":
        return None
    window, _, period = str(text).partition("/")
    try:
        w, p = parse_duration(window), parse_duration(period)
    except argparse.ArgumentTypeError:
        w = p = 0.0
    if not 0 < w <= p:
        raise argparse.ArgumentTypeError(f"not WINDOW/PERIOD (0 < WINDOW <= PERIOD) or 'always': {text!r} "
                                         f"(try {DEFAULT_SRTT_SAMPLING}, 1s/10s, always)")
    return w, p


DEFAULT_OWNER_WINDOW = "3s"  # `run --owner-window`


def parse_owner_window(text: str) -> float | None:
    """--owner-window: a duration > 0 in s; 'always' -> None."""
    if str(text).strip().lower() == "always":
        return None
    try:
        window = parse_duration(text)
    except argparse.ArgumentTypeError:
        window = 0.0
    if window <= 0:
        raise argparse.ArgumentTypeError(f"not a duration above 0 or 'always': {text!r} "
                                         f"(try {DEFAULT_OWNER_WINDOW}, 10s, always)")
    return window


def parse_runq_wait_min(text: str) -> int:
    """--runq-wait-min: 'off' -> 0 (no scheduler events); a duration -> ns (0 -> 1: every wait)."""
    if str(text).strip().lower() == "off":
        return 0
    try:
        return max(1, round(parse_duration(text) * 1e9))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a duration or 'off': {text!r} (try 100us, 1ms, 0, off)") from None


def parse_listen(text: str) -> tuple[str, int]:
    """'HOST:PORT', ':PORT' or 'PORT' -> (host, port)."""
    host, _, port = str(text).rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        number = int(port)
    except ValueError:
        raise CliError(f"--listen {text!r}: expected HOST:PORT, e.g. 0.0.0.0:{contract.DEFAULT_PORT}") from None
    if not 0 < number < 65536:
        raise CliError(f"--listen {text!r}: port must be 1-65535")
    return host, number


CONFIG_KEYS = {"node", "listen", "nccl_libs", "log_level", "log_format", "otlp_endpoint", "otlp_protocol",
               "slow_threshold", "slow_relative"}


def load_config(path: str | None) -> dict:
    """`run --config`'s TOML file: the keys of CONFIG_KEYS (docs/configuration.md)."""
    if not path:
        return {}
    import tomllib

    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except FileNotFoundError:
        raise CliError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise CliError(f"config file {path} is not valid TOML: {e}") from None
    unknown = set(cfg) - CONFIG_KEYS
    if unknown:
        raise CliError(f"config file {path}: unknown key(s) {', '.join(sorted(unknown))}; "
                       f"known: {', '.join(sorted(CONFIG_KEYS))}")
    if "nccl_libs" in cfg and not isinstance(cfg["nccl_libs"], list):
        raise CliError(f"config file {path}: nccl_libs must be a list of paths")
    return cfg


def require_privileges() -> None:
    """The capabilities of preflight.CAPABILITIES (docs/deploy.md): without
    CAP_SYS_ADMIN nothing can load, a one-line error; without the others
    `run` works for some processes only, and says which it cannot see."""
    from exporter.agent.preflight import missing_capabilities

    missing = dict(missing_capabilities())
    if "CAP_SYS_ADMIN" in missing:
        raise CliError("needs CAP_SYS_ADMIN (load BPF programs, attach uprobes; it includes CAP_BPF and "
                       "CAP_PERFMON): run it as root, or grant the capabilities in docs/deploy.md")
    for cap, why in missing.items():
        logging.getLogger("nccl_exporter").warning(
            "without %s this agent cannot %s; grant it (docs/deploy.md)", cap, why)


def require_tracefs() -> None:
    for path in ("/sys/kernel/tracing/events", "/sys/kernel/debug/tracing/events"):
        if os.path.isdir(path):
            return
    raise CliError("tracefs is not mounted: mount -t tracefs nodev /sys/kernel/tracing")


LOG_LEVELS = ["debug", "info", "warning", "error"]
LOG_FORMATS = ["text", "json"]
# The keys of a --log-format json line (docs/troubleshooting.md, "Logs"): a
# contract with log pipelines, like metric names.
LOG_KEYS = ("time", "level", "message", "logger", "node")
LOG_CONTEXT_KEYS = ("comm", "rank")  # where the line is about one communicator rank
_ANNOUNCE = {"json": False}  # what setup_logging chose, for announce()


def add_log_options(sp, level_default: str | None) -> None:
    """--log-level and --log-format of the agent commands (run, trace)."""
    sp.add_argument("--log-level", choices=LOG_LEVELS, default=level_default,
                    help=f"least severe level logged to stderr (default {level_default or 'info'})")
    sp.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                    help="text (default): 'TIME LEVEL message' lines; json: one JSON object a line, "
                         "keys " + ", ".join(LOG_KEYS) + ", and " + ", ".join(LOG_CONTEXT_KEYS)
                         + " where the line is about one (docs/troubleshooting.md, \"Logs\")")


class _NodeFilter(logging.Filter):
    """Puts the agent's node name on every record (the `node` key of JSON lines)."""

    def __init__(self, node: str):
        super().__init__()
        self.node = node

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "node", None):
            record.node = self.node
        return True


def setup_logging(level: str, fmt: str = "text", node: str = "") -> None:
    """Log records to stderr: text lines, or (fmt "json") one JSON object a
    line with the keys of LOG_KEYS, and those of LOG_CONTEXT_KEYS where a
    call passes them as `extra` (python-json-logger adds every extra)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter(
            "%(levelname)s %(message)s %(name)s", timestamp="time",
            rename_fields={"levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    handler.addFilter(_NodeFilter(node))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, str(level).upper(), logging.INFO))
    _ANNOUNCE["json"] = fmt == "json"


def announce(message: str, stream=None) -> None:
    """A status line of the agent (where it serves, that it stopped): as
    text on `stream` (default stdout), or with --log-format json a JSON
    record on stderr like every other line, whatever --log-level says (so a
    log pipeline sees only JSON)."""
    if _ANNOUNCE["json"]:
        status = logging.getLogger("nccl_exporter.status")
        status.setLevel(logging.INFO)
        status.info("%s", message)
    else:
        print(message, file=stream or sys.stdout, flush=True)


def json_logs() -> bool:
    """Whether setup_logging was asked for JSON lines."""
    return _ANNOUNCE["json"]


def stop_on_signals() -> threading.Event:
    """An event set by SIGINT or SIGTERM: the loop ends, and everything is flushed."""
    stop = threading.Event()

    def handler(signum, _frame):
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def start_agent(args, cfg, record_all=False, runq_event_min_ns=0):
    """The agent of `run` and `trace`, its libraries attached; --sched waits
    (args.sched) loads bpf/sched.c, otherwise the scheduler totals come from
    /proc (docs/sched.md, "Two modes")."""
    from exporter.agent.loop import Agent, AgentConfig, AgentError
    from exporter.sources.identity import node_name
    from exporter.sources.bpf import ProbeError

    pods = pod_resolver(args)  # bad --kubelet-* input: one line, before anything loads
    require_privileges()
    require_tracefs()
    node = node_name(getattr(args, "node", None), cfg.get("node"))
    libs = list(args.nccl_lib or cfg.get("nccl_libs") or [])
    try:
        # run's --series-ttl, --series-capacity, --histogram-resolution (absent: defaults)
        lifecycle = {name: getattr(args, name) for name in
                     ("series_ttl", "series_capacity", "histogram_resolution", "idle_detach")
                     if getattr(args, name, None) is not None}
        for name in ("srtt_sampling", "owner_window"):  # run only; trace keeps them attached
            if hasattr(args, name):
                lifecycle[name] = getattr(args, name)
        waits = getattr(args, "sched", "waits") == "waits"
        agent = Agent(AgentConfig(node=node, nccl_libs=libs, record_all=record_all, sched_waits=waits,
                                  runq_event_min_ns=runq_event_min_ns if waits else 0, **lifecycle))
    except ProbeError as e:
        raise CliError(str(e)) from None
    agent.processes.pods = pods  # before discovery: the first processes get it
    try:
        agent.start_discovery()
    except AgentError as e:
        agent.close()
        raise CliError(str(e)) from None
    return agent, node


def recording_scope(args):
    """--pid / --netns of `trace` -> a recording Scope (everything when neither is given)."""
    from exporter.sinks.recording.schema import RecordingError
    from exporter.sinks.recording.scope import Scope, netns_inode

    try:
        netns = netns_inode(args.netns) if args.netns else None
    except RecordingError as e:
        raise CliError(str(e)) from None
    gone = [p for p in args.pid or () if p <= 0 or not os.path.exists(f"/proc/{p}")]
    if gone:
        raise CliError(f"--pid {gone[0]}: no such process (a process to trace must be running: "
                       "see 'ps', or trace everything and filter with 'query')")
    return Scope(pids=args.pid or (), netns=netns)


def open_recorder(path, node, scope=None):
    from exporter.sinks.recording.schema import RecordingError
    from exporter.sinks.recording.writer import Recorder

    try:
        return Recorder(path, node=node, scope=scope)
    except RecordingError as e:
        raise CliError(str(e)) from None


# --- options shared by several commands -----------------------------------------

def add_pod_options(sp) -> None:
    """--kubelet-*: pod and container names from the kubelet (docs/deploy.md, "Pod identity")."""
    g = sp.add_argument_group(
        "pod identity",
        "Pod UID and container ID come from each traced process's cgroup, pod name and namespace "
        "from its POD_NAME/POD_NAMESPACE (downward API) or HOSTNAME and its service-account "
        "namespace file. The kubelet's pod list adds the container's name, and names for pods that "
        "set none: opt in with --kubelet-url.")
    g.add_argument("--kubelet-url", metavar="URL",
                   help="ask the kubelet's pod list (URL/pods), e.g. https://$NODE_IP:10250, at most "
                        "every 30 s and only for a pod it does not know yet")
    g.add_argument("--kubelet-token-file", metavar="FILE",
                   help="bearer token for the kubelet (re-read at every request), e.g. "
                        "/var/run/secrets/kubernetes.io/serviceaccount/token; its service account "
                        "needs get on nodes/proxy")
    g.add_argument("--kubelet-ca-file", metavar="FILE",
                   help="CA bundle for the kubelet's serving certificate (default: the system's)")
    g.add_argument("--kubelet-insecure-tls", action="store_true",
                   help="do not verify the kubelet's certificate (self-signed serving certificates)")


def pod_resolver(args):
    """The PodResolver of `run`/`trace`: with a KubeletPods when --kubelet-url is given."""
    from exporter.sources.pods import KubeletPods, PodResolver

    url = getattr(args, "kubelet_url", None)
    token = getattr(args, "kubelet_token_file", None)
    if not url:
        if token:
            raise CliError("--kubelet-token-file needs --kubelet-url")
        return PodResolver()
    if not url.startswith(("http://", "https://")):
        raise CliError(f"--kubelet-url {url!r}: an http:// or https:// URL, e.g. https://10.0.0.5:10250")
    for name in ("kubelet_token_file", "kubelet_ca_file"):
        path = getattr(args, name, None)
        if path and not os.access(path, os.R_OK):
            raise CliError(f"--{name.replace('_', '-')} {path}: cannot read it")
    return PodResolver(KubeletPods(url, token, getattr(args, "kubelet_ca_file", None),
                                   insecure=bool(getattr(args, "kubelet_insecure_tls", False))))


def add_lib_option(sp) -> None:
    sp.add_argument("--nccl-lib", action="append", metavar="PATH",
                    help="probe this libnccl (repeatable); default: every libnccl "
                         "mapped by running processes, and new ones as they appear")


def add_sched_options(sp, default: str, when: str) -> None:
    """--sched and --runq-wait-min (run: totals by default; trace: waits)."""
    sp.add_argument("--sched", choices=["totals", "waits"], default=default,
                    help="how the scheduler is watched (docs/sched.md): totals reads each traced thread's "
                         "run-queue and off-CPU time from the kernel's own accounting in /proc once a "
                         "second, with no program at any context switch; waits runs a BPF program at "
                         "every context switch and wakeup of the node while a job runs (2-20 %% of a "
                         "switch-heavy task's speed, bench/KERNEL.md) for run-queue histogram buckets, "
                         f"each NCCL call's own wait and its proxies', and wait events (default {default})")
    sp.add_argument("--runq-wait-min", type=parse_runq_wait_min, metavar="D|off",
                    default=parse_runq_wait_min(DEFAULT_RUNQ_WAIT_MIN),
                    help=f"{when} and --sched waits: record each time a thread of a traced process waited at least D "
                         f"runnable for a CPU (sched_events; default {DEFAULT_RUNQ_WAIT_MIN}; 0: every "
                         "wait; off: none)")

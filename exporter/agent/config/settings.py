"""The settings of `run` and `trace`: one field of `Config` each, holding its
`Setting` (flag, help, parser, default, environment variables; the TOML key
is the field's name). Add a setting here; read it as `cfg.<name>`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from exporter.records import contract, histogram
from exporter.agent.logs import LOG_CONTEXT_KEYS, LOG_FORMATS, LOG_KEYS, LOG_LEVELS
from exporter.agent.config.values import (
    _milliseconds,
    _text,
    parse_duration,
    parse_idle_detach,
    parse_listen,
    parse_owner_window,
    parse_runq_wait_min,
    parse_slow_threshold,
    parse_srtt_sampling,
    positive_duration,
    positive_factor,
    positive_int,
)


class SetupError(Exception):
    """Bad input or an unusable host, found before the agent runs: the CLI
    prints it as one line and exits 2."""


RUN, TRACE = ("run",), ("trace",)
BOTH = ("run", "trace")

# docs/configuration.md's sections and the --help groups, in order
GROUPS = {
    "serving": ("Serving and identity", None),
    "histograms": ("Histograms and series", None),
    "kernel": ("Kernel side: what runs and when", None),
    "slow": ("Slow calls and spans", None),
    "recording": ("Recording and the node query endpoint",
                  "The node query endpoint answers read-only SQL on the --db recording (docs/fleet-live.md)."),
    "tracing": ("What `trace` prints or records", None),
    "pods": ("Pod identity",
             "Pod UID and container ID come from each traced process's cgroup, pod name and namespace "
             "from its POD_NAME/POD_NAMESPACE (downward API) or HOSTNAME and its service-account "
             "namespace file. The kubelet's pod list adds the container's name, and names for pods that "
             "set none: opt in with --kubelet-url."),
}


@dataclass(frozen=True)
class Setting:
    """One setting: where it comes from and how its text becomes its value."""

    flag: str
    help: str
    parse: Callable[[Any], Any] = _text  # flag text, TOML string or variable -> value
    default: Any = None          # the value when nothing sets it (already parsed)
    shown: str = ""              # the default as the docs write it
    metavar: str | None = None
    choices: tuple = ()
    many: bool = False           # repeatable flag; a TOML list
    switch: bool = False         # a flag without value; a TOML bool
    env: tuple[str, ...] = ()    # variables read, in order, when no flag or key sets it
    env_parse: Callable[[Any], Any] | None = None  # variable text -> value (default: parse)
    group: str = "serving"
    commands: tuple[str, ...] = RUN
    trace: dict = field(default_factory=dict)  # what differs for `trace`: default, shown, help
    toml_aliases: tuple[str, ...] = ()  # older key names still read
    name: str = ""               # the Config field (filled in below)

    def for_command(self, command: str) -> "Setting":
        """This setting as `command` has it."""
        return dataclasses.replace(self, **self.trace) if command == "trace" and self.trace else self

    @property
    def key(self) -> str:
        """The `run --config` TOML key."""
        return self.name

    def parse_value(self, value, where: str):
        """A TOML value -> the setting's value; SetupError naming `where`.
        Strings are read as the flag's text; numbers where the flag takes one."""
        kinds = (str,) if self.parse is _text or self.choices else (str, int, float)
        what = "a string" if kinds == (str,) else "a string or a number"
        try:
            if self.switch:
                if not isinstance(value, bool):
                    raise argparse.ArgumentTypeError("true or false")
                return value
            if self.many:
                if isinstance(value, dict):  # a table KEY = VALUE stands for KEY=VALUE items
                    value = [f"{k}={v}" for k, v in value.items()]
                items = value if isinstance(value, list) else [value]
                if not all(isinstance(i, kinds) and not isinstance(i, bool) for i in items):
                    raise argparse.ArgumentTypeError(f"{what} or a list of them")
                return tuple(self._one(v) for v in items)
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise argparse.ArgumentTypeError(what)
            return self._one(value)
        except argparse.ArgumentTypeError as e:
            raise SetupError(f"{where} {value!r}: {e}") from None

    def _one(self, value):
        if self.choices and str(value) not in self.choices:
            raise argparse.ArgumentTypeError("one of " + ", ".join(self.choices))
        return self.parse(value)


def setting(flag: str, text: str, **kw) -> Any:
    """A Config field holding its Setting (`text`: its help)."""
    s = Setting(flag, text, **kw)
    default = s.default
    return field(default=default, metadata={"setting": s})


_SCHED_HELP = ("how the scheduler is watched (docs/sched.md): totals reads each traced thread's run-queue "
               "and off-CPU time from the kernel's own accounting in /proc once a second, with no program at "
               "any context switch; waits runs a BPF program at every context switch and wakeup of the node "
               "while a job runs (2-20 %% of a switch-heavy task's speed, bench/KERNEL.md) for run-queue "
               "histogram buckets, each NCCL call's own wait and its proxies', and wait events (default %s)")


@dataclass(frozen=True)
class Config:
    """What `run` or `trace` was asked for: built by `build` from flags, the
    TOML file and the environment; read-only afterwards."""

    # serving and identity
    listen: tuple[str, int] = setting(
        "--listen", f"where to serve /metrics, /-/ready and /-/healthy (default 0.0.0.0:{contract.DEFAULT_PORT})",
        parse=parse_listen, default=("0.0.0.0", contract.DEFAULT_PORT), shown=f"0.0.0.0:{contract.DEFAULT_PORT}",
        metavar="HOST:PORT")
    node: str = setting(
        "--node", "node label of every series, span and recording row (default: the hostname)",
        env=("NCCL_EXPORTER_NODE",), shown="the hostname", metavar="NAME", commands=BOTH,
        trace={"help": "node name stored in the recording (default: the hostname)"})
    log_level: str = setting(
        "--log-level", "least severe level logged to stderr (default info)",
        default="info", shown="info (trace: warning)", choices=LOG_LEVELS,
        commands=BOTH, trace={"default": "warning", "help": "least severe level logged to stderr (default warning)"})
    log_format: str = setting(
        "--log-format", "text (default): 'TIME LEVEL message' lines; json: one JSON object a line, keys "
                        + ", ".join(LOG_KEYS) + ", and " + ", ".join(LOG_CONTEXT_KEYS)
                        + " where the line is about one (docs/troubleshooting.md, \"Logs\")",
        default="text", shown="text", choices=LOG_FORMATS, commands=BOTH)
    nccl_lib: tuple[str, ...] = setting(
        "--nccl-lib", "probe this libnccl (repeatable); default: every libnccl mapped by running processes, "
                      "and new ones as they appear",
        default=(), shown="every libnccl running processes map", many=True, metavar="PATH", commands=BOTH,
        toml_aliases=("nccl_libs",))

    # histograms and series
    histogram_resolution: str = setting(
        "--histogram-resolution",
        "classic buckets of text scrapes, derived from the kernel's exponential (schema 3) buckets: coarse "
        "(default: each power of two seconds, 2^-20 s (0.95 us) .. 128 s, 29 buckets) or fine (each quarter "
        "power of two from 2^-19 s, 106 buckets); protobuf scrapes get native histograms (docs/metrics.md)",
        default=histogram.DEFAULT_CLASSIC, shown=histogram.DEFAULT_CLASSIC, choices=tuple(sorted(histogram.CLASSIC)),
        group="histograms")
    protobuf_classic_buckets: bool = setting(
        "--protobuf-classic-buckets",
        "protobuf scrapes carry each histogram's classic buckets beside the native ones (Prometheus keeps "
        "both only with scrape_classic_histograms, 2.45+, or always_scrape_classic_histograms, 3.x; "
        "docs/metrics.md)",
        default=False, shown="off", switch=True, group="histograms")
    series_ttl: float = setting(
        "--series-ttl", "a communicator's series leave the kernel maps and /metrics this long after it was "
                        "destroyed or aborted, or every process using it exited (default "
                        f"{contract.DEFAULT_SERIES_TTL:g}s)",
        parse=parse_duration, default=contract.DEFAULT_SERIES_TTL, shown=f"{contract.DEFAULT_SERIES_TTL:g}s",
        metavar="DURATION", group="histograms")
    series_capacity: int = setting(
        "--series-capacity", f"(op, comm, rank) series the kernel holds at once (default {contract.MAX_SERIES}); "
                             'when full, calls are counted in comm="overflow" series',
        parse=positive_int, default=contract.MAX_SERIES, shown=str(contract.MAX_SERIES), metavar="N",
        group="histograms")

    # kernel side
    sched: str = setting(
        "--sched", _SCHED_HELP % "totals", default="totals", shown="totals (trace: waits)",
        choices=("totals", "waits"), group="kernel", commands=BOTH,
        trace={"default": "waits", "help": _SCHED_HELP % "waits"})
    runq_wait_min: int = setting(
        "--runq-wait-min", "with --db and --sched waits: record each time a thread of a traced process waited "
                           "at least D runnable for a CPU (sched_events; default 100us; 0: every wait; off: none)",
        parse=parse_runq_wait_min, default=100_000, shown="100us", metavar="D|off", group="kernel", commands=BOTH)
    srtt_sampling: tuple[float, float] | None = setting(
        "--srtt-sampling", "while a job runs, sample the smoothed RTT of its sockets (nccl_tcp_srtt_seconds) "
                           "during WINDOW of every PERIOD only: the tcp_probe tracepoint it needs runs at every "
                           "incoming TCP segment of the node while attached (default 250ms/5s; always: attached "
                           "the whole time, docs/tcp.md)",
        parse=parse_srtt_sampling, default=(0.25, 5.0), shown="250ms/5s", metavar="WINDOW/PERIOD|always",
        group="kernel")
    owner_window: float | None = setting(
        "--owner-window", "learn which traced thread owns each TCP socket (the rank label of retransmits and "
                          "resets) by watching every socket send and receive of the node only for this long "
                          "after a job starts, after a traced process appears and after each connection one "
                          "accepts; sockets a traced thread connects are learnt at connect() anyway (default 3s; "
                          "always: watched the whole time, docs/tcp.md)",
        parse=parse_owner_window, default=3.0, shown="3s", metavar="DURATION|always", group="kernel")
    idle_detach: float = setting(
        "--idle-detach", "detach the tracepoints that run at every context switch, wakeup and socket "
                         "send/receive of the node once no process has been traced for this long, and attach "
                         "them again when one is (within a tenth of a second; what happens on the node "
                         "meanwhile is not seen): a node between jobs pays nothing (default 30s; off: always "
                         "attached)",
        parse=parse_idle_detach, default=30.0, shown="30s", metavar="DURATION|off", group="kernel")

    # slow calls, spans and OTLP
    slow_threshold: tuple[tuple[str | None, int], ...] = setting(
        "--slow-threshold", "a call at least this long is slow (default 50ms for every op); repeatable, e.g. "
                            "--slow-threshold 20ms --slow-threshold ALL_REDUCE=200ms (in TOML a string, a list, "
                            "or a table OP = DURATION)",
        parse=parse_slow_threshold, default=(), shown="50ms for every op", many=True, metavar="[OP=]DURATION",
        group="slow")
    slow_relative: float | None = setting(
        "--slow-relative", "instead of the fixed threshold, a call is slow at K x the recent p50 of its "
                           "op/comm/rank series (recomputed every 10 s; never below 1 ms)",
        parse=positive_factor, shown="off", metavar="K", group="slow")
    otlp_endpoint: str | None = setting(
        "--otlp-endpoint", "send a span per slow call here (docs/traces.md); no spans without one",
        env=("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"), shown="none",
        metavar="URL", group="slow")
    otlp_protocol: str = setting(
        "--otlp-protocol", "for spans and metrics (per signal, $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL and "
                           "$OTEL_EXPORTER_OTLP_METRICS_PROTOCOL come before the variable)",
        env=("OTEL_EXPORTER_OTLP_PROTOCOL",), default="grpc", shown="grpc", choices=("grpc", "http/protobuf"),
        group="slow")
    otlp_metrics_endpoint: str | None = setting(
        "--otlp-metrics-endpoint", "push every metric here over OTLP, histograms as exponential histograms "
                                   "with the kernel's buckets (none without one; docs/metrics.md \"OTLP metrics\")",
        env=("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",), shown="none", metavar="URL", group="slow")
    otlp_metrics_interval: float = setting(
        "--otlp-metrics-interval", "how often metrics are pushed (the variable is in milliseconds, as the "
                                   "OpenTelemetry SDK reads it)",
        parse=positive_duration, env=("OTEL_METRIC_EXPORT_INTERVAL",), env_parse=_milliseconds, default=60.0,
        shown="60s", metavar="DURATION", group="slow")

    # recording and the node query endpoint
    db: str | None = setting(
        "--db", "also record every NCCL call and TCP retransmit/reset, and the job's threads' CPU waits (each "
                "second's per thread kind; with --sched waits each wait), to this SQLite file (docs/schema.md; "
                "read it with 'query')",
        shown="off", metavar="PATH", group="recording", commands=BOTH,
        trace={"help": "record every NCCL call, TCP retransmit/reset and scheduler wait to this SQLite file "
                       "instead of printing (docs/schema.md; read it with 'query')", "group": "tracing"})
    query_listen: tuple[str, int] | None = setting(
        "--query-listen", "answer read-only SQL on the recording here (POST /api/v1/query), and serve it for "
                          "'fleet fetch'; needs --db; off by default",
        parse=parse_listen, shown="off", metavar="HOST:PORT", group="recording")
    query_token_file: str | None = setting(
        "--query-token-file", "the bearer token clients must send (required with --query-listen)",
        shown="none", metavar="F", group="recording")
    query_tls_cert: str | None = setting(
        "--query-tls-cert", "TLS certificate (required unless loopback only)", shown="none", metavar="F",
        group="recording")
    query_tls_key: str | None = setting(
        "--query-tls-key", "TLS private key", shown="none", metavar="F", group="recording")
    query_max_rows: int = setting(
        "--query-max-rows", "rows per answer at most (default 100000)",
        parse=positive_int, default=100_000, shown="100000", metavar="N", group="recording")
    query_time_limit: float = setting(
        "--query-time-limit", "per query (default 10s)",
        parse=positive_duration, default=10.0, shown="10s", metavar="D", group="recording")

    # trace: what it prints or records
    duration: float = setting(
        "--duration", "stop after D (30s, 2m, ...); default: until Ctrl-C",
        parse=parse_duration, default=0.0, shown="until Ctrl-C", metavar="D", group="tracing", commands=TRACE)
    format: str = setting(
        "--format", "how calls are printed: text (default, one aligned line) or json (one object a line, the "
                    "recording's column names)",
        default="text", shown="text", choices=("text", "json"), group="tracing", commands=TRACE)
    pid: tuple[int, ...] = setting(
        "--pid", "only this process (repeatable)", parse=positive_int, default=(), shown="every process",
        many=True, metavar="PID", group="tracing", commands=TRACE)
    netns: str | None = setting(
        "--netns", "only processes in this network namespace (/run/netns/NAME, /proc/PID/ns/net, or its "
                   "inode number)", shown="every namespace", metavar="PATH|INODE", group="tracing", commands=TRACE)

    # pod identity
    kubelet_url: str | None = setting(
        "--kubelet-url", "ask the kubelet's pod list (URL/pods), e.g. https://$NODE_IP:10250, at most every "
                         "30 s and only for a pod it does not know yet",
        shown="off", metavar="URL", group="pods", commands=BOTH)
    kubelet_token_file: str | None = setting(
        "--kubelet-token-file", "bearer token for the kubelet (re-read at every request), e.g. "
                                "/var/run/secrets/kubernetes.io/serviceaccount/token; its service account "
                                "needs get on nodes/proxy",
        shown="none", metavar="FILE", group="pods", commands=BOTH)
    kubelet_ca_file: str | None = setting(
        "--kubelet-ca-file", "CA bundle for the kubelet's serving certificate (default: the system's)",
        shown="the system's CAs", metavar="FILE", group="pods", commands=BOTH)
    kubelet_insecure_tls: bool = setting(
        "--kubelet-insecure-tls", "do not verify the kubelet's certificate (self-signed serving certificates)",
        default=False, shown="off", switch=True, group="pods", commands=BOTH)

    # not settings: what `build` adds
    command: str = "run"
    config_file: str | None = None
    origins: dict = field(default_factory=dict, compare=False)  # setting -> 'flag', 'config', '$VAR', 'default'
    environ: dict = field(default_factory=dict, compare=False, repr=False)

    # --- derived values (one rule each) ---

    @property
    def slow_thresholds(self) -> dict[str, int]:
        """{op: ns} of --slow-threshold; a bare duration applies to every collective."""
        out: dict[str, int] = {}
        for op, ns in self.slow_threshold:
            if op is None:
                out.update({name: ns for name in contract.COLLECTIVE_OPS.values()})
            else:
                out[op] = ns
        return out

    def otlp_protocol_for(self, signal: str) -> str:
        """'traces' or 'metrics': --otlp-protocol or its key, else the signal's own
        $OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL, else $OTEL_EXPORTER_OTLP_PROTOCOL, else grpc."""
        if self.origins.get("otlp_protocol") in ("flag", "config"):
            return self.otlp_protocol
        return self.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL") or self.otlp_protocol


SETTINGS: tuple[Setting, ...] = tuple(
    dataclasses.replace(f.metadata["setting"], name=f.name)
    for f in dataclasses.fields(Config) if "setting" in f.metadata)


def settings(command: str) -> list[Setting]:
    """The settings of `command` ('run' or 'trace'), as it has them."""
    return [s.for_command(command) for s in SETTINGS if command in s.commands]

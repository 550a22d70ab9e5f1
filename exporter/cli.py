"""nccl-exporter command line: check, run, trace, demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
import time

from . import __version__, contract

EPILOG = """\
examples:
  nccl-exporter check                      # can this node run the agent?
  nccl-exporter run                        # export metrics on :%d/metrics
  nccl-exporter run --nccl-lib /opt/nccl/lib/libnccl.so.2 --node gpu-017
  nccl-exporter trace --duration 10s       # print every NCCL call for 10 s
  nccl-exporter demo                       # an 8-rank simulated job, with loss

Without --nccl-lib the agent attaches to every libnccl that running
processes have mapped (wheels under site-packages included) and keeps
watching for new ones. It needs root (or CAP_BPF + CAP_PERFMON), tracefs
and kernel headers: 'nccl-exporter check' says what is missing.
""" % contract.DEFAULT_PORT


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


DEFAULT_RUNQ_WAIT_MIN = "100us"


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


CONFIG_KEYS = {"node", "listen", "nccl_libs", "log_level", "otlp_endpoint", "otlp_protocol",
               "slow_threshold", "slow_relative"}


def load_config(path: str | None) -> dict:
    """The TOML config file (keys: node, listen, nccl_libs, log_level)."""
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
    """Loading BPF and uprobes needs root or CAP_BPF+CAP_PERFMON (or CAP_SYS_ADMIN)."""
    if os.geteuid() == 0:
        return
    caps = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    caps = int(line.split()[1], 16)
    except OSError:
        pass
    cap_sys_admin, cap_perfmon, cap_bpf = 21, 38, 39
    if caps & (1 << cap_sys_admin) or (caps & (1 << cap_bpf) and caps & (1 << cap_perfmon)):
        return
    raise CliError("needs root, or CAP_BPF and CAP_PERFMON: run it with sudo")


def require_tracefs() -> None:
    for path in ("/sys/kernel/tracing/events", "/sys/kernel/debug/tracing/events"):
        if os.path.isdir(path):
            return
    raise CliError("tracefs is not mounted: mount -t tracefs nodev /sys/kernel/tracing")


# --- commands -----------------------------------------------------------------

def cmd_check(args) -> int:
    from . import preflight

    return preflight.main(nccl_libs=args.nccl_lib or ())


def _start_agent(args, cfg, record_all=False, runq_event_min_ns=0):
    from .agent import Agent, AgentConfig, AgentError
    from .identity import node_name
    from .probes import ProbeError

    require_privileges()
    require_tracefs()
    node = node_name(getattr(args, "node", None), cfg.get("node"))
    libs = list(args.nccl_lib or cfg.get("nccl_libs") or [])
    try:
        agent = Agent(AgentConfig(node=node, nccl_libs=libs, record_all=record_all,
                                  runq_event_min_ns=runq_event_min_ns))
    except ProbeError as e:
        raise CliError(str(e)) from None
    try:
        agent.start_discovery()
    except AgentError as e:
        agent.close()
        raise CliError(str(e)) from None
    return agent, node


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum, _frame):
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def cmd_run(args) -> int:
    from prometheus_client import CollectorRegistry, start_http_server

    cfg = load_config(args.config)
    _setup_logging(args.log_level or cfg.get("log_level") or "info")
    host, port = parse_listen(args.listen or cfg.get("listen") or f"0.0.0.0:{contract.DEFAULT_PORT}")
    registry = CollectorRegistry(auto_describe=False)
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        # --db: every call, and run-queue waits
        agent, node = _start_agent(args, cfg, record_all=bool(args.db),
                                   runq_event_min_ns=args.runq_wait_min if args.db else 0)
    except Exception:
        server.shutdown()
        raise
    from .collector import NcclCollector

    try:
        spans = _start_tracing(args, cfg, agent, node)
    except CliError:
        agent.close()
        server.shutdown()
        raise
    recorder = None
    if args.db:
        try:
            recorder = _open_recorder(args.db, node)
        except CliError:
            agent.close()
            server.shutdown()
            raise
        recorder.note(clock_offset_ns=agent.reader.clock.offset_ns)
        agent.listeners.append(recorder)
    registry.register(NcclCollector(agent.reader, node, agent.probes, agent.processes,
                                    lock=agent.lock, spans=spans, sections=agent.sections))
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    print(f"nccl-exporter {__version__} on node {node}: metrics at http://{shown}:{port}/metrics",
          flush=True)
    stop = _stop_on_signals()
    try:
        agent.run_until(stop)
    finally:
        if recorder is not None:
            recorder.set_kernel_lost(**_kernel_losses(agent))
        agent.close()
        if spans is not None:
            spans.close()
        server.shutdown()
        if recorder is not None:
            recorder.close()
            print(f"nccl-exporter: {recorder.summary()}", flush=True)
    print("nccl-exporter: stopped", flush=True)
    return 0


def parse_thresholds(values) -> dict[str, int]:
    """['50ms', 'ALL_REDUCE=200ms'] -> {op: ns}; a bare duration applies to every collective."""
    out: dict[str, int] = {}
    for value in values or ():
        op, sep, text = str(value).rpartition("=")
        try:
            ns = int(parse_duration(text) * 1e9)
        except argparse.ArgumentTypeError as e:
            raise CliError(f"--slow-threshold {value!r}: {e}") from None
        if not sep:
            out.update({name: ns for name in contract.COLLECTIVE_OPS.values()})
        elif op.upper() in contract.COLLECTIVE_OPS.values():
            out[op.upper()] = ns
        else:
            raise CliError(f"--slow-threshold {value!r}: unknown op {op!r}; ops: "
                           + ", ".join(contract.COLLECTIVE_OPS.values()))
    return out


def _start_tracing(args, cfg, agent, node):
    """Slow-call thresholds, and the span sink when an OTLP endpoint is configured."""
    from .slow import SlowCallPolicy

    configured = cfg.get("slow_threshold")
    if isinstance(configured, dict):
        configured = [f"{op}={d}" for op, d in configured.items()]
    elif configured is not None:
        configured = [str(configured)]
    thresholds = parse_thresholds([*(configured or []), *(args.slow_threshold or [])])
    relative = args.slow_relative if args.slow_relative is not None else cfg.get("slow_relative")
    if relative is not None and not (isinstance(relative, (int, float)) and relative > 0):
        raise CliError(f"--slow-relative {relative!r}: a factor > 0, e.g. 3")
    endpoint = (args.otlp_endpoint or cfg.get("otlp_endpoint")
                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    if not endpoint:
        return None  # nobody consumes slow-call events: the kernel sends none
    agent.slow = SlowCallPolicy(agent.probes, agent.reader, thresholds, relative)
    protocol = (args.otlp_protocol or cfg.get("otlp_protocol")
                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    from .spans import SpanSink, make_otlp_exporter

    try:
        exporter = make_otlp_exporter(protocol, endpoint)
    except ValueError as e:
        raise CliError(str(e)) from None
    sink = SpanSink(node, exporter, agent.processes)
    agent.listeners.append(sink)
    print(f"spans of slow calls -> {endpoint} (OTLP {protocol})", flush=True)
    return sink


def format_event_text(e) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(e.start_real_ns / 1e9))
    frac = f"{(e.start_real_ns % 1_000_000_000) // 1000:06d}"
    d = e.as_dict()
    parts = [f"{t}.{frac}", f"pid={e.pid}", f"tid={e.tid}", f"{e.op:<22}",
             f"comm={d['comm_id_hash']}", f"rank={e.rank}/{e.nranks}"]
    if e.op in contract.COLLECTIVE_OPS.values():
        parts += [f"count={e.count}", d["datatype"], f"bytes={e.bytes}"]
        if d["red_op"]:
            parts.append(d["red_op"])
        if e.root >= 0:
            parts.append(f"root={e.root}")
        if e.peer >= 0:
            parts.append(f"peer={e.peer}")
        parts.append(f"seq={e.seq}")
    parts += [f"{e.duration_ns / 1e6:.3f}ms", d["result"]]
    return " ".join(parts)


def _trace_scope(args):
    """--pid / --netns of `trace` -> a store.Scope (everything when neither is given)."""
    from .store import Scope, StoreError, netns_inode

    try:
        netns = netns_inode(args.netns) if args.netns else None
    except StoreError as e:
        raise CliError(str(e)) from None
    return Scope(pids=args.pid or (), netns=netns)


def _open_recorder(path, node, scope=None):
    from .store import Recorder, StoreError

    try:
        return Recorder(path, node=node, scope=scope)
    except StoreError as e:
        raise CliError(str(e)) from None


def _kernel_losses(agent) -> dict:
    counters = agent.reader.counters()
    misses = agent.probes.recursion_misses()
    return {"kernel_nccl_events": counters.get("EVENTS_LOST", 0),
            "kernel_tcp_events": counters.get("TCP_EVENTS_LOST", 0),
            "kernel_sched_events": counters.get("SCHED_EVENTS_LOST", 0),
            # retransmits the kernel skipped: another BPF program was running on that CPU
            "kernel_skipped_retransmits": misses.get("tracepoint__tcp__tcp_retransmit_skb", 0)}


def cmd_trace(args) -> int:
    from .identity import node_name
    from .maps import CallEvent
    from .store import Progress, StoreError

    _setup_logging(args.log_level)
    scope = _trace_scope(args)
    recorder = _open_recorder(args.out, node_name(args.node), scope) if args.out else None
    try:
        agent, _node = _start_agent(args, {}, record_all=True,
                                    runq_event_min_ns=args.runq_wait_min if args.out else 0)
    except BaseException:
        if recorder is not None:
            recorder.close()
        raise
    counts = {"shown": 0}

    def show(event):
        if not isinstance(event, CallEvent) or event.pid not in scope:
            return
        counts["shown"] += 1
        if args.format == "json":
            print(json.dumps(event.as_dict()), flush=True)
        else:
            print(format_event_text(event), flush=True)

    if recorder is not None:
        recorder.note(clock_offset_ns=agent.reader.clock.offset_ns)
        agent.listeners.append(recorder)
    else:
        agent.listeners.append(show)
    what = f"for {args.duration:g} s" if args.duration else "until Ctrl-C"
    where = f" to {args.out} ({scope.describe()})" if recorder is not None else ""
    print(f"tracing NCCL calls {what}{where}...", file=sys.stderr, flush=True)
    stop = _stop_on_signals()
    started = time.monotonic()
    deadline = started + args.duration if args.duration else None
    progress = Progress(recorder, sys.stderr) if recorder is not None else None
    lost = 0
    try:
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            agent.step()
            if progress is not None:
                recorder.set_kernel_lost(**_kernel_losses(agent))
                progress.tick()
        agent.reader.poll(0)  # what is already in the ring buffer is not lost
        lost = agent.reader.counters()["EVENTS_LOST"]
        if recorder is not None:
            recorder.set_kernel_lost(**_kernel_losses(agent))
    finally:
        agent.close()
        if recorder is not None:
            if progress is not None:
                progress.done()
            try:
                recorder.close()
            except StoreError as e:
                raise CliError(str(e)) from None
    if recorder is not None:
        print(f"recorded in {time.monotonic() - started:.1f} s: {recorder.summary()}",
              file=sys.stderr, flush=True)
    else:
        print(f"{counts['shown']} calls traced in {time.monotonic() - started:.1f} s, {lost} lost",
              file=sys.stderr, flush=True)
    return 0


def cmd_query(args) -> int:
    from . import query

    try:
        names, rows = query.run(args.db, args.sql)
    except query.QueryError as e:
        raise CliError(str(e)) from None
    query.write(names, rows, args.format)
    return 0


def cmd_demo(args) -> int:
    from . import demo

    require_privileges()
    return demo.main(args)


# --- parser ---------------------------------------------------------------------

def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other error: 'nccl-exporter: error: ...', exit 2."""

    def error(self, message):
        self.exit(2, f"nccl-exporter: error: {message}; see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="nccl-exporter",
        description="eBPF agent that measures NCCL calls (uprobes on libnccl) and exports "
                    "them as Prometheus metrics.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"nccl-exporter {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def lib_option(sp):
        sp.add_argument("--nccl-lib", action="append", metavar="PATH",
                        help="probe this libnccl (repeatable); default: every libnccl "
                             "mapped by running processes, and new ones as they appear")

    def runq_option(sp, when):
        sp.add_argument("--runq-wait-min", type=parse_runq_wait_min, metavar="D|off",
                        default=parse_runq_wait_min(DEFAULT_RUNQ_WAIT_MIN),
                        help=f"{when}: record each time a thread of a traced process waited at least D "
                             f"runnable for a CPU (sched_events; default {DEFAULT_RUNQ_WAIT_MIN}; 0: every "
                             "wait; off: none)")

    c = sub.add_parser("check", help="say what works and what is missing on this host")
    lib_option(c)
    c.set_defaults(func=cmd_check)

    r = sub.add_parser("run", help="attach the probes and serve /metrics",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Attach uprobes to libnccl and serve Prometheus metrics "
                                   f"(default port {contract.DEFAULT_PORT}).")
    r.add_argument("--listen", metavar="HOST:PORT",
                   help=f"where to serve /metrics (default 0.0.0.0:{contract.DEFAULT_PORT})")
    r.add_argument("--config", metavar="FILE",
                   help="TOML file with node, listen, nccl_libs, log_level (flags win)")
    r.add_argument("--node", metavar="NAME",
                   help="node label (default: config, $NCCL_EXPORTER_NODE, hostname)")
    r.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    r.add_argument("--otlp-endpoint", metavar="URL",
                   help="send a span per slow call here (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT "
                        "or $OTEL_EXPORTER_OTLP_ENDPOINT; no spans without one)")
    r.add_argument("--otlp-protocol", choices=["grpc", "http/protobuf"],
                   help="default: $OTEL_EXPORTER_OTLP_PROTOCOL or grpc")
    r.add_argument("--slow-threshold", action="append", metavar="[OP=]DURATION",
                   help="a call at least this long is slow (default 50ms for every op); "
                        "repeatable, e.g. --slow-threshold 20ms --slow-threshold ALL_REDUCE=200ms")
    r.add_argument("--slow-relative", type=float, metavar="K",
                   help="instead of the fixed threshold, a call is slow at K x the recent p50 of "
                        "its op/comm/rank series (recomputed every 10 s; never below 1 ms)")
    r.add_argument("--db", metavar="PATH",
                   help="also record every NCCL call, TCP retransmit/reset and scheduler wait to this SQLite file "
                        "(as 'trace --out'; read it with 'query')")
    runq_option(r, "with --db")
    lib_option(r)
    r.set_defaults(func=cmd_run)

    t = sub.add_parser("trace", help="print every NCCL call as it returns, or record them to SQLite")
    t.add_argument("--duration", type=parse_duration, default=0.0, metavar="D",
                   help="stop after D (30s, 2m, ...); default: until Ctrl-C")
    t.add_argument("--format", choices=["text", "json"], default="text")
    t.add_argument("--out", metavar="DB",
                   help="record every NCCL call, TCP retransmit/reset and scheduler wait to this "
                        "SQLite file instead of printing (docs/schema.md; read it with 'query')")
    t.add_argument("--pid", type=int, action="append", help="only this process (repeatable)")
    t.add_argument("--netns", metavar="PATH|INODE",
                   help="only processes in this network namespace (/run/netns/NAME, "
                        "/proc/PID/ns/net, or its inode number)")
    t.add_argument("--node", metavar="NAME",
                   help="node name stored in the recording (default: $NCCL_EXPORTER_NODE, hostname)")
    t.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="warning")
    runq_option(t, "with --out")
    lib_option(t)
    t.set_defaults(func=cmd_trace)

    q = sub.add_parser("query", help="run read-only SQL on a recording made by 'trace --out'",
                       description="Run one read-only SQL statement on a recording "
                                   "(tables: docs/schema.md; examples: docs/queries.md).")
    q.add_argument("db", metavar="DB", help="the recording (.db)")
    q.add_argument("sql", metavar="SQL", help="one SELECT (or WITH ...) statement")
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.set_defaults(func=cmd_query)

    d = sub.add_parser("demo", help="run an 8-rank simulated job with loss and a straggler, "
                                    "and show what the exporter sees")
    d.add_argument("--ranks", type=int, default=8, help="ranks, one per simulated host (default 8)")
    d.add_argument("--seconds", type=float, default=30.0, help="how long the job runs (default 30)")
    d.add_argument("--lossy-rank", type=int, default=5, help="rank whose link drops packets (default 5)")
    d.add_argument("--loss-percent", type=int, default=3, help="packet loss on that link (default 3)")
    d.add_argument("--straggler-rank", type=int, default=2,
                   help="rank that computes longer before each collective (default 2)")
    d.add_argument("--listen", default=f"127.0.0.1:{contract.DEFAULT_PORT}", metavar="HOST:PORT")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except CliError as e:
        print(f"nccl-exporter: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

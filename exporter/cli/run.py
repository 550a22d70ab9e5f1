"""`nccl-exporter run`: the agent, serving /metrics (and spans, and a recording)."""

from __future__ import annotations

import argparse
import logging
import os

from exporter import __version__
from exporter.records import contract, histogram
from exporter.agent.preflight import CAPABILITIES
from exporter.cli.common.options import (
    DEFAULT_IDLE_DETACH,
    DEFAULT_OWNER_WINDOW,
    CONFIG_KEYS,
    LOG_FORMATS,
    LOG_LEVELS,
    CliError,
    add_lib_option,
    add_log_options,
    announce,
    add_pod_options,
    add_sched_options,
    load_config,
    open_recorder,
    parse_duration,
    parse_idle_detach,
    parse_owner_window,
    parse_srtt_sampling,
    DEFAULT_SRTT_SAMPLING,
    parse_listen,
    positive_duration,
    positive_int,
    setup_logging,
    start_agent,
    stop_on_signals,
)


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="attach the probes and serve /metrics",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Attach uprobes to libnccl and serve Prometheus metrics "
                                   f"(default port {contract.DEFAULT_PORT}). Needs "
                                   + ", ".join(f"CAP_{c}" for c in CAPABILITIES)
                                   + " (root has them; docs/deploy.md says why each).")
    r.add_argument("--listen", metavar="HOST:PORT",
                   help=f"where to serve /metrics (default 0.0.0.0:{contract.DEFAULT_PORT})")
    r.add_argument("--config", metavar="FILE",
                   help="TOML file with any of the keys " + ", ".join(sorted(CONFIG_KEYS))
                        + " (a flag given too wins; docs/configuration.md)")
    r.add_argument("--node", metavar="NAME",
                   help="node label (default: config, $NCCL_EXPORTER_NODE, hostname)")
    add_log_options(r, None)
    r.add_argument("--otlp-endpoint", metavar="URL",
                   help="send a span per slow call here (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT "
                        "or $OTEL_EXPORTER_OTLP_ENDPOINT; no spans without one)")
    r.add_argument("--otlp-protocol", choices=["grpc", "http/protobuf"],
                   help="for spans and metrics (default: $OTEL_EXPORTER_OTLP_PROTOCOL or grpc)")
    r.add_argument("--otlp-metrics-endpoint", metavar="URL",
                   help="push every metric here over OTLP, histograms as exponential histograms with "
                        "the kernel's buckets (default: $OTEL_EXPORTER_OTLP_METRICS_ENDPOINT; none "
                        "without one; docs/metrics.md \"OTLP metrics\")")
    r.add_argument("--otlp-metrics-interval", type=parse_duration, metavar="DURATION",
                   help="how often (default: $OTEL_METRIC_EXPORT_INTERVAL ms, else 60s)")
    r.add_argument("--slow-threshold", action="append", metavar="[OP=]DURATION",
                   help="a call at least this long is slow (default 50ms for every op); "
                        "repeatable, e.g. --slow-threshold 20ms --slow-threshold ALL_REDUCE=200ms")
    r.add_argument("--slow-relative", type=float, metavar="K",
                   help="instead of the fixed threshold, a call is slow at K x the recent p50 of "
                        "its op/comm/rank series (recomputed every 10 s; never below 1 ms)")
    r.add_argument("--db", metavar="PATH",
                   help="also record every NCCL call and TCP retransmit/reset (and, with --sched waits, "
                        "scheduler wait) to this SQLite file (as 'trace --out'; read it with 'query')")
    add_sched_options(r, "totals", "with --db")
    r.add_argument("--srtt-sampling", type=parse_srtt_sampling, metavar="WINDOW/PERIOD|always",
                   default=parse_srtt_sampling(DEFAULT_SRTT_SAMPLING),
                   help="while a job runs, sample the smoothed RTT of its sockets (nccl_tcp_srtt_seconds) "
                        "during WINDOW of every PERIOD only: the tcp_probe tracepoint it needs runs at "
                        "every incoming TCP segment of the node while attached (default "
                        f"{DEFAULT_SRTT_SAMPLING}; always: attached the whole time, docs/tcp.md)")
    r.add_argument("--owner-window", type=parse_owner_window, metavar="DURATION|always",
                   default=parse_owner_window(DEFAULT_OWNER_WINDOW),
                   help="learn which traced thread owns each TCP socket (the rank label of retransmits "
                        "and resets) by watching every socket send and receive of the node only for this "
                        "long after a job starts, after a traced process appears and after each connection "
                        "one accepts; sockets a traced thread connects are learnt at connect() anyway "
                        f"(default {DEFAULT_OWNER_WINDOW}; always: watched the whole time, docs/tcp.md)")
    r.add_argument("--idle-detach", type=parse_idle_detach, metavar="DURATION|off",
                   default=DEFAULT_IDLE_DETACH,
                   help="detach the tracepoints that run at every context switch, wakeup and socket "
                        "send/receive of the node once no process has been traced for this long, and "
                        "attach them again when one is (within a tenth of a second; what happens on "
                        f"the node meanwhile is not seen): a node between jobs pays nothing (default "
                        f"{DEFAULT_IDLE_DETACH:g}s; off: always attached)")
    r.add_argument("--series-ttl", type=parse_duration, metavar="DURATION",
                   help="a communicator's series leave the kernel maps and /metrics this long after it "
                        "was destroyed or aborted, or every process using it exited (default "
                        f"{contract.DEFAULT_SERIES_TTL:g}s)")
    r.add_argument("--series-capacity", type=int, metavar="N",
                   help=f"(op, comm, rank) series the kernel holds at once (default {contract.MAX_SERIES}); "
                        'when full, calls are counted in comm="overflow" series')
    r.add_argument("--histogram-resolution", choices=sorted(histogram.CLASSIC),
                   help="classic buckets of text scrapes, derived from the kernel's exponential "
                        "(schema 3) buckets: coarse (default: each power of two seconds, 2^-20 s "
                        "(0.95 us) .. 128 s, 29 buckets) or fine (each quarter power of two from "
                        "2^-19 s, 106 buckets); protobuf scrapes get native histograms (docs/metrics.md)")
    r.add_argument("--protobuf-classic-buckets", action="store_true",
                   help="protobuf scrapes carry each histogram's classic buckets beside the native "
                        "ones (Prometheus keeps both only with scrape_classic_histograms, 2.45+, or "
                        "always_scrape_classic_histograms, 3.x; docs/metrics.md)")
    add_lib_option(r)
    add_pod_options(r)
    add_query_endpoint_options(r)
    r.set_defaults(func=main)


def main(args) -> int:
    from contextlib import ExitStack

    from prometheus_client import CollectorRegistry

    from exporter.sinks.http import HttpServer, notify_systemd
    from exporter.sinks.recording.schema import RecordingError
    from exporter.sources.identity import node_name
    from exporter.agent.pipeline import Pipeline

    cfg = load_config(args.config)
    for key, known in (("log_level", LOG_LEVELS), ("log_format", LOG_FORMATS)):
        if key in cfg and cfg[key] not in known:
            raise CliError(f"config file {args.config}: {key} {cfg[key]!r}: one of {', '.join(known)}")
    setup_logging(args.log_level or cfg.get("log_level") or "info",
                  args.log_format or cfg.get("log_format") or "text",
                  node_name(args.node, cfg.get("node")))
    host, port = parse_listen(args.listen or cfg.get("listen") or f"0.0.0.0:{contract.DEFAULT_PORT}")
    queries = open_query_endpoint(args)  # --query-listen: checked and bound before anything starts
    registry = CollectorRegistry(auto_describe=False)
    # What is opened is closed in the reverse order, also when a later step
    # fails: the recorder (its summary), the query endpoint, the spans, the
    # agent, the HTTP server.
    with ExitStack() as opened:
        try:
            # /metrics from the start; /-/ready answers 503 until the probes count
            server = HttpServer(host, port, registry, protobuf_classic=args.protobuf_classic_buckets)
        except OSError as e:
            raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        opened.callback(server.shutdown)
        server.watch(lambda: None)  # /-/healthy: 503 while starting, then the loop's heartbeat
        # --db: every call, and run-queue waits
        agent, node = start_agent(args, cfg, record_all=bool(args.db),
                                   runq_event_min_ns=args.runq_wait_min if args.db else 0)
        server.watch(lambda: agent.heartbeat)
        # the kernel's detaching (~0.13 s a probe) outlives the process: docs/deploy.md "Stopping"
        opened.callback(agent.close, detach_in_background=True)
        pipeline = Pipeline(agent, node)
        spans = start_tracing(args, cfg, agent, node)
        if spans is not None:
            opened.callback(spans.close)
            pipeline.listen(spans)
        recorder = None
        if args.db:
            recorder = open_recorder(args.db, node)
            opened.callback(_close_recorder, recorder, RecordingError)
            recorder.note(clock_offset_ns=agent.reader.clock.offset_ns)
            # Writing failed (disk full, read-only, locked): one line; the agent keeps
            # serving, and every event not recorded counts in nccl_exporter_recording_dropped_total.
            recorder.on_error = lambda message: logging.getLogger("nccl_exporter").error(
                "%s; metrics are still served, events not recorded are counted in "
                "nccl_exporter_recording_dropped_total", message)
            recorder.identify = agent.processes.describe  # pod and library version as on /metrics
            pipeline.listen(recorder)
            serve_queries(queries, node)  # the node query endpoint, on the recording
        if queries is not None:
            opened.callback(queries.close)
        pipeline.serve_metrics(registry, spans=spans, recorder=recorder)
        pusher = start_otlp_metrics(args, registry, node)
        if pusher is not None:  # closed before the agent: a last export while the maps are there
            opened.callback(pusher.shutdown)
        shown = "localhost" if host in ("0.0.0.0", "::") else host
        announce(f"nccl-exporter {__version__} on node {node}: metrics at http://{shown}:{port}/metrics")
        stop = stop_on_signals()
        when_ready(agent, server, node)
        try:
            agent.run_until(stop)
        finally:
            notify_systemd("STOPPING=1")
            if recorder is not None:
                recorder.set_kernel_lost(**agent.kernel_losses())
    announce("nccl-exporter: stopped")
    return 0


def _close_recorder(recorder, recording_error) -> None:
    try:
        recorder.close()
    except recording_error:
        pass  # already logged when it happened
    announce(f"nccl-exporter: {recorder.summary()}")


def attach_problems(reports) -> list[str]:
    """Libraries found at start whose functions did not all attach (one line each)."""
    out = []
    for r in reports:
        if r.failed:
            first = next(iter(r.failed.values()))
            out.append(f"{len(r.failed)} of {len(r.failed) + len(r.attached)} NCCL functions in "
                       f"{r.path} could not be attached ({first})")
    return out


def when_ready(agent, server, node) -> None:
    """Once the agent counts: /-/ready says 200, one log line, and sd_notify READY=1.
    Not ready while a library found at start is not fully attached (logged once)."""
    import threading

    from exporter.sinks.http import notify_systemd

    log = logging.getLogger("nccl_exporter")

    def wait() -> None:
        agent.ready.wait()
        problems = attach_problems(list(getattr(agent.probes, "reports", ())))
        if problems:
            log.error("not ready: %s; calls there are not counted (capabilities: "
                      "docs/deploy.md)", "; ".join(problems))
            # Started all the same (systemd's start returns, no restart loop):
            # the agent serves, /-/ready stays 503, and the unit's status says why.
            notify_systemd("READY=1\nSTATUS=not ready: " + "; ".join(problems))
            return
        server.set_ready()
        log.info("ready: probes loaded and attached on node %s, counting NCCL calls", node)
        notify_systemd("READY=1\nSTATUS=counting NCCL calls")

    if agent.ready.is_set():
        wait()
    else:
        threading.Thread(target=wait, name="nccl-exporter-ready", daemon=True).start()


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


def start_tracing(args, cfg, agent, node):
    """Slow-call thresholds, and the span sink when an OTLP endpoint is
    configured (the caller attaches it: Pipeline.listen)."""
    from exporter.agent.slow import SlowCallPolicy

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
    # With --db the kernel sends every call and every GPU operation: the sink
    # keeps the slow ones itself, and the plugin's thresholds stay at "all".
    agent.slow = SlowCallPolicy(agent.probes, agent.reader, thresholds, relative,
                                plugin=None if agent.config.record_all else agent.plugin)
    protocol = (args.otlp_protocol or cfg.get("otlp_protocol")
                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    from exporter.sinks.spans import SpanSink, make_otlp_exporter

    try:
        exporter = make_otlp_exporter(protocol, endpoint)
    except ValueError as e:
        raise CliError(str(e)) from None
    # With --db the kernel sends every call: the sink keeps the slow ones itself.
    policy = agent.slow
    sink = SpanSink(node, exporter, agent.processes,
                    slow=agent.slow.is_slow if agent.config.record_all else None,
                    gpu_slow=(lambda e: e.duration_ns >= policy.threshold_ns(e.op)) if agent.config.record_all else None)
    announce(f"spans of slow calls -> {endpoint} (OTLP {protocol})")
    return sink


# --- the node query endpoint: `run --db --query-listen` (docs/fleet-live.md) -------------

def add_query_endpoint_options(r) -> None:
    g = r.add_argument_group("query endpoint (with --db; docs/fleet-live.md)")
    g.add_argument("--query-listen", metavar="HOST:PORT",
                   help="answer read-only SQL on the recording here (POST /api/v1/query), and "
                        "serve it for 'fleet fetch'; off by default")
    g.add_argument("--query-token-file", metavar="F", help="the bearer token clients must send (required)")
    g.add_argument("--query-tls-cert", metavar="F", help="TLS certificate (required unless loopback only)")
    g.add_argument("--query-tls-key", metavar="F", help="TLS private key")
    g.add_argument("--query-max-rows", type=positive_int, metavar="N",
                   help="rows per answer at most (default 100000)")
    g.add_argument("--query-time-limit", type=positive_duration, metavar="D",
                   help="per query (default 10s)")


def open_query_endpoint(args):
    """Validate the --query-* options and bind the listener (not serving yet); None when off."""
    from exporter.sinks.recording import endpoint, protocol

    if not getattr(args, "query_listen", None):
        if any(getattr(args, k, None) for k in ("query_token_file", "query_tls_cert", "query_tls_key")):
            raise CliError("--query-token-file/--query-tls-* need --query-listen HOST:PORT")
        return None
    if not args.db:
        raise CliError("--query-listen needs --db PATH: queries are answered from the recording")
    if not args.query_token_file:
        raise CliError("--query-listen needs --query-token-file F (a bearer token)")
    try:
        host, port = parse_listen(args.query_listen)
    except CliError as e:
        raise CliError(str(e).replace("--listen", "--query-listen")) from None
    try:
        return endpoint.QueryEndpoint(
            args.db, node="", token=protocol.read_token(args.query_token_file, "--query-token-file"), host=host, port=port,
            tls_cert=args.query_tls_cert, tls_key=args.query_tls_key,
            max_rows=args.query_max_rows or endpoint.DEFAULT_MAX_ROWS,
            time_limit=args.query_time_limit or endpoint.DEFAULT_TIME_LIMIT_S)
    except (endpoint.EndpointError, protocol.ProtocolError) as e:
        raise CliError(str(e)) from None


def serve_queries(ep, node) -> None:
    """Start answering, once the recording exists."""
    if ep is None:
        return
    ep.node = node
    ep.start()
    announce(f"read-only queries at {ep.url}/api/v1/query (bearer token)")


def start_otlp_metrics(args, registry, node: str):
    """run --otlp-metrics-endpoint: the OtlpMetricsPusher, or None."""
    endpoint = args.otlp_metrics_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    if not endpoint:
        return None
    from exporter.sinks.otlp_metrics import OtlpMetricsPusher, default_interval_s, make_metric_exporter

    protocol = (args.otlp_protocol or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    interval = args.otlp_metrics_interval or default_interval_s()
    if interval <= 0:
        raise CliError(f"--otlp-metrics-interval {interval:g}s: a duration > 0, e.g. 30s")
    try:
        exporter = make_metric_exporter(protocol, endpoint)
    except ValueError as e:
        raise CliError(str(e)) from None
    announce(f"metrics -> {endpoint} (OTLP {protocol}, every {interval:g} s)")
    return OtlpMetricsPusher(registry, exporter, node, interval)

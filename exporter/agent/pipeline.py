"""The sinks of an agent, attached in one place: what `run` and `trace` publish.

    with ExitStack() as opened:
        pipeline = open_pipeline(cfg, opened)   # what can fail on bad input, before the probes load
        agent = start_agent(cfg)
        opened.callback(agent.close, detach_in_background=True)
        pipeline.attach(agent)                  # every sink the Config names, on the agent's records
        ...loop...
        pipeline.finish()

The sinks a Config names:
- the HTTP server (`run`: /metrics, /-/ready, /-/healthy; sinks/http.py), its
  collectors from the SOURCES rows (sinks/prometheus/);
- spans of slow calls over OTLP (--otlp-endpoint; sinks/spans.py), with the slow
  call policy (agent/slow.py);
- the OTLP metrics pusher (--otlp-metrics-endpoint; sinks/otlp_metrics.py);
- the recording (--db; sinks/recording/writer.py), and on it the node query
  endpoint (--query-listen; sinks/recording/endpoint.py);
- `trace`'s printer, which the command attaches itself with `listen`.
Each is closed in the reverse order it was opened, also when a later step fails.

Sources are wired in by their row in agent/sources.py's SOURCES: each row's
`collector` is its part of /metrics (sinks/prometheus/), its `tables` are
its own in recordings, and every source's records reach the listeners
attached here. So a new source is one row there, and a new sink is one step
of `open_pipeline`/`Pipeline.attach` here (docs/architecture.md).
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import ExitStack

from exporter import __version__
from exporter.agent import sources as agent_sources
from exporter.agent.config import Config, SetupError
from exporter.agent.logs import announce
from exporter.agent.loop import Agent
from exporter.records import histogram
from exporter.sinks.prometheus import Collector
from exporter.sinks.recording.writer import Recorder

log = logging.getLogger("nccl_exporter")


class Pipeline:
    """The sinks of an agent: those of a Config are opened by `open_pipeline`
    (before the agent exists) and attached to it by `attach`; `opened` closes
    them. Pipeline(agent, node).serve_metrics(registry) alone is /metrics."""

    def __init__(self, agent: Agent | None, node: str, cfg: Config | None = None,
                 opened: ExitStack | None = None):
        self.agent = agent
        self.node = node
        self.cfg = cfg
        self.opened = opened
        self.registry = None
        self.server = None    # HttpServer (run)
        self.recorder = None  # Recorder (--db)
        self.queries = None   # QueryEndpoint (--query-listen), bound before the agent starts
        self.spans = None     # SpanSink (--otlp-endpoint)
        self.pusher = None    # OtlpMetricsPusher (--otlp-metrics-endpoint)
        self.scope = None     # trace: the processes it records or prints (--pid, --netns)
        self._parts: dict = {}  # row name -> its part of /metrics (collectors), for source_loaded

    def collectors(self) -> list:
        """The sources' parts of /metrics, in SOURCES order (an optional source
        that did not load gets its part all the same, with None; one the loop
        loads after counting starts gets its source then: source_loaded)."""
        self._parts = {row.name: row.collector(getattr(self.agent, row.name, None))
                       for row in agent_sources.SOURCES if row.collector is not None}
        return list(self._parts.values())

    def source_loaded(self, row, source) -> None:
        """A source the agent's loop loaded after the start: its part of
        /metrics reads it from the next scrape, its tables are recorded."""
        part = self._parts.get(row.name)
        if part is not None:
            with self.agent.lock:  # a scrape reads it
                part.source = source
        if self.recorder is not None and row.tables:
            self.recorder.add_tables(row.tables)

    def serve_metrics(self, registry, spans=None, recorder=None) -> None:
        """Register what /metrics shows: every source's part, and the
        exporter's own families; spans and recorder add their counters."""
        registry.register(Collector(self.node, self.agent.processes, self.collectors(), spans=spans,
                                    lock=self.agent.lock, recorder=recorder,
                                    classic=histogram.CLASSIC[self.agent.config.histogram_resolution]))

    def listen(self, sink) -> None:
        """`sink(record)` for every record the sources deliver (recorder, span
        sink, the trace printer), called from the agent's loop. A recorder
        also gets the loaded sources' own tables."""
        if isinstance(sink, Recorder):
            sink.add_tables([t for row in self.agent.loaded for t in row.tables])
        self.agent.listeners.append(sink)

    def attach(self, agent: Agent) -> None:
        """Every sink the Config names, on `agent`'s records; `run`'s /metrics
        and readiness follow the agent from here."""
        cfg, opened = self.cfg, self.opened
        self.agent = agent
        agent.on_loaded.append(self.source_loaded)
        if self.server is not None:
            self.server.watch(lambda: agent.heartbeat)
        if cfg.command == "run":
            self.spans = start_spans(cfg, agent)
            if self.spans is not None:
                opened.callback(self.spans.close)
                self.listen(self.spans)
        if self.recorder is not None:
            recorder = self.recorder
            # sched: how run-queue waits were recorded (waits: sched_events; totals: sched_intervals)
            recorder.note(clock_offset_ns=agent.reader.clock.offset_ns,
                          sched="waits" if agent.config.sched_waits else "totals")
            recorder.identify = agent.processes.describe  # pod and library version as on /metrics
            self.listen(recorder)
        if self.queries is not None:
            self.queries.node = self.node
            self.queries.start()
            announce(f"read-only queries at {self.queries.url}/api/v1/query (bearer token)")
        if self.server is None:
            return
        self.serve_metrics(self.registry, spans=self.spans, recorder=self.recorder)
        self.pusher = start_otlp_metrics(cfg, self.registry)
        if self.pusher is not None:  # closed before the agent: a last export while the maps are there
            opened.callback(self.pusher.shutdown)
        host, port = cfg.listen
        shown = "localhost" if host in ("0.0.0.0", "::") else host
        announce(f"nccl-exporter {__version__} on node {self.node}: metrics at http://{shown}:{port}/metrics")
        when_ready(agent, self.server, self.node)

    def finish(self) -> None:
        """The loop ended: the kernel's losses into the recording; systemd hears we stop."""
        if self.server is not None:
            from exporter.sinks.http import notify_systemd

            notify_systemd("STOPPING=1")
        if self.recorder is not None and self.agent is not None:
            self.recorder.set_kernel_lost(**self.agent.kernel_losses())


def open_pipeline(cfg: Config, opened: ExitStack) -> Pipeline:
    """The pipeline of sinks `cfg` names, with what can fail on bad input or a
    busy port done before the probes load: the node query endpoint bound (not
    answering yet), the HTTP server serving /metrics (/-/ready 503 until the
    agent counts), the recording opened. `opened` closes each."""
    p = Pipeline(None, cfg.node, cfg, opened)
    if cfg.command == "run":
        p.queries = open_query_endpoint(cfg)
        if p.queries is not None:
            opened.callback(p.queries.close)
        from prometheus_client import CollectorRegistry

        from exporter.sinks.http import HttpServer

        p.registry = CollectorRegistry(auto_describe=False)
        host, port = cfg.listen
        try:
            p.server = HttpServer(host, port, p.registry, protobuf_classic=cfg.protobuf_classic_buckets)
        except OSError as e:
            raise SetupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        opened.callback(p.server.shutdown)
        p.server.watch(lambda: None)  # /-/healthy: 503 while starting, then the loop's heartbeat
    if cfg.command == "trace":
        p.scope = recording_scope(cfg)
    if cfg.db:
        p.recorder = open_recorder(cfg.db, cfg.node, p.scope)
        opened.callback(_close_recorder, p)
        if cfg.command == "run":
            # Writing failed (disk full, read-only, locked): one line; the agent keeps
            # serving, and every event not recorded counts in nccl_exporter_recording_dropped_total.
            p.recorder.on_error = lambda message: log.error(
                "%s; metrics are still served, events not recorded are counted in "
                "nccl_exporter_recording_dropped_total", message)
    return p


def _close_recorder(p: Pipeline) -> None:
    from exporter.sinks.recording.schema import RecordingError

    try:
        p.recorder.close()
    except RecordingError as e:
        if p.cfg.command == "trace":  # trace ends on a write error: exit 2 with why
            raise SetupError(str(e)) from None
        return  # run: already logged when it happened
    if p.cfg.command == "run" and p.agent is not None:
        announce(f"nccl-exporter: {p.recorder.summary()}")


# --- the recording -------------------------------------------------------------------------

def recording_scope(cfg: Config):
    """--pid / --netns of `trace` -> a recording Scope (everything when neither is given)."""
    from exporter.sinks.recording.schema import RecordingError
    from exporter.sinks.recording.scope import Scope, netns_inode

    try:
        netns = netns_inode(cfg.netns) if cfg.netns else None
    except RecordingError as e:
        raise SetupError(str(e)) from None
    gone = [p for p in cfg.pid if p <= 0 or not os.path.exists(f"/proc/{p}")]
    if gone:
        raise SetupError(f"--pid {gone[0]}: no such process (a process to trace must be running: "
                         "see 'ps', or trace everything and filter with 'query')")
    return Scope(pids=cfg.pid, netns=netns)


def open_recorder(path, node, scope=None):
    from exporter.sinks.recording.schema import RecordingError
    from exporter.sinks.recording.writer import Recorder

    try:
        return Recorder(path, node=node, scope=scope)
    except RecordingError as e:
        raise SetupError(str(e)) from None


def open_query_endpoint(cfg: Config):
    """The node query endpoint on the --db recording, bound (not answering yet); None when off."""
    if not cfg.query_listen:
        return None
    from exporter.sinks.recording import endpoint, protocol

    host, port = cfg.query_listen
    try:
        return endpoint.QueryEndpoint(
            cfg.db, node="", token=protocol.read_token(cfg.query_token_file, "--query-token-file"),
            host=host, port=port, tls_cert=cfg.query_tls_cert, tls_key=cfg.query_tls_key,
            max_rows=cfg.query_max_rows, time_limit=cfg.query_time_limit)
    except (endpoint.EndpointError, protocol.ProtocolError) as e:
        raise SetupError(str(e)) from None


# --- OTLP --------------------------------------------------------------------------------

def start_spans(cfg: Config, agent: Agent):
    """The span sink when an OTLP endpoint is configured, and the slow-call
    policy it follows (agent.slow); None without an endpoint."""
    from exporter.agent.slow import SlowCallPolicy

    if not cfg.otlp_endpoint:
        return None  # nobody consumes slow-call events: the kernel sends none
    # With --db the kernel sends every call and every GPU operation: the sink
    # keeps the slow ones itself, and the plugin's thresholds stay at "all".
    agent.slow = SlowCallPolicy(agent.probes, agent.reader, cfg.slow_thresholds, cfg.slow_relative,
                                plugin=None if agent.config.record_all else agent.plugin)
    protocol = cfg.otlp_protocol_for("traces")
    from exporter.sinks.spans import SpanSink, make_otlp_exporter

    exporter = _otlp_exporter(make_otlp_exporter, protocol, cfg.otlp_endpoint)
    # With --db the kernel sends every call: the sink keeps the slow ones itself.
    policy = agent.slow
    sink = SpanSink(cfg.node, exporter, agent.processes,
                    slow=agent.slow.is_slow if agent.config.record_all else None,
                    gpu_slow=((lambda e: e.duration_ns >= policy.threshold_ns(e.op))
                              if agent.config.record_all else None))
    announce(f"spans of slow calls -> {cfg.otlp_endpoint} (OTLP {protocol})")
    return sink


def _otlp_exporter(make, protocol: str, endpoint: str):
    """An OTLP exporter (spans or metrics); a bad protocol or endpoint is one line."""
    try:
        return make(protocol, endpoint)
    except ValueError as e:
        raise SetupError(str(e)) from None


def start_otlp_metrics(cfg: Config, registry):
    """--otlp-metrics-endpoint: the OtlpMetricsPusher, or None."""
    if not cfg.otlp_metrics_endpoint:
        return None
    from exporter.sinks.otlp_metrics import OtlpMetricsPusher, make_metric_exporter

    protocol = cfg.otlp_protocol_for("metrics")
    exporter = _otlp_exporter(make_metric_exporter, protocol, cfg.otlp_metrics_endpoint)
    interval = cfg.otlp_metrics_interval
    announce(f"metrics -> {cfg.otlp_metrics_endpoint} (OTLP {protocol}, every {interval:g} s)")
    return OtlpMetricsPusher(registry, exporter, cfg.node, interval)


# --- readiness ---------------------------------------------------------------------------

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
    from exporter.sinks.http import notify_systemd

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
        server.set_ready(loading=lambda: [row.name for row in agent.loading])
        log.info("ready: probes loaded and attached on node %s, counting NCCL calls", node)
        notify_systemd("READY=1\nSTATUS=counting NCCL calls")

    if agent.ready.is_set():
        wait()
    else:
        threading.Thread(target=wait, name="nccl-exporter-ready", daemon=True).start()

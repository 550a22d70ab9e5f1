"""Span builder: one OpenTelemetry span per slow NCCL call.

Slow calls arrive as CallEvents (bpf/nccl.c decides what is slow, see
exporter/agent/slow.py); TCP events arrive from the kernel-side probes. A call is
turned into a span a short while after it returned (`settle_s`), so the TCP
events of its window, which travel on another ring buffer, are in by then.

One trace per collective across ranks: the trace id is derived from
(communicator id, op, the rank's sequence number of that op on that
communicator), which every rank computes alike with no coordination, so the
spans of all ranks of one collective land in the same trace.

Where the profiler plugin runs, a slow GPU operation (GpuCall) becomes a span
too: start and end are its GPU interval in wall-clock time, the host enqueue
is an event on it, and its trace id is the same function of (communicator
id, op, NCCL's seqNumber), so it lands in the trace of the host call that
enqueued it and of the other ranks' spans.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import socket
import struct
import threading
import time
from collections import deque

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode

from exporter import __version__
from exporter.records import contract, render
from exporter.records.events import CallEvent, GpuCall, TcpEvent, format_comm

log = logging.getLogger("nccl_exporter")


def trace_id_for(comm: int, op: str, seq: int) -> int:
    """The 128-bit trace id of one collective: same on every rank and node."""
    data = b"nccl-exporter/1" + struct.pack("<QIQ", comm, contract.OP_CODES[op], seq)
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "big") or 1


class _ChosenTraceIds(IdGenerator):
    """Lets the builder choose the trace id of the next span it starts."""

    def __init__(self):
        self.local = threading.local()

    def generate_span_id(self) -> int:
        return random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        chosen = getattr(self.local, "trace_id", None)
        self.local.trace_id = None
        return chosen or random.getrandbits(128) or 1


class CountingExporter(SpanExporter):
    """Wraps the OTLP exporter to count what reached the backend and what did not."""

    def __init__(self, inner: SpanExporter):
        self.inner = inner
        self.exported = 0
        self.failed = 0

    def export(self, spans):
        try:
            result = self.inner.export(spans)
        except Exception as e:  # noqa: BLE001 - an exporter bug or a dead backend must not kill the thread
            log.warning("span export failed: %s", e)
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        return result

    def shutdown(self):
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


# The OTLP exporter classes of each signal: (module suffix, class name, HTTP path).
_OTLP_SIGNALS = {
    "traces": ("trace_exporter", "OTLPSpanExporter", "/v1/traces"),
    "metrics": ("metric_exporter", "OTLPMetricExporter", "/v1/metrics"),
}


def make_otlp_exporter(protocol: str, endpoint: str | None, timeout_s: float = 5.0,
                       signal: str = "traces"):
    """OTLP over gRPC (default) or HTTP/protobuf for `signal` (traces or metrics);
    the OTEL_EXPORTER_OTLP_[<SIGNAL>_]* variables apply when not given."""
    import importlib

    module, cls, path = _OTLP_SIGNALS[signal]
    if protocol == "grpc":
        exporter = getattr(importlib.import_module(f"opentelemetry.exporter.otlp.proto.grpc.{module}"), cls)
        kwargs = {"timeout": timeout_s}
        if endpoint:
            kwargs["endpoint"] = endpoint
            kwargs["insecure"] = endpoint.startswith("http://")
        return exporter(**kwargs)
    if protocol in ("http/protobuf", "http"):
        exporter = getattr(importlib.import_module(f"opentelemetry.exporter.otlp.proto.http.{module}"), cls)
        if endpoint and not endpoint.rstrip("/").endswith(path):
            endpoint = endpoint.rstrip("/") + path
        return exporter(endpoint=endpoint, timeout=timeout_s) if endpoint else exporter(timeout=timeout_s)
    raise ValueError(f"unknown OTLP protocol {protocol!r}: use grpc or http/protobuf")


class TcpWindow:
    """Recent TCP events, to find those inside a call's window."""

    def __init__(self, keep_s: float = 120.0, max_events: int = 100_000):
        self.keep_ns = int(keep_s * 1e9)
        self.events: deque = deque(maxlen=max_events)
        self.lock = threading.Lock()

    def add(self, event) -> None:
        with self.lock:
            self.events.append(event)

    def between(self, start_ns: int, end_ns: int) -> list:
        with self.lock:
            while self.events and self.events[0].timestamp_real_ns < end_ns - self.keep_ns:
                self.events.popleft()
            return [e for e in self.events if start_ns <= e.timestamp_real_ns <= end_ns]


class SpanSink:
    """Listener for the agent's events; builds and exports spans off the probe path."""

    def __init__(self, node: str, exporter: SpanExporter, processes, settle_s: float = 0.3,
                 max_pending: int = 10_000, max_queue: int = 8192, slow=None,
                 prune_interval_s: float = 10.0, exemplar_keep_s: float = 600.0,
                 proc: str = "/proc", gpu_slow=None):
        self.node = node
        self.gpu_slow = gpu_slow  # GpuCall -> bool when the kernel sends every GPU operation
        self.processes = processes
        # A callable event -> bool when the kernel sends every call (record-all,
        # `run --db`): only slow calls become spans, in every mode.
        self.slow = slow
        self.not_slow = 0  # calls seen and skipped as not slow
        self.prune_interval_ns = int(prune_interval_s * 1e9)
        self.exemplar_keep_s = exemplar_keep_s
        self.proc = proc
        self._next_prune_ns = 0
        self.settle_ns = int(settle_s * 1e9)
        self.exporter = CountingExporter(exporter)
        self.processor = BatchSpanProcessor(self.exporter, max_queue_size=max_queue,
                                            schedule_delay_millis=500, export_timeout_millis=5000)
        self.max_queue = max_queue
        self.ids = _ChosenTraceIds()
        self.providers: dict[int, TracerProvider] = {}
        self.pending: deque = deque()
        self.max_pending = max_pending
        self.window = TcpWindow()
        self.dropped = 0  # spans not built: the backend is behind (queue full) or we are
        self.built = 0
        self.exemplars: dict[tuple, tuple[str, float, float]] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="span-builder", daemon=True)
        self._thread.start()

    # --- the listener: called from the ring-buffer poll, must not block ----

    def __call__(self, event) -> None:
        if isinstance(event, TcpEvent):
            self.window.add(event)
            return
        if isinstance(event, CallEvent):
            if event.kind != contract.EVENT_CALL:
                return
            slow = self.slow
        elif isinstance(event, GpuCall):  # only slow ones, unless recording sends all
            slow = self.gpu_slow
        else:
            return
        if slow is not None and not slow(event):
            self.not_slow += 1
            return
        with self.lock:
            if len(self.pending) >= self.max_pending:
                self.dropped += 1
                return
            self.pending.append(event)

    # --- the builder thread ---------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now = time.time_ns()
            self._build_due(now - self.settle_ns)
            if now >= self._next_prune_ns:
                self._next_prune_ns = now + self.prune_interval_ns
                self.prune(now)

    def prune(self, now_ns: int | None = None) -> None:
        """Drop the tracer providers of processes that are gone (none has a span
        pending) and exemplars older than exemplar_keep_s: bounded state."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        with self.lock:
            pending = {e.pid for e in self.pending}
        for pid in [p for p in self.providers
                    if p not in pending and not os.path.exists(f"{self.proc}/{p}")]:
            del self.providers[pid]  # the shared processor stays; nothing to shut down
        oldest = now_ns / 1e9 - self.exemplar_keep_s
        for key in [k for k, (_t, _d, ts) in list(self.exemplars.items()) if ts < oldest]:
            self.exemplars.pop(key, None)

    def _build_due(self, cutoff_real_ns: int) -> None:
        while True:
            with self.lock:
                if not self.pending or self.pending[0].start_real_ns + self.pending[0].duration_ns > cutoff_real_ns:
                    return
                event = self.pending.popleft()
            in_sdk = self.built - self.exporter.exported - self.exporter.failed
            if in_sdk >= self.max_queue:
                self.dropped += 1  # the exporter is behind: drop here, counted
                continue
            try:
                self.build(event)
                self.built += 1
            except Exception as e:  # noqa: BLE001 - one bad event must not stop the builder
                log.warning("could not build a span for %s: %s", event.op, e,
                            extra={"comm": format_comm(event.comm), "rank": event.rank}
                            if isinstance(event, CallEvent) else None)
                self.dropped += 1

    def _provider(self, pid: int) -> TracerProvider:
        provider = self.providers.get(pid)
        if provider is None:
            who = self.processes.identity(pid) if self.processes else {}
            attrs = {
                "service.version": __version__,
                "host.name": socket.gethostname(),
                "node": self.node,
                "process.pid": pid,
            }
            if not (os.environ.get("OTEL_SERVICE_NAME")
                    or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")):
                attrs["service.name"] = "nccl-exporter"
            for key, attr in (("rank", "launcher.rank"), ("world_size", "launcher.world_size"),
                              ("launcher", "launcher.name")):
                if who.get(key) not in (None, ""):
                    attrs[attr] = who[key]
            # shutdown_on_exit=False: no atexit hook holding every provider ever made
            provider = TracerProvider(resource=Resource.create(attrs), id_generator=self.ids,
                                      shutdown_on_exit=False)
            provider.add_span_processor(self.processor)
            self.providers[pid] = provider
        return provider

    def build(self, e) -> None:
        if isinstance(e, GpuCall):
            return self.build_gpu(e)
        start = e.start_real_ns
        end = start + e.duration_ns
        tracer = self._provider(e.pid).get_tracer("nccl-exporter", __version__)
        if e.comm:  # seq counts from 0, like NCCL's seqNumber
            self.ids.local.trace_id = trace_id_for(e.comm, e.op, e.seq)
        attributes = render.span_attributes(e)
        span = tracer.start_span(f"nccl.{e.op}", kind=SpanKind.INTERNAL, start_time=start,
                                 attributes=attributes)
        self._tcp_events(span, e.pid, start, end)
        if e.result != 0:
            span.set_status(Status(StatusCode.ERROR, attributes["nccl.result"]))
        span.end(end_time=end)
        key = (e.op, format_comm(e.comm), e.rank)  # the duration series' labels
        trace_hex = f"{span.get_span_context().trace_id:032x}"
        self.exemplars[key] = (trace_hex, e.duration_ns, end / 1e9)

    def build_gpu(self, e: GpuCall) -> None:
        """A span over the GPU interval; the host enqueue as its event."""
        start = e.start_real_ns
        end = start + e.duration_ns
        tracer = self._provider(e.pid).get_tracer("nccl-exporter", __version__)
        # NCCL's commHash is the host spans' comm id too: the GPU span joins their trace.
        self.ids.local.trace_id = trace_id_for(e.comm, e.op, e.seq)
        attributes = render.gpu_span_attributes(e)
        span = tracer.start_span(f"nccl.{e.op}", kind=SpanKind.INTERNAL, start_time=start,
                                 attributes=attributes)
        if e.enqueue_real_ns:
            span.add_event("nccl.enqueue", timestamp=e.enqueue_real_ns)
        self._tcp_events(span, e.pid, start, end)
        span.end(end_time=end)

    def _tcp_events(self, span, pid: int, start: int, end: int) -> None:
        """The TCP events of the span's window: the process's own as span
        events, the host's other retransmits counted."""
        mine = elsewhere = 0
        for t in self.window.between(start, end):
            if t.pid == pid:
                mine += 1
                d = render.as_dict(t)
                span.add_event(
                    "tcp.retransmit" if t.event == "tcp_retransmit_skb" else f"tcp.{t.event.removeprefix('tcp_')}",
                    attributes={"net.peer.addr": t.daddr, "net.host.addr": t.saddr,
                                "net.host.port": t.sport, "net.peer.port": t.dport,
                                "tcp.state": d["state"], "tcp.event": t.event},
                    timestamp=t.timestamp_real_ns,
                )
            elif t.event == "tcp_retransmit_skb":
                elsewhere += 1
        span.set_attribute("nccl.tcp_events", mine)
        span.set_attribute("nccl.host_retransmits_elsewhere", elsewhere)

    def close(self, timeout_s: float = 5.0) -> None:
        """Build what is pending and flush it (bounded: a dead backend cannot hang us)."""
        self._stop.set()
        self._thread.join(timeout_s)
        self._build_due(time.time_ns() + 10**12)
        self.processor.force_flush(int(timeout_s * 1000))
        self.processor.shutdown()

    def counts(self) -> dict[str, int]:
        return {"exported": self.exporter.exported, "export_failed": self.exporter.failed,
                "dropped": self.dropped}



"""Real OTLP trace receivers for the tests: gRPC and HTTP/protobuf.

Both decode the wire bytes with the official OTLP protobuf definitions
(opentelemetry-proto) and keep every span they were sent.
"""

from __future__ import annotations

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Received:
    def __init__(self):
        self.requests = []
        self.lock = threading.Lock()

    def add(self, request) -> None:
        with self.lock:
            self.requests.append(request)

    def spans(self) -> list[tuple[dict, object]]:
        """[(resource attributes, span)] of everything received."""
        out = []
        with self.lock:
            for req in self.requests:
                for rs in req.resource_spans:
                    resource = {a.key: any_value(a.value) for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        out.extend((resource, span) for span in ss.spans)
        return out


def any_value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def attributes(span) -> dict:
    return {a.key: any_value(a.value) for a in span.attributes}


class GrpcReceiver(Received):
    def __init__(self):
        super().__init__()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver.add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop(grace=None)


class HttpReceiver(Received):
    def __init__(self):
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class MetricsReceiver:
    """A real OTLP metrics receiver over gRPC: keeps every export request,
    decoded with opentelemetry-proto."""

    def __init__(self):
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

        self.requests = []
        self.lock = threading.Lock()
        receiver = self

        class Service(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                with receiver.lock:
                    receiver.requests.append(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def latest(self) -> tuple[dict, dict]:
        """(resource attributes, {metric name: metric}) of the last request."""
        with self.lock:
            req = self.requests[-1]
        (rm,) = req.resource_metrics
        return ({a.key: any_value(a.value) for a in rm.resource.attributes},
                {m.name: m for sm in rm.scope_metrics for m in sm.metrics})

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop(grace=None)

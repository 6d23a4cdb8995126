"""An in-process OTLP trace receiver for tests: what Jaeger's collector would get.

``OtlpGrpcReceiver`` serves opentelemetry-proto's collector ``TraceService`` on 127.0.0.1 (a plain
grpc server, OTLP/gRPC); ``OtlpHttpReceiver`` accepts ``POST /v1/traces`` (OTLP/HTTP protobuf).
Both keep every span they got as a ``ReceivedSpan`` and can wait for the spans of a trace.
"""

from __future__ import annotations

import dataclasses
import http.server
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

KIND_NAMES = {
    value: name.removeprefix("SPAN_KIND_") for name, value in trace_pb2.Span.SpanKind.items()
}
STATUS_NAMES = {
    value: name.removeprefix("STATUS_CODE_") for name, value in trace_pb2.Status.StatusCode.items()
}


def any_value(value: common_pb2.AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which) if which else None


@dataclasses.dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    kind: str  # SERVER, CLIENT, INTERNAL ...
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: str  # UNSET, OK, ERROR
    resource: dict[str, Any]

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class _Store:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: any_value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=KIND_NAMES[span.kind],
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: any_value(a.value) for a in span.attributes},
                            status=STATUS_NAMES[span.status.code],
                            resource=resource,
                        )
                    )
        with self._lock:
            self._spans.extend(received)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, condition: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """Every span received, once ``condition`` holds for them (AssertionError on timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if condition(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({s.name for s in spans})
                raise AssertionError(f"spans not received within {timeout_s}s; have {names}")
            time.sleep(0.05)

    def wait_for_request(
        self, request_id: str, num_spans: int | None = None, timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """The spans of the trace whose text_completion span has ``gen_ai.response.id`` =
        request_id (every span of it, or at least ``num_spans``)."""

        def trace_of(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
            ids = {
                s.trace_id for s in spans if s.attributes.get("gen_ai.response.id") == request_id
            }
            return [s for s in spans if s.trace_id in ids]

        def complete(spans: list[ReceivedSpan]) -> bool:
            found = trace_of(spans)
            if num_spans is not None:
                return len(found) >= num_spans
            return any(s.kind == "SERVER" for s in found)

        return trace_of(self.wait_for(complete, timeout_s))


class OtlpGrpcReceiver(_Store, trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        super().__init__()
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server.start()

    def Export(self, request, context):  # noqa: N802 (the generated servicer's name)
        self.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def stop(self) -> None:
        self._server.stop(grace=None)


class OtlpHttpReceiver(_Store):
    def __init__(self) -> None:
        super().__init__()
        store = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                store.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

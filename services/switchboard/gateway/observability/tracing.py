"""OpenTelemetry traces of Generate calls, exported over OTLP (Jaeger ingests it directly).

Off unless an endpoint is configured: ``--otlp-traces-endpoint`` or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``OTEL_SDK_DISABLED=true``
or ``OTEL_TRACES_EXPORTER=none`` turn it off again). When off this module is not even imported.
The protocol is ``grpc`` by default, ``http/protobuf`` by ``--otlp-traces-protocol`` or
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``. Every other ``OTEL_*``
variable (sampler, batch processor, headers, certificates, resource, propagators) works as the
SDK documents.

Per request (docs/observability.md has every attribute)::

    switchboard.v1.GenerationService/Generate   SERVER  parent: the caller's traceparent
    └─ text_completion <model>                  CLIENT  gen_ai.* (its context goes to the engine)
       ├─ gateway.tokenize / gateway.dispatch / engine.queue / engine.prefill /
       │  engine.decode / gateway.respond        INTERNAL  (trace_phases: they tile the request)
       └─ engine.preempted                       INTERNAL  one per preemption

The two request spans start when the RPC arrives; the children are made when the request ends,
with explicit times from ``trace_phases`` (engine timestamps placed on this gateway's clock).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from urllib.parse import urlparse

import grpc
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from switchboard import __version__
from switchboard.gateway.observability.trace_phases import Phase
from switchboard.gateway.observability.tracing_config import TracingSettings

logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "switchboard-gateway"
GENERATE_METHOD = "switchboard.v1.GenerationService/Generate"
PROVIDER_NAME = "switchboard"
# OTel gRPC conventions: only these codes make a SERVER span an error (a client's mistake,
# such as INVALID_ARGUMENT or NOT_FOUND, is not the server's failure).
SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
SHUTDOWN_TIMEOUT_S = 5.0
_W3C = TraceContextTextMapPropagator()


def _exporter(settings: TracingSettings) -> SpanExporter:
    endpoint = settings.endpoint
    if endpoint is not None and "://" not in endpoint:
        endpoint = f"http://{endpoint}"  # a bare host:port is plain text, as in vLLM
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    if endpoint is not None and urlparse(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpSpanExporter(endpoint=endpoint)


def _resource(client_index: int) -> Resource:
    resource = Resource.create(
        {"process.pid": os.getpid(), "switchboard.gateway.client_index": client_index}
    )
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


def _peer_attributes(peer: str) -> dict[str, str | int]:
    """``ipv4:127.0.0.1:5000`` / ``ipv6:[::1]:5000`` -> network.peer.address and .port."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in rest:
        return {}
    address, _, port = rest.rpartition(":")
    attributes: dict[str, str | int] = {"network.peer.address": address.strip("[]")}
    if port.isdigit():
        attributes["network.peer.port"] = int(port)
    return attributes


class GatewayTracer:
    """The tracer provider of one gateway process, and the factory of request spans."""

    def __init__(
        self, settings: TracingSettings, client_index: int, server_address: str, server_port: int
    ) -> None:
        self.settings = settings
        self._provider = TracerProvider(resource=_resource(client_index))
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(settings)))
        self._tracer = self._provider.get_tracer("switchboard.gateway", __version__)
        self._server_attributes: dict[str, str | int] = {}
        if server_address:
            self._server_attributes["server.address"] = server_address
        if server_port:
            self._server_attributes["server.port"] = server_port
        logger.info(
            "tracing on: OTLP %s to %s%s",
            settings.protocol,
            settings.endpoint or "the OTEL_EXPORTER_OTLP_* endpoint",
            " (with prompt and output text)" if settings.trace_content else "",
        )

    def start_request(
        self,
        request_id: str,
        model: str,
        arrival_ns: int,
        metadata: Mapping[str, str],
        peer: str,
    ) -> RequestSpans:
        return RequestSpans(self, request_id, model, arrival_ns, metadata, peer)

    def shutdown(self) -> None:
        """Flush what is batched and stop; gives up after SHUTDOWN_TIMEOUT_S (a collector that
        is down must not hold the gateway's exit hostage)."""
        worker = threading.Thread(target=self._provider.shutdown, name="otel-shutdown", daemon=True)
        worker.start()
        worker.join(SHUTDOWN_TIMEOUT_S)
        if worker.is_alive():
            logger.warning("tracing: spans not flushed within %.0fs; dropped", SHUTDOWN_TIMEOUT_S)


class RequestSpans:
    """The spans of one Generate call."""

    def __init__(
        self,
        tracer: GatewayTracer,
        request_id: str,
        model: str,
        arrival_ns: int,
        metadata: Mapping[str, str],
        peer: str,
    ) -> None:
        self._tracer = tracer._tracer
        self._trace_content = tracer.settings.trace_content
        parent = propagate.extract(metadata)  # the caller's traceparent / tracestate
        server_attributes = {
            "rpc.system.name": "grpc",
            "rpc.method": GENERATE_METHOD,
            **tracer._server_attributes,
            **_peer_attributes(peer),
        }
        self.server = self._tracer.start_span(
            GENERATE_METHOD, parent, SpanKind.SERVER, server_attributes, start_time=arrival_ns
        )
        completion_attributes = {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.provider.name": PROVIDER_NAME,
            "gen_ai.request.model": model,
            "gen_ai.response.id": request_id,
            **tracer._server_attributes,
        }
        self.completion = self._tracer.start_span(
            f"text_completion {model}",
            trace.set_span_in_context(self.server),
            SpanKind.CLIENT,
            completion_attributes,
            start_time=arrival_ns,
        )

    def engine_trace_context(self) -> dict[str, str]:
        """W3C headers naming the text_completion span: the engine's parent, should it trace."""
        carrier: dict[str, str] = {}
        _W3C.inject(carrier, trace.set_span_in_context(self.completion))
        return carrier

    def set_request_attributes(self, attributes: Mapping[str, int | float | str]) -> None:
        self.completion.set_attributes(attributes)

    def finish(
        self,
        end_ns: int,
        code: grpc.StatusCode,
        completion_attributes: Mapping[str, AttributeValue],
        phases: list[Phase],
        content: tuple[str, str] | None = None,
    ) -> None:
        """End every span of the request at ``end_ns`` (gateway wall clock)."""
        completion = self.completion
        if completion.is_recording():
            completion.set_attributes(completion_attributes)
            if content is not None and self._trace_content:
                completion.set_attributes(_content_attributes(*content, completion_attributes))
            if code != grpc.StatusCode.OK:
                completion.set_attribute("error.type", code.name)
                completion.set_status(Status(StatusCode.ERROR, code.name))
            parent = trace.set_span_in_context(completion)
            for phase in phases:
                span = self._tracer.start_span(
                    phase.name,
                    parent,
                    SpanKind.INTERNAL,
                    phase.attributes or None,
                    start_time=phase.start_ns,
                )
                span.end(end_time=phase.end_ns)
        completion.end(end_time=end_ns)
        server = self.server
        server.set_attribute("rpc.response.status_code", code.name)
        if code in SERVER_ERROR_CODES:
            server.set_attribute("error.type", code.name)
            server.set_status(Status(StatusCode.ERROR, code.name))
        server.end(end_time=end_ns)


def _content_attributes(
    prompt: str, output: str, completion_attributes: Mapping[str, AttributeValue]
) -> dict[str, str]:
    """Opt-in (--trace-content): the GenAI message attributes, as JSON strings."""
    finish_reasons = completion_attributes.get("gen_ai.response.finish_reasons")
    output_message: dict[str, object] = {
        "role": "assistant",
        "parts": [{"type": "text", "content": output}],
    }
    if isinstance(finish_reasons, list | tuple) and finish_reasons:
        output_message["finish_reason"] = finish_reasons[0]
    return {
        "gen_ai.input.messages": json.dumps(
            [{"role": "user", "parts": [{"type": "text", "content": prompt}]}]
        ),
        "gen_ai.output.messages": json.dumps([output_message]),
    }

"""Tracing setup (flags and OTEL_* variables) and the spans of one request, into a real OTLP
receiver over both protocols."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from switchboard.config import GatewayConfig
from switchboard.gateway.observability.trace_phases import PREEMPTED, Phase
from switchboard.gateway.observability.tracing import GENERATE_METHOD, GatewayTracer
from switchboard.gateway.observability.tracing_config import TracingSettings, tracing_settings
from tests.otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
ARRIVAL = 1_700_000_000_000_000_000


@pytest.fixture
def grpc_receiver() -> Iterator[OtlpGrpcReceiver]:
    receiver = OtlpGrpcReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture
def http_receiver() -> Iterator[OtlpHttpReceiver]:
    receiver = OtlpHttpReceiver()
    yield receiver
    receiver.stop()


# ---------------------------------------------------------------- settings


def test_tracing_is_off_unless_an_endpoint_is_given() -> None:
    assert tracing_settings(GatewayConfig(), {}) is None
    on = tracing_settings(GatewayConfig(otlp_traces_endpoint="http://c:4317"), {})
    assert on == TracingSettings("http://c:4317", "grpc", False)


def test_otel_variables_enable_choose_the_protocol_and_disable() -> None:
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}
    assert tracing_settings(GatewayConfig(), env) == TracingSettings(None, "grpc", False)
    env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    settings = tracing_settings(GatewayConfig(trace_content=True), env)
    assert settings == TracingSettings(None, "http/protobuf", True)
    flag_wins = GatewayConfig(otlp_traces_endpoint="c:4317", otlp_traces_protocol="grpc")
    assert tracing_settings(flag_wins, env) == TracingSettings("c:4317", "grpc", False)
    assert tracing_settings(flag_wins, {**env, "OTEL_SDK_DISABLED": "true"}) is None
    assert tracing_settings(flag_wins, {**env, "OTEL_TRACES_EXPORTER": "none"}) is None
    with pytest.raises(ValueError, match="http/json"):
        tracing_settings(GatewayConfig(otlp_traces_endpoint="c", otlp_traces_protocol="http/json"))


# ---------------------------------------------------------------- spans


def make_tracer(endpoint: str, protocol: str, trace_content: bool = False) -> GatewayTracer:
    return GatewayTracer(TracingSettings(endpoint, protocol, trace_content), 0, "127.0.0.1", 50051)


def one_request(
    tracer: GatewayTracer,
    code: grpc.StatusCode,
    request_id: str = "req-1",
    content: tuple[str, str] | None = None,
) -> dict[str, str]:
    metadata = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    spans = tracer.start_request(request_id, "tiny", ARRIVAL, metadata, "ipv4:10.0.0.7:5555")
    spans.set_request_attributes({"gen_ai.request.max_tokens": 8})
    engine_context = spans.engine_trace_context()
    phases = [
        Phase("gateway.tokenize", ARRIVAL, ARRIVAL + 100),
        Phase("engine.queue", ARRIVAL + 100, ARRIVAL + 1_000),
        Phase(PREEMPTED, ARRIVAL + 300, ARRIVAL + 400, {"switchboard.preemption.number": 1}),
    ]
    attributes = {"gen_ai.response.finish_reasons": ["stop"], "gen_ai.usage.output_tokens": 3}
    spans.finish(ARRIVAL + 1_000, code, attributes, phases, content)
    return engine_context


def test_spans_of_a_request_over_otlp_grpc(grpc_receiver: OtlpGrpcReceiver) -> None:
    tracer = make_tracer(grpc_receiver.endpoint, "grpc")
    engine_context = one_request(tracer, grpc.StatusCode.OK)
    tracer.shutdown()  # flushes
    spans = {s.name: s for s in grpc_receiver.wait_for_request("req-1", num_spans=5)}
    server, completion = spans[GENERATE_METHOD], spans["text_completion tiny"]
    assert server.trace_id == TRACE_ID and server.parent_span_id == PARENT_ID
    assert server.kind == "SERVER" and completion.kind == "CLIENT"
    assert completion.parent_span_id == server.span_id
    assert server.attributes["rpc.system.name"] == "grpc"
    assert server.attributes["rpc.method"] == GENERATE_METHOD
    assert server.attributes["rpc.response.status_code"] == "OK"
    assert server.attributes["network.peer.address"] == "10.0.0.7"
    assert server.status == completion.status == "UNSET"
    assert completion.attributes["gen_ai.operation.name"] == "text_completion"
    assert completion.attributes["gen_ai.request.model"] == "tiny"
    assert completion.attributes["gen_ai.request.max_tokens"] == 8
    assert completion.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert "gen_ai.input.messages" not in completion.attributes
    for name in ("gateway.tokenize", "engine.queue", PREEMPTED):
        assert spans[name].parent_span_id == completion.span_id
        assert spans[name].kind == "INTERNAL"
    assert spans[PREEMPTED].attributes == {"switchboard.preemption.number": 1}
    assert (server.start_ns, server.end_ns) == (ARRIVAL, ARRIVAL + 1_000)
    # The engine is told the text_completion span is its parent.
    assert engine_context["traceparent"] == f"00-{TRACE_ID}-{completion.span_id}-01"
    assert server.resource["service.name"] == "switchboard-gateway"


@pytest.mark.parametrize(
    ("code", "server_status"),
    [(grpc.StatusCode.INVALID_ARGUMENT, "UNSET"), (grpc.StatusCode.UNAVAILABLE, "ERROR")],
)
def test_status_follows_the_grpc_conventions(
    grpc_receiver: OtlpGrpcReceiver, code: grpc.StatusCode, server_status: str
) -> None:
    tracer = make_tracer(grpc_receiver.endpoint, "grpc")
    one_request(tracer, code)
    tracer.shutdown()
    spans = {s.name: s for s in grpc_receiver.wait_for_request("req-1", num_spans=5)}
    server, completion = spans[GENERATE_METHOD], spans["text_completion tiny"]
    assert server.status == server_status
    assert server.attributes["rpc.response.status_code"] == code.name
    assert completion.status == "ERROR" and completion.attributes["error.type"] == code.name


def test_http_protobuf_with_content(http_receiver: OtlpHttpReceiver) -> None:
    tracer = make_tracer(http_receiver.endpoint, "http/protobuf", trace_content=True)
    one_request(tracer, grpc.StatusCode.OK, content=("Hello there", " world"))
    tracer.shutdown()
    spans = {s.name: s for s in http_receiver.wait_for_request("req-1", num_spans=5)}
    completion = spans["text_completion tiny"]
    assert "Hello there" in completion.attributes["gen_ai.input.messages"]
    assert " world" in completion.attributes["gen_ai.output.messages"]

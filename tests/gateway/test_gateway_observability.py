"""Traces and metrics of the in-process gateway, with a scripted engine whose wall clock is wrong.

The engine here (``ScriptedEngine``) stamps its events with the real monotonic clock, but its
wall clock, and so READY's anchor, runs 5 s ahead, as an engine pod on a badly synchronised
node would. The gateway must still place every span where the request spent its time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import gateway_scripted_engine
import grpc
import pytest
from gateway_harness import gateway_config, until
from gateway_scripted_engine import ScriptedEngine
from prometheus_client.parser import text_string_to_metric_families

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.config import GatewayConfig
from switchboard.gateway.grpc_server import GatewayServer
from tests.otlp_receiver import OtlpGrpcReceiver

SKEW_NS = 5_000_000_000
TRACE_ID, PARENT_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
WAIT_S = 10.0


class SkewedTime:
    """The scripted engine's ``time`` module: its wall clock runs SKEW_NS ahead."""

    def time_ns(self) -> int:
        return time.time_ns() + SKEW_NS

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.fixture
async def gateway(
    checkpoint_dir: Path, run_dir: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[GatewayServer, ScriptedEngine, OtlpGrpcReceiver]]:
    receiver = OtlpGrpcReceiver()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setattr(gateway_scripted_engine, "time", SkewedTime())
    gateway = GatewayConfig(
        host="127.0.0.1",
        port=0,
        otlp_traces_endpoint=receiver.endpoint,
        metrics_port=0,
        log_stats_interval_s=0.05,
    )
    config = gateway_config(checkpoint_dir, run_dir, gateway=gateway)
    server = GatewayServer(config)
    await server.start()
    script = server.state.tokenizer.encode(" one two three four", add_special_tokens=False)
    engine = ScriptedEngine(config.input_address, config.output_address, script)
    try:
        await engine.start()
        assert await server.engines.wait_until_ready(WAIT_S)
        yield server, engine, receiver
    finally:
        with contextlib.suppress(Exception):
            await engine.close()
        await server.stop()
        receiver.stop()


async def test_spans_are_placed_right_despite_a_skewed_engine_wall_clock(gateway) -> None:
    server, engine, receiver = gateway
    request = pb.GenerateRequest(text="Hello", request_id="skewed")
    request.stopping.max_tokens = 6
    request.output.kind = pb.OUTPUT_KIND_FINAL_ONLY
    metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"), ("tracestate", "vendor=x"))
    before_ns = time.time_ns()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        (final,) = [r async for r in stub.Generate(request, timeout=WAIT_S, metadata=metadata)]
    after_ns = time.time_ns()

    spans = receiver.wait_for_request("skewed", num_spans=8)
    named = {s.name: s for s in spans}
    completion = named["text_completion tiny"]
    assert all(s.trace_id == TRACE_ID for s in spans)
    # The engine was handed the text_completion span as its parent.
    trace_context = engine.added["skewed"].trace_context
    assert trace_context["traceparent"] == f"00-{TRACE_ID}-{completion.span_id}-01"
    assert trace_context["tracestate"] == "vendor=x"  # the caller's, carried along
    # Inside what the client saw (the anchor alone would put the engine phases 5 s later) ...
    assert all(before_ns <= s.start_ns <= s.end_ns <= after_ns for s in spans)
    # ... and as long as the engine measured them.
    metrics = final.metrics
    assert named["engine.queue"].duration_ns == metrics.queue_time.ToNanoseconds()
    assert named["engine.prefill"].duration_ns == metrics.prefill_time.ToNanoseconds()
    assert named["engine.decode"].duration_ns == metrics.decode_time.ToNanoseconds()
    # The response's own time to first token uses the same corrected clock.
    assert 0 < metrics.time_to_first_token.ToNanoseconds() <= after_ns - before_ns


async def test_request_metrics_of_the_gateway(gateway) -> None:
    server, _, _ = gateway
    request = pb.GenerateRequest(text="Hello", request_id="counted")
    request.stopping.max_tokens = 4
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        responses = [r async for r in stub.Generate(request, timeout=WAIT_S)]
    prompt_tokens = responses[0].prompt_info.num_prompt_tokens
    metrics = server.state.observability.metrics
    assert metrics is not None and metrics.port
    deadline = time.monotonic() + WAIT_S
    while server.engines.engines[0].scheduler_stats is None:  # the first heartbeat
        assert time.monotonic() < deadline, "no heartbeat with stats"
        await asyncio.sleep(0.02)
    url = f"http://127.0.0.1:{metrics.port}/metrics"
    with urllib.request.urlopen(url, timeout=WAIT_S) as reply:
        text = reply.read().decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }

    def value(name: str, **extra: str) -> float | None:
        labels = {"model_name": "tiny", "engine": "0", **extra}
        return samples.get((name, tuple(sorted(labels.items()))))

    assert value("switchboard:request_success_total", finished_reason="length") == 1
    assert value("switchboard:generation_tokens_total") == 4
    assert value("switchboard:prompt_tokens_total") == prompt_tokens
    assert value("switchboard:e2e_request_latency_seconds_count") == 1
    assert value("switchboard:inter_token_latency_seconds_count") == 3
    assert value("switchboard:num_requests_running") is not None  # the engine's heartbeats


async def test_client_metrics_histograms_and_spans_report_the_same_times(gateway) -> None:
    """n = 3, sequences scheduled at different times, one preempted: the client's
    RequestMetrics, the Prometheus histograms and the span attributes come from one record."""
    server, engine, receiver = gateway
    request_id = "agreeing"
    engine.schedule_delay_s = {f"1_{request_id}": 0.03, f"2_{request_id}": 0.06}
    engine.preempt_at_step = {f"2_{request_id}": 2}
    request = pb.GenerateRequest(text="Hello", request_id=request_id)
    request.stopping.max_tokens = 5
    request.sampling.n = 3
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        responses = [r async for r in stub.Generate(request, timeout=WAIT_S)]
    final = responses[-1].metrics
    assert final.num_preemptions == 1
    assert final.decode_time.ToNanoseconds() > 60_000_000  # until the late sequence's last token

    spans = receiver.wait_for_request(request_id, num_spans=8)
    completion = next(s for s in spans if s.name == "text_completion tiny")
    named = {s.name: s for s in spans}
    assert named["engine.queue"].duration_ns == final.queue_time.ToNanoseconds()
    assert named["engine.prefill"].duration_ns == final.prefill_time.ToNanoseconds()
    assert named["engine.decode"].duration_ns == final.decode_time.ToNanoseconds()
    assert completion.attributes["switchboard.request.num_preemptions"] == 1
    ttft_s = final.time_to_first_token.ToNanoseconds() / 1e9
    assert completion.attributes["gen_ai.response.time_to_first_chunk"] == pytest.approx(ttft_s)

    metrics = server.state.observability.metrics
    assert metrics is not None and metrics.port
    url = f"http://127.0.0.1:{metrics.port}/metrics"
    with urllib.request.urlopen(url, timeout=WAIT_S) as reply:
        text = reply.read().decode()
    sums = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.endswith("_sum") and sample.labels.get("engine", "0") == "0"
    }
    prefix = "switchboard:"
    assert sums[prefix + "request_queue_time_seconds_sum"] == pytest.approx(
        final.queue_time.ToNanoseconds() / 1e9
    )
    assert sums[prefix + "request_prefill_time_seconds_sum"] == pytest.approx(
        final.prefill_time.ToNanoseconds() / 1e9
    )
    assert sums[prefix + "request_decode_time_seconds_sum"] == pytest.approx(
        final.decode_time.ToNanoseconds() / 1e9
    )
    assert sums[prefix + "time_to_first_token_seconds_sum"] == pytest.approx(ttft_s)
    assert sums["gen_ai_server_time_to_first_token_seconds_sum"] == pytest.approx(ttft_s)
    assert sums[prefix + "e2e_request_latency_seconds_sum"] == pytest.approx(
        final.e2e_latency.ToNanoseconds() / 1e9
    )


async def test_the_periodic_stats_line(gateway, caplog: pytest.LogCaptureFixture) -> None:
    server, _, _ = gateway
    caplog.set_level(logging.INFO, logger="switchboard.gateway.observability.stats_log")
    request = pb.GenerateRequest(text="Hello", request_id="logged")
    request.stopping.max_tokens = 4
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        assert [r async for r in stub.Generate(request, timeout=WAIT_S)]

    def logged() -> bool:  # throughput, then the engine's queue state from its heartbeat
        lines = [r.getMessage() for r in caplog.records if r.name.endswith("stats_log")]
        return any("engine 0: running" in line for line in lines)

    await until(logged, "a stats line with the engine's state is logged")
    line = next(r.getMessage() for r in caplog.records if "engine 0: running" in r.getMessage())
    assert line.startswith("Gateway_0: prompt ") and " tokens/s, generation " in line
    assert "requests in flight | engine 0: running " in line and ", KV cache " in line

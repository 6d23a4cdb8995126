"""Bounded cost before work (gateway/pipeline/request_bounds.py, gateway/admission.py,
gateway/request_guard.py), in-process over real gRPC with a scripted engine: what the audit's
bad inputs get now."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from gateway_harness import WAIT_S, gateway_config, until
from gateway_scripted_engine import ScriptedEngine
from google.rpc import error_details_pb2
from prometheus_client.parser import text_string_to_metric_families

from switchboard import cli
from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.cli import serve
from switchboard.config import GatewayConfig
from switchboard.gateway.admission import Admission
from switchboard.gateway.api_errors import status_details
from switchboard.gateway.grpc_server import GatewayServer
from switchboard.gateway.pipeline.request_bounds import longest_token_bytes

GENERATE = "/switchboard.v1.GenerationService/Generate"
TOKENIZE = "/switchboard.v1.GenerationService/Tokenize"


class Gateway:
    def __init__(self, server: GatewayServer, engine: ScriptedEngine) -> None:
        self.server, self.engine = server, engine
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    async def generate(self, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        return [r async for r in self.stub.Generate(request, timeout=WAIT_S)]

    async def error(self, request: pb.GenerateRequest) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await self.generate(request)
        return error.value


@pytest.fixture
async def start(checkpoint_dir: Path, run_dir: str) -> AsyncIterator:
    started: list[Gateway] = []

    async def start_gateway(**overrides) -> Gateway:
        gateway = GatewayConfig(host="127.0.0.1", port=0, **overrides.pop("gateway", {}))
        config = gateway_config(checkpoint_dir, run_dir, gateway=gateway, **overrides)
        server = GatewayServer(config)
        await server.start()
        engine = ScriptedEngine(config.input_address, config.output_address, [5, 6, 7])
        gw = Gateway(server, engine)
        started.append(gw)
        await engine.start()
        assert await server.engines.wait_until_ready(WAIT_S)
        await until(lambda: server.state.facts.vocab_size == engine.vocab_size, "READY")
        return gw

    yield start_gateway
    for gw in started:
        await gw.channel.close()
        with contextlib.suppress(Exception):
            await gw.engine.close()
        await gw.server.stop()


def request(text: str = "Hello", max_tokens: int = 3, **fields) -> pb.GenerateRequest:
    r = pb.GenerateRequest(text=text, **fields)
    r.stopping.max_tokens = max_tokens
    return r


def field_of(error: grpc.aio.AioRpcError) -> str:
    status = status_details(error)
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            return bad.field_violations[0].field
    return ""


async def test_a_huge_prompt_is_refused_before_it_is_tokenized(start) -> None:
    gw = await start()
    state = gw.server.state
    longest = longest_token_bytes(state.tokenizer)
    assert state.longest_token_bytes == longest > 0
    limit = state.facts.max_model_len * longest
    began = time.monotonic()
    error = await gw.error(request("x" * (16 << 20)))
    assert time.monotonic() - began < 10  # tokenizing it whole took a minute
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the limit is {limit} bytes" in error.details()
    assert field_of(error) == "text"
    # Tokenize has the same bound; a prompt at the limit is tokenized (and judged by tokens).
    with pytest.raises(grpc.aio.AioRpcError) as tokenize:
        await gw.stub.Tokenize(pb.TokenizeRequest(text="x" * (limit + 1)), timeout=WAIT_S)
    assert tokenize.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = await gw.error(request("x" * limit))
    assert "max_model_len" in error.details() and "bytes of text" not in error.details()


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"request_id": "réq-1"}, "request_id"),  # non-ASCII: was INTERNAL "Invalid metadata"
        ({"request_id": "a\nb"}, "request_id"),  # a control character
        ({"request_id": "r" * (16 << 10)}, "request_id"),  # was RESOURCE_EXHAUSTED (headers)
        ({"model": "m" * (16 << 10)}, "model"),  # was echoed into the trailers
        ({"model": "mödel"}, "model"),
        ({"labels": {"k\x00": "v"}}, "labels"),
        ({"labels": {"k": "v" * 2000}}, "labels"),
        ({"labels": {f"k{i}": "v" for i in range(65)}}, "labels"),
    ],
    ids=[
        "non-ascii-id",
        "control-id",
        "16k-id",
        "16k-model",
        "non-ascii-model",
        "label-key",
        "label-value",
        "too-many-labels",
    ],  # fmt: skip
)
async def test_ids_model_and_labels_are_checked_before_any_echo(start, fields, field) -> None:
    gw = await start()
    error = await gw.error(request(**fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert field_of(error) == field
    echoed = fields.get("request_id") or fields.get("model") or ""
    assert len(error.details()) < 300 and (not echoed or echoed not in error.details())
    assert not gw.engine.added
    # A printable request id at the limit is fine, and comes back in the header.
    call = gw.stub.Generate(request(request_id="r" * 256), timeout=WAIT_S)
    assert ("x-request-id", "r" * 256) in tuple(await call.initial_metadata())
    _ = [r async for r in call]


async def test_malformed_protobuf_is_invalid_argument_with_one_warning(
    start, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await start()
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, a length past the end
    caplog.set_level(logging.WARNING)
    for method, kind in ((GENERATE, "unary_stream"), (TOKENIZE, "unary_unary")):
        caplog.clear()
        call = getattr(gw.channel, kind)(method)(garbage, timeout=WAIT_S)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            if kind == "unary_stream":
                _ = [r async for r in call]
            else:
                await call
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf message" in error.value.details()
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "malformed request to" in warnings[0].getMessage()
        assert warnings[0].levelno == logging.WARNING and warnings[0].exc_info is None
    # Well-formed requests pass through the guard unchanged.
    assert (await gw.generate(request()))[-1].outputs[0].finish_reason


async def test_a_rank_beyond_the_deployment_is_invalid_one_not_ready_unavailable(start) -> None:
    gw = await start(num_engines=2)  # rank 1 exists but has not joined
    error = await gw.error(request(data_parallel_rank=2))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(error) == "data_parallel_rank"
    error = await gw.error(request(data_parallel_rank=1))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert (await gw.generate(request(data_parallel_rank=0)))[-1].outputs[0].finish_reason


def abort_count(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as reply:
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "switchboard:request_success_total"
        and sample.labels.get("finished_reason") == "abort"
    )


async def test_every_cancelled_stream_counts_as_an_abort(start) -> None:
    gw = await start(gateway={"metrics_port": 0})
    state = gw.server.state
    port = state.observability.metrics.port
    counts = state.observability.counts
    gw.engine.mode = "hang"  # streams stay open until cancelled
    tokenizing = asyncio.Event()
    release = asyncio.Event()
    in_pool = state.in_pool

    async def slow_pool(fn, *args, **kwargs):  # holds the prompt in "tokenization"
        if fn == state.tokenizer.encode and args and args[0] == "slow":
            tokenizing.set()
            await release.wait()
        return await in_pool(fn, *args, **kwargs)

    state.in_pool = slow_pool
    calls = []
    # Cancelled while its prompt is tokenized: no engine has it yet (the 2 of 200 missed).
    for _ in range(5):
        tokenizing.clear()
        call = gw.stub.Generate(request("slow"), timeout=WAIT_S)
        calls.append(call)
        await asyncio.wait_for(tokenizing.wait(), WAIT_S)
        call.cancel()
    # Cancelled with the engine working on it.
    for i in range(15):
        call = gw.stub.Generate(request(f"hang {i}"), timeout=WAIT_S)
        calls.append(call)
        await until(lambda n=i: len(gw.engine.added) == n + 1, "the ADD")
        call.cancel()
    release.set()
    await until(lambda: counts.requests_in_flight == 0, "every call ended")
    assert abort_count(port) == 20


async def test_admission_caps_inflight_requests_and_queued_prompt_tokens(start) -> None:
    gw = await start(gateway={"max_inflight_requests": 2, "max_queued_prompt_tokens": 10})
    gw.engine.mode = "hang"  # no output: requests stay in flight, prompts stay queued
    first = gw.stub.Generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8, 9, 10])), timeout=WAIT_S
    )
    await until(lambda: len(gw.engine.added) == 1, "the first ADD")
    error = await gw.error(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8, 9])))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-queued-prompt-tokens 10" in error.details()
    status = status_details(error)
    assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)
    second = gw.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5])), timeout=WAIT_S)
    await until(lambda: len(gw.engine.added) == 2, "the second ADD")
    error = await gw.error(request())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-inflight-requests 2" in error.details()
    admission = gw.server.state.admission
    assert admission.in_flight == 2 and admission.queued_prompt_tokens == 7
    first.cancel()
    second.cancel()
    await until(lambda: admission.in_flight == 0, "both released")
    assert admission.queued_prompt_tokens == 0
    gw.engine.mode = "normal"
    assert (await gw.generate(request()))[-1].outputs[0].finish_reason


def test_admission_queue_leaves_at_the_first_output() -> None:
    admission = Admission(max_requests=0, max_queued_prompt_tokens=100)
    ticket = admission.enter()
    ticket.queue_prompt(80)
    other = admission.enter()
    with pytest.raises(Exception, match="RESOURCE|limit"):
        other.queue_prompt(30)
    ticket.prompt_started()
    other.queue_prompt(30)
    ticket.release()
    other.release()
    other.release()  # idempotent
    assert admission.in_flight == 0 and admission.queued_prompt_tokens == 0


def test_flags_reach_the_gateway_config() -> None:
    args = cli.make_parser().parse_args(
        ["serve", "--max-inflight-requests", "7", "--max-queued-prompt-tokens", "0"]
    )
    gateway, _ = serve.build_configs(args, "/models/x")
    assert gateway.gateway.max_inflight_requests == 7
    assert gateway.gateway.max_queued_prompt_tokens == 0
    defaults = serve.build_configs(cli.make_parser().parse_args(["serve"]), "/models/x")[0]
    assert defaults.gateway.max_inflight_requests == 1024


def test_prompt_bytes_count_what_the_template_renders() -> None:
    from switchboard.gateway.pipeline.request_bounds import prompt_bytes

    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")])
    bare = prompt_bytes(request)
    tool = request.tools.add(type="function")
    tool.function.name = "lookup"
    tool.function.parameters = '{"type": "object"}' * 100
    assert prompt_bytes(request) >= bare + len(tool.function.parameters)

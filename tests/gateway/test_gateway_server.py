"""The gateway in-process over real gRPC and real ZeroMQ, with a scripted engine peer.

The engine here is ``ScriptedEngine`` (tests/gateway/gateway_scripted_engine.py): it speaks
wire 1 like an engine core but emits tokens from a fixed script. End-to-end tests with the real
engine core and workers live in tests/e2e.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from gateway_harness import WAIT_S, gateway_config, health_status, until
from gateway_scripted_engine import ScriptedEngine
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from switchboard.api.v1 import admin_service_pb2 as admin_pb
from switchboard.api.v1 import admin_service_pb2_grpc as admin_grpc
from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.api.v1 import model_service_pb2 as model_pb
from switchboard.api.v1 import model_service_pb2_grpc as model_grpc
from switchboard.cli.client import run_generate
from switchboard.config import GatewayConfig
from switchboard.gateway.api_errors import status_details
from switchboard.gateway.grpc_server import GENERATION_SERVICE, GatewayServer
from switchboard.gateway.text import Tokenizer

SCRIPT_TEXT = " one two three four five six seven eight nine ten"


@dataclasses.dataclass
class Harness:
    server: GatewayServer
    engine: ScriptedEngine
    channel: grpc.aio.Channel
    tokenizer: Tokenizer

    @property
    def stub(self) -> pb_grpc.GenerationServiceStub:
        return pb_grpc.GenerationServiceStub(self.channel)

    async def health(self, service: str = GENERATION_SERVICE) -> int:
        return await health_status(self.channel, service)


StartGateway = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def start_gateway(checkpoint_dir: Path, run_dir: str) -> AsyncIterator[StartGateway]:
    started: list[Harness] = []

    async def start(connect_engine: bool = True, **overrides) -> Harness:
        config = gateway_config(checkpoint_dir, run_dir, **overrides)
        server = GatewayServer(config)
        await server.start()
        tokenizer = server.state.tokenizer
        script = tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
        engine = ScriptedEngine(config.input_address, config.output_address, script)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        harness = Harness(server, engine, channel, tokenizer)
        started.append(harness)
        if connect_engine:
            await engine.start()
            assert await server.engines.wait_until_ready(WAIT_S)
            await until(lambda: server.state.facts.vocab_size == engine.vocab_size, "READY")
        return harness

    yield start
    for harness in started:
        await harness.channel.close()
        with contextlib.suppress(Exception):
            await harness.engine.close()
        await harness.server.stop()


def _generate(text: str = "Hello", max_tokens: int = 5, **fields) -> pb.GenerateRequest:
    stopping = fields.pop("stopping", pb.StoppingCriteria())
    stopping.max_tokens = max_tokens
    return pb.GenerateRequest(text=text, stopping=stopping, **fields)


async def _collect(call) -> list[pb.GenerateResponse]:
    return [response async for response in call]


async def test_health_and_reflection(start_gateway: StartGateway) -> None:
    h = await start_gateway(connect_engine=False)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert await h.health("") == serving
    assert await h.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    await h.engine.start()
    await until(lambda: bool(h.server.engines.live_engines), "the engine is ready")
    await until(lambda: h.server.state.facts.max_model_len == 64, "facts follow READY")
    assert await h.health() == serving

    stub = reflection_pb2_grpc.ServerReflectionStub(h.channel)
    requests = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    async for reply in stub.ServerReflectionInfo(requests, timeout=WAIT_S):
        names = {s.name for s in reply.list_services_response.service}
    assert {
        GENERATION_SERVICE,
        "switchboard.v1.ModelService",
        "switchboard.v1.AdminService",
        "grpc.health.v1.Health",
    } <= names


async def test_generate_streams_deltas_with_prompt_info_and_usage(
    start_gateway: StartGateway,
) -> None:
    h = await start_gateway()
    request = _generate(max_tokens=6, request_id="req-stream")
    request.output.return_token_ids = True
    call = h.stub.Generate(request, timeout=WAIT_S)
    responses = await _collect(call)
    assert ("x-request-id", "req-stream") in tuple(await call.initial_metadata())
    assert await call.code() == grpc.StatusCode.OK
    text = "".join(r.outputs[0].text for r in responses)
    ids = [t for r in responses for t in r.outputs[0].token_ids]
    assert len(ids) == 6
    assert text == h.tokenizer.decode(ids)
    assert text.startswith(" one two")
    assert all(r.request_id == "req-stream" for r in responses)
    first, last = responses[0], responses[-1]
    assert first.HasField("prompt_info") and first.prompt_info.num_prompt_tokens > 0
    assert first.prompt_info.token_ids == h.tokenizer.encode("Hello")
    assert not any(r.HasField("usage") for r in responses[:-1])
    assert last.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 6 and last.usage.cached_prompt_tokens == 2
    assert last.metrics.engine_id == h.engine.engine_id
    assert last.metrics.HasField("queue_time") and last.metrics.HasField("time_to_first_token")
    added = h.engine.added["req-stream"]
    assert added.sampling_params.max_tokens == 6
    assert added.sampling_params.eos_token_ids == [h.tokenizer.token_id("<|endoftext|>")]


@pytest.mark.parametrize("kind", [pb.OUTPUT_KIND_FINAL_ONLY, pb.OUTPUT_KIND_CUMULATIVE])
async def test_output_kinds(start_gateway: StartGateway, kind: int) -> None:
    h = await start_gateway()
    request = _generate(max_tokens=5, output=pb.OutputOptions(kind=kind))
    responses = await _collect(h.stub.Generate(request, timeout=WAIT_S))
    final = responses[-1]
    if kind == pb.OUTPUT_KIND_FINAL_ONLY:
        assert len(responses) == 1
        assert final.HasField("prompt_info") and final.HasField("usage")
    else:
        texts = [r.outputs[0].text for r in responses]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert final.outputs[0].text == h.tokenizer.decode(h.engine.script[:5])


async def test_stop_string_ends_the_stream_and_aborts_the_engine(
    start_gateway: StartGateway,
) -> None:
    h = await start_gateway()
    request = _generate(max_tokens=20, request_id="req-stop")
    request.stopping.stop.append("three")
    responses = await _collect(h.stub.Generate(request, timeout=WAIT_S))
    final = responses[-1].outputs[0]
    assert "".join(r.outputs[0].text for r in responses) == " one two "
    assert final.finish_reason == pb.FINISH_REASON_STOP
    assert final.stop_string == "three"
    await until(lambda: "req-stop" in h.engine.aborted, "the engine got ABORT")


@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_client_going_away_aborts_on_the_engine(start_gateway: StartGateway, how) -> None:
    h = await start_gateway()
    h.engine.mode = "hang"
    request = _generate(max_tokens=20, request_id=f"req-{how}")
    # The deadline leaves the gateway ample time to send ADD even on a loaded machine.
    call = h.stub.Generate(request, timeout=5.0 if how == "deadline" else WAIT_S)
    await until(lambda: request.request_id in h.engine.added, "the engine got ADD")
    if how == "cancel":
        call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED
    else:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _collect(call)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await until(lambda: request.request_id in h.engine.aborted, "the engine got ABORT")
    await until(lambda: not h.server.engines.is_live(request.request_id), "it was forgotten")


async def test_abort_rpc_ends_the_stream_ok_with_finish_abort(start_gateway: StartGateway) -> None:
    h = await start_gateway()
    h.engine.mode = "hang"
    call = h.stub.Generate(_generate(max_tokens=20, request_id="req-a"), timeout=WAIT_S)
    await until(lambda: "req-a" in h.engine.added, "the engine got ADD")
    abort = pb.AbortRequest(request_ids=["req-a", "nope"], reason="test")
    reply = await h.stub.Abort(abort, timeout=WAIT_S)
    assert list(reply.aborted_request_ids) == ["req-a"]
    assert list(reply.unknown_request_ids) == ["nope"]
    responses = await _collect(call)
    assert await call.code() == grpc.StatusCode.OK
    assert responses[-1].outputs[0].finish_reason == pb.FINISH_REASON_ABORT
    assert responses[-1].HasField("usage")
    await until(lambda: "req-a" in h.engine.aborted, "the engine got ABORT")
    again = await h.stub.Abort(abort, timeout=WAIT_S)  # idempotent
    assert list(again.unknown_request_ids) == ["req-a", "nope"]


async def test_invalid_arguments_and_duplicates(start_gateway: StartGateway) -> None:
    h = await start_gateway()
    bad = _generate(sampling=pb.SamplingParams(temperature=-1.0))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _collect(h.stub.Generate(bad, timeout=WAIT_S))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.temperature" in caught.value.details()
    status = status_details(caught.value)
    assert status is not None and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]

    too_long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 64), request_id="req-long")
    call = h.stub.Generate(too_long, timeout=WAIT_S)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _collect(call)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len is 64" in caught.value.details()
    # Refused after the header went out (it is sent while the request is checked): still there.
    assert ("x-request-id", "req-long") in tuple(await call.initial_metadata())

    unknown = _generate(model="gpt-9")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _collect(h.stub.Generate(unknown, timeout=WAIT_S))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    h.engine.mode = "hang"
    first = h.stub.Generate(_generate(request_id="dup"), timeout=WAIT_S)
    await until(lambda: "dup" in h.engine.added, "the engine got ADD")
    second = h.stub.Generate(_generate(request_id="dup"), timeout=WAIT_S)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _collect(second)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert ("x-request-id", "dup") in tuple(await second.initial_metadata())
    first.cancel()


async def test_engine_error_is_internal(start_gateway: StartGateway) -> None:
    h = await start_gateway()
    h.engine.mode = "error"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _collect(h.stub.Generate(_generate(), timeout=WAIT_S))
    assert caught.value.code() == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("death", ["ENGINE_CORE_DEAD", "silence"])
async def test_engine_death_fails_requests_and_stops_the_gateway(
    start_gateway: StartGateway, death: str
) -> None:
    h = await start_gateway(heartbeat_timeout_s=1.0)
    run = asyncio.create_task(h.server.run())
    h.engine.mode = "hang"
    call = h.stub.Generate(_generate(request_id="req-d"), timeout=WAIT_S)
    await until(lambda: "req-d" in h.engine.added, "the engine got ADD")
    if death == "ENGINE_CORE_DEAD":
        await h.engine.die()
    else:
        h.engine.silent = True
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _collect(call)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert await asyncio.wait_for(run, WAIT_S) != 0


async def test_bad_frames_are_dropped(start_gateway: StartGateway) -> None:
    h = await start_gateway()
    await h.engine.send_raw([b"\xc1 not msgpack"])
    await h.engine.send_raw([b"\x92\x01"])  # truncated array
    responses = await _collect(h.stub.Generate(_generate(max_tokens=3), timeout=WAIT_S))
    assert responses[-1].outputs[0].finish_reason == pb.FINISH_REASON_LENGTH


async def test_tokenize_detokenize_and_model_info(start_gateway: StartGateway) -> None:
    h = await start_gateway()
    tokens = await h.stub.Tokenize(
        pb.TokenizeRequest(text="héllo 😀", return_token_strs=True), timeout=WAIT_S
    )
    assert list(tokens.token_ids) == h.tokenizer.encode("héllo 😀")
    assert len(tokens.token_strs) == len(tokens.token_ids) and tokens.max_model_len == 64
    text = await h.stub.Detokenize(pb.DetokenizeRequest(token_ids=tokens.token_ids), timeout=WAIT_S)
    assert text.text == "héllo 😀"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await h.stub.Detokenize(pb.DetokenizeRequest(token_ids=[10**6]), timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    models = model_grpc.ModelServiceStub(h.channel)
    listed = await models.ListModels(model_pb.ListModelsRequest(), timeout=WAIT_S)
    assert [m.name for m in listed.models] == ["tiny"]
    info = await models.GetModelInfo(model_pb.GetModelInfoRequest(model="tiny"), timeout=WAIT_S)
    assert info.max_model_len == 64 and info.vocab_size == h.engine.vocab_size
    assert list(info.eos_token_ids) == [h.tokenizer.token_id("<|endoftext|>")]
    server = await models.GetServerInfo(model_pb.GetServerInfoRequest(), timeout=WAIT_S)
    assert server.api_version == "switchboard.v1"
    assert [e.engine_id for e in server.engines] == [h.engine.engine_id]
    assert server.engines[0].state == model_pb.ENGINE_STATE_READY


async def test_admin_utility_allow_list(start_gateway: StartGateway) -> None:
    h = await start_gateway()
    admin = admin_grpc.AdminServiceStub(h.channel)
    args = struct_pb2.ListValue()
    args.append(1)
    reply = await admin.Utility(
        admin_pb.UtilityRequest(method="reset_prefix_cache", args=args), timeout=WAIT_S
    )
    assert reply.results[0].engine_id == h.engine.engine_id
    assert reply.results[0].result.struct_value["method"] == "reset_prefix_cache"
    assert h.engine.utility_calls == [("reset_prefix_cache", [1])]
    failed = await admin.Utility(admin_pb.UtilityRequest(method="is_sleeping"), timeout=WAIT_S)
    assert failed.results[0].status.code == grpc.StatusCode.INTERNAL.value[0]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admin.Utility(admin_pb.UtilityRequest(method="shutdown"), timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_admin_is_unimplemented_unless_enabled(start_gateway: StartGateway) -> None:
    h = await start_gateway(gateway=GatewayConfig(host="127.0.0.1", port=0))
    admin = admin_grpc.AdminServiceStub(h.channel)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admin.Utility(admin_pb.UtilityRequest(method="get_stats"), timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_generate_client_streams_to_its_output(start_gateway: StartGateway) -> None:
    h = await start_gateway()
    out, err = io.StringIO(), io.StringIO()
    target = f"127.0.0.1:{h.server.port}"
    code = await asyncio.to_thread(
        run_generate, target, "Hello", 4, 0.0, timeout_s=WAIT_S, out=out, err=err
    )
    assert code == 0, err.getvalue()
    assert out.getvalue() == h.tokenizer.decode(h.engine.script[:4]) + "\n"
    assert "[length; " in err.getvalue()
    assert next(iter(h.engine.added.values())).sampling_params.temperature == 0.0

    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(
        run_generate, target, "Hello", 0, None, timeout_s=WAIT_S, out=out, err=err
    )
    assert code == 1 and "INVALID_ARGUMENT" in err.getvalue()

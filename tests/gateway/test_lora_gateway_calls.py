"""A LoRA adapter's name through the gateway's calls, in-process with a scripted engine that
holds adapters: Tokenize, Detokenize and GetModelInfo answer for an adapter as for its base
model; an adapter the engine no longer holds (unloaded through another gateway) is NOT_FOUND
naming it, and this gateway forgets it and asks the engines again next time."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from gateway_harness import WAIT_S, connect_scripted, gateway_config, start_scripted, stop_scripted
from gateway_scripted_engine import ScriptedEngine

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.api.v1 import model_service_pb2 as model_pb
from switchboard.api.v1 import model_service_pb2_grpc as model_grpc
from switchboard.config import GatewayConfig, ModelConfig
from switchboard.config.lora import LoraConfig
from switchboard.gateway.api_errors import status_details
from switchboard.gateway.grpc_server import GatewayServer


@dataclasses.dataclass
class LoraHarness:
    server: GatewayServer
    engine: ScriptedEngine
    channel: grpc.aio.Channel

    @property
    def generation(self) -> pb_grpc.GenerationServiceStub:
        return pb_grpc.GenerationServiceStub(self.channel)

    @property
    def models(self) -> model_grpc.ModelServiceStub:
        return model_grpc.ModelServiceStub(self.channel)

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        url = f"http://127.0.0.1:{self.server.http_port}{path}"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
            return response.status, await response.json()


StartLora = Callable[..., Awaitable[LoraHarness]]


@pytest.fixture
async def start_lora(checkpoint_dir: Path, run_dir: str) -> AsyncIterator[StartLora]:
    started: list[LoraHarness] = []

    async def start(lora_modules: list[str], held: dict[str, str]) -> LoraHarness:
        """A gateway started with ``lora_modules``; its engine holds the adapters ``held``."""
        lora = LoraConfig(enable_lora=True, lora_modules=lora_modules)
        model = ModelConfig(model=str(checkpoint_dir), served_model_name="tiny", lora=lora)
        gateway = GatewayConfig(host="127.0.0.1", port=0, http_port=0)
        config = gateway_config(checkpoint_dir, run_dir, model=model, gateway=gateway)
        server, engine = await start_scripted(config, " one two three")
        engine.lora_adapters.update(held)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        harness = LoraHarness(server, engine, channel)
        started.append(harness)
        await connect_scripted(server, engine)
        return harness

    yield start
    for harness in started:
        await harness.channel.close()
        await stop_scripted(harness.server, harness.engine)


async def _not_found(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    return caught.value


async def test_an_adapter_tokenizes_and_describes_itself_as_its_base_model(
    start_lora: StartLora,
) -> None:
    h = await start_lora(["sql=/adapters/sql"], {"sql": "/adapters/sql", "chat": "/adapters/chat"})
    base = await h.generation.Tokenize(pb.TokenizeRequest(text="hello there"), timeout=WAIT_S)
    for adapter in ("sql", "chat"):  # "chat": loaded through another gateway, asked of engines
        tokens = await h.generation.Tokenize(
            pb.TokenizeRequest(model=adapter, text="hello there"), timeout=WAIT_S
        )
        assert list(tokens.token_ids) == list(base.token_ids) and tokens.token_ids
        text = await h.generation.Detokenize(
            pb.DetokenizeRequest(model=adapter, token_ids=tokens.token_ids), timeout=WAIT_S
        )
        assert text.text == "hello there"
        info = await h.models.GetModelInfo(
            model_pb.GetModelInfoRequest(model=adapter), timeout=WAIT_S
        )
        assert (info.card.name, info.card.parent) == (adapter, "tiny")
        assert info.vocab_size == h.engine.vocab_size and info.max_model_len == 64
    base_info = await h.models.GetModelInfo(model_pb.GetModelInfoRequest(), timeout=WAIT_S)
    assert (base_info.card.name, base_info.card.parent) == ("tiny", "")

    status, body = await h.post("/tokenize", {"model": "sql", "prompt": "hello there"})
    assert status == 200 and body["tokens"] == list(base.token_ids)
    status, body = await h.post("/detokenize", {"model": "chat", "tokens": body["tokens"]})
    assert status == 200 and body["prompt"] == "hello there"

    error = await _not_found(
        h.generation.Tokenize(pb.TokenizeRequest(model="nope", text="hi"), timeout=WAIT_S)
    )
    assert "'nope'" in (error.details() or "") and "sql" in (error.details() or "")
    await _not_found(
        h.generation.Detokenize(pb.DetokenizeRequest(model="nope", token_ids=[1]), timeout=WAIT_S)
    )
    await _not_found(
        h.models.GetModelInfo(model_pb.GetModelInfoRequest(model="nope"), timeout=WAIT_S)
    )
    status, body = await h.post("/tokenize", {"model": "nope", "prompt": "hi"})
    assert status == 404 and "'nope'" in body["error"]["message"]


async def test_an_adapter_the_engines_no_longer_hold_is_not_found_and_forgotten(
    start_lora: StartLora,
) -> None:
    # "sql" is known here but was unloaded (through another gateway) from the engine.
    h = await start_lora(["sql=/adapters/sql"], {})
    stopping = pb.StoppingCriteria(max_tokens=2)
    request = pb.GenerateRequest(model="sql", text="Hello", stopping=stopping)
    error = await _not_found(h.generation.Generate(request, timeout=WAIT_S).read())
    assert error.details() == "LoRA adapter 'sql' is not loaded"
    details = status_details(error)
    assert details is not None and "LORA_ADAPTER_NOT_FOUND" in str(details)
    listed = await h.models.ListModels(model_pb.ListModelsRequest(), timeout=WAIT_S)
    assert [m.name for m in listed.models] == ["tiny"]  # forgotten

    # Loaded again through another gateway: the next request asks the engine and runs.
    h.engine.lora_adapters["sql"] = "/adapters/sql"
    responses = [r async for r in h.generation.Generate(request, timeout=WAIT_S)]
    assert responses[-1].outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert ("list_loras", []) in h.engine.utility_calls

    # Over HTTP the same refusal is a 404 naming the adapter.
    del h.engine.lora_adapters["sql"]
    completion = {"model": "sql", "prompt": "Hello", "max_tokens": 2}
    status, body = await h.post("/v1/completions", completion)
    assert status == 404 and body["error"]["message"] == "LoRA adapter 'sql' is not loaded"
    assert body["error"]["code"] == "lora_adapter_not_found"
    assert "sql" not in h.server.state.facts.loras.adapters

"""Streams that pause while their engine is alive (gateway/engines/stream_stalls.py): counted
once per stream and pause, one WARNING per engine with its state, nothing before a stream's first
token. In-process gateway, scripted engine that holds its tokens but keeps its heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from gateway_harness import WAIT_S, gateway_config, until
from gateway_scripted_engine import ScriptedEngine

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.config import GatewayConfig
from switchboard.gateway.grpc_server import GatewayServer

STALL_WARN_S = 0.3
STALLS = "switchboard:request_stalls_total"
WATCH_LOGGER = "switchboard.gateway.engines.stream_stalls"
Gateway = tuple[GatewayServer, ScriptedEngine, pb_grpc.GenerationServiceStub]


@pytest.fixture
async def gateway(checkpoint_dir: Path, run_dir: str) -> AsyncIterator[Gateway]:
    gateway = GatewayConfig(host="127.0.0.1", port=0, metrics_port=0, stall_warn_s=STALL_WARN_S)
    config = gateway_config(checkpoint_dir, run_dir, gateway=gateway)
    server = GatewayServer(config)
    await server.start()
    engine = ScriptedEngine(config.input_address, config.output_address, [5, 6, 7])
    try:
        await engine.start()
        assert await server.engines.wait_until_ready(WAIT_S)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, engine, pb_grpc.GenerationServiceStub(channel)
    finally:
        with contextlib.suppress(Exception):
            await engine.close()
        await server.stop()


def stalls(server: GatewayServer) -> float:
    metrics = server.state.observability.metrics
    assert metrics is not None
    value = metrics.registry.get_sample_value(STALLS, {"model_name": "tiny", "engine": "0"})
    return value or 0.0


async def stream(
    stub: pb_grpc.GenerationServiceStub, request_id: str, seen: dict[str, int]
) -> list[int]:
    """Generate 5 tokens, noting in ``seen`` how many have arrived."""
    request = pb.GenerateRequest(text="Hello", request_id=request_id)
    request.stopping.max_tokens = 5
    request.output.return_token_ids = True
    tokens: list[int] = []
    async for response in stub.Generate(request, timeout=WAIT_S * 3):
        for output in response.outputs:
            tokens += output.token_ids
        seen[request_id] = len(tokens)
    return tokens


def watch_lines(caplog: pytest.LogCaptureFixture, level: str) -> list[str]:
    records = caplog.records
    return [r.getMessage() for r in records if r.name == WATCH_LOGGER and r.levelname == level]


async def test_paused_streams_are_counted_once_and_logged_once_with_the_engines_state(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    server, engine, stub = gateway
    release = engine.holds[2] = asyncio.Event()  # two tokens each, then none until released
    engine.schedule_delay_s = {"queued": 60.0}  # never gets a first token: not a stall
    caplog.set_level(logging.INFO, logger=WATCH_LOGGER)
    seen: dict[str, int] = {}
    ids = ["s0", "s1", "s2"]
    queued = asyncio.ensure_future(stream(stub, "queued", seen))
    streams = [asyncio.ensure_future(stream(stub, i, seen)) for i in ids]
    await until(lambda: all(seen.get(i) == 2 for i in ids), "two tokens on every stream")
    await until(lambda: stalls(server) == 3, "the three streams counted as paused")
    # However long the pause lasts, each stream counts once and the engine is logged once.
    await asyncio.sleep(STALL_WARN_S * 4)  # several more rounds of the watch
    assert stalls(server) == 3
    warnings = watch_lines(caplog, "WARNING")
    assert len(warnings) == 1, warnings
    line = warnings[0]
    assert "engine scripted-0 (DP rank 0): 3 stream(s) got no token for more than 0.3s" in line
    assert "while the engine is alive" in line and "last heard from" in line
    assert "running 4" in line and "no worker stalled" in line
    assert "queued" not in line

    release.set()
    finished = await asyncio.wait_for(asyncio.gather(*streams), WAIT_S)
    assert [len(tokens) for tokens in finished] == [5, 5, 5]
    await until(lambda: bool(watch_lines(caplog, "INFO")), "the pause is over")
    assert watch_lines(caplog, "INFO") == [
        "engine scripted-0: no stream is paused any more (3 stream(s) paused in all)"
    ]
    assert stalls(server) == 3
    queued.cancel()
    with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
        await queued


async def test_a_stream_that_pauses_twice_counts_twice(gateway: Gateway) -> None:
    server, engine, stub = gateway
    first, second = asyncio.Event(), asyncio.Event()
    engine.holds.update({1: first, 3: second})  # a pause after the first token, and the third
    seen: dict[str, int] = {}
    call = asyncio.ensure_future(stream(stub, "twice", seen))
    await until(lambda: stalls(server) == 1, "the first pause counted")
    first.set()
    await until(lambda: seen.get("twice") == 3, "the stream moves again")
    await until(lambda: stalls(server) == 2, "the second pause counted")
    second.set()
    assert len(await asyncio.wait_for(call, WAIT_S)) == 5
    assert stalls(server) == 2

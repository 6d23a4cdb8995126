"""A client cannot flood the gateway's log: malformed requests and wrong keys give a few WARNING
lines per cause and window, then one line with the count (log_limits.py). In-process gateway
over real gRPC and HTTP."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import aiohttp
import grpc
import pytest
from gateway_harness import WAIT_S, gateway_config
from gateway_scripted_engine import ScriptedEngine

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.common.log_limits import DEFAULT_BURST, report_suppressed
from switchboard.config import GatewayConfig
from switchboard.gateway.auth import Credentials
from switchboard.gateway.grpc_server import GatewayServer

KEY = "the-one-key-0123456789"
GENERATE = "/switchboard.v1.GenerationService/Generate"
GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, a length past the end
FLOOD = 30


async def test_a_flood_of_bad_requests_gives_a_few_lines_and_a_count(
    checkpoint_dir: Path, run_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = GatewayConfig(host="127.0.0.1", port=0, http_port=0)
    config = gateway_config(checkpoint_dir, run_dir, gateway=gateway)
    server = GatewayServer(config, Credentials((KEY,)))
    await server.start()
    engine = ScriptedEngine(config.input_address, config.output_address, [5, 6, 7])
    report_suppressed()  # what earlier tests of this process left in the windows
    caplog.clear()
    caplog.set_level(logging.WARNING)
    try:
        await engine.start()
        assert await server.engines.wait_until_ready(WAIT_S)
        bearer = (("authorization", f"Bearer {KEY}"),)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for _ in range(FLOOD):
                call = channel.unary_stream(GENERATE)(GARBAGE, timeout=WAIT_S, metadata=bearer)
                with pytest.raises(grpc.aio.AioRpcError) as malformed:
                    _ = [r async for r in call]
                assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            stub = pb_grpc.GenerationServiceStub(channel)
            request = pb.GenerateRequest(text="Hello")
            request.stopping.max_tokens = 2
            for _ in range(FLOOD):
                wrong = (("authorization", "Bearer not-the-key"),)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    _ = [r async for r in stub.Generate(request, timeout=WAIT_S, metadata=wrong)]
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            timeout = aiohttp.ClientTimeout(total=WAIT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                for _ in range(FLOOD):  # the HTTP front's wrong keys: the same cause
                    headers = {"Authorization": "Bearer not-the-key"}
                    url = f"http://127.0.0.1:{server.http_port}/v1/models"
                    async with session.get(url, headers=headers) as response:
                        assert response.status == 401
            # The flood disturbed nothing: a good request is served.
            served = [r async for r in stub.Generate(request, timeout=WAIT_S, metadata=bearer)]
            assert served[-1].outputs[0].finish_reason
    finally:
        with contextlib.suppress(Exception):
            await engine.close()
        await server.stop()  # says what it suppressed
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    malformed_lines = [line for line in lines if line.startswith("malformed request to")]
    refused_lines = [line for line in lines if line.endswith(": invalid API key")]
    assert len(malformed_lines) == DEFAULT_BURST
    assert len(refused_lines) == DEFAULT_BURST
    counts = [line for line in lines if line.startswith("suppressed")]
    assert len(counts) == 2, counts
    assert any(
        f"suppressed {FLOOD - DEFAULT_BURST} similar warnings (malformed request)" in c
        for c in counts
    )
    assert any(
        f"suppressed {2 * FLOOD - DEFAULT_BURST} similar warnings (invalid API key)" in c
        for c in counts
    )

"""A fuzz of every method of GenerationService and ModelService against an in-process gateway
with the scripted engine: messages built from the descriptors with random and boundary field
values, plus random bytes sent raw (identity serializers), plus oversized repeated fields: every
repeated field (and map) of every request message, at any depth, with 10^4 to 10^5 entries or
with one entry of 1 MiB, in an otherwise valid request. No call may end UNKNOWN or INTERNAL (the
scripted engine applies the wire's request rules as an engine core does: what the gateway lets
through that the engine refuses ends INTERNAL) or hang past its deadline; the gateway keeps
serving and answers a valid request afterwards as it did before. The count of cases per status
code is printed (``-s`` shows it)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fuzz_messages import fill, methods, mutate, oversized_cases, valid_generate
from gateway_harness import WAIT_S, gateway_config, until
from gateway_scripted_engine import ScriptedEngine

from switchboard.api.v1 import generation_service_pb2, model_service_pb2
from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.config import GatewayConfig
from switchboard.gateway.grpc_server import GatewayServer

SEED = int(os.environ.get("SWITCHBOARD_FUZZ_SEED", "20261201"))  # another seed: another run
CASES_PER_METHOD = 300  # structured messages per method
RAW_CASES_PER_METHOD = 120  # random and mutated bytes per method
CONCURRENCY = 32
OVERSIZED_CONCURRENCY = 4
DEADLINE_S = 5.0
# UNKNOWN/INTERNAL: an unhandled error; DEADLINE_EXCEEDED: a hang; RESOURCE_EXHAUSTED: none of
# these calls may hit admission (32 at once) or a size limit (e.g. an oversized trailer).
FORBIDDEN_NAMES = {"UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}


async def _call(channel: grpc.aio.Channel, path: str, streaming: bool, raw: bytes) -> str:
    identity = lambda b: b  # noqa: E731
    try:
        if streaming:
            call = channel.unary_stream(path, request_serializer=identity,
                                        response_deserializer=identity)  # fmt: skip
            async for _ in call(raw, timeout=DEADLINE_S):
                pass
        else:
            unary = channel.unary_unary(path, request_serializer=identity,
                                        response_deserializer=identity)  # fmt: skip
            await unary(raw, timeout=DEADLINE_S)
    except grpc.aio.AioRpcError as error:
        return error.code().name
    return "OK"


class _Harness:
    def __init__(self, server: GatewayServer, engine: ScriptedEngine) -> None:
        self.server, self.engine = server, engine


@pytest.fixture
async def gateway(checkpoint_dir: Path, run_dir: str) -> AsyncIterator[_Harness]:
    config = gateway_config(
        checkpoint_dir, run_dir, gateway=GatewayConfig(host="127.0.0.1", port=0)
    )
    server = GatewayServer(config)
    await server.start()
    engine = ScriptedEngine(config.input_address, config.output_address, [5, 6, 7])
    await engine.start()
    assert await server.engines.wait_until_ready(WAIT_S)
    await until(lambda: server.ready, "ready")
    try:
        yield _Harness(server, engine)
    finally:
        with contextlib.suppress(Exception):
            await engine.close()
        await server.stop()


async def _reference(channel: grpc.aio.Channel) -> list[Any]:
    stub = pb_grpc.GenerationServiceStub(channel)
    request = pb.GenerateRequest(text="Hello", request_id="reference")
    request.stopping.max_tokens = 3
    answers: list[Any] = []
    for response in [r async for r in stub.Generate(request, timeout=WAIT_S)]:
        response.ClearField("metrics")  # times differ from run to run
        answers.append(response)
    tokenized = await stub.Tokenize(pb.TokenizeRequest(text="Hello"), timeout=WAIT_S)
    return [*answers, tokenized]


async def test_grpc_fuzz(gateway: _Harness) -> None:
    rng = random.Random(SEED)
    cases: list[tuple[str, bool, bytes]] = []
    for path, method in methods():
        input_type = method.input_type
        module = generation_service_pb2 if "Generation" in path else model_service_pb2
        request_class = getattr(module, input_type.name)
        streaming = method.server_streaming
        samples = []
        for i in range(CASES_PER_METHOD):
            if method.name == "Generate" and i % 2:
                msg = valid_generate(rng)
            else:
                msg = fill(request_class(), rng)
            samples.append(msg.SerializeToString())
        cases += [(path, streaming, raw) for raw in samples]
        for i in range(RAW_CASES_PER_METHOD):
            raw = rng.randbytes(rng.choice([0, 1, 2, 5, 17, 100, 1000]))
            if i % 2:
                raw = mutate(rng.choice(samples), rng)
            cases.append((path, streaming, raw))
    rng.shuffle(cases)
    counts: collections.Counter[str] = collections.Counter()
    per_method: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    bad: list[tuple[str, str, bytes]] = []
    max_message_bytes = gateway.server.config.gateway.max_message_bytes
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.server.port}") as channel:
        before = await _reference(channel)
        limit = asyncio.Semaphore(CONCURRENCY)

        async def run(path: str, streaming: bool, raw: bytes, what: str = "") -> None:
            async with limit:
                code = await _call(channel, path, streaming, raw)
            counts[code] += 1
            per_method[f"{path.rsplit('/', 1)[1]} {what}".strip()][code] += 1
            # grpc's own answer to a message over the gateway's size limit, and only to one
            too_big = len(raw) > max_message_bytes
            if code in FORBIDDEN_NAMES - ({"RESOURCE_EXHAUSTED"} if too_big else set()):
                bad.append((f"{path} {what}", code, raw))

        await asyncio.wait_for(asyncio.gather(*(run(*case) for case in cases)), timeout=90)
        print(f"\ngRPC fuzz: {len(cases)} cases; per status code: {dict(counts.most_common())}")
        for name, method_counts in sorted(per_method.items()):
            print(f"  {name}: {dict(method_counts.most_common())}")
        assert not bad, [(p, c, r[:200]) for p, c, r in bad[:5]]
        big = oversized_cases(rng)
        counts.clear()
        per_method.clear()
        limit = asyncio.Semaphore(OVERSIZED_CONCURRENCY)
        await asyncio.wait_for(asyncio.gather(*(run(*case) for case in big)), timeout=120)
        print(f"oversized: {len(big)} cases; per status code: {dict(counts.most_common())}")
        for name, method_counts in sorted(per_method.items()):
            print(f"  {name}: {dict(method_counts.most_common())}")
        assert not bad, [(p, c, r[:200]) for p, c, r in bad[:5]]
        # Still serving, and a valid request is answered as before.
        await until(lambda: not gateway.server._calls._live, "every fuzz call finished")
        after = await _reference(channel)
    assert after == before

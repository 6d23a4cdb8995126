"""One gateway, several engines (scripted peers over real ZeroMQ): routing, pinning, fan-out of
utility calls, one engine's death and its re-admission, load reports, the handshake port."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import zmq
import zmq.asyncio
from gateway_harness import WAIT_S, gateway_config, health_status, until
from gateway_scripted_engine import ScriptedEngine
from grpc_health.v1 import health_pb2

from switchboard.api.v1 import admin_service_pb2 as admin_pb
from switchboard.api.v1 import admin_service_pb2_grpc as admin_grpc
from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.gateway.grpc_server import GENERATION_SERVICE, GatewayServer
from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import (
    EngineLoad,
    GatewayAddresses,
    GatewayHello,
    LoadReport,
)

SCRIPT = [5, 6, 7, 8]


class Cluster:
    def __init__(self, server: GatewayServer, run_dir: str) -> None:
        self.server = server
        self.config = server.config
        self.run_dir = run_dir
        self.engines: list[ScriptedEngine] = []
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    async def add_engine(self, rank: int, engine_id: str = "", step_s: float = 0.005):
        engine = ScriptedEngine(
            self.config.input_address, self.config.output_address, SCRIPT, rank=rank, step_s=step_s
        )
        engine.engine_id = engine_id or engine.engine_id
        self.engines.append(engine)
        await engine.start()
        engines = self.server.engines.engines
        await until(
            lambda: rank in engines and engines[rank].engine_id == engine.engine_id
            and engines[rank].alive,
            f"engine {engine.engine_id} is ready",
        )  # fmt: skip
        return engine

    async def health(self, service: str = GENERATION_SERVICE) -> int:
        return await health_status(self.channel, service)

    async def generate(self, max_tokens: int = 3, rank: int | None = None) -> list:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]))
        request.stopping.max_tokens = max_tokens
        if rank is not None:
            request.data_parallel_rank = rank
        return [r async for r in self.stub.Generate(request, timeout=WAIT_S)]


@pytest.fixture
async def start_cluster(checkpoint_dir, run_dir: str) -> AsyncIterator[Callable]:
    clusters: list[Cluster] = []

    async def start(**overrides) -> Cluster:
        fields = {"exit_when_engines_dead": False, "num_engines": 2, **overrides}
        server = GatewayServer(gateway_config(checkpoint_dir, run_dir, **fields))
        await server.start()
        cluster = Cluster(server, run_dir)
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        await cluster.channel.close()
        for engine in cluster.engines:
            with contextlib.suppress(Exception):
                await engine.close()
        await cluster.server.stop()


async def test_requests_spread_and_pin(start_cluster) -> None:
    cluster = await start_cluster()
    engines = [await cluster.add_engine(0), await cluster.add_engine(1)]
    results = await asyncio.gather(*(cluster.generate(max_tokens=5) for _ in range(30)))
    per_engine = collections.Counter(r[-1].metrics.engine_id for r in results)
    assert set(per_engine) == {"scripted-0", "scripted-1"}
    assert min(per_engine.values()) >= 30 * 0.25, per_engine
    assert len(engines[0].added) + len(engines[1].added) == 30

    pinned = await cluster.generate(rank=1)
    assert pinned[-1].metrics.engine_id == "scripted-1"
    assert list(engines[1].added.values())[-1].data_parallel_rank == 1
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await cluster.generate(rank=7)
    # Beyond the deployment's ranks: a permanent error, not a retryable UNAVAILABLE.
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "data_parallel_rank 7 is out of range" in error.value.details()


async def test_utility_calls_fan_out_to_every_engine(start_cluster) -> None:
    cluster = await start_cluster()
    await cluster.add_engine(0)
    await cluster.add_engine(1)
    stub = admin_grpc.AdminServiceStub(cluster.channel)
    reply = await stub.Utility(admin_pb.UtilityRequest(method="get_stats"), timeout=WAIT_S)
    assert sorted(r.engine_id for r in reply.results) == ["scripted-0", "scripted-1"]
    assert all(r.status.code == 0 for r in reply.results)
    assert all(e.utility_calls == [("get_stats", [])] for e in cluster.engines)


async def test_one_engine_dies_the_other_serves_and_the_dead_one_comes_back(
    start_cluster,
) -> None:
    cluster = await start_cluster()
    await cluster.add_engine(0, step_s=0.02)
    dying = await cluster.add_engine(1, step_s=0.02)
    dying.mode = "hang"  # its requests stay pending until it dies
    calls = [asyncio.create_task(cluster.generate(max_tokens=20, rank=r)) for r in (0, 1, 0, 1)]
    await until(lambda: len(dying.added) == 2, "engine 1 holds two requests")
    await dying.send_raw(zmq_channel.engine_dead_frames(1, dying.engine_id))
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert [isinstance(o, list) for o in outcomes] == [True, False, True, False]
    for failed in outcomes[1::2]:
        assert failed.code() == grpc.StatusCode.UNAVAILABLE
    engines = cluster.server.engines.engines
    assert engines[0].alive and not engines[1].alive
    assert await cluster.health() == health_pb2.HealthCheckResponse.SERVING
    assert (await cluster.generate())[-1].metrics.engine_id == "scripted-0"  # routed around

    await dying.close()
    cluster.engines.remove(dying)
    await cluster.add_engine(1, engine_id="scripted-1-restarted")  # READY again: re-admitted
    pinned = await cluster.generate(rank=1)
    assert pinned[-1].metrics.engine_id == "scripted-1-restarted"


async def test_no_ready_engine_is_not_serving_but_alive(start_cluster) -> None:
    cluster = await start_cluster()
    engine = await cluster.add_engine(0)
    assert await cluster.health() == health_pb2.HealthCheckResponse.SERVING
    await engine.send_raw(zmq_channel.engine_dead_frames(0, engine.engine_id))
    await until(lambda: not cluster.server.engines.live_engines, "the engine is dead")
    await until(lambda: not cluster.server._stop_requested.is_set(), "still running")
    assert await cluster.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await cluster.health("") == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await cluster.generate()
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_load_reports_steer_new_requests(start_cluster) -> None:
    ctx = zmq.asyncio.Context()
    pub = zmq_channel.make_socket(ctx, zmq.PUB, "tcp://127.0.0.1:0", bind=True)
    try:
        cluster = await start_cluster(coordinator_publish_address=zmq_channel.bound_address(pub))
        await cluster.add_engine(0)
        await cluster.add_engine(1)
        engines = cluster.server.engines.engines
        busy = LoadReport(1, [EngineLoad(0, 40, 64, 0.9, "scripted-0"), EngineLoad(1, 0, 0)])
        while engines[0].load is None:  # PUB drops messages until the SUB has joined
            await pub.send(zmq_channel.encode(busy))
            await asyncio.sleep(0.05)
        results = await asyncio.gather(*(cluster.generate() for _ in range(10)))
        assert {r[-1].metrics.engine_id for r in results} == {"scripted-1"}
    finally:
        pub.close(linger=0)
        ctx.term()


async def test_handshake_port_tells_engines_the_data_ports(start_cluster) -> None:
    cluster = await start_cluster(
        input_address="tcp://127.0.0.1:0",
        output_address="tcp://127.0.0.1:0",
        handshake_address="tcp://127.0.0.1:0",
        client_index=12345,
    )
    client = cluster.server.engines
    ctx = zmq.asyncio.Context()
    dealer = zmq_channel.make_socket(ctx, zmq.DEALER, client.handshake_address, bind=False)
    try:
        await dealer.send(zmq_channel.encode(GatewayHello(0, "e0")))
        answer = zmq_channel.decode(await asyncio.wait_for(dealer.recv(), WAIT_S), GatewayAddresses)
    finally:
        dealer.close(linger=0)
        ctx.term()
    assert answer.client_index == 12345 and answer.gateway_id == client.gateway_id
    assert client.input_address.endswith(f":{answer.input_port}")
    assert client.output_address.endswith(f":{answer.output_port}")

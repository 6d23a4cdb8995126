"""For in-process gateway tests: the gateway's config, starting and stopping it with the scripted
engine, waiting for a condition, and asking the gateway's health service."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from gateway_scripted_engine import ScriptedEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchboard.config import GatewayConfig, GatewayRoleConfig, ModelConfig, ipc_address
from switchboard.gateway.grpc_server import GatewayServer

WAIT_S = 10.0


def gateway_config(checkpoint_dir: Path, run_dir: str, **overrides: Any) -> GatewayRoleConfig:
    """A gateway for the test checkpoint (served as "tiny") on 127.0.0.1, any free port, admin
    on, its engine sockets in ``run_dir``; ``overrides``: other GatewayRoleConfig fields."""
    fields: dict[str, Any] = dict(
        model=ModelConfig(model=str(checkpoint_dir), served_model_name="tiny"),
        gateway=GatewayConfig(host="127.0.0.1", port=0, enable_admin=True),
        input_address=ipc_address(run_dir, "in"),
        output_address=ipc_address(run_dir, "out"),
        heartbeat_timeout_s=5.0,
    )
    return GatewayRoleConfig(**{**fields, **overrides})


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll ``predicate`` on the event loop; fail naming ``what`` after ``timeout_s``."""

    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"timed out waiting until {what}") from None


async def start_scripted(
    config: GatewayRoleConfig, script_text: str
) -> tuple[GatewayServer, ScriptedEngine]:
    """The gateway of ``config``, started, and a scripted engine on its sockets that emits the
    tokens of ``script_text`` (not started: :func:`connect_scripted`)."""
    server = GatewayServer(config)
    await server.start()
    script = server.state.tokenizer.encode(script_text, add_special_tokens=False)
    return server, ScriptedEngine(config.input_address, config.output_address, script)


async def connect_scripted(server: GatewayServer, engine: ScriptedEngine) -> None:
    """Start the engine and wait until the gateway is ready to serve."""
    await engine.start()
    assert await server.engines.wait_until_ready(WAIT_S)
    await until(lambda: server.ready, "the gateway is ready")


async def stop_scripted(server: GatewayServer, engine: ScriptedEngine) -> None:
    """Stop both (the engine may be closed already, or never started)."""
    with contextlib.suppress(Exception):
        await engine.close()
    await server.stop()


async def health_status(channel: grpc.aio.Channel, service: str, timeout_s: float = WAIT_S) -> int:
    """The serving status the gateway's health service reports for ``service``."""
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=service)
    return (await stub.Check(request, timeout=timeout_s)).status

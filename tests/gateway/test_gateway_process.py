"""The gateway as its own process: ``python -m switchboard.gateway --config-json JSON``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
from gateway_harness import health_status
from gateway_scripted_engine import ScriptedEngine
from grpc_health.v1 import health_pb2

from switchboard.config import (
    GatewayConfig,
    GatewayRoleConfig,
    ModelConfig,
    encode_config,
    ipc_address,
)
from switchboard.gateway.grpc_server import GENERATION_SERVICE, GatewayServer

WAIT_S = 30.0


def _config(checkpoint_dir: Path, run_dir: str, **overrides) -> GatewayRoleConfig:
    fields = dict(
        model=ModelConfig(model=str(checkpoint_dir)),
        gateway=GatewayConfig(host="127.0.0.1", port=0),
        input_address=ipc_address(run_dir, "in"),
        output_address=ipc_address(run_dir, "out"),
        client_index=0,
    )
    return GatewayRoleConfig(**{**fields, **overrides})


class GatewayProcess:
    def __init__(self, config: GatewayRoleConfig, log_path: Path) -> None:
        self.log_path = log_path
        cmd = [sys.executable, "-m", "switchboard.gateway", "--config-json", encode_config(config)]
        with open(log_path, "wb") as log:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def port(self) -> int:
        """The port from the gateway's 'listening on host:port' log line."""
        for _ in range(int(WAIT_S / 0.05)):
            for line in self.log().splitlines():
                if " listening on " in line:
                    return int(line.split(" listening on ")[1].split()[0].rsplit(":", 1)[1])
            assert self.process.poll() is None, self.log()
            await asyncio.sleep(0.05)
        raise AssertionError(f"no 'listening on' line\n{self.log()}")

    async def wait(self) -> int:
        for _ in range(int(WAIT_S / 0.05)):
            if self.process.poll() is not None:
                return self.process.returncode
            await asyncio.sleep(0.05)
        raise AssertionError(f"the gateway did not exit\n{self.log()}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


async def _health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await health_status(channel, service, WAIT_S)


async def test_titled_process_serves_health_and_stops_cleanly_on_sigterm(
    checkpoint_dir: Path, run_dir: str, tmp_path: Path
) -> None:
    gateway = GatewayProcess(_config(checkpoint_dir, run_dir), tmp_path / "gateway.log")
    try:
        port = await gateway.port()
        cmdline = Path(f"/proc/{gateway.process.pid}/cmdline").read_bytes()
        assert cmdline.startswith(b"switchboard::Gateway_0")
        assert await _health(port, "") == health_pb2.HealthCheckResponse.SERVING
        assert await _health(port, GENERATION_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        gateway.process.send_signal(signal.SIGTERM)
        assert await gateway.wait() == 0, gateway.log()
    finally:
        gateway.kill()


async def test_process_exits_non_zero_when_its_engine_dies(
    checkpoint_dir: Path, run_dir: str, tmp_path: Path
) -> None:
    config = _config(checkpoint_dir, run_dir)
    gateway = GatewayProcess(config, tmp_path / "gateway.log")
    engine = ScriptedEngine(config.input_address, config.output_address, [5])
    try:
        port = await gateway.port()
        await engine.start()
        for _ in range(int(WAIT_S / 0.05)):
            if await _health(port, GENERATION_SERVICE) == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"never SERVING\n{gateway.log()}")
        await engine.die()
        assert await gateway.wait() != 0
        assert "is dead: it sent ENGINE_CORE_DEAD" in gateway.log()
    finally:
        gateway.kill()
        await engine.close()


async def test_no_engine_within_the_startup_timeout_stops_the_gateway(
    checkpoint_dir: Path, run_dir: str
) -> None:
    gateway = GatewayConfig(host="127.0.0.1", port=0, startup_timeout_s=0.2)
    server = GatewayServer(_config(checkpoint_dir, run_dir, gateway=gateway))
    await server.start()
    assert await asyncio.wait_for(server.run(), WAIT_S) != 0

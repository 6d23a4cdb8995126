"""Start and stop a real `switchboard serve` for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

READINESS_SERVICE = "switchboard.v1.GenerationService"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    process: subprocess.Popen
    target: str
    run_base: Path  # SWITCHBOARD_RPC_BASE_PATH: the server's run directory is created in here
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def health(self, service: str = READINESS_SERVICE) -> int:
        with self.channel() as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the supervisor and wait; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"server did not stop within {timeout}s\n{self.log()}") from None


def start_server(
    model_dir: str, workdir: Path, *extra_args: str, ready_timeout: float = 180.0
) -> RunningServer:
    port = free_port()
    run_base = workdir / "run"
    run_base.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "server.log"
    env = dict(os.environ, SWITCHBOARD_RPC_BASE_PATH=str(run_base), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "switchboard.cli", "serve", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), *extra_args]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = RunningServer(process, f"127.0.0.1:{port}", run_base, log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}\n{server.log()}")
        try:
            if server.health() == health_pb2.HealthCheckResponse.SERVING:
                return server
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    server.stop()
    raise AssertionError(f"server not ready within {ready_timeout}s\n{server.log()}")

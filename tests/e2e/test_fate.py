"""The fate model on one machine (docs/architecture.md): stop cleanly, or die together and say
so."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.server import RunningServer, descendants, free_port, start_server

pytestmark = pytest.mark.slow


def ring_segments(engine_pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"sb_ring_{engine_pid}_")]


def assert_nothing_left(server: RunningServer, pids: list[int]) -> None:
    if server.leftovers is None:
        server.stop()
    assert server.leftovers == [], "the run directory must be removed"
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    assert left == [], f"processes left behind: {left}"


LONG_STREAMS = 3  # run one after another (--max-num-seqs 1): ~1,500 decode steps in all


def start_long_streams(server: RunningServer) -> list[tuple[threading.Thread, dict]]:
    """Greedy streams queued behind each other, so that work is left whenever something stops
    them (one stream alone can end within a second on tiny-llama); each records how it ended."""
    streams = [_start_stream(server) for _ in range(LONG_STREAMS)]
    deadline = time.monotonic() + 30
    while all(o["messages"] == 0 for _, o in streams) and time.monotonic() < deadline:
        time.sleep(0.05)
    return streams


def _start_stream(server: RunningServer) -> tuple[threading.Thread, dict]:
    outcome: dict = {"messages": 0}

    def run() -> None:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 5, 6]))
        request.sampling.temperature = 0.0
        request.stopping.ignore_eos = True
        request.stopping.max_tokens = 500
        with server.channel() as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            try:
                for _ in stub.Generate(request, timeout=120):
                    outcome["messages"] += 1
                    time.sleep(0.01)  # a slow reader keeps the request alive in the engine
                outcome["code"] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                outcome["code"] = exc.code()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_everything_cleanly(
    tiny_model: str, tmp_path: Path, stop_signal: signal.Signals
) -> None:
    """SIGTERM (an orchestrator) or SIGINT (Ctrl-C): exit code 0, nothing left behind."""
    server = start_server(tiny_model, tmp_path)
    titled = server.titled_processes()
    engine_pid = titled["switchboard::EngineCore_DP0"]
    assert ring_segments(engine_pid), "the engine's ring lives in /dev/shm while it runs"
    server.process.send_signal(stop_signal)
    try:
        code = server.process.wait(60)
    finally:
        server.stop()  # SIGTERM (then kill) only if it still runs; records what is left
    assert code == 0, server.log()
    assert f"received {stop_signal.name}: stopping" in server.log()
    assert ring_segments(engine_pid) == []
    assert_nothing_left(server, list(titled.values()))


@pytest.mark.parametrize(
    "victim",
    ["switchboard::Worker_DP0_PP0_TP0", "switchboard::EngineCore_DP0", "switchboard::Gateway_0"],
)
def test_a_dead_process_takes_the_server_down(tiny_model: str, tmp_path: Path, victim: str) -> None:
    """A worker death is reported by the engine (ENGINE_CORE_DEAD); an engine killed with -9 is
    found by the gateway's heartbeat watch; a gateway killed with -9 drops its clients' connections
    and the supervisor sees it go. Either way the pending streams fail UNAVAILABLE and the whole
    server exits non-zero, leaving nothing behind. This is --restart-policy never (the default,
    always, restarts a dead engine: tests/e2e/test_resilience.py)."""
    server = start_server(
        tiny_model, tmp_path, "--restart-policy", "never", "--no-resume", "--max-num-seqs", "1"
    )
    titled = server.titled_processes()
    engine_pid = titled["switchboard::EngineCore_DP0"]
    streams = start_long_streams(server)
    os.kill(titled[victim], signal.SIGKILL)
    for thread, _ in streams:
        thread.join(60)
    codes = [outcome.get("code") for _, outcome in streams]
    # A stream the engine had already finished may end OK; every other one fails UNAVAILABLE.
    assert grpc.StatusCode.UNAVAILABLE in codes, (codes, server.log())
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
    code = server.process.wait(60)
    assert code != 0, server.log()
    assert ring_segments(engine_pid) == []
    assert_nothing_left(server, list(titled.values()) + descendants(server.process.pid))


def _serve_until_exit(cmd_args: list[str], workdir: Path) -> tuple[int, str]:
    run_base = Path(tempfile.mkdtemp(prefix="sb-"))
    env = dict(os.environ, SWITCHBOARD_RPC_BASE_PATH=str(run_base), PYTHONUNBUFFERED="1")
    log_path = workdir / "server.log"
    cmd = [sys.executable, "-m", "switchboard.cli", "serve", "--host", "127.0.0.1", *cmd_args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        code = process.wait(240)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(run_base, ignore_errors=True)
    return code, log_path.read_text(errors="replace")


@pytest.mark.parametrize("failure", ["weights", "port"])
def test_a_process_that_cannot_start_stops_the_server_without_restarts(
    tiny_model: str, tmp_path: Path, failure: str
) -> None:
    """An engine whose model fails to load, or a gateway whose port is taken, fails the same way
    on every try: the server stops at once with the cause in its log, instead of restarting it."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    http_port = holder.getsockname()[1] if failure == "port" else free_port()
    if failure == "weights":
        (weights,) = model.glob("*.safetensors")
        weights.write_bytes(weights.read_bytes()[:1000])
    try:
        code, log = _serve_until_exit(
            ["--model", str(model), "--port", str(free_port()), "--http-port", str(http_port)],
            tmp_path,
        )
    finally:
        holder.close()
    role = "EngineCore_DP0" if failure == "weights" else "Gateway_0"
    assert code != 0, log
    assert f"{role} (pid" in log and "failed to start" in log, log
    assert "restarting it" not in log, log

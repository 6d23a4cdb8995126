"""The four wire-1 attacks of the audit against a TCP gateway (`switchboard gateway`, started
here on 127.0.0.1 and ended by its pid), with and without CURVE keys.

With ``--curve-keys-dir`` a peer without an admitted key (a) gets no answer to a GatewayHello,
(b) cannot put a forged EngineCoreOutputs into a live stream, (c) cannot take the gateway out of
service with ENGINE_CORE_DEAD and (d) cannot register a rogue READY; an admitted engine key
cannot speak for another rank. The attacker is given the data ports (which it could not learn:
see (a)). Without keys the same forgery reaches the stream (the control), and the gateway says
once that its wire is unauthenticated.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.wire import curve, zmq_channel
from switchboard.wire.engine_msgs import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineReady,
    FinishReason,
    GatewayAddresses,
    GatewayHello,
    RequestType,
)

pytestmark = pytest.mark.slow

READINESS = "switchboard.v1.GenerationService"
SERVING = health_pb2.HealthCheckResponse.SERVING
WAIT_S = 30.0
NO_ANSWER_MS = 1500


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


def hello(port: int, keys: curve.CurveKeys | None, timeout_ms: int = 5000) -> bytes | None:
    """Say GatewayHello to the handshake port; the answer, or None."""
    ctx = zmq.Context()
    try:
        sock = zmq_channel.make_socket(
            ctx, zmq.DEALER, f"tcp://127.0.0.1:{port}", bind=False, curve=keys
        )
        sock.send(zmq_channel.encode(GatewayHello(0, "who-am-i")))
        answer = sock.recv() if sock.poll(timeout_ms) else None
        sock.close(linger=0)
        return answer
    finally:
        ctx.term()


def ready(rank: int, engine_id: str) -> EngineReady:
    return EngineReady(
        engine_id=engine_id,
        data_parallel_rank=rank,
        max_model_len=64,
        num_gpu_blocks=32,
        block_size=16,
        kv_capacity_tokens=512,
        wall_clock_ns=time.time_ns(),
        monotonic_ns=time.monotonic_ns(),
        vocab_size=300,
        dtype="float32",
    )


class Engine(threading.Thread):
    """A minimal engine peer over the real wire: READY, heartbeats, records ADDs, and pushes
    the tokens the test tells it to. Every socket is used in this thread only."""

    def __init__(self, addresses: GatewayAddresses, keys: curve.CurveKeys | None, rank: int = 0):
        super().__init__(daemon=True)
        self.addresses, self.keys, self.rank = addresses, keys, rank
        self.engine_id = f"legit-{rank}"
        # As a real engine with CURVE: a routing id new at each start.
        self.identity = zmq_channel.engine_identity(rank, os.urandom(8) if keys else b"")
        self.added: list[str] = []
        self.commands: queue.Queue = queue.Queue()
        self.stop_event = threading.Event()

    def push(self, request_id: str, token: int, finish: bool = False) -> None:
        self.commands.put((request_id, token, finish))

    def run(self) -> None:
        ctx = zmq.Context()
        base = "tcp://127.0.0.1"
        dealer = zmq_channel.make_socket(
            ctx,
            zmq.DEALER,
            f"{base}:{self.addresses.input_port}",
            bind=False,
            identity=self.identity,
            curve=self.keys,
        )
        push = zmq_channel.make_socket(
            ctx, zmq.PUSH, f"{base}:{self.addresses.output_port}", bind=False, curve=self.keys
        )
        dealer.send(zmq_channel.encode(ready(self.rank, self.engine_id)))
        last_beat = 0.0
        while not self.stop_event.is_set():
            if dealer.poll(20):
                kind, body, _ = zmq_channel.parse_request_frames(dealer.recv_multipart())
                if kind is RequestType.ADD:
                    self.added.append(body.request_id)
            while not self.commands.empty():
                request_id, token, finish = self.commands.get()
                output = EngineCoreOutput(request_id, [token])
                if finish:
                    output.finish_reason = FinishReason.LENGTH
                push.send(
                    zmq_channel.encode(
                        EngineCoreOutputs(self.rank, time.monotonic_ns(), outputs=[output])
                    )
                )
            if time.monotonic() - last_beat > 0.2:
                beat = EngineCoreOutputs(self.rank, time.monotonic_ns(), heartbeat=True)
                push.send(zmq_channel.encode(beat))
                last_beat = time.monotonic()
        dealer.close(linger=0)
        push.close(linger=0)
        ctx.term()


class Attacker:
    """Sockets of a peer that reached the data ports (with ``keys``, or none)."""

    def __init__(self, addresses: GatewayAddresses, keys: curve.CurveKeys | None = None):
        self.ctx = zmq.Context()
        self.addresses, self.keys = addresses, keys

    def push(self, frames: list[bytes]) -> None:
        sock = zmq_channel.make_socket(
            self.ctx,
            zmq.PUSH,
            f"tcp://127.0.0.1:{self.addresses.output_port}",
            bind=False,
            linger_ms=1000,
            curve=self.keys,
        )
        sock.send_multipart(frames)
        time.sleep(0.5)  # time for a (refused) handshake and delivery
        sock.close(linger=0)

    def ready(self, rank: int, engine_id: str, identity: bytes | None = None) -> None:
        sock = zmq_channel.make_socket(
            self.ctx,
            zmq.DEALER,
            f"tcp://127.0.0.1:{self.addresses.input_port}",
            bind=False,
            identity=identity or zmq_channel.engine_identity(rank),
            linger_ms=1000,
            curve=self.keys,
        )
        sock.send(zmq_channel.encode(ready(rank, engine_id)))
        time.sleep(0.5)
        sock.close(linger=0)

    def close(self) -> None:
        self.ctx.term()


class Gateway:
    """`switchboard gateway` on 127.0.0.1 (fixed handshake port), ended by its pid."""

    def __init__(self, checkpoint_dir: Path, workdir: Path, keys_dir: str | None) -> None:
        self.grpc_port, self.handshake_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.log_path = workdir / "gateway.log"
        args = [sys.executable, "-m", "switchboard.cli", "gateway", "--model",
                str(checkpoint_dir), "--host", "127.0.0.1", "--port", str(self.grpc_port),
                "--engine-host", "127.0.0.1", "--handshake-port", str(self.handshake_port),
                "--engine-heartbeat-timeout", "30", "--disable-log-stats",
                "--http-port", "-1"]  # fmt: skip
        if keys_dir:
            args += ["--curve-keys-dir", keys_dir]
        with open(self.log_path, "wb") as log:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.channel = grpc.insecure_channel(self.target)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> int:
        try:
            request = health_pb2.HealthCheckRequest(service=READINESS)
            return health_pb2_grpc.HealthStub(self.channel).Check(request, timeout=5).status
        except grpc.RpcError:
            return -1

    def stop(self) -> int | None:
        self.channel.close()
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
            return None


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("keys") / "k")
    curve.generate(path, engines=2)
    return path


@pytest.fixture(scope="module")
def keyed(
    checkpoint_dir: Path, keys_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Gateway, GatewayAddresses, Engine]]:
    """A CURVE gateway and one legitimate engine (key engine-0) serving through it."""
    gateway = Gateway(checkpoint_dir, tmp_path_factory.mktemp("keyed"), keys_dir)
    engine = None
    try:
        engine_keys = curve.client_keys(keys_dir, "engine-0", curve.GATEWAY)
        answer = None

        def answered() -> bool:
            nonlocal answer
            assert gateway.process.poll() is None, gateway.log()
            answer = hello(gateway.handshake_port, engine_keys, timeout_ms=500)
            return answer is not None

        wait_for(answered, "the gateway answers a keyed hello")
        addresses = zmq_channel.decode(answer, GatewayAddresses)
        engine = Engine(addresses, engine_keys)
        engine.start()
        wait_for(lambda: gateway.health() == SERVING, "the keyed engine is admitted")
        yield gateway, addresses, engine
    finally:
        if engine is not None:
            engine.stop_event.set()
            engine.join(5)
        code = gateway.stop()
    assert code == 0, gateway.log()


def collect_stream(gateway: Gateway, engine: Engine, forge) -> list[int]:
    """One stream: the engine sends a token, ``forge(request_id)`` runs, the engine finishes
    it; the token ids the client got."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]))
    request.stopping.max_tokens = 3
    request.output.return_token_ids = True
    before = len(engine.added)
    call = pb_grpc.GenerationServiceStub(gateway.channel).Generate(request, timeout=60)
    got: list[int] = []
    done = threading.Event()

    def read() -> None:
        for response in call:
            for output in response.outputs:
                got.extend(output.token_ids)
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_for(lambda: len(engine.added) > before, "the engine gets the ADD")
    request_id = engine.added[-1]
    engine.push(request_id, 11)
    wait_for(lambda: got == [11], "the first token reaches the client")
    forge(request_id)
    engine.push(request_id, 12)
    engine.push(request_id, 13, finish=True)
    assert done.wait(WAIT_S), "the stream ends"
    return got


def test_a_unkeyed_hello_gets_no_answer(keyed, keys_dir: str) -> None:
    gateway, _, _ = keyed
    assert hello(gateway.handshake_port, None, NO_ANSWER_MS) is None
    # A client with a pair the gateway does not know, knowing the gateway's public key.
    stranger = curve.CurveKeys(*zmq.curve_keypair(), curve._public(keys_dir, curve.GATEWAY))
    assert hello(gateway.handshake_port, stranger, NO_ANSWER_MS) is None
    assert "CURVE: refused a client whose public key" in gateway.log()
    # The admitted key still gets its answer.
    keys = curve.client_keys(keys_dir, "engine-1", curve.GATEWAY)
    assert hello(gateway.handshake_port, keys) is not None


def test_b_forged_outputs_do_not_reach_a_live_stream(keyed) -> None:
    gateway, addresses, engine = keyed
    attacker = Attacker(addresses)

    def forge(request_id: str) -> None:
        forged = EngineCoreOutput(request_id, [99], finish_reason=FinishReason.STOP)
        attacker.push([zmq_channel.encode(EngineCoreOutputs(0, 0, outputs=[forged]))])

    try:
        assert collect_stream(gateway, engine, forge) == [11, 12, 13]
    finally:
        attacker.close()


def test_c_forged_engine_dead_does_not_change_readiness(keyed) -> None:
    gateway, addresses, engine = keyed
    attacker = Attacker(addresses)
    try:
        attacker.push(zmq_channel.engine_dead_frames(0, engine.engine_id))
        attacker.push([ENGINE_CORE_DEAD])
    finally:
        attacker.close()
    time.sleep(0.5)
    assert gateway.health() == SERVING
    assert "is dead" not in gateway.log()
    assert collect_stream(gateway, engine, lambda _: None) == [11, 12, 13]


def test_d_rogue_ready_does_not_register(keyed, keys_dir: str) -> None:
    gateway, addresses, engine = keyed
    attacker = Attacker(addresses)
    try:
        attacker.ready(0, "rogue-unkeyed")
    finally:
        attacker.close()
    # An admitted key speaks for its own rank only: engine-1's key cannot be rank 0.
    other = Attacker(addresses, curve.client_keys(keys_dir, "engine-1", curve.GATEWAY))
    try:
        other.ready(0, "rogue-engine-1")
        wait_for(lambda: "from the key engine-1 (that key is rank 1's)" in gateway.log(), "drop")
        # Nor can it take over rank 0's routing id (no handover under CURVE): its READY, were
        # it for rank 1, would not move rank 0's requests to it.
        other.ready(1, "rogue-identity", identity=engine.identity)
        # Nor forge rank 0's outputs or death with its own key.
        other.push(zmq_channel.engine_dead_frames(0, engine.engine_id))
    finally:
        other.close()
    log = gateway.log()
    assert "rogue-unkeyed" not in log and "engine rogue-engine-1 (DP rank 0) READY" not in log
    assert "rogue-identity" not in log and "is dead" not in log
    assert "dropped ENGINE_CORE_DEAD for DP rank 0 from the key engine-1" in log
    assert collect_stream(gateway, engine, lambda _: None) == [11, 12, 13]


def test_without_keys_the_wire_is_open_and_says_so(checkpoint_dir: Path, tmp_path: Path) -> None:
    """The control: plain TCP still works, warns once, and the forgery of (b) gets through."""
    gateway = Gateway(checkpoint_dir, tmp_path, None)
    engine = None
    try:
        answer = None

        def answered() -> bool:
            nonlocal answer
            assert gateway.process.poll() is None, gateway.log()
            answer = hello(gateway.handshake_port, None, timeout_ms=500)
            return answer is not None

        wait_for(answered, "the gateway answers")
        addresses = zmq_channel.decode(answer, GatewayAddresses)
        engine = Engine(addresses, None)
        engine.start()
        wait_for(lambda: gateway.health() == SERVING, "the engine is admitted")
        attacker = Attacker(addresses)

        def forge(request_id: str) -> None:
            forged = EngineCoreOutput(request_id, [99], finish_reason=FinishReason.STOP)
            attacker.push([zmq_channel.encode(EngineCoreOutputs(0, 0, outputs=[forged]))])

        try:
            assert collect_stream(gateway, engine, forge) == [11, 99]
        finally:
            attacker.close()
        assert gateway.log().count("wire without CURVE keys") == 1
    finally:
        if engine is not None:
            engine.stop_event.set()
            engine.join(5)
        code = gateway.stop()
    assert code == 0, gateway.log()

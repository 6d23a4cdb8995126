"""The engine core's I/O threads in-process, against gateway-side sockets (no engine, no worker)."""

from __future__ import annotations

import logging
import queue
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest
import zmq

from switchboard.engine.io_threads import GatewayChange, InputThread
from switchboard.engine.output_thread import OutputThread, send_engine_dead_directly
from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    RequestType,
    SchedulerStats,
    UtilityCall,
)

TIMEOUT_MS = 10_000
READY = EngineReady("engine-x", 0, 512, 64, 16, 1024, 1, 2)


class Gateways:
    """``n`` gateways' ROUTER + PULL pairs on tcp loopback."""

    def __init__(self, n: int) -> None:
        self.ctx = zmq.Context()
        self.routers = [self._bind(zmq.ROUTER) for _ in range(n)]
        self.pulls = [self._bind(zmq.PULL) for _ in range(n)]

    def _bind(self, kind: int) -> zmq.Socket:
        sock = zmq_channel.make_socket(self.ctx, kind, "tcp://127.0.0.1:0", bind=True)
        sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        return sock

    def input_addresses(self) -> list[str]:
        return [zmq_channel.bound_address(s) for s in self.routers]

    def output_addresses(self) -> list[str]:
        return [zmq_channel.bound_address(s) for s in self.pulls]

    def recv_output(self, index: int) -> EngineCoreOutputs | None:
        return zmq_channel.parse_output_frames(self.pulls[index].recv_multipart())[0]

    def close(self) -> None:
        for sock in self.routers + self.pulls:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def gateways() -> Iterator[Gateways]:
    gws = Gateways(2)
    yield gws
    gws.close()


def start_input_thread(gateways: Gateways, failures: list[str]):
    input_queue: queue.Queue = queue.Queue()
    aborts_queue: queue.Queue = queue.Queue()

    def prepare_add(request: EngineCoreRequest):
        return None if request.request_id.startswith("reject") else ("prepared", request)

    thread = InputThread(
        gateways.ctx,
        gateways.input_addresses(),
        zmq_channel.engine_identity(3),
        lambda: READY,
        prepare_add,
        input_queue,
        aborts_queue,
        failures.append,
    )
    thread.start()
    return thread, input_queue, aborts_queue


def test_input_thread(gateways: Gateways, caplog: pytest.LogCaptureFixture) -> None:
    failures: list[str] = []
    thread, input_queue, aborts_queue = start_input_thread(gateways, failures)
    try:
        for router in gateways.routers:  # READY first, on every gateway
            identity, body = router.recv_multipart()
            assert identity == zmq_channel.engine_identity(3)
            assert zmq_channel.parse_ready(body) == READY
        router = gateways.routers[1]

        def send(frames: list) -> None:
            router.send_multipart([zmq_channel.engine_identity(3), *frames])

        with caplog.at_level(logging.WARNING):
            send([b"\x42", b"junk"])
            send([RequestType.UTILITY.value, b"\xc1"])
            send(zmq_channel.request_frames(RequestType.START_DP_WAVE, [1, 0]))
            send(zmq_channel.request_frames(RequestType.ADD, EngineCoreRequest("reject-me", [1])))
            send(zmq_channel.request_frames(RequestType.ADD, EngineCoreRequest("r1", [1, 2])))
            send(zmq_channel.request_frames(RequestType.ABORT, ["r1"]))
            send(zmq_channel.request_frames(RequestType.UTILITY, UtilityCall(1, 7, "get_stats")))
            items = [input_queue.get(timeout=10) for _ in range(3)]
        assert items == [
            (RequestType.ADD, ("prepared", EngineCoreRequest("r1", [1, 2]))),
            (RequestType.ABORT, ["r1"]),
            (RequestType.UTILITY, UtilityCall(1, 7, "get_stats")),
        ]
        assert aborts_queue.get_nowait() == ["r1"]
        assert input_queue.empty()
        assert caplog.text.count("Dropped a bad request frame") == 2
        assert "Dropped a START_DP_WAVE frame" in caplog.text
    finally:
        thread.stop()
    assert not thread.is_alive()
    assert failures == []


def test_a_gateway_that_restarts_is_reported_lost_then_gets_ready_again() -> None:
    """A gateway's process dies (its ROUTER closes) and a new one binds the same ipc:// path, as
    the supervisor restarts it: what it sent before dying is taken in, then its loss is reported
    (the engine aborts its requests), and the reconnected DEALER sends READY again, so the new
    gateway admits the engine and its requests arrive."""
    run_dir = tempfile.mkdtemp(prefix="sb-io-")  # ipc:// paths must stay short
    address = f"ipc://{run_dir}/gateway0-input"
    ctx = zmq.Context()
    input_queue: queue.Queue = queue.Queue()
    identity = zmq_channel.engine_identity(3)

    def router() -> zmq.Socket:
        sock = zmq_channel.make_socket(ctx, zmq.ROUTER, address, bind=True)
        sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        return sock

    def send(sock: zmq.Socket, request_id: str) -> None:
        frames = zmq_channel.request_frames(RequestType.ADD, EngineCoreRequest(request_id, [1]))
        sock.send_multipart([identity, *frames])

    first = router()
    thread = InputThread(
        ctx,
        [address],
        identity,
        lambda: READY,
        lambda request: request.request_id,
        input_queue,
        queue.Queue(),
        lambda failure: None,
        on_gateway_lost=lambda index: input_queue.put(("lost", index)),
    )
    thread.start()
    second = None
    try:
        assert first.recv_multipart() == [identity, zmq_channel.encode(READY)]
        send(first, "from-the-dead-one")
        first.close(linger=TIMEOUT_MS)  # sent before the connection drops
        assert input_queue.get(timeout=10) == (RequestType.ADD, "from-the-dead-one")
        assert input_queue.get(timeout=10) == ("lost", 0)
        second = router()  # the restarted gateway, same address
        received_identity, body = second.recv_multipart()
        assert received_identity == identity and zmq_channel.parse_ready(body) == READY
        send(second, "from-the-new-one")
        assert input_queue.get(timeout=10) == (RequestType.ADD, "from-the-new-one")
        assert input_queue.empty()
    finally:
        thread.stop()
        if second is not None:
            second.close(linger=0)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)
    assert not thread.is_alive()


def outputs_for(request_id: str, num_tokens: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(0, 1, [EngineCoreOutput(request_id, list(range(num_tokens)))])


def test_output_thread_routes_reuses_buffers_and_dies_loudly(gateways: Gateways) -> None:
    output_queue: queue.Queue = queue.Queue()
    failures: list[str] = []
    thread = OutputThread(
        gateways.ctx, gateways.output_addresses(), output_queue, 0, 3600.0, failures.append
    )
    thread.start()
    # Sizes vary so that a buffer reused while zmq still held it would corrupt a message.
    sent = [(i % 2, outputs_for(f"r{i}", (i * 37) % 300)) for i in range(200)]
    output_queue.put((5, outputs_for("nobody", 1)))  # unknown gateway: dropped
    for item in sent:
        output_queue.put(item)
    output_queue.put(ENGINE_CORE_DEAD)
    for index in (0, 1):
        expected = [outputs for client, outputs in sent if client == index]
        assert [gateways.recv_output(index) for _ in expected] == expected
        assert gateways.recv_output(index) is None  # ENGINE_CORE_DEAD, last
    thread.join(10)
    assert not thread.is_alive() and failures == []


def test_output_thread_heartbeats_every_idle_gateway(gateways: Gateways) -> None:
    output_queue: queue.Queue = queue.Queue()
    thread = OutputThread(
        gateways.ctx, gateways.output_addresses(), output_queue, 4, 0.05, lambda _: None
    )
    thread.start()
    try:
        for index in (0, 1):
            heartbeat = gateways.recv_output(index)
            assert heartbeat.heartbeat and heartbeat.engine_index == 4
            assert heartbeat.outputs == [] and heartbeat.timestamp_ns <= time.monotonic_ns()
    finally:
        thread.stop()
    assert not thread.is_alive()


def test_exactly_one_gateway_is_named_exporter_of_the_engine_stats(gateways: Gateways) -> None:
    output_queue: queue.Queue = queue.Queue()
    thread = OutputThread(
        gateways.ctx, gateways.output_addresses(), output_queue, 0, 0.05, lambda _: None
    )
    thread.latest_stats = SchedulerStats(num_running_reqs=1)
    thread.start()
    try:
        beats = [gateways.recv_output(index) for index in (0, 1)]
        assert [b.heartbeat and b.scheduler_stats is not None for b in beats] == [True, True]
        assert [b.exports_engine_stats for b in beats] == [True, False]  # the lowest index
        # Gateway 0 goes away: gateway 1 is the exporter from the next stats on.
        output_queue.put(GatewayChange(0, None))
        output_queue.put((1, EngineCoreOutputs(0, 1, scheduler_stats=SchedulerStats())))
        while not (received := gateways.recv_output(1)).scheduler_stats == SchedulerStats():
            pass  # heartbeats sent before the change
        assert received.exports_engine_stats
    finally:
        thread.stop()
    assert not thread.is_alive()


def test_engine_core_dead_without_an_output_thread(gateways: Gateways) -> None:
    send_engine_dead_directly(gateways.ctx, gateways.output_addresses())
    assert [gateways.recv_output(i) for i in (0, 1)] == [None, None]


def test_output_thread_fails_the_engine_after_a_freeze(gateways: Gateways) -> None:
    """A gap between its wake-ups far over the gateways' heartbeat timeout (here: a timeout
    below the heartbeat interval) means the process was stopped: the engine must fail."""
    failures: list[str] = []
    thread = OutputThread(
        gateways.ctx,
        gateways.output_addresses(),
        queue.Queue(),
        0,
        0.2,
        failures.append,
        exit_after_frozen_s=0.05,
    )
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert failures and "frozen for" in failures[0]

"""The engine core's two I/O threads: all socket work and (de)serialisation of wire 1.

The busy loop never touches a socket; these threads hand work to it through in-memory queues,
so decoding a request and encoding a step's outputs overlap with the forward pass.

* :class:`InputThread` connects one DEALER per gateway, sends ``EngineReady`` first on each
  (a ROUTER can only address peers it has heard from), then decodes request frames and
  prepares each ADD (builds the scheduler's request, hashes its prompt blocks) before queueing
  it. A frame that breaks the contract is logged and dropped: a bad peer never kills the engine.
* Either thread failing is fatal: it reports through ``on_failure`` and the busy loop raises.
* :class:`OutputThread` connects one PUSH per gateway and sends ``(client_index,
  EngineCoreOutputs)`` items, encoding into reused buffers; it sends heartbeats when a gateway
  has heard nothing for ``heartbeat_interval_s``, and on ``ENGINE_CORE_DEAD`` sends that
  literal frame to every gateway as its last act.

Input queue items are ``(RequestType, payload)``: ADD -> prepared request, ABORT -> list of
request ids (also put on the aborts queue), UTILITY -> ``UtilityCall``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from switchboard.engine import clock
from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    RequestType,
    SchedulerStats,
)

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 100  # how often an idle input thread checks whether it should stop
DEAD_LINGER_MS = 4000  # a PUSH keeps unsent frames this long at close, so the last word arrives
STOP_OUTPUT = None  # output-queue sentinel: flush and exit without declaring death

# Returns the item to queue for the busy loop, or None when the request was rejected.
PrepareAdd = Callable[[EngineCoreRequest], Any | None]


class InputThread(threading.Thread):
    def __init__(
        self,
        ctx: zmq.Context,
        addresses: list[str],
        identity: bytes,
        make_ready: Callable[[], EngineReady],
        prepare_add: PrepareAdd,
        input_queue: queue.Queue,
        aborts_queue: queue.Queue,
        on_failure: Callable[[str], None],
    ) -> None:
        super().__init__(name="EngineCoreInput", daemon=True)
        self._on_failure = on_failure
        self._ctx = ctx
        self._addresses = addresses
        self._identity = identity
        self._make_ready = make_ready
        self._prepare_add = prepare_add
        self._input_queue = input_queue
        self._aborts_queue = aborts_queue
        self._stop_event = threading.Event()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout_s)

    def run(self) -> None:
        sockets = [
            zmq_channel.make_socket(
                self._ctx, zmq.DEALER, address, bind=False, identity=self._identity
            )
            for address in self._addresses
        ]
        try:
            ready = zmq_channel.encode(self._make_ready())
            for sock in sockets:
                sock.send(ready)
            logger.info("Sent READY to %d gateway(s)", len(sockets))
            self._serve(sockets)
        except Exception as exc:
            logger.exception("Engine input thread failed")
            self._on_failure(f"input thread failed: {exc!r}")
        finally:
            for sock in sockets:
                sock.close(linger=0)

    def _serve(self, sockets: list[zmq.Socket]) -> None:
        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        while not self._stop_event.is_set():
            for sock, _ in poller.poll(POLL_INTERVAL_MS):
                self._handle_frames(sock.recv_multipart(copy=False))

    def _handle_frames(self, frames: list[zmq.Frame]) -> None:
        try:
            request_type, body, _tensor_frames = zmq_channel.parse_request_frames(
                [frame.buffer for frame in frames]
            )
        except zmq_channel.BadFrame as exc:
            logger.warning("Dropped a bad request frame: %s", exc)
            return
        if request_type == RequestType.ADD:
            prepared = self._prepare_add(body)
            if prepared is not None:
                self._input_queue.put((RequestType.ADD, prepared))
        elif request_type == RequestType.ABORT:
            self._aborts_queue.put(body)  # fast path, drained right after the forward pass
            self._input_queue.put((RequestType.ABORT, body))  # keeps order relative to ADDs
        elif request_type == RequestType.UTILITY:
            self._input_queue.put((RequestType.UTILITY, body))
        else:
            logger.warning("Dropped a %s frame: not handled by this engine", request_type.name)


class _BufferPool:
    """Byte buffers for zero-copy sends; one is reused once zmq reports it sent."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._in_flight: deque[tuple[bytearray, zmq.MessageTracker]] = deque()

    def take(self) -> bytearray:
        if self._in_flight and self._in_flight[0][1].done:
            return self._in_flight.popleft()[0]
        return bytearray()

    def give(self, buffer: bytearray, tracker: zmq.MessageTracker) -> None:
        self._in_flight.append((buffer, tracker))
        if len(self._in_flight) > self._capacity:
            self._in_flight.popleft()  # still in flight: zmq keeps it alive, we just forget it


class OutputThread(threading.Thread):
    def __init__(
        self,
        ctx: zmq.Context,
        addresses: list[str],
        output_queue: queue.Queue,
        engine_index: int,
        heartbeat_interval_s: float,
        on_failure: Callable[[str], None],
    ) -> None:
        super().__init__(name="EngineCoreOutput", daemon=True)
        self._on_failure = on_failure
        self._ctx = ctx
        self._addresses = addresses
        self._output_queue = output_queue
        self._engine_index = engine_index
        self._heartbeat_interval_s = heartbeat_interval_s
        # Set by the busy loop every turn; heartbeats carry it (engine-level metrics stay fresh).
        self.latest_stats: SchedulerStats | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._buffers = _BufferPool(capacity=len(addresses) + 1)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then exit (not a death: no ENGINE_CORE_DEAD)."""
        self._output_queue.put(STOP_OUTPUT)
        if self.is_alive():
            self.join(timeout_s)

    def run(self) -> None:
        sockets = [
            zmq_channel.make_socket(
                self._ctx, zmq.PUSH, address, bind=False, linger_ms=DEAD_LINGER_MS
            )
            for address in self._addresses
        ]
        try:
            self._serve(sockets)
        except Exception as exc:
            logger.exception("Engine output thread failed")
            self._on_failure(f"output thread failed: {exc!r}")
        finally:
            for sock in sockets:
                sock.close()  # lingers up to DEAD_LINGER_MS so the last frames arrive

    def _serve(self, sockets: list[zmq.Socket]) -> None:
        last_sent = [time.monotonic()] * len(sockets)
        while True:
            wait_s = max(0.0, min(last_sent) + self._heartbeat_interval_s - time.monotonic())
            try:
                item = self._output_queue.get(timeout=wait_s)
            except queue.Empty:
                self._send_heartbeats(sockets, last_sent)
                continue
            if item is STOP_OUTPUT:
                return
            if item == ENGINE_CORE_DEAD:
                for sock in sockets:
                    sock.send(ENGINE_CORE_DEAD)
                logger.info("Sent ENGINE_CORE_DEAD to %d gateway(s)", len(sockets))
                return
            client_index, outputs = item
            if not 0 <= client_index < len(sockets):
                logger.warning(
                    "Dropped outputs for unknown gateway (client_index %s)", client_index
                )
                continue
            self._send(sockets[client_index], outputs)
            last_sent[client_index] = time.monotonic()

    def _send_heartbeats(self, sockets: list[zmq.Socket], last_sent: list[float]) -> None:
        now = time.monotonic()
        for index, sock in enumerate(sockets):
            if now - last_sent[index] >= self._heartbeat_interval_s:
                heartbeat = EngineCoreOutputs(
                    engine_index=self._engine_index,
                    timestamp_ns=clock.monotonic_ns(),
                    scheduler_stats=self.latest_stats,
                    heartbeat=True,
                )
                self._send(sock, heartbeat)
                last_sent[index] = now

    def _send(self, sock: zmq.Socket, outputs: EngineCoreOutputs) -> None:
        buffer = self._buffers.take()
        self._encoder.encode_into(outputs, buffer)
        tracker = sock.send(buffer, copy=False, track=True)
        self._buffers.give(buffer, tracker)


def send_engine_dead_directly(ctx: zmq.Context, addresses: list[str]) -> None:
    """ENGINE_CORE_DEAD from a fresh PUSH per gateway, for a death before the output thread runs."""
    for address in addresses:
        sock = zmq_channel.make_socket(ctx, zmq.PUSH, address, bind=False, linger_ms=DEAD_LINGER_MS)
        sock.send(ENGINE_CORE_DEAD)
        sock.close()
    logger.info("Sent ENGINE_CORE_DEAD to %d gateway(s)", len(addresses))

"""The engine core's output thread: encodes each step's outputs and sends them to the gateways
(wire 1), heartbeats while a gateway hears nothing else, and ENGINE_CORE_DEAD as its last act.

It connects one PUSH per gateway (``GatewayChange`` items on the output queue add or drop one)
and encodes into reused buffers. ``send_engine_dead_directly`` says ENGINE_CORE_DEAD for an
engine that dies before the thread runs. The shared parts and the input thread: ``io_threads``.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from switchboard.engine import clock
from switchboard.engine.io_threads import GatewayChange, GatewaySocketThread
from switchboard.wire import zmq_channel
from switchboard.wire.codec import ENGINE_CORE_OUTPUTS
from switchboard.wire.curve import CurveKeys
from switchboard.wire.engine_msgs import ENGINE_CORE_DEAD, EngineCoreOutputs, SchedulerStats

logger = logging.getLogger(__name__)

DEAD_LINGER_MS = 4000  # a PUSH keeps unsent frames this long at close, so the last word arrives
STOP_OUTPUT = None  # output-queue sentinel: flush and exit without declaring death


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


class OutputThread(GatewaySocketThread):
    def __init__(
        self,
        ctx: zmq.SyncContext,
        addresses: list[str],
        output_queue: queue.Queue[Any],
        engine_index: int,
        heartbeat_interval_s: float,
        on_failure: Callable[[str], None],
        engine_id: str = "",
        curve: CurveKeys | None = None,
        exit_after_frozen_s: float = 0.0,
    ) -> None:
        # Closing lingers up to DEAD_LINGER_MS (set on each PUSH) so the last frames arrive.
        super().__init__("EngineCoreOutput", "output", ctx, addresses, on_failure, None, curve)
        self._exit_after_frozen_s = exit_after_frozen_s
        self._output_queue = output_queue
        self._engine_index = engine_index
        self._engine_id = engine_id
        self._last_sent: dict[int, float] = {}
        self._heartbeat_interval_s = heartbeat_interval_s
        # Set by the busy loop every turn; heartbeats carry it (engine-level metrics stay fresh).
        self.latest_stats: SchedulerStats | None = None
        self._buffers = _BufferPool(capacity=len(addresses) + 1)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then exit (not a death: no ENGINE_CORE_DEAD)."""
        self._output_queue.put(STOP_OUTPUT)
        if self.is_alive():
            self.join(timeout_s)

    def _run(self) -> None:
        for client_index, address in enumerate(self._addresses):
            self._change(GatewayChange(client_index, address))
        self._serve()

    def _change(self, change: GatewayChange) -> None:
        old = self._sockets.pop(change.client_index, None)
        self._last_sent.pop(change.client_index, None)
        if old is not None:
            old.close(linger=0)  # the gateway is gone: nobody will read what is queued
        if change.address is not None:
            self._sockets[change.client_index] = zmq_channel.make_socket(
                self._ctx,
                zmq.PUSH,
                change.address,
                bind=False,
                linger_ms=DEAD_LINGER_MS,
                curve=self._curve,
            )
            self._last_sent[change.client_index] = time.monotonic()

    def _serve(self) -> None:
        tick = time.monotonic()
        while True:
            oldest = min(self._last_sent.values(), default=time.monotonic())
            wait_s = max(0.0, oldest + self._heartbeat_interval_s - time.monotonic())
            try:
                item = self._output_queue.get(timeout=wait_s)
            except queue.Empty:
                tick = self._check_not_frozen(tick)
                self._send_heartbeats()
                continue
            tick = self._check_not_frozen(tick)
            if item is STOP_OUTPUT:
                return
            if isinstance(item, GatewayChange):
                self._change(item)
                continue
            if item == ENGINE_CORE_DEAD:
                frames = zmq_channel.engine_dead_frames(self._engine_index, self._engine_id)
                for sock in self._sockets.values():
                    sock.send_multipart(frames)
                logger.info("Sent ENGINE_CORE_DEAD to %d gateway(s)", len(self._sockets))
                return
            client_index, outputs = item
            target = self._sockets.get(client_index)
            if target is None:
                logger.warning(
                    "Dropped outputs for unknown gateway (client_index %s)", client_index
                )
                continue
            if outputs.scheduler_stats is not None:
                outputs.exports_engine_stats = self._exports_engine_stats(client_index)
            self._send(target, outputs)
            self._last_sent[client_index] = time.monotonic()

    def _check_not_frozen(self, last_tick: float) -> float:
        """This thread wakes at least every heartbeat interval; a far longer gap means the
        whole process was stopped (SIGSTOP) past the gateways' heartbeat timeout: they have
        declared this engine dead and failed its requests over, so it must not carry on as if
        nothing happened. Raising fails the engine (IO_THREAD_FAILED); the supervisor restarts
        it."""
        now = time.monotonic()
        gap = now - last_tick
        if self._exit_after_frozen_s and gap > self._exit_after_frozen_s:
            raise RuntimeError(
                f"the engine was frozen for {gap:.1f}s, past the gateways' heartbeat timeout "
                f"({self._exit_after_frozen_s:g}s): they declared it dead; exiting to be restarted"
            )
        return now

    def _send_heartbeats(self) -> None:
        now = time.monotonic()
        last_sent = self._last_sent
        for index, sock in self._sockets.items():
            if now - last_sent[index] >= self._heartbeat_interval_s:
                stats = self.latest_stats
                heartbeat = EngineCoreOutputs(
                    engine_index=self._engine_index,
                    timestamp_ns=clock.monotonic_ns(),
                    scheduler_stats=stats,
                    heartbeat=True,
                    exports_engine_stats=stats is not None and self._exports_engine_stats(index),
                )
                self._send(sock, heartbeat)
                last_sent[index] = now

    def _exports_engine_stats(self, client_index: int) -> bool:
        """Exactly one gateway of those this engine talks to exports its engine-level metrics:
        the lowest client_index (gateway 0 on one machine; on Kubernetes, where indices are
        random, whichever is lowest, and the next one within a discovery round if it goes)."""
        return client_index == min(self._sockets)

    def _send(self, sock: zmq.SyncSocket, outputs: EngineCoreOutputs) -> None:
        buffer = self._buffers.take()
        ENGINE_CORE_OUTPUTS.encode_into(outputs, buffer)
        tracker = sock.send(buffer, copy=False, track=True)
        self._buffers.give(buffer, tracker)


def send_engine_dead_directly(
    ctx: zmq.SyncContext,
    addresses: list[str],
    engine_index: int = 0,
    engine_id: str = "",
    curve: CurveKeys | None = None,
) -> None:
    """ENGINE_CORE_DEAD from a fresh PUSH per gateway, for a death before the output thread runs."""
    frames = zmq_channel.engine_dead_frames(engine_index, engine_id)
    for address in addresses:
        sock = zmq_channel.make_socket(
            ctx, zmq.PUSH, address, bind=False, linger_ms=DEAD_LINGER_MS, curve=curve
        )
        sock.send_multipart(frames)
        sock.close()
    logger.info("Sent ENGINE_CORE_DEAD to %d gateway(s)", len(addresses))

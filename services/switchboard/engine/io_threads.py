"""The engine core's two I/O threads: all socket work and (de)serialisation of wire 1.

The busy loop never touches a socket; these threads hand work to it through in-memory queues,
so decoding a request and encoding a step's outputs overlap with the forward pass.

* :class:`InputThread` connects one DEALER per gateway, sends ``EngineReady`` first on each
  (a ROUTER can only address peers it has heard from), then decodes request frames and
  prepares each ADD (builds the scheduler's request, hashes its prompt blocks) before queueing
  it. A frame that breaks the contract is logged and dropped: a bad peer never kills the engine.
  When a gateway's connection drops (its process died) it says so through ``on_gateway_lost``
  (the busy loop aborts that gateway's requests: nobody reads their outputs any more); when
  the DEALER connects again (the gateway restarted at the same address) it sends READY again,
  which re-admits the engine there.
* Either thread failing is fatal: it reports through ``on_failure`` and the busy loop raises.
* :class:`OutputThread` connects one PUSH per gateway and sends ``(client_index,
  EngineCoreOutputs)`` items, encoding into reused buffers; it sends heartbeats when a gateway
  has heard nothing for ``heartbeat_interval_s``, and on ``ENGINE_CORE_DEAD`` sends that
  literal frame to every gateway as its last act.

Input queue items are ``(RequestType, payload)``: ADD -> prepared request, ABORT -> list of
request ids (also put on the aborts queue), UTILITY -> ``UtilityCall``.

Gateways are keyed by ``client_index``. One machine: the launcher's address lists, index i =
list position. Engines on other hosts: gateways come and go (``engine/handshake.py`` finds
them), through :meth:`InputThread.add_gateway` / ``remove_gateway`` and :class:`GatewayChange`
items on the output queue, so each thread alone owns its sockets.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from switchboard.common.log_limits import WarningLimit
from switchboard.engine import clock
from switchboard.wire import zmq_channel
from switchboard.wire.codec import ENGINE_CORE_OUTPUTS, ENGINE_READY
from switchboard.wire.connection_events import ConnectionEvents, PeerChange
from switchboard.wire.curve import CurveKeys
from switchboard.wire.engine_msgs import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    RequestType,
    SchedulerStats,
)

logger = logging.getLogger(__name__)
limited = WarningLimit(logger)

POLL_INTERVAL_MS = 100  # how often an idle input thread checks whether it should stop
DEAD_LINGER_MS = 4000  # a PUSH keeps unsent frames this long at close, so the last word arrives
STOP_OUTPUT = None  # output-queue sentinel: flush and exit without declaring death

# The busy loop's input queue: (RequestType, payload) items, see the module docstring (the
# engine core adds its own failure kinds, strings).
InputQueue = queue.Queue[tuple[RequestType | str, Any]]
# Returns the item to queue for the busy loop, or None when the request was rejected.
PrepareAdd = Callable[[EngineCoreRequest], Any | None]


@dataclass(frozen=True)
class GatewayChange:
    """Output-queue item: connect a PUSH to a gateway's PULL (``address``) or drop it (None)."""

    client_index: int
    address: str | None


class _GatewaySocketThread(threading.Thread):
    """An I/O thread that owns one socket per gateway; its failure is fatal to the engine:
    logged, then reported through ``on_failure`` (the busy loop raises)."""

    def __init__(
        self,
        name: str,
        role: str,
        ctx: zmq.SyncContext,
        addresses: list[str],
        on_failure: Callable[[str], None],
        close_linger_ms: int | None,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._curve = curve  # CURVE client keys toward the gateways (None: plain)
        self._role = role
        self._ctx = ctx
        self._addresses = addresses
        self._on_failure = on_failure
        self._close_linger_ms = close_linger_ms  # None: the socket's own LINGER option
        self._sockets: dict[int, zmq.SyncSocket] = {}

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:
            logger.exception("Engine %s thread failed", self._role)
            self._on_failure(f"{self._role} thread failed: {exc!r}")
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=self._close_linger_ms)

    def _run(self) -> None:
        raise NotImplementedError


class InputThread(_GatewaySocketThread):
    def __init__(
        self,
        ctx: zmq.SyncContext,
        addresses: list[str],
        identity: bytes,
        make_ready: Callable[[], EngineReady],
        prepare_add: PrepareAdd,
        input_queue: InputQueue,
        aborts_queue: queue.Queue[list[str]],
        on_failure: Callable[[str], None],
        curve: CurveKeys | None = None,
        on_gateway_lost: Callable[[int], None] = lambda client_index: None,
    ) -> None:
        super().__init__("EngineCoreInput", "input", ctx, addresses, on_failure, 0, curve)
        self._identity = identity
        self._make_ready = make_ready
        self._prepare_add = prepare_add
        self._input_queue = input_queue
        self._aborts_queue = aborts_queue
        self._on_gateway_lost = on_gateway_lost
        self._stop_event = threading.Event()
        self._changes: queue.Queue[tuple[int, str | None]] = queue.Queue()
        self._poller = zmq.Poller()
        # Each DEALER's connection events, by the monitor socket that carries them.
        self._watches: dict[zmq.SyncSocket, tuple[int, ConnectionEvents[zmq.SyncSocket]]] = {}

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout_s)

    def _close_sockets(self) -> None:
        for _, events in self._watches.values():
            events.close()
        self._watches.clear()
        super()._close_sockets()

    def add_gateway(self, client_index: int, address: str) -> None:
        """Connect a DEALER to one more gateway's ROUTER and send it READY (thread-safe)."""
        self._changes.put((client_index, address))

    def remove_gateway(self, client_index: int) -> None:
        self._changes.put((client_index, None))

    def _run(self) -> None:
        for client_index, address in enumerate(self._addresses):
            self._connect(client_index, address)
        if self._addresses:
            logger.info("Sent READY to %d gateway(s)", len(self._addresses))
        self._serve()

    def _connect(self, client_index: int, address: str) -> None:
        self._disconnect(client_index)
        events: ConnectionEvents[zmq.SyncSocket] = ConnectionEvents()
        try:
            sock = zmq_channel.make_socket(
                self._ctx,
                zmq.DEALER,
                address,
                bind=False,
                identity=self._identity,
                curve=self._curve,
                before_connect=events.watch,
            )
        except BaseException:
            events.close()  # an open monitor would hold the context's term() forever
            raise
        sock.send(ENGINE_READY.encode(self._make_ready()))
        self._sockets[client_index] = sock
        self._poller.register(sock, zmq.POLLIN)
        self._watches[events.monitor] = (client_index, events)
        self._poller.register(events.monitor, zmq.POLLIN)

    def _disconnect(self, client_index: int) -> None:
        sock = self._sockets.pop(client_index, None)
        if sock is None:
            return
        for monitor, (index, events) in list(self._watches.items()):
            if index == client_index:
                self._poller.unregister(monitor)
                events.close()
                del self._watches[monitor]
        self._poller.unregister(sock)
        sock.close(linger=0)

    def _apply_changes(self) -> None:
        while True:
            try:
                client_index, address = self._changes.get_nowait()
            except queue.Empty:
                return
            if address is None:
                self._disconnect(client_index)
                logger.info("Disconnected from gateway %d", client_index)
                self._on_gateway_lost(client_index)
            else:
                self._connect(client_index, address)
                logger.info("Sent READY to gateway %d at %s", client_index, address)

    def _serve(self) -> None:
        while not self._stop_event.is_set():
            self._apply_changes()
            for sock, _ in self._poller.poll(POLL_INTERVAL_MS):
                watch = self._watches.get(sock)
                if watch is None:
                    self._handle_frames(sock.recv_multipart(copy=False))
                else:
                    client_index, events = watch
                    self._peer_changed(client_index, events.change(sock.recv_multipart()))

    def _peer_changed(self, client_index: int, change: PeerChange | None) -> None:
        sock = self._sockets[client_index]
        if change is PeerChange.LOST:
            # What the gateway sent before it went is taken in first, then aborted with the rest.
            while sock.poll(0):
                self._handle_frames(sock.recv_multipart(copy=False))
            logger.info(
                "Gateway %d went away (stopped or died): aborting its requests; READY goes "
                "again when it is back",
                client_index,
            )
            self._on_gateway_lost(client_index)
        elif change is PeerChange.BACK:
            sock.send(ENGINE_READY.encode(self._make_ready()))
            logger.info("Gateway %d is back: sent READY again", client_index)

    def _handle_frames(self, frames: list[zmq.Frame]) -> None:
        try:
            request_type, body, _tensor_frames = zmq_channel.parse_request_frames(
                [frame.buffer for frame in frames]
            )
        except zmq_channel.BadFrame as exc:
            limited.warning("bad request frame", "Dropped a bad request frame: %s", exc)
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
            limited.warning(
                "bad request frame",
                "Dropped a %s frame: not handled by this engine",
                request_type.name,
            )


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


class OutputThread(_GatewaySocketThread):
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

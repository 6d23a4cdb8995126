"""The engine core's two I/O threads: all socket work and (de)serialisation of wire 1.

This module holds what both share and the input thread; the output thread is ``output_thread``.

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
* :class:`OutputThread` (``output_thread``) connects one PUSH per gateway and sends
  ``(client_index, EngineCoreOutputs)`` items, encoding into reused buffers; it sends heartbeats
  when a gateway has heard nothing for ``heartbeat_interval_s``, and on ``ENGINE_CORE_DEAD``
  sends that literal frame to every gateway as its last act.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from switchboard.common.log_limits import WarningLimit
from switchboard.wire import zmq_channel
from switchboard.wire.codec import ENGINE_READY
from switchboard.wire.connection_events import ConnectionEvents, PeerChange
from switchboard.wire.curve import CurveKeys
from switchboard.wire.engine_msgs import (
    EngineCoreRequest,
    EngineReady,
    RequestType,
)

logger = logging.getLogger(__name__)
limited = WarningLimit(logger)

POLL_INTERVAL_MS = 100  # how often an idle input thread checks whether it should stop

# The busy loop's input queue: (RequestType, payload) items, see the module docstring (the
# engine core adds its own failure kinds, strings).
InputItem = tuple[RequestType | str, Any]  # (kind, payload) for the busy loop
InputQueue = queue.Queue[InputItem]
# Returns the item to queue for the busy loop, or None when the request was rejected.
PrepareAdd = Callable[[EngineCoreRequest], Any | None]


@dataclass(frozen=True)
class GatewayChange:
    """Output-queue item: connect a PUSH to a gateway's PULL (``address``) or drop it (None)."""

    client_index: int
    address: str | None


class GatewaySocketThread(threading.Thread):
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


class InputThread(GatewaySocketThread):
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

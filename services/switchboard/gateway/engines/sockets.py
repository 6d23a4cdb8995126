"""Wire 1's sockets, gateway side (``zmq.asyncio``), with CURVE when a keys directory is given.

The gateway binds a ROUTER (requests out) and a PULL (outputs in). An engine core connects a
DEALER and a PUSH and speaks first: its READY arrives on the ROUTER as ``[identity, body]``,
and from then on the gateway addresses it as ``[identity, type byte, body]``. Outputs of all
engines arrive on the PULL. Engines on other hosts: ``handshake_address`` binds the fixed
handshake port that tells them the data sockets' ports.

Sends never block: the sockets have no high-water mark, so ``send_multipart`` completes at
once, which lets an abort be sent from a ``finally`` block of a cancelled stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any, cast

import zmq
import zmq.asyncio

from switchboard.common.log_limits import WarningLimit
from switchboard.gateway.engines.handshake_server import HandshakeServer, port_of
from switchboard.gateway.engines.pool import LoadSubscriber
from switchboard.gateway.engines.types import EngineHandle
from switchboard.wire import curve, zmq_channel
from switchboard.wire.curve import CurveKeys
from switchboard.wire.engine_msgs import (
    EngineCoreOutputs,
    EngineDead,
    EngineReady,
    GatewayAddresses,
    RequestType,
)

logger = logging.getLogger(__name__)
limited = WarningLimit(logger)  # what arrives may come from anyone who reaches the ports


class EngineSockets:
    def __init__(
        self,
        input_address: str,
        output_address: str,
        *,
        client_index: int,
        coordinator_publish_address: str,
        handshake_address: str,
        curve_keys_dir: str,
        on_send_failed: Callable[[EngineHandle, str], None],
    ) -> None:
        self.input_address = input_address
        self.output_address = output_address
        self.client_index = client_index
        self.coordinator_publish_address = coordinator_publish_address
        self.handshake_address = handshake_address
        self.curve_keys_dir = curve_keys_dir
        self.gateway_id = f"Gateway_{client_index}-{uuid.uuid4().hex[:8]}"
        self._on_send_failed = on_send_failed  # the engine is gone (marks it dead)
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._ipc_paths: list[str] = []
        self._authenticator: Any = None  # the ZAP thread when CURVE is on
        self._key_warnings: set[tuple[str, str]] = set()

    # -- lifecycle -----------------------------------------------------------------------------

    def _security(self) -> tuple[CurveKeys | None, CurveKeys | None]:
        """(the data and handshake sockets' server keys, the coordinator SUB's client keys);
        both None without a keys directory. Starts the ZAP thread when there is one."""
        addresses = (self.input_address, self.output_address, self.handshake_address)
        tcp = any(a.startswith("tcp://") for a in addresses)
        if not self.curve_keys_dir:
            if tcp or self.coordinator_publish_address.startswith("tcp://"):
                curve.warn_unauthenticated("gateway")
            return None, None
        keys_dir = self.curve_keys_dir
        server = curve.server_keys(keys_dir, curve.GATEWAY)
        subscriber = None
        if self.coordinator_publish_address:
            subscriber = curve.client_keys(keys_dir, curve.GATEWAY, curve.COORDINATOR)
        assert self._ctx is not None
        allowed = os.path.join(keys_dir, curve.ALLOWED_ENGINES)
        self._authenticator = curve.start_authenticator(self._ctx, [allowed])
        return server, subscriber

    def bind(self, engines: Callable[[], dict[int, EngineHandle]]) -> list[asyncio.Task]:
        """Bind the sockets; return the tasks of the handshake port and of the coordinator's
        load reports (which keep ``engines()``' loads fresh), where configured."""
        for address in (self.input_address, self.output_address):
            if address.startswith("ipc://"):
                zmq_channel.check_private_dir(os.path.dirname(address.removeprefix("ipc://")))
        self._ctx = zmq.asyncio.Context()
        server, subscriber = self._security()
        self._router = zmq_channel.make_socket(
            self._ctx, zmq.ROUTER, self.input_address, bind=True, curve=server
        )
        # Sending to a peer that is gone raises instead of dropping the message silently.
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted engine reconnects with the identity of its dead predecessor (its DP rank):
        # the new connection takes the identity over instead of being refused. With CURVE an
        # engine's identity is new at each start, and a second peer claiming one in use (another
        # admitted key) is refused rather than handed the engine's requests.
        if server is None:
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._pull = zmq_channel.make_socket(
            self._ctx, zmq.PULL, self.output_address, bind=True, curve=server
        )
        self.input_address = zmq_channel.bound_address(self._router)
        self.output_address = zmq_channel.bound_address(self._pull)
        self._ipc_paths = [
            a.removeprefix("ipc://")
            for a in (self.input_address, self.output_address)
            if a.startswith("ipc://")
        ]
        tasks = []
        if self.coordinator_publish_address:
            loads = LoadSubscriber(
                self._ctx, self.coordinator_publish_address, engines, curve=subscriber
            )
            tasks.append(asyncio.create_task(loads.run(), name="engine-load-subscriber"))
        if self.handshake_address:
            answer = GatewayAddresses(
                gateway_id=self.gateway_id,
                client_index=self.client_index,
                input_port=port_of(self.input_address),
                output_port=port_of(self.output_address),
            )
            handshake = HandshakeServer(self._ctx, self.handshake_address, answer, curve=server)
            self.handshake_address = handshake.address
            tasks.append(asyncio.create_task(handshake.run(), name="engine-handshake"))
        logger.info(
            "wire 1: ROUTER bound at %s, PULL bound at %s; waiting for engine READY",
            self.input_address,
            self.output_address,
        )
        return tasks

    def close(self) -> None:
        for sock in (self._router, self._pull):
            if sock is not None:
                sock.close(linger=0)
        for path in self._ipc_paths:  # libzmq leaves the socket files it bound behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._ipc_paths = []
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if self._ctx is not None:
            self._ctx.term()
        self._router = self._pull = self._ctx = None
        logger.info("wire 1: sockets closed")

    # -- out -----------------------------------------------------------------------------------

    def send(self, engine: EngineHandle, request_type: RequestType, body: Any) -> bool:
        """Send one request frame; False (and ``on_send_failed``) if it cannot go out."""
        assert self._router is not None
        frames = [engine.identity, *zmq_channel.request_frames(request_type, body)]
        # A Future (pyzmq's stubs say only Awaitable): done at once unless the send is queued.
        sent = cast("asyncio.Future[Any]", self._router.send_multipart(frames, copy=False))
        if not sent.done():  # queued behind an earlier send (never with HWM 0): check later
            sent.add_done_callback(lambda f: self._check_late_send(f, engine))
            return True
        if sent.exception() is not None:
            self._on_send_failed(engine, f"a send to it failed ({sent.exception()})")
            return False
        return True

    def _check_late_send(self, sent: asyncio.Future, engine: EngineHandle) -> None:
        if not sent.cancelled() and sent.exception() is not None:
            self._on_send_failed(engine, f"a send to it failed ({sent.exception()})")

    # -- in ------------------------------------------------------------------------------------

    async def receive_ready(self, on_ready: Callable[[bytes, EngineReady], None]) -> None:
        """Hand each engine's READY (with the identity to address it by) to ``on_ready``."""
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart(copy=False)
            if len(frames) != 2:
                limited.warning(
                    "bad READY",
                    "dropped a ROUTER message of %d frames (want 2: READY)",
                    len(frames),
                )
                continue
            identity, body = frames[0].bytes, frames[1]
            try:
                ready = zmq_channel.parse_ready(body.buffer)
            except zmq_channel.BadFrame as exc:
                limited.warning("bad READY", "dropped a bad READY from %r: %s", identity, exc)
                continue
            if self._key_may_be(body, ready.data_parallel_rank, "READY"):
                on_ready(identity, ready)

    async def receive_outputs(
        self,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_engine_dead: Callable[[EngineDead | None], None],
    ) -> None:
        """Hand each engine step's outputs to ``on_outputs`` and each ENGINE_CORE_DEAD (None when
        it names no engine) to ``on_engine_dead``.

        The PULL is read from a reader callback on its file descriptor, every frame that is
        there at once until the queue is empty (libzmq signals the descriptor only when the
        queue goes from empty to not): pyzmq's awaitable receive costs a future, a poll of the
        socket's events and several flag-enum operations for each message, and a message
        arrives per engine step."""
        assert self._pull is not None
        pull: zmq.Socket[bytes] = zmq.Socket.shadow(self._pull.underlying)
        loop = asyncio.get_running_loop()
        failed: asyncio.Future[None] = loop.create_future()

        def drain() -> None:
            try:
                while True:
                    try:
                        received = pull.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        return
                    self._receive(received, on_outputs, on_engine_dead)
            except Exception as exc:  # the task ends with it, as an awaited receive would
                if not failed.done():
                    failed.set_exception(exc)

        fd = cast(int, pull.getsockopt(zmq.FD))
        loop.add_reader(fd, drain)
        try:
            drain()  # what came before the reader was added
            await failed
        finally:
            loop.remove_reader(fd)

    def _receive(
        self,
        received: list[zmq.Frame],
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_engine_dead: Callable[[EngineDead | None], None],
    ) -> None:
        frames = [frame.buffer for frame in received]
        try:
            outputs, _ = zmq_channel.parse_output_frames(frames)
        except zmq_channel.BadFrame as exc:
            limited.warning("bad output frame", "dropped a bad output frame: %s", exc)
            return
        if outputs is None:
            dead = zmq_channel.parse_engine_dead(frames)
            rank = None if dead is None else dead.engine_index
            if self._key_may_be(received[0], rank, "ENGINE_CORE_DEAD"):
                on_engine_dead(dead)
        elif self._key_may_be(received[0], outputs.engine_index, "outputs"):
            on_outputs(outputs)

    def _key_may_be(self, frame: zmq.Frame, rank: int | None, what: str) -> bool:
        """CURVE on: a key named for a rank (``engine-<r>``) speaks for that rank only (a
        message naming no rank, the one-frame ENGINE_CORE_DEAD, needs a key named for none).
        CURVE off: anyone may."""
        if not self.curve_keys_dir:
            return True
        try:
            user_id = str(frame.get("User-Id"))
        except zmq.ZMQError:
            user_id = ""
        key_rank = curve.rank_of_key(user_id)
        if key_rank is None or key_rank == rank:
            return True
        if (user_id, what) not in self._key_warnings:  # once: outputs come every step
            self._key_warnings.add((user_id, what))
            logger.warning(
                "dropped %s for DP rank %s from the key %s (that key is rank %d's)",
                what,
                rank,
                user_id,
                key_rank,
            )
        return False

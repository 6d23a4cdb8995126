"""The gateway's fixed TCP handshake port, for engine cores on other hosts.

A gateway binds its data sockets (ROUTER for requests, PULL for outputs) on port 0, so their
ports are only known once bound. Engines know one fixed port: they say ``GatewayHello`` to it
and get ``GatewayAddresses`` back (the two data ports, this gateway's ``client_index`` and a
``gateway_id`` that changes when the gateway restarts), then connect and send READY on the
ROUTER as on one machine::

    engine DEALER ──[GatewayHello]──────> ROUTER (handshake port)   engine ─DEALER─> data ROUTER
                  <─[GatewayAddresses]──                            engine ─PUSH──> data PULL

Engines repeat the hello every discovery round; answering is stateless and cheap.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from switchboard.common.log_limits import WarningLimit
from switchboard.wire import zmq_channel
from switchboard.wire.codec import GATEWAY_ADDRESSES, GATEWAY_HELLO, DecodeError
from switchboard.wire.curve import CurveKeys
from switchboard.wire.engine_msgs import GatewayAddresses

logger = logging.getLogger(__name__)
limited = WarningLimit(logger)  # anyone who reaches the port can send anything


def port_of(address: str) -> int:
    """The port of a bound ``tcp://host:port`` address."""
    return int(address.rsplit(":", 1)[1])


class HandshakeServer:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        answer: GatewayAddresses,
        curve: CurveKeys | None = None,
    ) -> None:
        self._answer = GATEWAY_ADDRESSES.encode(answer)
        self._sock = zmq_channel.make_socket(ctx, zmq.ROUTER, address, bind=True, curve=curve)
        self.address = zmq_channel.bound_address(self._sock)
        self._engines_seen: dict[int, str] = {}
        logger.info(
            "handshake port %s: engines get ROUTER port %d, PULL port %d (client_index %d)",
            self.address,
            answer.input_port,
            answer.output_port,
            answer.client_index,
        )

    async def run(self) -> None:
        try:
            while True:
                frames = await self._sock.recv_multipart()
                if len(frames) != 2:
                    limited.warning(
                        "bad GatewayHello", "dropped a handshake message of %d frames", len(frames)
                    )
                    continue
                identity, body = frames
                try:
                    hello = GATEWAY_HELLO.decode(body)
                except DecodeError as exc:
                    limited.warning("bad GatewayHello", "dropped a bad GatewayHello: %s", exc)
                    continue
                if self._engines_seen.get(hello.engine_index) != hello.engine_id:
                    self._engines_seen[hello.engine_index] = hello.engine_id
                    logger.info(
                        "hello from engine %s (DP rank %d): sent it our ports",
                        hello.engine_id,
                        hello.engine_index,
                    )
                await self._sock.send_multipart([identity, self._answer])
        except asyncio.CancelledError:
            self._sock.close(linger=0)
            raise

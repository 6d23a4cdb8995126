"""Whether the peer of a connecting socket went away, and whether it came back.

A connecting ZeroMQ socket reconnects on its own when its peer restarts at the same address
(the supervisor restarts a dead gateway or coordinator there), but nothing in the messages says
so: the engine must send READY again to a restarted gateway (its ROUTER has never heard of the
engine) and abort the requests of the dead one, and a gateway must stop trusting the loads of a
dead coordinator. The socket's monitor says it: one ``LOST`` when a working connection drops
(the peer's process died or closed the socket), one ``BACK`` when a connection completes its
handshake after that. A connection whose handshake fails (a CURVE key the peer does not admit)
never worked: its drop is no loss, and the retries that follow say nothing.
"""

from __future__ import annotations

import enum
from typing import Any, Generic, TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
# A socket of a plain context (zmq.SyncSocket) or of an asyncio one (zmq.asyncio.Socket).
S = TypeVar("S", bound="zmq.Socket[Any]")


class PeerChange(enum.Enum):
    LOST = "lost"
    BACK = "back"


class ConnectionEvents(Generic[S]):
    """The monitor of one connecting socket (a plain or an asyncio one: ``monitor`` is of the
    same kind). Attach it before the socket connects (``zmq_channel.make_socket(...,
    before_connect=events.watch)``), or a peer that goes away at once goes unseen; then poll
    ``monitor`` and hand what it received to :meth:`change`."""

    def __init__(self) -> None:
        self._sock: S | None = None
        self._monitor: S | None = None
        self._up = False  # a connection has completed its handshake and not dropped since
        self._lost = False  # one that had dropped, and none has completed a handshake since

    def watch(self, sock: S) -> None:
        self._sock = sock
        self._monitor = sock.get_monitor_socket(_EVENTS)

    @property
    def monitor(self) -> S:
        assert self._monitor is not None, "watch() a socket first"
        return self._monitor

    def change(self, frames: list[Any]) -> PeerChange | None:
        """What one monitor message (its frames) means: LOST when a working connection drops,
        BACK when the next one completes its handshake; None for the first connection and for
        connections that never worked."""
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_DISCONNECTED and self._up:
            self._up, self._lost = False, True
            return PeerChange.LOST
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._up = True
            if self._lost:
                self._lost = False
                return PeerChange.BACK
        return None

    def close(self) -> None:
        """Stop monitoring (before the socket itself is closed)."""
        if self._sock is not None and not self._sock.closed:
            self._sock.disable_monitor()
        if self._monitor is not None:
            self._monitor.close(linger=0)

"""Wire 2 transport, the ZeroMQ half of the shared-memory ring (see ``shm_ring``).

Two sockets join the ring's writer to its readers, both ``ipc://`` paths under the run dir:

    notify        writer XPUB --(1 byte per enqueue)--> reader SUB (CONFLATE: keeps the newest)
                  wakes a reader that found nothing during its short spin and went to sleep.
    side channel  writer XPUB --(whole message)-------> reader SUB (unbounded: nothing dropped)
                  carries a message larger than a chunk; its chunk only marks its place in order.

Both are XPUBs with ``XPUB_VERBOSE`` so that the writer sees *every* reader's subscription:
:meth:`WriterSockets.wait_for_subscribers` returns once all readers' subscriptions have reached
both sockets, after which nothing published can be lost to ZeroMQ's slow-joiner effect.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

# Messages at least this large are handed to ZeroMQ without a copy when they are immutable.
_ZERO_COPY_MIN_BYTES = 64 * 1024
# How long closing the writer waits for side-channel messages still queued to readers.
_SIDE_LINGER_MS = 1000
# A reader that never sleeps still lets libzmq process its command queue this often.
NOTIFY_DRAIN_INTERVAL_S = 2.0
_SUBSCRIBE = 1


def _ipc_path(address: str) -> str | None:
    return address[len("ipc://") :] if address.startswith("ipc://") else None


class WriterSockets:
    """The writer's two XPUB sockets, bound; owns its own ZeroMQ context."""

    def __init__(self, notify_address: str, side_channel_address: str) -> None:
        self._ctx = zmq.Context(io_threads=1)
        self.notify_address = notify_address
        self.side_channel_address = side_channel_address
        self._notify = self._xpub(notify_address, linger_ms=0)
        self._side = self._xpub(side_channel_address, linger_ms=_SIDE_LINGER_MS)
        # Subscriptions seen so far, kept across calls: a caller may wait in short slices.
        self._subscriptions = {self._notify: 0, self._side: 0}
        self._closed = False

    def _xpub(self, address: str, *, linger_ms: int) -> zmq.SyncSocket:
        sock = self._ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # pass up every reader's subscription, not just one
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.bind(address)
        return sock

    def wait_for_subscribers(self, n_readers: int, deadline: float) -> bool:
        """Block until ``n_readers`` subscriptions arrived on both sockets; False at deadline."""
        poller = zmq.Poller()
        for sock in self._subscriptions:
            poller.register(sock, zmq.POLLIN)
        while min(self._subscriptions.values()) < n_readers:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return False
            for sock, _ in poller.poll(remaining_ms):
                if sock.recv()[:1] == bytes([_SUBSCRIBE]):
                    self._subscriptions[sock] += 1
        return True

    def notify(self) -> None:
        self._notify.send(b"\x01", zmq.NOBLOCK)

    def send_large(self, data: Buffer) -> None:
        zero_copy = isinstance(data, bytes) and len(data) >= _ZERO_COPY_MIN_BYTES
        self._side.send(data, 0, copy=not zero_copy)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._notify.close()
        self._side.close()
        self._ctx.term()  # waits for the side channel's linger, then the ipc files are unbound
        for address in (self.notify_address, self.side_channel_address):
            path = _ipc_path(address)
            if path is not None:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


class ReaderSockets:
    """A reader's two SUB sockets, connected; owns its own ZeroMQ context."""

    def __init__(self, notify_address: str, side_channel_address: str) -> None:
        self._ctx = zmq.Context(io_threads=1)
        self._notify = self._ctx.socket(zmq.SUB)
        self._notify.setsockopt(zmq.CONFLATE, 1)  # one pending wake-up is as good as many
        self._notify.setsockopt(zmq.LINGER, 0)
        self._notify.setsockopt(zmq.SUBSCRIBE, b"")
        self._notify.connect(notify_address)
        self._notify_poll = [(self._notify, zmq.POLLIN)]
        self._side = self._ctx.socket(zmq.SUB)
        self._side.setsockopt(zmq.RCVHWM, 0)
        self._side.setsockopt(zmq.LINGER, 0)
        self._side.setsockopt(zmq.SUBSCRIBE, b"")
        self._side.connect(side_channel_address)
        self._last_drain = time.monotonic()
        self._closed = False

    def drain_notifications(self) -> None:
        """Drop pending wake-ups; call this *before* the last look at the flags, never after."""
        self._last_drain = time.monotonic()
        try:
            while True:
                self._notify.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass

    def drain_if_due(self) -> None:
        """Called by a busy reader so that libzmq's command queue does not grow unboundedly."""
        if time.monotonic() - self._last_drain > NOTIFY_DRAIN_INTERVAL_S:
            self.drain_notifications()

    def wait_for_notification(self, timeout_s: float) -> None:
        """Sleep until the writer's next wake-up or ``timeout_s``, whichever comes first."""
        zmq.zmq_poll(self._notify_poll, max(1, int(timeout_s * 1000)))

    def recv_large(self, timeout_s: float | None) -> bytes | None:
        """The next side-channel message, or None if none arrived within ``timeout_s``."""
        timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
        if not self._side.poll(timeout_ms, zmq.POLLIN):
            return None
        return self._side.recv(copy=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._notify.close()
        self._side.close()
        self._ctx.term()

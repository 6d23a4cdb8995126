"""The engine's KV-event publisher: vLLM's ``ZmqEventPublisher`` contract (wire/kv_events.py).

The busy loop hands each step's events over with :meth:`KvEventPublisher.publish`, which
numbers the batch at once (so a utility call can say how far the stream has come) and queues
it; this thread encodes it, sends it on the PUB socket and keeps the last ``buffer_steps``
payloads for replay, answering replay requests on the ROUTER socket between sends. A slow or
absent subscriber costs nothing but the PUB socket's high-water mark: ZeroMQ drops for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from switchboard.config import KVEventsConfig
from switchboard.wire.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    KVEvent,
    KVEventBatch,
    binds,
    decode_seq,
    encode_batch,
    encode_seq,
    offset_endpoint,
)

logger = logging.getLogger(__name__)

POLL_MS = 100  # how long the thread waits for a batch before it looks at replay requests again
STOP_TIMEOUT_S = 5.0


class KvEventPublisher:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], config: KVEventsConfig, rank: int):
        self._rank = rank
        self.topic = config.topic
        self._topic = config.topic.encode()
        self.endpoint = offset_endpoint(config.endpoint, rank)
        self.replay_endpoint = (
            offset_endpoint(config.replay_endpoint, rank) if config.replay_endpoint else None
        )
        # Batches to send; None: stop.
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(
            config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.next_seq = 0  # the number the next batch gets (busy loop only)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise RuntimeError(f"KV events: cannot open {self.endpoint}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        logger.info(
            "KV events: publishing on %s (replay: %s, topic %r)",
            self.endpoint,
            self.replay_endpoint or "off",
            config.topic,
        )

    def start(self) -> None:
        """Start the thread; the first batch says the cache is empty (this engine just
        started: a subscriber that knew an earlier incarnation starts over)."""
        self._thread.start()
        self.publish([AllBlocksCleared()])

    def publish(self, events: list[KVEvent]) -> None:
        """Busy loop: one batch of events, in order. Never blocks: past ``max_queue_size``
        batches waiting (the thread far behind) a batch is dropped and logged, and a
        subscriber sees the gap in the sequence numbers."""
        seq = self.next_seq
        self.next_seq += 1
        batch = KVEventBatch(time.time(), events, self._rank)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            logger.warning("KV events: the send queue is full, batch %d dropped", seq)

    def stop(self) -> None:
        """Send what is queued (for a moment at most), then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(STOP_TIMEOUT_S)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=POLL_MS / 1000)
                if item is None:
                    return
            except queue.Empty:
                item = None
            if item is not None:
                seq, batch = item
                payload = encode_batch(batch)
                self._buffer.append((seq, payload))
                try:
                    self._pub.send_multipart((self._topic, encode_seq(seq), payload), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the PUB socket drops for a subscriber past its high-water mark
            # Replay only with nothing queued: every batch numbered before the request came
            # (a subscriber may have the number from a utility call) is in the buffer then.
            if self._replay is not None and self._queue.empty():
                while self._replay.poll(0):
                    self._serve_replay(self._replay.recv_multipart())

    def _serve_replay(self, frames: list[bytes]) -> None:
        """``[identity, b"", start_seq]`` (a DEALER or REQ) or ``[identity, start_seq]``:
        every buffered batch from ``start_seq`` on, then the end marker."""
        assert self._replay is not None
        if len(frames) == 3 and frames[1] == b"":
            delimiter: tuple[bytes, ...] = (b"",)
        elif len(frames) == 2:
            delimiter = ()
        else:
            logger.warning("KV events: dropped a replay request of %d frames", len(frames))
            return
        try:
            start = decode_seq(frames[-1])
        except ValueError as exc:
            logger.warning("KV events: dropped a bad replay request: %s", exc)
            return
        identity = frames[0]
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((identity, *delimiter, encode_seq(seq), payload))
        self._replay.send_multipart((identity, *delimiter, END_SEQ, b""))

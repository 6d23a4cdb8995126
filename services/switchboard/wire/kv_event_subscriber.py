"""Subscribing to one engine's KV events (wire/kv_events.py), gaps filled by replay.

The Python API for whatever follows an engine's prefix cache (a router, a gRPC stream of the
events, a test)::

    ctx = zmq.asyncio.Context()
    subscriber = KvEventSubscriber(ctx, "tcp://engine-0:5557", "tcp://engine-0:5558")
    mirror = CachedBlocks()
    while True:
        for seq, batch in await subscriber.receive():  # in order, gaps replayed
            mirror.apply(batch)                         # mirror.hashes: what the engine holds

The endpoints are the engine's, offset by its DP rank (``offset_endpoint``) and with ``*``
replaced by its address. ``receive`` returns the batches to apply in sequence order: a live
batch whose number skips some is preceded by the missing ones, fetched from the replay socket.
A batch numbered below the next expected one means the engine restarted (its first batch,
``AllBlocksCleared``, starts the mirror over); its stream is replayed from 0. Batches the
publisher no longer buffers are counted in ``lost_batches``: the mirror may then hold hashes
the engine evicted, or miss some it stored, until a reset. ``catch_up`` replays up to a known
sequence number (``next_seq`` of the engine's ``get_cached_block_hashes`` utility) when no
live batch is coming to reveal a gap; ``follow`` does so by itself until the first live batch
(a subscription the publisher has not taken yet when a batch goes out misses it, and with no
later batch nothing would reveal the gap).

A consumer that starts from a snapshot of the engine's cache (``get_cached_block_hashes``: its
hashes and ``next_seq``) connects first (``connected``), then takes the snapshot, then calls
``start_from(next_seq)``: batches queued on the socket from before the snapshot are then
dropped as already in it, not taken for an engine restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

from switchboard.wire.block_hash import BlockHash
from switchboard.wire.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    decode_seq,
    encode_seq,
)

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 10.0
FOLLOW_POLL_S = 1.0  # how often an idle ``follow`` looks up (cancellation is immediate)
# The publisher takes a new subscription on its own I/O thread a moment after the handshake: a
# batch sent in between reaches no one. Until the first live batch arrives (or this long), an
# idle poll asks the engine for its next sequence number and replays what is missing.
PROBE_WINDOW_S = 30.0

Batches = list[tuple[int, KVEventBatch]]
_WILDCARD_HOSTS = ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:", "tcp://:::")


def connectable(endpoint: str) -> str:
    """A bound endpoint as a subscriber on this host reaches it: a wildcard host is the
    engine's own host, which for the engines of this gateway's machine is 127.0.0.1."""
    for wildcard in _WILDCARD_HOSTS:
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard) :]
    return endpoint


class CachedBlocks:
    """The set of block hashes an engine's prefix cache holds, as its events say."""

    def __init__(self) -> None:
        self.hashes: set[BlockHash] = set()

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.hashes.clear()


class KvEventSubscriber:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        next_seq: int = 0,
    ) -> None:
        """``next_seq``: the first batch wanted (a subscriber resuming where it stopped)."""
        self._ctx = ctx
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_s = replay_timeout_s
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        self.next_seq = next_seq  # the batch expected next
        self._applied_below = 0  # batches under this are in the consumer's snapshot already
        self.lost_batches = 0  # batches neither received nor replayable
        self.replayed_batches = 0

    async def connected(self, timeout_s: float) -> bool:
        """Wait until the SUB socket has met the publisher (False: not within ``timeout_s``).
        A batch published before that is not delivered live: take the position to follow
        from (``next_seq``) after this, and the first batch missed is replayed."""
        monitor = self._sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            return bool(await monitor.poll(int(timeout_s * 1000)))
        finally:
            self._sub.disable_monitor()
            monitor.close(linger=0)

    def start_from(self, next_seq: int, replay_from: int | None = None) -> None:
        """Follow from batch ``next_seq``: the consumer knows the state of every batch before
        it (a snapshot taken after ``connected``), so older ones still queued are dropped.
        ``replay_from``: start there instead (``catch_up(next_seq)`` replays the batches up
        to ``next_seq``), for a consumer that wants them as batches."""
        self.next_seq = next_seq if replay_from is None else replay_from
        self._applied_below = next_seq

    async def follow(
        self,
        next_seq_of: Callable[[], Awaitable[int]],
        poll_s: float = FOLLOW_POLL_S,
        probe_window_s: float = PROBE_WINDOW_S,
    ) -> AsyncIterator[Batches]:
        """The batches to apply, in order, for as long as the caller iterates; also yields []
        when batches were lost (``lost_batches`` grew) with none to apply. Until the first live
        batch (at most ``probe_window_s``), an idle poll asks ``next_seq_of`` (the engine's
        ``next_seq``) and replays what the subscription missed."""
        probe_until = time.monotonic() + probe_window_s
        lost = self.lost_batches
        while True:
            batches = await self.receive(poll_s)
            if batches:
                probe_until = 0.0  # a live batch: the subscription is in place
            elif time.monotonic() < probe_until:
                batches = await self.catch_up(await next_seq_of())
            if batches or self.lost_batches != lost:
                lost = self.lost_batches
                yield batches

    async def receive(self, timeout_s: float | None = None) -> Batches:
        """The next live batch, after any it skipped (replayed); [] on timeout."""
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        if not await self._sub.poll(timeout_ms):
            return []
        frames = await self._sub.recv_multipart()
        try:
            if len(frames) != 3:
                raise ValueError(f"{len(frames)} frames, not 3")
            seq, batch = decode_seq(frames[1]), decode_batch(frames[2])
        except (ValueError, msgspec.DecodeError) as exc:
            logger.warning("KV events: dropped a bad message: %s", exc)
            return []
        if seq < self._applied_below:
            return []  # queued before the consumer's snapshot, which holds it
        self._applied_below = 0
        if seq < self.next_seq:
            logger.info("KV events: sequence went back to %d: the engine restarted", seq)
            self.next_seq = 0
        batches = await self._replay_until(seq) if seq > self.next_seq else []
        batches.append((seq, batch))
        self.next_seq = seq + 1
        return batches

    async def catch_up(self, next_seq: int) -> Batches:
        """The batches before ``next_seq`` not yet received (replayed)."""
        if next_seq <= self.next_seq:
            return []
        batches = await self._replay_until(next_seq)
        self.next_seq = max(self.next_seq, next_seq)
        return batches

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    async def _replay_until(self, stop: int) -> Batches:
        """Batches ``self.next_seq`` .. ``stop - 1`` from the replay socket; those it cannot
        get are counted lost (the caller moves ``next_seq`` on)."""
        start = self.next_seq
        got = await self._request_replay(start) if self._replay_endpoint else []
        batches: Batches = []
        expected = start
        for seq, payload in got:
            if seq < expected or seq >= stop:
                continue
            try:
                batch = decode_batch(payload)
            except msgspec.DecodeError as exc:
                logger.warning("KV events: dropped a bad replayed batch %d: %s", seq, exc)
                continue
            self.lost_batches += seq - expected
            batches.append((seq, batch))
            expected = seq + 1
        if expected < stop:
            self.lost_batches += stop - expected
            logger.warning(
                "KV events: batches %d..%d lost (not replayable); the mirror may be off",
                expected,
                stop - 1,
            )
        self.replayed_batches += len(batches)
        return batches

    async def _request_replay(self, start: int) -> list[tuple[int, bytes]]:
        assert self._replay_endpoint is not None
        if self._replay is None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(self._replay_endpoint)
        await self._replay.send_multipart((b"", encode_seq(start)))
        deadline = time.monotonic() + self._replay_timeout_s
        got: list[tuple[int, bytes]] = []
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not await self._replay.poll(remaining_ms):
                logger.warning("KV events: no full replay within %ss", self._replay_timeout_s)
                self._replay.close(linger=0)  # a late answer must not meet the next request
                self._replay = None
                return got
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or frames[0] != b"":
                continue
            if frames[1] == END_SEQ:
                return got
            got.append((decode_seq(frames[1]), frames[2]))

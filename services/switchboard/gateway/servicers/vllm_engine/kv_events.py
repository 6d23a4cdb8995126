"""``SubscribeKvEvents``: the engines' KV-cache events (wire/kv_events.py) relayed as the
proto's ``KvEventBatch`` stream, as vLLM's reference servicer (``smg-grpc-servicer``) relays
them.

One SUB socket per DP rank (the endpoints each engine reported in READY), each followed with
``KvEventSubscriber`` so a skipped batch is replayed before anything later goes out. Every
batch keeps its rank's own sequence number and carries ``dp_rank``: the ranks count
separately, so a consumer keeps one cursor per rank. A block hash (a 32-byte SHA-256 digest)
becomes the proto's ``int64`` as the reference servicer folds it: its last eight bytes read
big-endian, as a two's-complement signed integer (the low 64 bits vLLM publishes as an int).
Batches neither received nor replayable end the stream with DATA_LOSS (the consumer clears and
resubscribes); an engine that restarts starts its numbering over at 0 with ``cleared``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import zmq.asyncio
from smg_grpc_proto.generated import common_pb2

from switchboard.gateway.api_errors import ApiError, unavailable
from switchboard.gateway.state import GatewayState
from switchboard.wire.block_hash import BlockHash
from switchboard.wire.engine_msgs import EngineReady
from switchboard.wire.kv_event_subscriber import Batches, KvEventSubscriber, connectable
from switchboard.wire.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

logger = logging.getLogger(__name__)

NOT_ENABLED = (
    "SubscribeKvEvents: the engines publish no KV cache events; start the server with "
    '--kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq", '
    '"replay_endpoint": "tcp://*:5567"}\''
)
UTILITY_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0


def to_int64(block_hash: BlockHash) -> int:
    """The proto's ``block_hash``: the digest's last eight bytes, big-endian, signed."""
    return int.from_bytes(block_hash[-8:], "big", signed=True)


@dataclasses.dataclass(frozen=True)
class RankSource:
    rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str


def sources(engines: list[EngineReady]) -> list[RankSource]:
    """The live engines that publish events, by rank."""
    return [
        RankSource(
            ready.data_parallel_rank,
            connectable(ready.kv_events_endpoint),
            connectable(ready.kv_events_replay_endpoint)
            if ready.kv_events_replay_endpoint
            else None,
            ready.kv_events_topic,
        )
        for ready in sorted(engines, key=lambda ready: ready.data_parallel_rank)
        if ready.kv_events_endpoint
    ]


class EventConverter:
    """Our events to the proto's, numbering events across the stream (``event_id``)."""

    def __init__(self) -> None:
        self._event_id = 0

    def batch(self, seq: int, batch: KVEventBatch, rank: int) -> common_pb2.KvEventBatch:
        proto = common_pb2.KvEventBatch(sequence_number=seq, timestamp=batch.ts, dp_rank=rank)
        for event in batch.events:
            self._event_id += 1
            proto.events.append(self.event(event, self._event_id))
        return proto

    @staticmethod
    def event(event: KVEvent, event_id: int) -> common_pb2.KvCacheEvent:
        if isinstance(event, BlockStored):
            size = event.block_size
            stored = common_pb2.KvBlocksStored(
                blocks=[
                    common_pb2.KvBlock(
                        block_hash=to_int64(block_hash),
                        token_ids=event.token_ids[i * size : (i + 1) * size],
                        block_size=size,
                    )
                    for i, block_hash in enumerate(event.block_hashes)
                ]
            )
            if event.parent_block_hash is not None:
                stored.parent_block_hash = to_int64(event.parent_block_hash)
            if event.medium is not None:
                stored.medium = event.medium
            if event.medium == MEDIUM_GPU:
                stored.tier = common_pb2.KV_CACHE_TIER_DEVICE
            if event.lora_name is not None:
                stored.lora_name = event.lora_name
            return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
        if isinstance(event, BlockRemoved):
            removed = common_pb2.KvBlocksRemoved(
                block_hashes=[to_int64(block_hash) for block_hash in event.block_hashes]
            )
            if event.medium is not None:
                removed.medium = event.medium
            if event.medium == MEDIUM_GPU:
                removed.tier = common_pb2.KV_CACHE_TIER_DEVICE
            return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)
        assert isinstance(event, AllBlocksCleared)
        return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


class KvEventRelay:
    """One ``SubscribeKvEvents`` call: every rank's subscriber, merged into one stream.

    ``start_at``: each rank's next sequence number once its socket is connected (its
    ``get_cached_block_hashes`` utility). Start 0 follows each rank from there on (live, a
    batch missed while the socket connects replayed); start N replays each rank's buffered
    batches from N on first (the caller checks N is not past a rank's position)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        ranks: list[RankSource],
        next_seq_of: Callable[[int], Awaitable[int]],
    ) -> None:
        self.ranks = ranks
        self._next_seq_of = next_seq_of  # a rank's (by index) next batch number, asked of it
        self.subscribers = [
            KvEventSubscriber(ctx, r.endpoint, r.replay_endpoint, r.topic) for r in ranks
        ]
        self._positions = [0] * len(ranks)
        self._converter = EventConverter()
        self._queue: asyncio.Queue[tuple[int, Batches | Exception]] = asyncio.Queue()

    async def connect(self) -> None:
        """Wait for every SUB socket to meet its publisher (a rank not met in time is
        followed anyway: its batches until then come by replay, on its next live batch)."""
        met = await asyncio.gather(*(s.connected(CONNECT_TIMEOUT_S) for s in self.subscribers))
        for source, ok in zip(self.ranks, met, strict=True):
            if not ok:
                logger.warning("SubscribeKvEvents: %s not connected yet", source.endpoint)

    def start_at(self, positions: list[int], start: int) -> None:
        self._positions = positions
        for subscriber, position in zip(self.subscribers, positions, strict=True):
            subscriber.start_from(position, replay_from=start or None)

    async def stream(self) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The merged stream, until the caller stops iterating (the client cancelled): the
        rank loops end and every socket is closed then."""
        tasks = [asyncio.create_task(self._follow(i)) for i in range(len(self.ranks))]
        try:
            while True:
                index, batches = await self._queue.get()
                rank = self.ranks[index].rank
                if isinstance(batches, Exception):
                    raise ApiError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"SubscribeKvEvents: DP rank {rank}'s events broke off: {batches}",
                    )
                lost = self.subscribers[index].lost_batches
                if lost:
                    raise ApiError(
                        grpc.StatusCode.DATA_LOSS,
                        f"SubscribeKvEvents: {lost} KV event batch(es) of DP rank {rank} are "
                        "no longer buffered (no replay_endpoint, or past buffer_steps); clear "
                        "what you hold for it and resubscribe",
                    )
                for seq, batch in batches:
                    yield self._converter.batch(seq, batch, rank)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()

    def close(self) -> None:
        for subscriber in self.subscribers:
            subscriber.close()
        logger.info("SubscribeKvEvents: stream closed, %d rank socket(s) closed", len(self.ranks))

    async def _follow(self, index: int) -> None:
        subscriber = self.subscribers[index]
        try:
            caught_up = await subscriber.catch_up(self._positions[index])
            if caught_up or subscriber.lost_batches:
                await self._queue.put((index, caught_up))
            async for batches in subscriber.follow(lambda: self._next_seq_of(index)):
                await self._queue.put((index, batches))
        except (zmq.ZMQError, OSError) as exc:  # a broken socket ends the stream, not the gateway
            logger.warning("SubscribeKvEvents: DP rank %d: %s", self.ranks[index].rank, exc)
            await self._queue.put((index, exc))


async def subscribe(state: GatewayState, ctx: zmq.asyncio.Context, start: int) -> KvEventRelay:
    """The relay for one call over the live engines that publish events; the refusals
    (events off, no engine, a start past a rank's stream) come before any socket opens."""
    live = state.engines.live_engines
    if not live:
        raise unavailable("SubscribeKvEvents: no engine core is ready")
    publishing = [engine for engine in live if engine.ready.kv_events_endpoint]
    if not publishing:
        raise ApiError(grpc.StatusCode.UNIMPLEMENTED, NOT_ENABLED, reason="NOT_IMPLEMENTED")

    async def next_seq_of(index: int) -> int:
        engine = publishing[index]
        reply = await state.engines.call_utility(
            engine, "get_cached_block_hashes", [], UTILITY_TIMEOUT_S
        )
        return int(reply["next_seq"])

    relay = KvEventRelay(ctx, sources([engine.ready for engine in publishing]), next_seq_of)
    try:
        await relay.connect()
        positions = list(await asyncio.gather(*(next_seq_of(i) for i in range(len(publishing)))))
        for engine, position in zip(publishing, positions, strict=True):
            if start > position:
                raise ApiError(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"start_sequence_number {start} is past DP rank "
                    f"{engine.ready.data_parallel_rank}'s stream (its next batch is {position})",
                    field="start_sequence_number",
                )
    except BaseException:
        relay.close()
        raise
    relay.start_at(positions, start)
    return relay

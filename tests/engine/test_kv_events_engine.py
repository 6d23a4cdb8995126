"""A real engine core publishing KV events (``--kv-events-config``): a subscriber rebuilds the
engine's set of cached block hashes from the stream, evictions included, and again after
missing part of the stream, by replay."""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import zmq.asyncio

from switchboard.config import CacheConfig, KVEventsConfig
from switchboard.wire.block_hash import extend_block_hashes
from switchboard.wire.engine_msgs import EngineCoreRequest, FinishReason, SamplingParams
from switchboard.wire.kv_event_subscriber import CachedBlocks, KvEventSubscriber
from switchboard.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.engine.test_core_frames import BLOCK_SIZE, EngineUnderTest
from tests.tiny_checkpoint import tiny_llama_dir

pytestmark = pytest.mark.slow

NUM_BLOCKS = 24  # 384 tokens: a few prompts fill it, so blocks are evicted
RECEIVE_TIMEOUT_S = 5.0  # a live batch not here by then is fetched by replay instead


@pytest.fixture(scope="module")
def sockets() -> Iterator[tuple[str, str]]:
    where = tempfile.mkdtemp(prefix="sb-kv-")  # ipc:// paths are short
    yield f"ipc://{where}/pub", f"ipc://{where}/replay"
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(sockets: tuple[str, str]) -> Iterator[EngineUnderTest]:
    endpoint, replay = sockets
    events = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay, topic="kv"
    )
    cache = CacheConfig(
        block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS, kv_events_config=events
    )
    running = EngineUnderTest(tiny_llama_dir(), cache=cache)
    yield running
    running.close()


def prompts(seed: int, n: int) -> list[list[int]]:
    """Conversations sharing a first block, each 3-6 blocks long."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 1000) for _ in range(BLOCK_SIZE)]
    return [
        shared + [rng.randrange(1, 1000) for _ in range(rng.randrange(2, 5) * BLOCK_SIZE + 3)]
        for _ in range(n)
    ]


def run(engine: EngineUnderTest, name: str, tokens: list[int]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = engine.generate(EngineCoreRequest(name, tokens, sampling_params=params))
    assert outputs[-1].finish_reason == FinishReason.LENGTH


def engine_state(engine: EngineUnderTest, call_id: int) -> tuple[set[bytes], int]:
    reply = engine.call_utility(call_id, "get_cached_block_hashes")
    assert reply.failure_message is None, reply.failure_message
    return set(reply.result["block_hashes"]), reply.result["next_seq"]


async def follow(
    subscriber: KvEventSubscriber, mirror: CachedBlocks, next_seq: int, seen: list[type]
) -> None:
    """Apply batches until every one before ``next_seq`` is in."""
    while subscriber.next_seq < next_seq:
        batches = await subscriber.receive(RECEIVE_TIMEOUT_S)
        if not batches:  # nothing live is coming (a slow join missed it): replay
            batches = await subscriber.catch_up(next_seq)
        for _, batch in batches:
            assert batch.data_parallel_rank == 0
            seen.extend(type(event) for event in batch.events)
            mirror.apply(batch)


def test_a_subscriber_rebuilds_the_cache_and_fills_a_gap_by_replay(
    engine: EngineUnderTest, sockets: tuple[str, str]
) -> None:
    endpoint, replay = sockets
    ctx = zmq.asyncio.Context()
    mirror = CachedBlocks()
    seen: list[type] = []

    async def scenario() -> None:
        subscriber = KvEventSubscriber(ctx, endpoint, replay, topic="kv")
        for i, tokens in enumerate(prompts(1, 10)):
            run(engine, f"a{i}", tokens)
        state, next_seq = engine_state(engine, 1)
        await follow(subscriber, mirror, next_seq, seen)
        assert seen[0] is AllBlocksCleared  # the engine's first batch: it started empty
        assert mirror.hashes == state and state
        assert BlockStored in seen and BlockRemoved in seen  # the cache filled up and evicted
        # One of the cached prompts again: its blocks are hits, the hashes the engine stored.
        again = prompts(1, 10)[-1]
        expected: list[bytes] = []
        extend_block_hashes(expected, again, BLOCK_SIZE, None)
        assert set(expected) <= mirror.hashes

        # A gap: the subscriber is away while more requests run, then comes back where it was.
        resume_at = subscriber.next_seq
        subscriber.close()
        for i, tokens in enumerate(prompts(2, 5)):
            run(engine, f"b{i}", tokens)
        _, missed_up_to = engine_state(engine, 2)
        assert missed_up_to > resume_at
        subscriber = KvEventSubscriber(ctx, endpoint, replay, topic="kv", next_seq=resume_at)
        run(engine, "c", prompts(3, 1)[0])  # its batch reveals the gap
        state, next_seq = engine_state(engine, 3)
        await follow(subscriber, mirror, next_seq, seen)
        assert subscriber.lost_batches == 0
        assert subscriber.replayed_batches >= missed_up_to - resume_at
        assert mirror.hashes == state
        subscriber.close()

    try:
        asyncio.run(scenario())
    finally:
        ctx.destroy(linger=0)

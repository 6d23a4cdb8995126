"""KV events from the cache manager and the block pool, without an engine: replayed into a set,
they always give the prefix cache's own hashes, and every stored chain links to its parent."""

from __future__ import annotations

import random

from switchboard.engine.kv_cache import KVCacheManager
from switchboard.wire.block_hash import extend_block_hashes
from switchboard.wire.kv_event_subscriber import CachedBlocks
from switchboard.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from tests.engine.test_kv_cache import BS, compute, make_request


def replayed(kv: KVCacheManager) -> CachedBlocks:
    """The events recorded so far, through the wire codec, applied to a fresh mirror."""
    assert kv.pool.events is not None
    mirror = CachedBlocks()
    mirror.apply(decode_batch(encode_batch(KVEventBatch(0.0, kv.pool.events, 0))))
    return mirror


def test_events_rebuild_the_cache_through_hits_evictions_and_a_reset() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    kv.pool.events = []
    rng = random.Random(7)
    shared = [rng.randrange(1000) for _ in range(2 * BS)]
    for i in range(40):
        tokens = shared + [rng.randrange(1000) for _ in range(rng.randrange(1, 3 * BS))]
        request = make_request(f"r{i}", tokens, salt="t" if i % 5 == 0 else None)
        compute(kv, request)
        kv.free(request)
        assert replayed(kv).hashes == set(kv.pool.cached_hashes())
    kinds = {type(event) for event in kv.pool.events}
    assert kinds == {BlockStored, BlockRemoved}  # the workload evicted
    assert kv.reset_prefix_cache()
    assert isinstance(kv.pool.events[-1], AllBlocksCleared)
    assert replayed(kv).hashes == set() == set(kv.pool.cached_hashes())


def test_a_stored_event_carries_its_tokens_and_chains_to_its_parent() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    kv.pool.events = []
    prompt = list(range(100, 100 + 3 * BS + 1))
    compute(kv, make_request("a", prompt))
    longer = prompt[: 2 * BS] + list(range(500, 500 + 2 * BS))
    compute(kv, make_request("b", longer))  # hits two blocks, stores two more
    first, second = kv.pool.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.parent_block_hash is None
    assert first.token_ids == prompt[: 3 * BS] and first.block_size == BS
    expected: list[bytes] = []
    extend_block_hashes(expected, longer, BS, None)
    assert second.block_hashes == expected[2:]
    assert second.parent_block_hash == expected[1]  # a consumer can link it to the chain
    assert second.token_ids == longer[2 * BS :]
    assert (second.medium, second.lora_id, second.lora_name) == ("GPU", None, None)


def test_a_duplicate_block_is_not_reported_stored() -> None:
    """Two requests computing the same block at once: only the first registers it, so only
    the first is reported (and a later eviction removes the one hash once)."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    kv.pool.events = []
    prompt = list(range(2 * BS + 1))
    a, b = make_request("a", prompt), make_request("b", prompt)
    for request in (a, b):  # both allocated before either is computed: no hit for b
        assert kv.allocate_slots(request, request.num_tokens) is not None
    for request in (a, b):
        request.num_computed_tokens = request.num_tokens
        kv.cache_blocks(request)
    assert len(kv.pool.events) == 1
    assert replayed(kv).hashes == set(kv.pool.cached_hashes())


def test_no_events_are_recorded_unless_asked() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    compute(kv, make_request("a", list(range(3 * BS))))
    assert kv.pool.events is None

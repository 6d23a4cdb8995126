"""Block pool, KV cache manager and block hashes, without a scheduler or a model."""

from __future__ import annotations

import hashlib
import struct

import pytest

from switchboard.engine.block_pool import BlockPool
from switchboard.engine.kv_cache import KVCacheManager
from switchboard.engine.request import Request
from switchboard.wire.block_hash import ROOT_HASH, extend_block_hashes, token_bytes
from switchboard.wire.engine_msgs import EngineCoreRequest, SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request.from_engine_core_request(
        EngineCoreRequest(rid, tokens, sampling_params=SamplingParams(), cache_salt=salt), BS, 0
    )


def compute(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> list[int]:
    """Allocate for the whole prompt (after any prefix hit), 'compute' it, register its blocks."""
    hits, num_hit = kv.get_computed_blocks(request)
    n = (num_tokens or request.num_tokens) - num_hit
    assert kv.allocate_slots(request, n, hits) is not None
    request.num_computed_tokens = num_hit + n
    kv.cache_blocks(request)
    return kv.block_ids(request.request_id)


# ---------------------------------------------------------------- hashes


def test_block_hash_is_sha256_over_parent_and_little_endian_uint32_tokens():
    hashes: list[bytes] = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8, 9], BS, None)
    assert len(hashes) == 2  # only full blocks
    first = hashlib.sha256(ROOT_HASH + struct.pack("<4I", 1, 2, 3, 4)).digest()
    second = hashlib.sha256(first + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert hashes == [first, second]
    assert ROOT_HASH == hashlib.sha256(b"switchboard/prefix-cache/v1").digest()


def test_salt_changes_every_block_and_hashes_extend_incrementally():
    tokens = list(range(12))
    plain: list[bytes] = []
    salted: list[bytes] = []
    extend_block_hashes(plain, tokens, BS, None)
    extend_block_hashes(salted, tokens, BS, "tenant")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    incremental: list[bytes] = []
    for end in range(13):
        extend_block_hashes(incremental, tokens[:end], BS, "tenant")
    assert incremental == salted


def test_token_ids_outside_uint32_are_rejected():
    assert token_bytes([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    with pytest.raises(ValueError):
        token_bytes([2**32])
    with pytest.raises(ValueError):
        make_request("neg", [1, -1, 2, 3])


def test_request_hashes_outputs_as_blocks_fill():
    request = make_request("r", [1, 2, 3, 4, 5, 6])
    assert len(request.block_hashes) == 1
    request.append_output_token(7)
    request.update_block_hashes()
    assert len(request.block_hashes) == 1
    request.append_output_token(8)
    request.update_block_hashes()
    assert len(request.block_hashes) == 2
    assert request.block_hashes == make_request("s", [1, 2, 3, 4, 5, 6, 7, 8]).block_hashes


# ---------------------------------------------------------------- block pool


def test_pool_allocates_in_order_and_reuses_plain_blocks_last_in_first_out():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 3
    pool.free_blocks(reversed(a))
    assert pool.num_free_blocks == 6
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(5)


def test_pool_keeps_hashed_blocks_until_evicted_oldest_first():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for block, h in zip(blocks, [b"h0", b"h1", b"h2", b"h3"], strict=True):
        assert pool.cache_block(block, h)
    pool.free_blocks([blocks[2], blocks[0]])  # freed in this order: 2 is the oldest
    assert pool.num_free_blocks == 2 and pool.num_cached_blocks == 4
    assert pool.usage() == 0.5
    (taken,) = pool.get_new_blocks(1)
    assert taken.block_id == 2 and taken.block_hash is None
    assert pool.get_cached_block(b"h2") is None
    assert pool.get_cached_block(b"h0") is blocks[0]
    assert pool.num_evictions == 1


def test_touch_revives_a_free_cached_block_and_shares_a_used_one():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], b"x")
    pool.cache_block(blocks[1], b"y")
    pool.free_blocks([blocks[0]])
    pool.touch([blocks[0], blocks[1]])
    assert (blocks[0].ref_cnt, blocks[1].ref_cnt) == (1, 2)
    assert pool.num_free_blocks == 1
    assert not pool.cache_block(pool.get_new_blocks(1)[0], b"x")  # duplicates stay unhashed


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], b"x")
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"x") is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"x") is None and blocks[0].block_hash is None
    assert pool.num_free_blocks == 3


# ---------------------------------------------------------------- manager


def test_allocate_slots_grows_the_table_as_tokens_need_slots():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("r", list(range(5)))
    assert kv.allocate_slots(request, 5) == [0, 1]
    request.num_computed_tokens = 5
    assert kv.allocate_slots(request, 3) == []  # slots 5..7 are in block 1
    request.num_computed_tokens = 8
    assert kv.allocate_slots(request, 1) == [2]
    assert kv.block_ids("r") == [0, 1, 2]
    kv.free(request)
    assert kv.num_free_blocks == 8 and kv.block_ids("r") == []


def test_allocate_slots_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    first = make_request("a", list(range(8)))
    assert kv.allocate_slots(first, 8) == [0, 1]
    second = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(second, 8) is None
    assert kv.num_free_blocks == 1 and kv.block_ids("b") == []


def test_prefix_hit_shares_blocks_and_caps_at_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(12)))
    a_blocks = compute(kv, a)
    b = make_request("b", list(range(12)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8  # 12 tokens: the 3rd block would leave nothing to compute
    assert [blk.block_id for blk in hits] == a_blocks[:2]
    assert kv.allocate_slots(b, 4, hits) == a_blocks[:2] + [3]
    assert [kv.pool.blocks[i].ref_cnt for i in a_blocks] == [2, 2, 1]
    c = make_request("c", list(range(12)), salt="other")
    assert kv.get_computed_blocks(c) == ([], 0)


def test_prefix_hit_on_freed_blocks_counts_them_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(9)))
    compute(kv, a)  # 3 blocks, 2 of them hashed
    kv.free(a)
    assert kv.num_free_blocks == 3 and kv.pool.num_cached_blocks == 2
    b = make_request("b", list(range(8)) + [50])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, 1, hits) is not None  # 2 revived + 1 new = all 3
    assert kv.num_free_blocks == 0


def test_eviction_takes_the_tail_of_a_freed_chain_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(16)))
    compute(kv, a)  # 4 hashed blocks
    kv.free(a)
    newcomer = make_request("n", list(range(100, 104)))
    kv.allocate_slots(newcomer, 4)
    # the chain's head survives: a request with the same start still hits 3 blocks
    again = make_request("again", list(range(16)))
    assert kv.get_computed_blocks(again)[1] == 12


def test_caching_off_never_registers_or_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(8)))
    compute(kv, a)
    kv.free(a)
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)

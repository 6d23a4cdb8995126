"""Paged attention (the torch reference) equals plain causal attention over each request's whole
sequence."""

from __future__ import annotations

import random

import torch

from switchboard.models.attention import (
    AttentionMetadata,
    DecodeBatch,
    _equal_fresh_run,
    new_kv_cache,
    paged_attention,
)
from tests.models.paged_reference import dense_attention, lay_out_step

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def test_decode_batch_and_prefill_chunks_read_their_own_blocks():
    torch.manual_seed(0)
    rng = random.Random(0)
    free = list(range(40))
    rng.shuffle(free)
    cache = new_kv_cache(40, BLOCK, KV_HEADS, DIM, torch.float32, "cpu")
    # (tokens cached, tokens this step): two decodes, a chunk after a prefix, a fresh prefill
    shapes = [(9, 1), (2, 1), (6, 5), (0, 7)]
    full = [
        (torch.randn(c + n, KV_HEADS, DIM), torch.randn(c + n, KV_HEADS, DIM)) for c, n in shapes
    ]
    tables = [[free.pop() for _ in range(-(-(c + n) // BLOCK))] for c, n in shapes]
    queries, keys, values, slots, spans = lay_out_step(cache, shapes, full, tables, HEADS)
    max_blocks = max(len(t) for t in tables[:2])
    decode = DecodeBatch(
        block_table=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables[:2]]),
        context_lens=torch.tensor([10, 3]),
        max_context_len=10,
    )
    metadata = AttentionMetadata(torch.tensor(slots), decode=decode, prefills=spans)
    out = paged_attention(
        torch.cat(queries), torch.cat(keys), torch.cat(values), cache, metadata, DIM**-0.5
    )
    expected = torch.cat(
        [dense_attention(q, k, v) for q, (k, v) in zip(queries, full, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_rows_of_one_length_attend_without_a_mask():
    """Rows whose contexts all have the batch's full length need no key mask (none is built),
    and give what dense attention gives; a sliding window shorter than that still masks."""
    torch.manual_seed(1)
    cache = new_kv_cache(16, BLOCK, KV_HEADS, DIM, torch.float32, "cpu")
    shapes = [(6, 1), (6, 1), (6, 1)]  # three decodes, each at context length 7
    full = [(torch.randn(7, KV_HEADS, DIM), torch.randn(7, KV_HEADS, DIM)) for _ in shapes]
    tables = [[0, 5], [2, 9], [11, 3]]
    queries, keys, values, slots, _ = lay_out_step(cache, shapes, full, tables, HEADS)
    decode = DecodeBatch(
        block_table=torch.tensor(tables),
        context_lens=torch.tensor([7, 7, 7]),
        max_context_len=7,
        all_full_length=True,
    )
    assert decode.key_mask(None) is None
    assert decode.key_mask(8) is None  # a window wider than the context cuts nothing
    assert decode.key_mask(3) is not None
    for window in (None, 3):
        metadata = AttentionMetadata(torch.tensor(slots), decode=decode)
        _assert_dense(queries, keys, values, full, cache, metadata, window)


def test_new_prompts_of_one_length_attend_together_and_others_alone():
    """Adjacent new prompts of one length take one batched call (``_equal_fresh_run``); a
    chunk after a cached prefix, a prompt of another length and a window shorter than the
    prompts break a run. Every row still equals dense causal attention."""
    torch.manual_seed(2)
    rng = random.Random(2)
    free = list(range(60))
    rng.shuffle(free)
    cache = new_kv_cache(60, BLOCK, KV_HEADS, DIM, torch.float32, "cpu")
    # (tokens cached, tokens this step): a decode, three new 6-token prompts, a chunk after a
    # prefix, two new 6-token prompts, a new 5-token prompt
    shapes = [(4, 1), (0, 6), (0, 6), (0, 6), (3, 6), (0, 6), (0, 6), (0, 5)]
    full = [
        (torch.randn(c + n, KV_HEADS, DIM), torch.randn(c + n, KV_HEADS, DIM)) for c, n in shapes
    ]
    tables = [[free.pop() for _ in range(-(-(c + n) // BLOCK))] for c, n in shapes]
    queries, keys, values, slots, spans = lay_out_step(cache, shapes, full, tables, HEADS)
    assert [_equal_fresh_run(spans, i, None) for i in (0, 3, 4, 6)] == [3, 1, 2, 1]
    assert _equal_fresh_run(spans, 0, 4) == 1  # the window cuts these prompts
    decode = DecodeBatch(
        block_table=torch.tensor([tables[0]]), context_lens=torch.tensor([5]), max_context_len=5
    )
    for window in (None, 4):
        metadata = AttentionMetadata(torch.tensor(slots), decode=decode, prefills=spans)
        _assert_dense(queries, keys, values, full, cache, metadata, window)


def _assert_dense(queries, keys, values, full, cache, metadata, window: int | None) -> None:
    """Paged attention of the step equals dense causal attention over each whole sequence."""
    out = paged_attention(
        torch.cat(queries),
        torch.cat(keys),
        torch.cat(values),
        cache,
        metadata,
        DIM**-0.5,
        sliding_window=window,
    )
    expected = torch.cat(
        [dense_attention(q, k, v, window) for q, (k, v) in zip(queries, full, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

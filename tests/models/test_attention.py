"""Paged attention equals plain causal attention over each request's whole sequence."""

from __future__ import annotations

import random

import torch

from switchboard.models.attention import (
    AttentionMetadata,
    DecodeBatch,
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

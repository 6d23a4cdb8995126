"""Paged attention equals plain causal attention over each request's whole sequence."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from switchboard.models.attention import (
    AttentionMetadata,
    DecodeBatch,
    PrefillSpan,
    new_kv_cache,
    paged_attention,
)

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def dense_attention(q, k, v):
    """Causal attention where the last len(q) positions of k/v are the queries'."""
    n, length = q.shape[0], k.shape[0]
    mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1).flatten(1)


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
    # Put the already-cached tokens in place, as earlier steps would have.
    for (cached, _), (k, v), table in zip(shapes, full, tables, strict=True):
        for pos in range(cached):
            slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
            cache[0].view(-1, KV_HEADS, DIM)[slot] = k[pos]
            cache[1].view(-1, KV_HEADS, DIM)[slot] = v[pos]

    queries, keys, values, slots, spans = [], [], [], [], []
    row = 0
    for (cached, n), (k, v), table in zip(shapes, full, tables, strict=True):
        queries.append(torch.randn(n, HEADS, DIM))
        keys.append(k[cached:])
        values.append(v[cached:])
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, cached + n)]
        if n > 1:
            spans.append(PrefillSpan(row, n, cached + n, torch.tensor(table)))
        row += n
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

"""For paged-attention tests: one step's tokens laid out in a paged KV cache, and dense
attention over the whole sequences to compare the paged result with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from switchboard.models.attention import PrefillSpan


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Causal attention (within the last ``window`` positions, if given) where the last len(q)
    positions of k/v are the queries'; grouped k/v heads are repeated to q's."""
    n, length = q.shape[0], k.shape[0]
    query_pos = torch.arange(length - n, length)[:, None]
    key_pos = torch.arange(length)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1).flatten(1)


def lay_out_step(
    cache: torch.Tensor,
    shapes: list[tuple[int, int]],
    full: list[tuple[torch.Tensor, torch.Tensor]],
    tables: list[list[int]],
    num_heads: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[int], list]:
    """Per sequence ``(tokens cached, tokens this step)`` with its whole k/v and block table:
    write the cached tokens into ``cache`` (as earlier steps would have) and draw this step's
    queries. Returns (queries, new keys, new values, slot per new token, prefill spans)."""
    _, _, block, num_kv_heads, dim = cache.shape
    flat_k, flat_v = cache[0].view(-1, num_kv_heads, dim), cache[1].view(-1, num_kv_heads, dim)
    queries, keys, values, slots, spans, row = [], [], [], [], [], 0
    for (cached, n), (k, v), table in zip(shapes, full, tables, strict=True):
        for pos in range(cached):
            flat_k[table[pos // block] * block + pos % block] = k[pos]
            flat_v[table[pos // block] * block + pos % block] = v[pos]
        queries.append(torch.randn(n, num_heads, dim))
        keys.append(k[cached:])
        values.append(v[cached:])
        slots += [table[p // block] * block + p % block for p in range(cached, cached + n)]
        if n > 1:
            spans.append(PrefillSpan(row, n, cached + n, torch.tensor(table)))
        row += n
    return queries, keys, values, slots, spans

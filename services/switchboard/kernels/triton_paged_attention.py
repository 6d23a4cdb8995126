# The @triton.jit kernels' parameters are Triton's (pointers, tl.constexpr), not Python types.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""Paged attention in Triton: kernels that read the KV blocks in place, through the block
tables (no gather into a padded copy, unlike the torch reference off CPU). The Triton attention
backend (``models/triton_backend.py``) lays a step's metadata out for them and calls them.

- Decode (one query token per request): one program per (request, KV head) loads the query
  heads of its group, walks the request's blocks (``block_table[r, p // block_size]``) one
  block at a time and keeps an online softmax in float32 (running max, running sum, rescaled
  accumulator). Sliding windows skip the blocks behind the window and mask inside it.
- Prefill chunks (several query tokens, with or without a cached prefix): one program per
  (tile of ``PREFILL_BLOCK_M`` query rows of a span, query head); every key, the chunk's own
  included, is read from the cache (written first), with the causal mask shifted by the tokens
  already cached, and the same online softmax (``tl.dot`` per block).

Both need a power-of-two block size (``tl.arange``); prefill also needs block size >= 16 (the
``tl.dot`` minimum): ``decode_supported`` / ``prefill_supported``. ``TRITON_INTERPRET=1`` runs
the kernels on CPU tensors (slowly), which the tests use. Importing this module imports triton
(a test extra, not a serving dependency): only the Triton backend does, when chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from switchboard.kernels.triton_support import interpreted

PREFILL_BLOCK_M = 16


@triton.jit
def _decode_kernel(
    Q,
    KV,
    BlockTable,
    ContextLens,
    Out,
    values_offset,
    stride_q_tok,
    stride_q_head,
    stride_bt,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_o_tok,
    stride_o_head,
    scale,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(ContextLens + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    n = tl.arange(0, BLOCK_SIZE)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(
        Q + seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
        mask=q_mask,
        other=0.0,
    ).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    first_pos = 0
    if HAS_WINDOW:
        first_pos = tl.maximum(context_len - window, 0)
    for b in range(first_pos // BLOCK_SIZE, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(BlockTable + seq * stride_bt + b).to(tl.int64)
        pos = b * BLOCK_SIZE + n
        valid = (pos < context_len) & (pos >= first_pos)
        offsets = (
            block * stride_kv_block
            + n[:, None] * stride_kv_slot
            + kv_head * stride_kv_head
            + d[None, :]
        )
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(KV + offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_SIZE, DIM]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_use[:, None])
        alpha = tl.exp(m - m_use)
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(KV + values_offset + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(
        Out + seq * stride_o_tok + heads[:, None] * stride_o_head + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=q_mask,
    )


@triton.jit
def _prefill_kernel(
    Q,
    KV,
    BlockTables,
    TileSpan,
    TileRow,
    SpanStart,
    SpanTokens,
    SpanContext,
    Out,
    values_offset,
    stride_q_tok,
    stride_q_head,
    stride_bt,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_o_tok,
    stride_o_head,
    scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    span = tl.load(TileSpan + tile)
    row0 = tl.load(TileRow + tile)
    token_start = tl.load(SpanStart + span)
    num_tokens = tl.load(SpanTokens + span)
    context_len = tl.load(SpanContext + span)
    cached = context_len - num_tokens
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < num_tokens
    query_pos = cached + rows
    d = tl.arange(0, DIM_PAD)
    n = tl.arange(0, BLOCK_SIZE)
    d_mask = d < HEAD_DIM
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        Q + (token_start + rows)[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
        mask=q_mask,
        other=0.0,
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    last_pos = tl.minimum(context_len - 1, cached + row0 + BLOCK_M - 1)
    first_pos = 0
    if HAS_WINDOW:
        first_pos = tl.maximum(cached + row0 - window + 1, 0)
    for b in range(first_pos // BLOCK_SIZE, last_pos // BLOCK_SIZE + 1):
        block = tl.load(BlockTables + span * stride_bt + b).to(tl.int64)
        key_pos = b * BLOCK_SIZE + n
        offsets = (
            block * stride_kv_block
            + n[:, None] * stride_kv_slot
            + kv_head * stride_kv_head
            + d[None, :]
        )
        kv_mask = (key_pos < context_len)[:, None] & d_mask[None, :]
        k = tl.load(KV + offsets, mask=kv_mask, other=0.0).to(q.dtype)
        if DOT_F32:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        elif IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        valid = key_pos[None, :] <= query_pos[:, None]
        if HAS_WINDOW:
            valid &= key_pos[None, :] > query_pos[:, None] - window
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_use[:, None])
        alpha = tl.exp(m - m_use)
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(KV + values_offset + offsets, mask=kv_mask, other=0.0).to(q.dtype)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        elif IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(
        Out + (token_start + rows)[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=q_mask,
    )


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def decode_supported(block_size: int) -> bool:
    return _is_power_of_two(block_size)


def prefill_supported(block_size: int) -> bool:
    return _is_power_of_two(block_size) and block_size >= 16


def prefill_tiles(num_tokens: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """(span index, first row within the span) of every ``block_m``-row query tile."""
    spans: list[int] = []
    rows: list[int] = []
    for index, n in enumerate(num_tokens):
        for row in range(0, n, block_m):
            spans.append(index)
            rows.append(row)
    return spans, rows


@dataclass(frozen=True)
class PrefillSpans:
    """A step's prefill spans in the prefill kernel's form (int32, on the device)."""

    block_tables: torch.Tensor  # [spans, max_blocks]
    tile_span: torch.Tensor  # [tiles]: the span of each query tile
    tile_row: torch.Tensor  # [tiles]: its first row within the span
    span_start: torch.Tensor  # [spans]: first row in the batch
    span_tokens: torch.Tensor  # [spans]
    span_context: torch.Tensor  # [spans]


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    output: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Rows ``0..len(context_lens)-1`` of ``output`` (``[tokens, heads, head_dim]``): one query
    token per row over its blocks. Graph-safe: no host reads of the tensors."""
    size = block_table.shape[0]
    heads, head_dim = query.shape[1:]
    kv_heads = kv_cache.shape[3]
    group = heads // kv_heads
    _decode_kernel[(size, kv_heads)](
        query,
        kv_cache,
        block_table,
        context_lens,
        output,
        kv_cache.stride(0),
        query.stride(0),
        query.stride(1),
        block_table.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        output.stride(0),
        output.stride(1),
        scale,
        sliding_window or 0,
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        HAS_WINDOW=sliding_window is not None,
    )


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    spans: PrefillSpans,
    output: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    """The prefill spans' rows of ``output`` (``[tokens, heads, head_dim]``): each query token
    over its span's blocks up to its own position (the K/V of the step already written)."""
    heads, head_dim = query.shape[1:]
    kv_heads = kv_cache.shape[3]
    _prefill_kernel[(spans.tile_span.shape[0], heads)](
        query,
        kv_cache,
        spans.block_tables,
        spans.tile_span,
        spans.tile_row,
        spans.span_start,
        spans.span_tokens,
        spans.span_context,
        output,
        kv_cache.stride(0),
        query.stride(0),
        query.stride(1),
        spans.block_tables.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        output.stride(0),
        output.stride(1),
        scale,
        sliding_window or 0,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_SIZE=kv_cache.shape[2],
        HAS_WINDOW=sliding_window is not None,
        IEEE=query.dtype == torch.float32,
        # Triton's interpreter gets half-precision tl.dot wrong (numpy has no bfloat16).
        DOT_F32=interpreted(),
    )

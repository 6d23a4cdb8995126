"""Paged attention over a block-structured KV cache, and its reference in plain torch.

One layer's cache is one tensor::

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
             |  `--------- one block = block_size token slots
             `-- 0 = keys, 1 = values

A token at position ``p`` of a request lives in slot ``block_table[p // block_size] *
block_size + p % block_size``. Each step first writes the new tokens' K/V into their slots
(``slot_mapping``; float32 on CPU in one C call, ``kernels/fused_ops.py``), then every request
attends over its own blocks. In the reference, decoding requests (one query token each) are
gathered through their block tables into one padded batch for SDPA; requests with several query
tokens (prefill chunks) go through SDPA too: a run of new prompts of one length in one call, a
chunk after a cached prefix over its gathered blocks with a causal mask shifted by the tokens
already cached.

A sliding-window layer (Mistral, some Qwen2 layers) masks keys more than ``sliding_window - 1``
positions behind each query, as transformers does (``kv_pos > q_pos - window``). The blocks
behind the window stay allocated: the mask is exact, only the memory saving is not taken.

Backends. The model files call :func:`paged_attention` only; it writes the new K/V and hands
the rest to the step's backend (``metadata.backend``), which prepared its own view of the
metadata once per step (``prepare``; e.g. int32 block tables for a GPU kernel). The code in this
file is the reference backend (``ReferenceBackend``: plain torch, on any device);
``cpu_kernel_attention.py`` runs the C decode kernel on CPU, ``triton_backend.py`` the Triton
kernels, and ``attention_backends.py`` picks one for a device (``SWITCHBOARD_ATTENTION_BACKEND``).
Metadata with no backend runs the reference.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from switchboard.kernels import fused_ops

if TYPE_CHECKING:
    from switchboard.models.lora.stacks import LoraBatch


@dataclass
class PrefillSpan:
    """A request with several query tokens in this step."""

    token_start: int  # first row of its query tokens in the flattened batch
    num_tokens: int
    context_len: int  # tokens in the cache after this step, this chunk included
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] long, on the device
    # The chunk reaches past the prompt: generated tokens recomputed (a resumed or preempted
    # request) or proposed ones. Decode attended those one row at a time; a CPU kernel does too.
    past_prompt: bool = False
    # sliding_window -> the causal mask, built by the first layer that needs it in this step
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def causal_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[num_tokens, context_len] bool: query i (at position context_len - num_tokens + i)
        sees the keys up to it, and no further back than the window."""
        mask = self._masks.get(sliding_window)
        if mask is None:
            device = self.block_ids.device
            first = self.context_len - self.num_tokens
            query_pos = torch.arange(first, self.context_len, device=device)
            key_pos = torch.arange(self.context_len, device=device)
            mask = key_pos[None, :] <= query_pos[:, None]
            if sliding_window is not None:
                mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
            self._masks[sliding_window] = mask
        return mask


@dataclass
class DecodeBatch:
    """Requests with exactly one query token each; they occupy rows ``0..size-1``."""

    block_table: torch.Tensor  # [size, max_blocks] long; padded rows point at block 0
    context_lens: torch.Tensor  # [size] long
    max_context_len: int
    # Every row's context is max_context_len long (one request, or all at the same length):
    # without a window, no key is masked and attention runs without a mask.
    all_full_length: bool = False
    # sliding_window -> the key mask, built by the first layer that needs it in this step
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return self.block_table.shape[0]

    def key_mask(self, sliding_window: int | None) -> torch.Tensor | None:
        """[size, 1, 1, max_context_len] bool: the cached keys each row's query sees (its
        context, no further back than the window; the query sits at context_len - 1). None
        when every row sees every key."""
        if self.all_full_length and (
            sliding_window is None or sliding_window >= self.max_context_len
        ):
            return None
        mask = self._masks.get(sliding_window)
        if mask is None:
            context_lens = self.context_lens
            positions = torch.arange(self.max_context_len, device=context_lens.device)
            mask = positions[None, :] < context_lens[:, None]
            if sliding_window is not None:
                mask &= positions[None, :] >= (context_lens - sliding_window)[:, None]
            mask = self._masks[sliding_window] = mask[:, None, None, :]
        return mask


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each request attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] long
    decode: DecodeBatch | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Set by AttentionBackend.prepare (once per step); None = the reference backend.
    backend: AttentionBackend | None = None
    prepared: Any = None  # the backend's own per-step metadata
    # The step's rows of LoRA adapters (models/lora); None = every row on the base model.
    lora: LoraBatch | None = None


class AttentionBackend:
    """How a step's attention runs over the paged cache: ``prepare`` once per step (after the
    input batch is built), then ``forward`` for every layer. The K/V of the step's tokens are
    already in the cache when ``forward`` runs."""

    name = "base"

    def decode_graphs_supported(self, block_size: int) -> bool:
        """Whether a decode step over ``block_size``-token blocks can be captured in a CUDA graph
        (no host reads, no data-dependent shapes): only a backend of device kernels can."""
        return False

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        metadata.backend = self
        return metadata

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """``[num_tokens, heads, head_dim]`` attention output (not flattened)."""
        raise NotImplementedError


class ReferenceBackend(AttentionBackend):
    """Plain torch on any device: decodes gathered out of the cache for one SDPA call, prefill
    chunks through SDPA (``reference_prefill_attention``)."""

    name = "reference"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        output = torch.empty_like(query)
        if metadata.decode is not None:
            decode = metadata.decode
            output[: decode.size] = gathered_decode_attention(
                query[: decode.size], kv_cache, decode, scale, sliding_window
            )
        reference_prefill_attention(
            output, query, key, value, kv_cache, metadata, scale, sliding_window
        )
        return output


REFERENCE = ReferenceBackend()


def new_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    # Zeroed, not empty: masked-out slots are still multiplied by a zero weight, and a NaN left
    # in never-written memory would poison the sum.
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # On CPU, private anonymous memory: the kernel hands out zeroed pages when they are first
    # touched. torch.zeros wrote every page at start instead (2 GiB: 4 s of a 10 s start on a
    # 2-core VM), most of them for blocks a short run never uses.
    pages = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` (``[num_tokens, kv_heads, head_dim]``) in their slots."""
    if fused_ops.write_kv(kv_cache, key, value, slot_mapping):  # float32 on CPU: one C call
        return
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    dtype = kv_cache.dtype  # the cache's dtype may differ from the model's (--kv-cache-dtype)
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(dtype))


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention for all requests of a step.

    ``query`` is ``[num_tokens, heads, head_dim]``; ``key``/``value`` are this step's new
    ``[num_tokens, kv_heads, head_dim]``. Returns ``[num_tokens, heads * head_dim]``.
    ``sliding_window`` = how many positions (the query's own included) a query sees.
    """
    write_kv(kv_cache, key, value, metadata.slot_mapping)
    backend = metadata.backend or REFERENCE
    output = backend.forward(query, key, value, kv_cache, metadata, scale, sliding_window)
    return output.flatten(1)


def reference_prefill_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    spans: list[PrefillSpan] | None = None,
) -> None:
    """The prefill spans' rows of ``output`` in torch (``spans``: these of the step's only):
    plain causal attention in one call for each run of adjacent new prompts of one length
    (nothing cached, no window cut; a run may be one prompt), masked attention over its context
    for any other span."""
    spans = metadata.prefills if spans is None else spans
    i = 0
    while i < len(spans):
        span = spans[i]
        if _is_fresh(span, sliding_window):
            run = _equal_fresh_run(spans, i, sliding_window)
            rows = slice(span.token_start, span.token_start + run * span.num_tokens)
            output[rows] = _batched_causal_attention(
                query[rows], key[rows], value[rows], run, scale
            )
            i += run
            continue
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        if span.num_tokens == span.context_len:  # nothing cached, a window cuts: this step's k/v
            keys, values = key[rows], value[rows]
        else:
            keys, values = (t.to(query.dtype) for t in _cached_context(kv_cache, span))
        output[rows] = _masked_prefill_attention(
            query[rows], keys, values, span, scale, sliding_window
        )
        i += 1


def _is_fresh(span: PrefillSpan, sliding_window: int | None) -> bool:
    """A whole prompt in this step (nothing cached before it) that no window cuts."""
    return span.num_tokens == span.context_len and (
        sliding_window is None or sliding_window >= span.context_len
    )


def _equal_fresh_run(spans: list[PrefillSpan], first: int, sliding_window: int | None) -> int:
    """How many spans from ``first`` on are fresh, of one length and in adjacent rows (1 when
    the first is not fresh: it is attended alone)."""
    head = spans[first]
    if not _is_fresh(head, sliding_window):
        return 1
    end = first + 1
    while end < len(spans):
        span = spans[end]
        expected_start = head.token_start + (end - first) * head.num_tokens
        if (
            span.num_tokens != head.num_tokens
            or span.token_start != expected_start
            or not _is_fresh(span, sliding_window)
        ):
            break
        end += 1
    return end - first


def _batched_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: int, scale: float
) -> torch.Tensor:
    """Causal attention of ``batch`` prompts of one length laid end to end: one SDPA call
    instead of one per prompt (each call wakes the intra-op threads; at 32-token prompts the
    calls cost more than the arithmetic). ``[batch * length, heads, head_dim]`` in and out."""
    rows, heads, head_dim = query.shape
    length = rows // batch
    queries = query.view(batch, length, heads, head_dim).transpose(1, 2)
    keys = key.view(batch, length, -1, head_dim).transpose(1, 2)
    values = value.view(batch, length, -1, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(rows, heads, head_dim)


def gathered_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: DecodeBatch,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """The torch path (any device): each row's context gathered out of the cache, then SDPA."""
    size, max_blocks = batch.block_table.shape
    block_size, _, head_dim = kv_cache.shape[2:]
    length = batch.max_context_len
    # [2, size, max_blocks, block_size, kv_heads, head_dim] -> [2, size, kv_heads, length, dim]
    gathered = kv_cache[:, batch.block_table].view(2, size, max_blocks * block_size, -1, head_dim)
    keys = gathered[0, :, :length].transpose(1, 2).to(query.dtype)
    values = gathered[1, :, :length].transpose(1, 2).to(query.dtype)
    out = F.scaled_dot_product_attention(
        query[:, :, None, :],
        keys,
        values,
        attn_mask=batch.key_mask(sliding_window),
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, 0, :]


def _cached_context(kv_cache: torch.Tensor, span: PrefillSpan) -> tuple[torch.Tensor, ...]:
    """The span's whole context (cached prefix + this chunk), gathered out of its blocks:
    keys and values ``[context_len, kv_heads, head_dim]``."""
    blocks = kv_cache[:, span.block_ids].flatten(1, 2)[:, : span.context_len]
    return blocks[0], blocks[1]


def _masked_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    span: PrefillSpan,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """A chunk after a cached prefix, or one a window cuts. ``key``/``value``: the span's
    context ``[context_len, kv_heads, head_dim]``."""
    keys = key.transpose(0, 1)[None]
    values = value.transpose(0, 1)[None]
    queries = query.transpose(0, 1)[None]  # [1, heads, num_tokens, dim]
    mask = span.causal_mask(sliding_window)
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)

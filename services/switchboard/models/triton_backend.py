"""The Triton attention backend: a step's metadata laid out once for the Triton paged-attention
kernels (``kernels/triton_paged_attention.py``: int32 block tables, query tiles), then every
layer's attention on them. A part of the step the kernels cannot take (a block size that is not
a power of two; prefill also below 16) runs the torch reference instead, logged once.

Importing this module imports triton: ``attention_backends.select_backend`` imports it only when
this backend is chosen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from switchboard.kernels import triton_paged_attention as triton_kernels
from switchboard.models.attention import (
    AttentionBackend,
    AttentionMetadata,
    gathered_decode_attention,
    reference_prefill_attention,
)

logger = logging.getLogger(__name__)


@dataclass
class TritonPrepared:
    """One step's metadata in the kernels' form, built once by ``TritonBackend.prepare``."""

    decode_block_table: torch.Tensor | None = None  # [size, max_blocks] int32
    decode_context_lens: torch.Tensor | None = None  # [size] int32
    prefill: triton_kernels.PrefillSpans | None = None


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def decode_graphs_supported(self, block_size: int) -> bool:
        return triton_kernels.decode_supported(block_size)

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        prepared = TritonPrepared()
        decode = metadata.decode
        if decode is not None:
            prepared.decode_block_table = decode.block_table.to(torch.int32)
            prepared.decode_context_lens = decode.context_lens.to(torch.int32)
        if metadata.prefills:
            prepared.prefill = _prefill_spans(metadata)
        metadata.prepared = prepared
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
        prepared = metadata.prepared
        if not isinstance(prepared, TritonPrepared):  # not prepared by us: do it now
            prepared = self.prepare(metadata).prepared
        if query.stride(-1) != 1:
            query = query.contiguous()
        output = torch.empty_like(query)
        block_size = kv_cache.shape[2]
        decode = metadata.decode
        if decode is not None:
            if triton_kernels.decode_supported(block_size) and kv_cache.is_contiguous():
                assert prepared.decode_block_table is not None
                assert prepared.decode_context_lens is not None
                triton_kernels.decode_attention(
                    query,
                    kv_cache,
                    prepared.decode_block_table,
                    prepared.decode_context_lens,
                    output,
                    scale,
                    sliding_window,
                )
            else:
                self._fall_back("decode", block_size)
                output[: decode.size] = gathered_decode_attention(
                    query[: decode.size], kv_cache, decode, scale, sliding_window
                )
        if metadata.prefills:
            if triton_kernels.prefill_supported(block_size) and kv_cache.is_contiguous():
                assert prepared.prefill is not None
                triton_kernels.prefill_attention(
                    query, kv_cache, prepared.prefill, output, scale, sliding_window
                )
            else:
                self._fall_back("prefill", block_size)
                reference_prefill_attention(
                    output, query, key, value, kv_cache, metadata, scale, sliding_window
                )
        return output

    def _fall_back(self, part: str, block_size: int) -> None:
        if part not in self._warned:
            self._warned.add(part)
            logger.warning(
                "Triton %s attention needs a power-of-two block size%s (have %d): "
                "using the reference path for it",
                part,
                " >= 16" if part == "prefill" else "",
                block_size,
            )


def _prefill_spans(metadata: AttentionMetadata) -> triton_kernels.PrefillSpans:
    spans = metadata.prefills
    device = spans[0].block_ids.device
    max_blocks = max(span.block_ids.shape[0] for span in spans)
    tables = torch.zeros((len(spans), max_blocks), dtype=torch.int32, device=device)
    for index, span in enumerate(spans):
        tables[index, : span.block_ids.shape[0]] = span.block_ids
    tile_span, tile_row = triton_kernels.prefill_tiles(
        [s.num_tokens for s in spans], triton_kernels.PREFILL_BLOCK_M
    )
    host = torch.tensor(
        [
            [s.token_start for s in spans],
            [s.num_tokens for s in spans],
            [s.context_len for s in spans],
        ],
        dtype=torch.int32,
    ).to(device, non_blocking=True)
    tiles = torch.tensor([tile_span, tile_row], dtype=torch.int32).to(device, non_blocking=True)
    return triton_kernels.PrefillSpans(
        block_tables=tables,
        tile_span=tiles[0],
        tile_row=tiles[1],
        span_start=host[0],
        span_tokens=host[1],
        span_context=host[2],
    )

"""The CPU attention backend: the C decode kernel (``kernels/paged_decode.py``), which reads the
paged cache (float32 or bfloat16) in place, for every query row it can take (float32 or
bfloat16, computed in float32).

Decodes go to the kernel. So do prompt tokens while a chunk's context is short
(``KERNEL_MAX_CONTEXT``), and every chunk of a few tokens: each is one more row of the same kernel
call, a row whose context ends at the token's own position (the causal mask; SDPA's per-call cost
was most of the attention time of a step of short prompts). A chunk of many tokens over a long
context goes to the torch reference, and the rest of its step to the kernel; any other dtype or
device runs the reference whole. Where a chunk goes is its own matter, whatever shares its
step, so its rows have the same floats in every step, and a request's tokens do not depend on
the batch it runs in (a decode with its proposed tokens, speculative decoding, included).
On this backend a decode-only step of a Llama-family model may skip the layers' Python and run
in one C call (``LlamaForCausalLM``, ``kernels/decode_stack.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from switchboard.kernels import paged_decode
from switchboard.models.attention import (
    REFERENCE,
    AttentionBackend,
    AttentionMetadata,
    PrefillSpan,
    reference_prefill_attention,
)

# Prompt chunks whose context (cached tokens and their own) is at most this long go through
# the decode kernel, one query row per token; a longer one takes SDPA, whose blocked kernel
# reuses each key across queries while the kernel reads a row's whole context per row.
# Measured per layer on a 2-core EPYC, two threads, kernel against SDPA (8 heads of 32 / 9
# heads of 64): 8 new prompts of 32 tokens 586 / 442 us against 691 / 542; a new one of 256
# 1,198 / 1,404 against 1,486 / 1,469; 32 tokens after 224 cached 300 / 384 against 420 / 423;
# 64 after 448 844 / 1,269 against 910 / 1,045; 256 after 1,792 12.7 / 19.5 ms against
# 8.0 / 11.1 ms.
KERNEL_MAX_CONTEXT = 256
# A chunk of at most this many tokens goes to the kernel whatever its context: a decode step's
# token with its proposed ones (speculative decoding) is a few rows of one block table, which the
# kernel attends as a group reading the context once for all of them; SDPA gathered the whole
# context out of the cache per layer for them (SmolLM2-135M, 5 tokens after 400: a step of
# ~0.8 s against ~30 ms for one token).
KERNEL_ANY_CONTEXT_MAX_TOKENS = 16
# A model whose matmuls round each row to 8 bits (integer dot products) sends every chunk to the
# kernel: SDPA's sums differ from the kernel's by float rounding, which 8-bit rounding of the
# next matmul's input turns into different tokens (SmolLM2 from its GGUF, a 300-token prompt
# prefilled whole against in chunks of 9: log-probabilities apart by up to 17), so a request's
# tokens would depend on how its prompt was chunked, hence on the requests beside it. Measured,
# the same model, one 2,048-token prompt in chunks of 512: 4.6 s against 3.5 s through SDPA
# (512 tokens: 0.62 against 0.56 s). ``CPU_KERNEL_EVERY_CHUNK`` is that backend.


@dataclass
class KernelRows:
    """The step's query tokens as kernel rows (``token_rows``), built by the first layer."""

    every_chunk: bool = False  # the backend's: no chunk takes SDPA
    built: bool = False
    # [num_tokens, max_blocks] block table and [num_tokens] context lengths; None = the kernel
    # does not take the whole step
    rows: tuple[torch.Tensor, torch.Tensor] | None = None
    # otherwise: the kernel's rows (decodes and short chunks: their row indices, block table and
    # context lengths; None when there are none) and the spans left to the reference
    kernel_part: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    reference_spans: list[PrefillSpan] = field(default_factory=list)


class CpuKernelBackend(AttentionBackend):
    """The C decode kernel where it applies, the torch reference elsewhere. Chosen on CPU when
    the kernel loads (``attention_backends``)."""

    name = "cpu-kernel"

    def __init__(self, every_chunk: bool = False) -> None:
        self.every_chunk = every_chunk  # else long chunks over a long context take SDPA

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        metadata.prepared = KernelRows(self.every_chunk)
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
        if not paged_decode.usable_for(query, kv_cache):
            return REFERENCE.forward(query, key, value, kv_cache, metadata, scale, sliding_window)
        prepared = metadata.prepared
        if not isinstance(prepared, KernelRows):  # not prepared by us: do it now
            prepared = self.prepare(metadata).prepared
        build_rows(prepared, metadata, query.shape[0])
        if prepared.rows is not None:
            block_table, context_lens = prepared.rows
            return paged_decode.paged_decode(
                query, kv_cache, block_table, context_lens, scale, sliding_window
            )
        output = torch.empty_like(query)
        if prepared.kernel_part is not None:
            rows, block_table, context_lens = prepared.kernel_part
            output[rows] = paged_decode.paged_decode(
                query[rows], kv_cache, block_table, context_lens, scale, sliding_window
            )
        reference_prefill_attention(
            output,
            query,
            key,
            value,
            kv_cache,
            metadata,
            scale,
            sliding_window,
            spans=prepared.reference_spans,
        )
        return output


CPU_KERNEL = CpuKernelBackend()
CPU_KERNEL_EVERY_CHUNK = CpuKernelBackend(every_chunk=True)  # for models that round rows to 8 bits


def stack_rows(
    metadata: AttentionMetadata, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of a step the one-call decode stack can take besides decodes: chunks the
    decode kernel attends (a decode with its proposed tokens, a short prompt or a chunk of one
    after a short context), as ``token_rows`` lays them out (kept on the metadata for the
    layers' attention too). None for a step with a chunk SDPA attends: the layers take it. The
    stack's rows are the layers' floats in float32 (the same kernels); a step of 64 decodes
    and a 32-token prompt (llama-100m, bfloat16) took about half the time of the layers'."""
    prepared = metadata.prepared
    if not isinstance(prepared, KernelRows):
        return token_rows(metadata, num_tokens)
    return build_rows(prepared, metadata, num_tokens).rows


def build_rows(prepared: KernelRows, metadata: AttentionMetadata, num_tokens: int) -> KernelRows:
    """Fill ``prepared`` once per step, whoever asks first (the decode stack or a layer's
    attention): the whole step as kernel rows, or else its split between the kernel and the
    reference. Both halves at once: a step the stack declines goes on to the layers, whose
    attention reads the split."""
    if not prepared.built:
        prepared.rows = token_rows(metadata, num_tokens, prepared.every_chunk)
        if prepared.rows is None:
            prepared.kernel_part, prepared.reference_spans = split_rows(
                metadata, prepared.every_chunk
            )
        prepared.built = True
    return prepared


def token_rows(
    metadata: AttentionMetadata, num_tokens: int, every_chunk: bool = False
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every query token of the step as a decode-kernel row: ``[num_tokens, max_blocks]``
    block table and ``[num_tokens]`` context lengths (a prompt token at position ``p`` sees
    ``p + 1`` keys, its own included: the causal mask). None when a chunk's context is too
    long for the kernel to be the faster, or the spans do not cover the rows."""
    spans = metadata.prefills
    if any(_reference_span(span, every_chunk) for span in spans):
        return None
    decode = metadata.decode
    decoded = 0 if decode is None else decode.size
    if decoded + sum(span.num_tokens for span in spans) != num_tokens:
        return None
    if not spans and decode is not None:  # decodes only: their own table, not a copy
        return decode.block_table, decode.context_lens
    return _lay_out_rows(metadata, spans, [span.token_start for span in spans], num_tokens)


def _lay_out_rows(
    metadata: AttentionMetadata, spans: list[PrefillSpan], starts: list[int], num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_rows, max_blocks]`` block table and ``[num_rows]`` context lengths: the decodes
    in the first rows, each span's tokens from its row in ``starts`` (a prompt token at
    position ``p`` sees ``p + 1`` keys)."""
    decode = metadata.decode
    device = metadata.slot_mapping.device
    width = max([span.block_ids.shape[0] for span in spans] + [0])
    if decode is not None:
        width = max(width, decode.block_table.shape[1])
    table = torch.zeros(num_rows, width, dtype=torch.long, device=device)
    lens = torch.empty(num_rows, dtype=torch.long, device=device)
    if decode is not None:
        table[: decode.size, : decode.block_table.shape[1]] = decode.block_table
        lens[: decode.size] = decode.context_lens
    for span, start in zip(spans, starts, strict=True):
        rows = slice(start, start + span.num_tokens)
        table[rows, : span.block_ids.shape[0]] = span.block_ids
        first = span.context_len - span.num_tokens + 1
        torch.arange(first, span.context_len + 1, out=lens[rows])
    return table, lens


def split_rows(
    metadata: AttentionMetadata, every_chunk: bool = False
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, list[PrefillSpan]]:
    """For a step the kernel does not take whole: its decodes and the chunks it would take in a
    step of their own (at most ``KERNEL_ANY_CONTEXT_MAX_TOKENS`` tokens, or a context of at most
    ``KERNEL_MAX_CONTEXT``; any under ``every_chunk``) as kernel rows (row indices, block
    table, context lengths; None when there are none), and the other chunks, left to the
    reference."""
    short = [s for s in metadata.prefills if not _reference_span(s, every_chunk)]
    longer = [s for s in metadata.prefills if _reference_span(s, every_chunk)]
    decode = metadata.decode
    decoded = 0 if decode is None else decode.size
    if not short:
        if decode is None:
            return None, longer
        rows = torch.arange(decoded, device=decode.block_table.device)
        return (rows, decode.block_table, decode.context_lens), longer
    starts = list(itertools.accumulate((span.num_tokens for span in short), initial=decoded))
    num_rows = starts.pop()
    table, lens = _lay_out_rows(metadata, short, starts, num_rows)
    index = torch.empty(num_rows, dtype=torch.long, device=table.device)
    torch.arange(decoded, out=index[:decoded])
    for span, start in zip(short, starts, strict=True):
        end = span.token_start + span.num_tokens
        torch.arange(span.token_start, end, out=index[start : start + span.num_tokens])
    return (index, table, lens), longer


def _reference_span(span: PrefillSpan, every_chunk: bool) -> bool:
    """A chunk SDPA attends faster than the kernel: many tokens over a long context (none
    under ``every_chunk``). A chunk past the prompt stays on the kernel, which attended its
    tokens as decode rows: its floats, hence its next tokens, are the undisturbed run's."""
    return (
        not every_chunk
        and not span.past_prompt
        and span.context_len > KERNEL_MAX_CONTEXT
        and span.num_tokens > KERNEL_ANY_CONTEXT_MAX_TOKENS
    )

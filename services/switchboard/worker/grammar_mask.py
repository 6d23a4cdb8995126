"""Apply the engine's structured-output bitmask to the logits, before sampling (torch).

The engine core computes, for each constrained request that samples in the step, which tokens
its grammar allows next (``engine/constrained_decoding.py``) and sends the rows packed in the step
(``SchedulerOutput.grammar_bitmask``: ceil(vocab / 32) little-endian int32 words per row, bit
``t % 32`` of word ``t // 32`` = token ``t`` allowed, rows in ``structured_request_ids`` order).
Here every disallowed token's logit becomes -inf on the matching logits rows; unconstrained rows
of the same batch are untouched. Tokens beyond the mask's width (a model vocabulary padded past
the tokenizer's) are disallowed too.
"""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: bytes, num_rows: int, vocab_size: int) -> torch.Tensor:
    """``[num_rows, vocab_size]`` bool, True where allowed (CPU)."""
    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(num_rows, -1)
    allowed = ((words.unsqueeze(-1) >> _BITS) & 1).bool().view(num_rows, -1)
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(num_rows, vocab_size - width, dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)


def apply_grammar_bitmask(
    logits: torch.Tensor,
    bitmask: bytes,
    structured_request_ids: list[str],
    sampled_request_ids: list[str],
) -> None:
    """Mask ``logits`` ``[len(sampled_request_ids), vocab]`` in place. A mask row whose request
    does not sample here (not expected: the engine sends rows for sampling requests only) is
    skipped."""
    if not bitmask or not structured_request_ids:
        return
    row_of = {rid: row for row, rid in enumerate(sampled_request_ids)}
    mask_rows, logit_rows = [], []
    for i, rid in enumerate(structured_request_ids):
        row = row_of.get(rid)
        if row is not None:
            mask_rows.append(i)
            logit_rows.append(row)
    if not logit_rows:
        return
    allowed = unpack_bitmask(bitmask, len(structured_request_ids), logits.shape[-1])
    if len(mask_rows) != len(structured_request_ids):
        allowed = allowed[mask_rows]
    rows = torch.tensor(logit_rows, dtype=torch.long, device=logits.device)
    selected = logits.index_select(0, rows)
    selected.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, rows, selected)

"""What changes logits before the draw: token masks, logit bias and penalties, per row.

Every part is optional and touches only the rows that use it, so a batch where a few requests
set a penalty pays for those rows only. Order (vLLM's)::

    allowed_token_ids  every other token -> -inf
    banned tokens      -> -inf (bad words whose prefix ends the output; EOS and stop tokens
                       before min_tokens)
    logit_bias         += bias
    penalties          repetition (HF: logit / p if > 0 else logit * p, over prompt + output),
                       then -= frequency * count and -= presence * (count > 0) (OpenAI: output)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")


@dataclass
class Penalties:
    rows: torch.Tensor  # [k] long: the batch rows with a penalty
    presence: torch.Tensor  # [k, 1] float32
    frequency: torch.Tensor  # [k, 1] float32
    output_counts: torch.Tensor  # [k, vocab] float32: each token's count in the row's output
    repetition: torch.Tensor | None = None  # [k, 1] float32; None when no row has one
    prompt_mask: torch.Tensor | None = None  # [k, vocab] bool: in the prompt (with repetition)


@dataclass
class TokenPairs:
    """Sparse (row, token) entries, e.g. the tokens banned in each row."""

    rows: torch.Tensor  # [m] long
    token_ids: torch.Tensor  # [m] long
    values: torch.Tensor | None = None  # [m] float32 (logit bias)


@dataclass
class LogitsProcessing:
    allowed_rows: torch.Tensor | None = None  # [k] long
    disallowed_mask: torch.Tensor | None = None  # [k, vocab] bool: True = not allowed
    banned: TokenPairs | None = None
    logit_bias: TokenPairs | None = None
    penalties: Penalties | None = None


def apply_logits_processing(logits: torch.Tensor, processing: LogitsProcessing) -> torch.Tensor:
    """Apply every part of ``processing`` to float32 ``logits`` ``[rows, vocab]`` in place."""
    if processing.allowed_rows is not None and processing.disallowed_mask is not None:
        rows = processing.allowed_rows
        masked = logits.index_select(0, rows).masked_fill_(processing.disallowed_mask, _NEG_INF)
        logits.index_copy_(0, rows, masked)
    if processing.banned is not None:
        banned = processing.banned
        logits.index_put_(
            (banned.rows, banned.token_ids), torch.tensor(_NEG_INF, device=logits.device)
        )
    if processing.logit_bias is not None:
        bias = processing.logit_bias
        assert bias.values is not None
        logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if processing.penalties is not None:
        apply_penalties(logits, processing.penalties)
    return logits


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    rows = penalties.rows
    selected = logits.index_select(0, rows)
    counts = penalties.output_counts
    in_output = counts > 0
    if penalties.repetition is not None:
        seen = in_output if penalties.prompt_mask is None else in_output | penalties.prompt_mask
        repetition = penalties.repetition
        penalised = torch.where(selected > 0, selected / repetition, selected * repetition)
        selected = torch.where(seen, penalised, selected)
    selected -= penalties.frequency * counts
    selected -= penalties.presence * in_output
    logits.index_copy_(0, rows, selected)
    return logits

"""Logprobs of chosen tokens, their ranks and the top-N alternatives, as wire structs.

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before
penalties, temperature or filtering: vLLM's default ``raw_logprobs``), so they compare with
transformers' scores. The same code serves output tokens (chosen = sampled) and prompt tokens
(chosen = the next prompt token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from switchboard.wire.engine_msgs import TokenLogprobs

# Prompt logprobs need full-vocabulary logits at every prompt position: at most this many rows
# at a time, so a long prefill chunk does not allocate chunk x vocab floats at once.
PROMPT_LOGPROBS_ROWS_PER_SLICE = 256


def token_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_top: list[int]
) -> list[TokenLogprobs]:
    """One ``TokenLogprobs`` per row of ``logprobs`` ``[k, vocab]`` (already log-softmaxed):
    the chosen token (``chosen`` ``[k]``) with its rank (1 = most likely), then the row's
    ``num_top[i]`` most likely tokens with ranks 1..N."""
    chosen_logprobs = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > chosen_logprobs).sum(dim=-1).add_(1)
    max_top = max(num_top, default=0)
    if max_top > 0:
        top_values, top_ids = logprobs.topk(max_top, dim=-1)
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    else:
        top_values_list = top_ids_list = [[] for _ in num_top]
    results = []
    for i, (token_id, logprob, rank) in enumerate(
        zip(chosen.tolist(), chosen_logprobs[:, 0].tolist(), ranks.tolist(), strict=True)
    ):
        n = num_top[i]
        results.append(
            TokenLogprobs(
                token_ids=[token_id, *top_ids_list[i][:n]],
                logprobs=[logprob, *top_values_list[i][:n]],
                ranks=[rank, *range(1, n + 1)],
            )
        )
    return results


def prompt_token_logprobs(
    hidden_rows: torch.Tensor,
    next_token_ids: torch.Tensor,
    num_top: list[int],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[TokenLogprobs]:
    """Logprobs of ``next_token_ids`` ``[k]`` given the final hidden states ``[k, hidden]`` of
    the positions before them, in slices of ``PROMPT_LOGPROBS_ROWS_PER_SLICE`` rows."""
    results: list[TokenLogprobs] = []
    for start in range(0, hidden_rows.shape[0], PROMPT_LOGPROBS_ROWS_PER_SLICE):
        end = start + PROMPT_LOGPROBS_ROWS_PER_SLICE
        logprobs = compute_logits(hidden_rows[start:end]).log_softmax(dim=-1)
        results += token_logprobs(logprobs, next_token_ids[start:end], num_top[start:end])
    return results

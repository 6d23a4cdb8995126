"""Verifying proposed tokens (speculative decoding): one forward pass, then one draw per position.

A request with proposals ``d_0 .. d_{k-1}`` has ``k + 1`` logits rows: row ``i`` is the model's
distribution of the token after ``d_{i-1}`` (row 0: after its last known token). Each row is
sampled exactly as a request alone would be sampled at that output index (same settings, and
for a seeded request the same seeded uniform), and the request gets the samples up to and
including the first that differs from its proposal::

    samples   s_0 s_1 s_2 s_3 s_4        proposals  d_0 d_1 d_2 d_3
    s_0 = d_0, s_1 = d_1, s_2 != d_2  ->  emitted s_0 s_1 s_2  (2 accepted + the model's own)

Every emitted token is the model's own sample given the tokens before it (a proposal is kept only
where it equals that sample), so the output has exactly the distribution of decoding one token at
a time. For a proposal that is one token (no distribution, as an n-gram's) this is the rejection
rule of speculative sampling: ``d_i`` is accepted with probability ``p_i(d_i)``, and on rejection
the token is drawn from ``p_i`` without ``d_i``, renormalised (the sample conditioned on being
``!= d_i``). Greedy rows accept a proposal iff it is the argmax. A seeded request draws the same
uniforms as without speculation (one per output index), so its tokens are the same with
speculation on or off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from switchboard.worker.sampler import SamplingBatch, new_request_generator
from switchboard.worker.sampling_inputs import build_sampling_batch
from switchboard.worker.step_inputs import RequestState


def expand_rows(
    states: Sequence[RequestState], proposals: dict[str, list[int]]
) -> tuple[list[RequestState], list[list[int]]]:
    """One entry per logits row (a state repeated once per proposal after its own row), and
    each state's proposals ([] for most)."""
    if not proposals:
        return list(states), [[] for _ in states]
    rows: list[RequestState] = []
    drafts_of: list[list[int]] = []
    for state in states:
        drafts = proposals.get(state.request_id, [])
        rows += [state] * (1 + len(drafts))
        drafts_of.append(drafts)
    return rows, drafts_of


def build_verify_batch(
    rows: Sequence[RequestState],
    drafts_of: Sequence[list[int]],
    vocab_size: int,
    device: torch.device,
) -> SamplingBatch:
    """The sampling batch of the expanded rows: a seeded request's row ``i`` draws from a
    generator set for output index ``num_output_tokens + i``, as it would one step at a time."""
    batch = build_sampling_batch(rows, vocab_size, device)
    row = 0
    for drafts in drafts_of:
        state = rows[row]
        seed = state.sampling_params.seed
        if drafts and seed is not None and row in batch.generators:
            for i in range(1, len(drafts) + 1):
                batch.generators[row + i] = new_request_generator(seed, state.num_output_tokens + i)
        row += 1 + len(drafts)
    return batch


def accepted_tokens(samples: list[int], drafts: list[int]) -> list[int]:
    """The samples up to and including the first that differs from its proposal (all of them,
    the last one beyond the proposals, when every proposal matches)."""
    for i, draft in enumerate(drafts):
        if samples[i] != draft:
            return samples[: i + 1]
    return samples[: len(drafts) + 1]

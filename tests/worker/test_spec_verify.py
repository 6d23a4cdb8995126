"""Verification of proposed tokens keeps the model's distribution: over many draws of a small
vocabulary, the first emitted token follows p_0 whatever was proposed, and the token after an
accepted proposal follows p_1 (chi-square, fixed seed)."""

from __future__ import annotations

import pytest
import torch

from switchboard.wire.engine_msgs import SamplingParams
from switchboard.worker.sampler import sample
from switchboard.worker.spec_verify import accepted_tokens, build_verify_batch, expand_rows
from switchboard.worker.step_inputs import RequestState

VOCAB = 6
NUM_REQUESTS = 8_000
# chi-square critical value for 5 degrees of freedom at p = 0.001
CHI2_CRITICAL_DF5 = 20.515


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_accepted_tokens_stop_at_the_first_difference():
    assert accepted_tokens([1, 2, 3], [1, 2]) == [1, 2, 3]
    assert accepted_tokens([1, 7, 3], [1, 2]) == [1, 7]
    assert accepted_tokens([5, 2, 3], [1, 2]) == [5]
    assert accepted_tokens([4], []) == [4]


def test_rejection_sampling_keeps_the_distribution():
    torch.manual_seed(0)
    logits_0 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 1.5])
    logits_1 = torch.tensor([0.0, 0.3, 1.2, -1.0, 0.8, 0.1])
    temperature = 0.9
    p_0 = (logits_0 / temperature).softmax(-1)
    p_1 = (logits_1 / temperature).softmax(-1)
    draft = 1  # neither the likeliest token nor a rare one
    states = [
        RequestState(f"r{i}", [0, 3, 4], [0], 2, SamplingParams(temperature=temperature))
        for i in range(NUM_REQUESTS)
    ]
    rows, drafts_of = expand_rows(states, {s.request_id: [draft] for s in states})
    logits = torch.stack([logits_0, logits_1]).repeat(NUM_REQUESTS, 1)
    batch = build_verify_batch(rows, drafts_of, VOCAB, torch.device("cpu"))
    samples = sample(logits, batch).token_ids.tolist()
    firsts, seconds = [], []
    for i in range(NUM_REQUESTS):
        emitted = accepted_tokens(samples[2 * i : 2 * i + 2], [draft])
        firsts.append(emitted[0])
        if len(emitted) == 2:
            seconds.append(emitted[1])
    first_counts = torch.bincount(torch.tensor(firsts), minlength=VOCAB).double()
    second_counts = torch.bincount(torch.tensor(seconds), minlength=VOCAB).double()
    # accepted with probability p_0(draft); otherwise a token of the rest, renormalised
    assert len(seconds) / NUM_REQUESTS == pytest.approx(float(p_0[draft]), abs=0.02)
    assert chi_square(first_counts, p_0.double()) < CHI2_CRITICAL_DF5
    assert chi_square(second_counts, p_1.double()) < CHI2_CRITICAL_DF5
    rejected = first_counts.clone()
    rejected[draft] = 0
    residual = p_0.double().clone()
    residual[draft] = 0
    residual /= residual.sum()
    nonzero = residual > 0
    statistic = chi_square(rejected[nonzero], residual[nonzero])
    assert statistic < 18.467  # 4 degrees of freedom at p = 0.001

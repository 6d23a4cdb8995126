"""The sampler: greedy, top-k, top-p, temperature and per-request seeds."""

from __future__ import annotations

import torch

from switchboard.worker.sampler import (
    SamplingBatch,
    apply_top_k_top_p,
    new_request_generator,
    sample,
)

VOCAB = 50
CPU = torch.device("cpu")


def batch(rows: int, *, temperature=1.0, top_k=0, top_p=1.0, seeds=None) -> SamplingBatch:
    seeds = seeds or {}
    return SamplingBatch.build(
        temperatures=[temperature] * rows,
        top_ks=[top_k] * rows,
        top_ps=[top_p] * rows,
        generators={row: new_request_generator(seed, CPU, 0, VOCAB) for row, seed in seeds.items()},
        vocab_size=VOCAB,
        device=CPU,
    )


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(6)
    assert torch.equal(sample(logits, batch(6, temperature=0.0)), logits.argmax(-1))


def test_top_k_one_is_greedy_even_at_high_temperature():
    logits = random_logits(6)
    for _ in range(5):
        tokens = sample(logits, batch(6, temperature=5.0, top_k=1))
        assert torch.equal(tokens, logits.argmax(-1))


def test_greedy_and_random_rows_mix_in_one_batch():
    logits = random_logits(2)
    mixed = SamplingBatch.build([0.0, 1.0], [0, 0], [1.0, 1.0], {}, VOCAB, CPU)
    assert sample(logits, mixed)[0] == logits[0].argmax()


def test_top_p_restricts_to_the_nucleus():
    # Probabilities 0.5, 0.3, 0.15, then a long tail: top_p 0.7 keeps exactly the first two.
    probs = torch.tensor([0.5, 0.3, 0.15] + [0.05 / (VOCAB - 3)] * (VOCAB - 3))
    logits = probs.log().expand(400, VOCAB).contiguous()
    tokens = sample(logits, batch(400, top_p=0.7))
    assert set(tokens.tolist()) == {0, 1}


def test_top_k_keeps_only_the_k_best():
    # Three near-equal winners just above 47 others: unfiltered, the others win most draws.
    logits = torch.full((1, VOCAB), 8.0) + random_logits(1) * 0.01
    logits[0, [4, 17, 30]] = torch.tensor([9.0, 9.2, 9.1])
    logits = logits.expand(300, VOCAB).contiguous()
    best = {4, 17, 30}
    tokens = sample(logits, batch(300, top_k=3))
    assert set(tokens.tolist()) == best


def test_filtering_masks_per_row():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    filtered = apply_top_k_top_p(logits, torch.tensor([2, 4]), None)
    assert torch.isinf(filtered[0, :2]).all() and torch.isfinite(filtered[0, 2:]).all()
    assert torch.isfinite(filtered[1]).all()


def test_temperature_flattens_the_distribution():
    logits = torch.tensor([[2.0, 0.0] + [-30.0] * (VOCAB - 2)]).expand(2000, VOCAB).contiguous()
    cold = sample(logits, batch(2000, temperature=0.3)).eq(1).float().mean()
    hot = sample(logits, batch(2000, temperature=3.0)).eq(1).float().mean()
    assert cold < 0.05 < 0.2 < hot


def test_same_seed_same_tokens_whatever_the_neighbours():
    row = random_logits(1, seed=7)
    alone = [sample(row, batch(1, seeds={0: 1234}))[0].item()]
    # Same request (seed 1234) at row 2 among other requests, seeded and not.
    crowd = torch.cat([random_logits(2, seed=1), row, random_logits(3, seed=2)])
    in_crowd = sample(crowd, batch(6, seeds={0: 99, 2: 1234, 4: 5}))[2].item()
    assert alone == [in_crowd]


def test_seeded_stream_continues_across_steps_and_resumes_after_preemption():
    row = random_logits(1, seed=3)
    generator_batch = batch(1, seeds={0: 42})
    uninterrupted = [sample(row, generator_batch)[0].item() for _ in range(6)]
    # A resumed request skips the draws of the 4 tokens it already produced.
    resumed = SamplingBatch.build(
        [1.0], [0], [1.0], {0: new_request_generator(42, CPU, 4, VOCAB)}, VOCAB, CPU
    )
    assert [sample(row, resumed)[0].item() for _ in range(2)] == uninterrupted[4:]
    assert len(set(uninterrupted)) > 1  # really random, not stuck on one token

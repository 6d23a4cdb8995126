"""The sampler: greedy, top-k, top-p, temperature, per-request seeds, and the draw itself."""

from __future__ import annotations

import torch

from switchboard.worker.sampler import TOP_CANDIDATES, SamplingBatch, new_request_generator
from switchboard.worker.sampler import sample as sample_tokens

VOCAB = 50
CPU = torch.device("cpu")


def batch(
    rows: int, *, temperature=1.0, top_k=0, top_p=1.0, seeds=None, logits_vocab=VOCAB
) -> SamplingBatch:
    seeds = seeds or {}
    return SamplingBatch.build(
        temperatures=[temperature] * rows,
        top_ks=[top_k] * rows,
        top_ps=[top_p] * rows,
        generators={row: new_request_generator(seed) for row, seed in seeds.items()},
        vocab_size=logits_vocab,
        device=CPU,
    )


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The sampled ids (on a copy: the sampler works on its logits in place)."""
    return sample_tokens(logits.clone(), batch).token_ids


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


def test_filters_apply_per_row():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]]).repeat(100, 1)
    mixed = SamplingBatch.build([1.0] * 200, [2, 0] * 100, [1.0] * 200, {}, 4, CPU)
    tokens = sample(logits, mixed)
    assert set(tokens[0::2].tolist()) == {2, 3}  # top-2 of the first kind of row
    assert set(tokens[1::2].tolist()) == {0, 1, 2, 3}  # no filter on the second kind


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    tokens = sample(probs.log().expand(8000, 4).contiguous(), batch(8000, logits_vocab=4))
    frequencies = torch.bincount(tokens, minlength=4).float() / 8000
    assert torch.allclose(frequencies, probs, atol=0.03), frequencies


def test_a_nucleus_wider_than_the_candidates_is_drawn_from_a_full_sort():
    vocab = 4 * TOP_CANDIDATES
    # A flat distribution: top_p 0.9 keeps ~90% of the vocabulary, far past the candidates.
    logits = torch.zeros(600, vocab)
    logits[:, -10:] = -30.0  # the tail: outside any nucleus below 1
    rows = batch(600, top_p=0.9, logits_vocab=vocab)
    tokens = sample(logits, rows)
    assert int(tokens.max()) < vocab - 10
    assert len(set(tokens.tolist())) > TOP_CANDIDATES / 2  # not stuck in the candidates


def test_top_k_beyond_the_candidates_and_top_p_combine():
    vocab = 4 * TOP_CANDIDATES
    logits = torch.linspace(10.0, 0.0, vocab).expand(400, vocab).contiguous()
    k = TOP_CANDIDATES + 50
    tokens = sample(logits, batch(400, temperature=5.0, top_k=k, logits_vocab=vocab))
    assert int(tokens.max()) < k and int(tokens.max()) > TOP_CANDIDATES / 2


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
    uninterrupted = [
        sample(row, SamplingBatch.build([1.0], [0], [1.0], {0: gen}, VOCAB, CPU))[0].item()
        for gen in (new_request_generator(42, step) for step in range(6))
    ]
    # A request resumed with 4 outputs gets the generator of its 5th token.
    resumed = SamplingBatch.build([1.0], [0], [1.0], {0: new_request_generator(42, 4)}, VOCAB, CPU)
    assert sample(row, resumed)[0].item() == uninterrupted[4]
    assert len(set(uninterrupted)) > 1  # really random, not stuck on one token

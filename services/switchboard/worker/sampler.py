"""Picking the next token of each request from its logits.

One call handles the whole batch: greedy rows take the argmax; the other rows are divided by
their temperature, cut to top-k and top-p, and sampled with the exponential-race trick
(``argmax(probs / q)`` with ``q ~ Exp(1)`` draws a token with probability ``probs``). A request
with a seed owns a ``torch.Generator`` that draws its row's ``q``: its tokens depend on its seed
and its own logits only, never on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_TEMPERATURE = 1e-5  # at or below this a request is sampled greedily


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # [rows] float32
    top_k: torch.Tensor | None  # [rows] long, vocab size where off; None if no row uses it
    top_p: torch.Tensor | None  # [rows] float32, 1.0 where off; None if no row uses it
    all_greedy: bool
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> its seed's

    @classmethod
    def build(
        cls,
        temperatures: list[float],
        top_ks: list[int],
        top_ps: list[float],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        ks = [k if 0 < k < vocab_size else vocab_size for k in top_ks]
        return cls(
            temperature=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_k=torch.tensor(ks, device=device)
            if min(ks, default=vocab_size) < vocab_size
            else None,
            top_p=torch.tensor(top_ps, dtype=torch.float32, device=device)
            if min(top_ps, default=1.0) < 1.0
            else None,
            all_greedy=all(t <= GREEDY_TEMPERATURE for t in temperatures),
            generators=generators,
        )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token ids ``[rows]`` (long) for float32 ``logits`` ``[rows, vocab]``."""
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens
    is_greedy = batch.temperature <= GREEDY_TEMPERATURE
    temperature = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = apply_top_k_top_p(logits / temperature[:, None], batch.top_k, batch.top_p)
    probs = scaled.softmax(dim=-1, dtype=torch.float32)
    race = torch.empty_like(probs).exponential_()
    for row, generator in batch.generators.items():
        race[row].exponential_(generator=generator)
    sampled_tokens = probs.div(race).argmax(dim=-1)
    return torch.where(is_greedy, greedy_tokens, sampled_tokens)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and then its top-p nucleus."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        vocab_size = logits.shape[-1]
        kth_smallest_kept = (vocab_size - top_k).clamp(min=0, max=vocab_size - 1)
        threshold = sorted_logits.gather(1, kth_smallest_kept[:, None])
        sorted_logits.masked_fill_(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose total stays within 1 - p; always keep the best token.
        outside = cumulative <= (1 - top_p)[:, None]
        outside[:, -1] = False
        sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def new_request_generator(
    seed: int, device: torch.device, skip_draws: int, vocab_size: int
) -> torch.Generator:
    """A generator for a seeded request; ``skip_draws`` replays the draws of tokens it already
    sampled (a request resumed after preemption continues the same random stream)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    if skip_draws:
        scratch = torch.empty(vocab_size, device=device)
        for _ in range(skip_draws):
            scratch.exponential_(generator=generator)
    return generator

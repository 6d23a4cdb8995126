"""Picking the next token of each request from its logits.

One call handles the whole batch, in vLLM's order::

    raw logits --(logprobs are taken here: the model's own distribution)
      -> allowed_token_ids, bad words, min_tokens (masks), logit_bias     logits_processors.py
      -> repetition / frequency / presence penalties                       logits_processors.py
      -> greedy rows: argmax
      -> other rows: / temperature -> softmax -> min_p -> top-k -> top-p -> draw

A draw is one uniform number per row, mapped through the row's cumulative distribution (inverse
CDF): cheap on any device, unlike drawing vocabulary-sized noise. Top-k and top-p look at the
``TOP_CANDIDATES`` most likely tokens (``topk``, not a sort of the whole vocabulary); a row whose
top-p nucleus is wider than that is sorted in full, alone. A request with a seed draws its
uniform from its own ``torch.Generator``, seeded from (seed, output index): its tokens depend on
its seed and its own logits only, never on the rest of the batch or on a preemption in between.
A batch with nothing but plain greedy rows is one ``argmax``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from switchboard.kernels import fused_ops
from switchboard.wire.engine_msgs import TokenLogprobs
from switchboard.worker.logits_processors import LogitsProcessing, apply_logits_processing
from switchboard.worker.logprobs import token_logprobs

GREEDY_TEMPERATURE = 1e-5  # at or below this a request is sampled greedily
TOP_CANDIDATES = 256  # top-k / top-p first look at this many most likely tokens


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # [rows] float32
    top_k: torch.Tensor | None  # [rows] long, vocab size where off; None if no row uses it
    top_p: torch.Tensor | None  # [rows] float32, 1.0 where off; None if no row uses it
    all_greedy: bool
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> its own (CPU)
    min_p: torch.Tensor | None = None  # [rows] float32, 0.0 where off; None if no row uses it
    processing: LogitsProcessing | None = None  # masks, bias, penalties; None if no row has any
    logprob_rows: torch.Tensor | None = None  # [k] long: rows that want logprobs
    num_logprobs: list[int] = field(default_factory=list)  # [k]: top-N of each of those rows
    random_rows: torch.Tensor | None = None  # [m] long: the non-greedy rows; None if every row

    @classmethod
    def build(
        cls,
        temperatures: list[float],
        top_ks: list[int],
        top_ps: list[float],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
        *,
        min_ps: list[float] | None = None,
        processing: LogitsProcessing | None = None,
        num_logprobs: dict[int, int] | None = None,
    ) -> SamplingBatch:
        """``num_logprobs``: row -> top-N, for the rows that want logprobs."""
        ks = [k if 0 < k < vocab_size else vocab_size for k in top_ks]
        use_min_p = min_ps is not None and max(min_ps, default=0.0) > 0.0
        logprob_rows = sorted(num_logprobs) if num_logprobs else []
        random_rows = [row for row, t in enumerate(temperatures) if t > GREEDY_TEMPERATURE]
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
            min_p=torch.tensor(min_ps, dtype=torch.float32, device=device) if use_min_p else None,
            processing=processing,
            logprob_rows=torch.tensor(logprob_rows, dtype=torch.long, device=device)
            if logprob_rows
            else None,
            num_logprobs=[num_logprobs[row] for row in logprob_rows] if num_logprobs else [],
            random_rows=torch.tensor(random_rows, dtype=torch.long, device=device)
            if 0 < len(random_rows) < len(temperatures)
            else None,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] long
    logprobs: dict[int, TokenLogprobs]  # row -> its logprobs, for the rows that asked


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Pick one token per row of float32 ``logits`` ``[rows, vocab]`` (modified in place)."""
    raw_logprobs = None
    if batch.logprob_rows is not None:
        raw_logprobs = logits.index_select(0, batch.logprob_rows).log_softmax(dim=-1)
    if batch.processing is not None:
        apply_logits_processing(logits, batch.processing)
    token_ids = _pick(logits, batch)
    logprobs: dict[int, TokenLogprobs] = {}
    if raw_logprobs is not None and batch.logprob_rows is not None:
        chosen = token_ids.index_select(0, batch.logprob_rows)
        rows = batch.logprob_rows.tolist()
        entries = token_logprobs(raw_logprobs, chosen, batch.num_logprobs)
        logprobs = dict(zip(rows, entries, strict=True))
    return SamplerOutput(token_ids, logprobs)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the sample of a batch of plain greedy rows, which needs no
    ``SamplingBatch`` (``RequestState.plain_greedy``)."""
    tokens = fused_ops.argmax_rows(logits)  # on CPU in float32: torch's answer, sooner
    return tokens if tokens is not None else logits.argmax(dim=-1)


def _pick(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.all_greedy:
        return greedy_tokens(logits)
    rows = batch.random_rows  # None: every row

    def of_rows(values: torch.Tensor | None) -> torch.Tensor | None:
        return values if values is None or rows is None else values.index_select(0, rows)

    tokens = None if rows is None else greedy_tokens(logits)
    selected = logits if rows is None else logits.index_select(0, rows)
    temperature = of_rows(batch.temperature)
    assert temperature is not None
    probs = selected.div_(temperature[:, None]).softmax(dim=-1)
    min_p = of_rows(batch.min_p)
    if min_p is not None:
        probs = apply_min_p(probs, min_p)
    uniforms = _uniforms(batch, probs.shape[0]).to(probs.device)
    top_k, top_p = of_rows(batch.top_k), of_rows(batch.top_p)
    if top_k is None and top_p is None:
        sampled = _inverse_cdf(probs, uniforms)
    else:
        sampled = _sample_top_k_top_p(probs, top_k, top_p, uniforms)
    if tokens is None or rows is None:  # both or neither
        return sampled
    return tokens.index_copy_(0, rows, sampled)


def _uniforms(batch: SamplingBatch, num_rows: int) -> torch.Tensor:
    """One U[0, 1) per sampled row (CPU); seeded rows draw from their own generator."""
    uniforms = torch.rand(num_rows)
    if batch.generators:
        position = (
            {row: i for i, row in enumerate(batch.random_rows.tolist())}
            if batch.random_rows is not None
            else None
        )
        for row, generator in batch.generators.items():
            i = row if position is None else position.get(row)
            if i is not None:  # a seeded greedy row draws nothing
                uniforms[i] = torch.rand((), generator=generator)
    return uniforms


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Column of each row where its cumulative weight passes ``uniform * total``."""
    cumulative = weights.cumsum(dim=-1)
    targets = uniforms[:, None] * cumulative[:, -1:]
    chosen = torch.searchsorted(cumulative, targets, right=True)
    return chosen.clamp_(max=weights.shape[-1] - 1)[:, 0]


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero every token less likely than ``min_p`` times the row's most likely one."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return probs.masked_fill_(probs < threshold, 0.0)


def _sample_top_k_top_p(
    probs: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Draw within each row's top-k, then its top-p nucleus (of the top-k, renormalised)."""
    num_rows, vocab_size = probs.shape
    if top_k is None:
        top_k = torch.full((num_rows,), vocab_size, dtype=torch.long, device=probs.device)
    if top_p is None:
        top_p = torch.ones(num_rows, dtype=torch.float32, device=probs.device)
    limited = top_k[top_k < vocab_size]
    widest_k = int(limited.max()) if limited.numel() else 0
    num_candidates = min(vocab_size, max(TOP_CANDIDATES, widest_k))
    values, ids = probs.topk(num_candidates, dim=-1)
    mass = probs.sum(dim=-1)  # 1, or less after min_p
    tokens, covered = _draw_sorted(values, ids, top_k, top_p, mass, uniforms)
    if bool(covered.all()):
        return tokens
    # Rows the candidates do not settle: no filter at all (a draw from every token), or a
    # nucleus wider than the candidates (a full sort of that row).
    unfiltered = ~covered & (top_k >= vocab_size) & (top_p >= 1.0)
    if bool(unfiltered.any()):
        rows = unfiltered.nonzero()[:, 0]
        tokens[rows] = _inverse_cdf(probs[rows], uniforms[rows])
    wide = ~covered & ~unfiltered
    if bool(wide.any()):
        rows = wide.nonzero()[:, 0]
        values, ids = probs[rows].sort(dim=-1, descending=True)
        wide_tokens, _ = _draw_sorted(
            values, ids, top_k[rows], top_p[rows], mass[rows], uniforms[rows]
        )
        tokens[rows] = wide_tokens
    return tokens


def _draw_sorted(
    values: torch.Tensor,
    ids: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    mass: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw among the most likely tokens of each row (``values`` descending, ``ids`` theirs).

    Returns the tokens and, per row, whether the candidates hold its whole top-k/top-p set
    (a row whose answer needs tokens beyond the candidates must be drawn again by the caller).
    """
    num_candidates = values.shape[-1]
    positions = torch.arange(num_candidates, device=values.device)
    values = values.masked_fill(positions[None, :] >= top_k[:, None], 0.0)
    k_within = top_k <= num_candidates
    # Top-p is relative to what top-k kept (all of it is here when k fits) or to all the mass.
    base = torch.where(k_within, values.sum(dim=-1), mass)
    cumulative = values.cumsum(dim=-1)
    # Keep a token while the mass before it is below p (so the most likely one always stays).
    keep = (cumulative - values) < (top_p * base)[:, None]
    keep[:, 0] = True
    covered = k_within | ((top_p < 1.0) & (cumulative[:, -1] >= top_p * base))
    chosen = _inverse_cdf(values * keep, uniforms)
    return ids.gather(1, chosen[:, None])[:, 0], covered


def step_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed of a seeded request's draw for output token ``num_output_tokens``."""
    return (seed * 0x9E3779B97F4A7C15 + num_output_tokens) % (1 << 64)


def new_request_generator(seed: int, num_output_tokens: int = 0) -> torch.Generator:
    """A seeded request's generator (CPU: one number per step), set for its next token."""
    generator = torch.Generator()
    generator.manual_seed(step_seed(seed, num_output_tokens))
    return generator

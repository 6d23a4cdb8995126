"""The sampling settings of one step's batch, built from the requests' own state.

Each row is a request being sampled; its ``SamplingParams`` arrived once with it (wire 2
``NewRequest``), its output history is kept by the worker (``step_inputs.RequestState``). The
builder turns them into a few tensors per knob, only for the rows that use the knob; a batch of
plain greedy requests gets none and samples with one ``argmax``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from switchboard.worker.logits_processors import LogitsProcessing, Penalties, TokenPairs
from switchboard.worker.sampler import SamplingBatch, step_seed
from switchboard.worker.step_inputs import RequestState


def build_sampling_batch(
    states: Sequence[RequestState], vocab_size: int, device: torch.device
) -> SamplingBatch:
    params = [state.sampling_params for state in states]
    min_ps = [p.min_p for p in params]
    num_logprobs = {row: p.logprobs for row, p in enumerate(params) if p.logprobs is not None}
    return SamplingBatch.build(
        temperatures=[p.temperature for p in params],
        top_ks=[p.top_k for p in params],
        top_ps=[p.top_p for p in params],
        generators=_step_generators(states),
        vocab_size=vocab_size,
        device=device,
        min_ps=min_ps,
        processing=build_logits_processing(states, vocab_size, device),
        num_logprobs=num_logprobs,
    )


def _step_generators(states: Sequence[RequestState]) -> dict[int, torch.Generator]:
    """Each seeded row's generator, set for the token it samples now: a draw depends on the
    seed and the output index only (a resumed request continues where it was)."""
    generators = {}
    for row, state in enumerate(states):
        seed = state.sampling_params.seed
        if state.generator is not None and seed is not None:
            state.generator.manual_seed(step_seed(seed, state.num_output_tokens))
            generators[row] = state.generator
    return generators


def build_logits_processing(
    states: Sequence[RequestState], vocab_size: int, device: torch.device
) -> LogitsProcessing | None:
    """Masks, bias and penalties of the rows that set any; None when no row does. A knob added
    here must also make a request not plain greedy (``step_inputs.plain_greedy_from``), or the
    runner's one-argmax shortcut would skip it."""
    allowed: list[tuple[int, list[int]]] = []
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    penalty_rows: list[int] = []
    for row, state in enumerate(states):
        p = state.sampling_params
        if p.allowed_token_ids:
            allowed.append((row, [t for t in p.allowed_token_ids if 0 <= t < vocab_size]))
        for token_id in _banned_tokens(state):
            if 0 <= token_id < vocab_size:
                banned_rows.append(row)
                banned_ids.append(token_id)
        if p.logit_bias:
            for token_id, value in p.logit_bias.items():
                if 0 <= token_id < vocab_size:
                    bias_rows.append(row)
                    bias_ids.append(token_id)
                    bias_values.append(value)
        if state.output_history is not None:
            penalty_rows.append(row)
    if not (allowed or banned_rows or bias_rows or penalty_rows):
        return None
    processing = LogitsProcessing()
    if allowed:
        processing.allowed_rows = _long([row for row, _ in allowed], device)
        mask = torch.ones(len(allowed), vocab_size, dtype=torch.bool)
        for i, (_, token_ids) in enumerate(allowed):
            mask[i, token_ids] = False
        processing.disallowed_mask = mask.to(device)
    if banned_rows:
        processing.banned = TokenPairs(_long(banned_rows, device), _long(banned_ids, device))
    if bias_rows:
        values = torch.tensor(bias_values, dtype=torch.float32, device=device)
        processing.logit_bias = TokenPairs(
            _long(bias_rows, device), _long(bias_ids, device), values
        )
    if penalty_rows:
        processing.penalties = _penalties(states, penalty_rows, vocab_size, device)
    return processing


def _banned_tokens(state: RequestState) -> list[int]:
    """EOS and stop tokens before min_tokens; the last token of each bad word whose other
    tokens end the output."""
    p = state.sampling_params
    banned: list[int] = []
    if state.num_output_tokens < p.min_tokens:
        if not p.ignore_eos:
            banned += p.eos_token_ids
        banned += p.stop_token_ids
    for word in p.bad_words_token_ids or ():
        prefix = word[:-1]
        if not prefix or state.output_tail(len(prefix)) == prefix:
            banned.append(word[-1])
    return banned


def _penalties(
    states: Sequence[RequestState], rows: list[int], vocab_size: int, device: torch.device
) -> Penalties:
    selected = [states[row] for row in rows]
    params = [state.sampling_params for state in selected]
    histories = [_history(state) for state in selected]
    padded = pad_sequence(histories, batch_first=True, padding_value=vocab_size).to(device)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    penalties = Penalties(
        rows=_long(rows, device),
        presence=_column([p.presence_penalty for p in params], device),
        frequency=_column([p.frequency_penalty for p in params], device),
        output_counts=counts[:, :vocab_size],
    )
    if any(p.repetition_penalty != 1.0 for p in params):
        penalties.repetition = _column([p.repetition_penalty for p in params], device)
        prompts = [_prompt_token_set(state, vocab_size) for state in selected]
        padded_prompts = pad_sequence(prompts, batch_first=True, padding_value=vocab_size)
        prompt_mask = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
        prompt_mask.scatter_(1, padded_prompts.to(device), True)
        penalties.prompt_mask = prompt_mask[:, :vocab_size]
    return penalties


def _history(state: RequestState) -> torch.Tensor:
    assert state.output_history is not None  # rows with penalties keep one
    return state.output_history.view()


def _prompt_token_set(state: RequestState, vocab_size: int) -> torch.Tensor:
    """The distinct prompt token ids (CPU), computed once per request."""
    if state.prompt_token_set is None:
        prompt = torch.tensor(state.token_ids[: state.num_prompt_tokens], dtype=torch.long)
        state.prompt_token_set = prompt[(prompt >= 0) & (prompt < vocab_size)].unique()
    return state.prompt_token_set


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

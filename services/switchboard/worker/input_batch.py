"""Per-request state kept between steps, and the flattened inputs of one step.

The engine sends a delta per step (see ``wire/step_msgs.py``); :class:`RequestStates` applies
it. :func:`build_step_inputs` then lays the scheduled tokens of all requests out as one batch::

    rows:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]     d = decoding request (1 token)
            `- decode batch -'  `- prefill spans -'     p = request with a chunk of tokens

A request's tokens this step are ``token_ids[num_computed : num_computed + n]`` at positions
``num_computed ..``; it is sampled when that range reaches the end of its known tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from switchboard.models.attention import AttentionMetadata, DecodeBatch, PrefillSpan
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.step_msgs import SchedulerOutput


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt + every token sampled so far (the worker's own copy)
    block_ids: list[int]  # the block table
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None = None  # set when the request has a seed


class RequestStates(dict[str, RequestState]):
    """request_id -> state, updated from each step's delta."""

    def apply(
        self, step: SchedulerOutput, make_generator: Callable[[int, int], torch.Generator]
    ) -> None:
        """``make_generator(seed, num_output_tokens)`` builds a seeded request's generator."""
        for request_id in step.finished_request_ids:
            self.pop(request_id, None)
        for new in step.new_requests:
            seed = new.sampling_params.seed
            self[new.request_id] = RequestState(
                request_id=new.request_id,
                token_ids=list(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=new.sampling_params,
                generator=None if seed is None else make_generator(seed, new.num_output_tokens),
            )
        for cached in step.cached_requests:
            state = self.get(cached.request_id)
            if state is None:
                raise KeyError(f"step {step.step_id}: unknown request {cached.request_id!r}")
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    metadata: AttentionMetadata
    request_ids: list[str]  # every scheduled request, in row order
    sampled_request_ids: list[str]  # the requests sampled this step
    logits_rows: torch.Tensor  # [len(sampled_request_ids)]: row of each one's last token


def build_step_inputs(
    step: SchedulerOutput, states: RequestStates, block_size: int, device: torch.device
) -> StepInputs:
    scheduled = [(states[rid], n) for rid, n in step.num_scheduled_tokens.items() if n > 0]
    decodes = [(state, n) for state, n in scheduled if n == 1]
    prefills = [(state, n) for state, n in scheduled if n > 1]

    input_ids: list[int] = []
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    request_ids: list[str] = []
    sampled_ids: list[str] = []
    logits_rows: list[int] = []
    spans: list[PrefillSpan] = []
    for state, n in decodes + prefills:
        start = state.num_computed_tokens
        end = start + n
        if end > len(state.token_ids):
            raise ValueError(
                f"step {step.step_id}: {state.request_id!r} scheduled to position {end} but "
                f"the worker knows {len(state.token_ids)} tokens"
            )
        num_blocks = -(-end // block_size)
        if num_blocks > len(state.block_ids):
            raise ValueError(
                f"step {step.step_id}: {state.request_id!r} needs {num_blocks} blocks for "
                f"{end} tokens but has {len(state.block_ids)}"
            )
        row = len(input_ids)
        block_table = torch.tensor(state.block_ids[:num_blocks], dtype=torch.long)
        token_positions = torch.arange(start, end, dtype=torch.long)
        input_ids.extend(state.token_ids[start:end])
        positions.append(token_positions)
        slots.append(
            block_table[token_positions // block_size] * block_size + token_positions % block_size
        )
        request_ids.append(state.request_id)
        if n > 1:
            spans.append(PrefillSpan(row, n, end, block_table.to(device)))
        if end == len(state.token_ids):
            sampled_ids.append(state.request_id)
            logits_rows.append(row + n - 1)

    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        decode=_decode_batch([state for state, _ in decodes], block_size, device),
        prefills=spans,
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.cat(positions).to(device),
        metadata=metadata,
        request_ids=request_ids,
        sampled_request_ids=sampled_ids,
        logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
    )


def _decode_batch(
    states: list[RequestState], block_size: int, device: torch.device
) -> DecodeBatch | None:
    if not states:
        return None
    context_lens = [state.num_computed_tokens + 1 for state in states]
    max_blocks = -(-max(context_lens) // block_size)
    table = [
        state.block_ids[:max_blocks] + [0] * (max_blocks - min(max_blocks, len(state.block_ids)))
        for state in states
    ]
    return DecodeBatch(
        block_table=torch.tensor(table, dtype=torch.long, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        max_context_len=max(context_lens),
    )

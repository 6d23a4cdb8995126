"""Per-request state kept between steps, and the flattened inputs of one step.

The engine sends a delta per step (see ``wire/step_msgs.py``); :class:`RequestStates` applies
it. :func:`build_step_inputs` then lays the scheduled tokens of all requests out as one batch::

    rows:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]     d = decoding request (1 token)
            `- decode batch -'  `- prefill spans -'     p = request with a chunk of tokens

A request's tokens this step are ``token_ids[num_computed : num_computed + n]`` at positions
``num_computed ..``; it is sampled when that range reaches the end of its known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from switchboard.models.attention import AttentionMetadata, DecodeBatch, PrefillSpan
from switchboard.wire.engine_msgs import SamplingParams, TokenLogprobs
from switchboard.wire.step_msgs import SchedulerOutput
from switchboard.worker.sampler import GREEDY_TEMPERATURE, new_request_generator


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. To CUDA: staged in pinned memory (torch's caching host
    allocator keeps the pinned blocks and does not reuse one until its copy is done) and
    copied without blocking the host, so the step's inputs overlap with the previous kernels.
    Elsewhere (CPU) a plain ``.to``: the tensor itself."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class TokenHistory:
    """A request's output token ids as a growing CPU tensor (amortised O(1) appends), so the
    sampler builds the batch's penalty counts from views without copying Python lists."""

    __slots__ = ("_buffer", "_length")

    def __init__(self, token_ids: list[int]) -> None:
        self._buffer = torch.empty(max(64, 2 * len(token_ids)), dtype=torch.long)
        self._buffer[: len(token_ids)] = torch.tensor(token_ids, dtype=torch.long)
        self._length = len(token_ids)

    def append(self, token_id: int) -> None:
        if self._length == self._buffer.shape[0]:
            grown = torch.empty(2 * self._length, dtype=torch.long)
            grown[: self._length] = self._buffer
            self._buffer = grown
        self._buffer[self._length] = token_id
        self._length += 1

    def view(self) -> torch.Tensor:
        return self._buffer[: self._length]

    def __len__(self) -> int:
        return self._length


def uses_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


def plain_greedy_from(params: SamplingParams) -> int:
    """The output count from which a request's sample is plainly its logits' argmax: greedy,
    no mask, bias, penalty or min_p, no logprobs, and past min_tokens where that bans its EOS or
    stop tokens; -1 when never (the sampler's full path decides). Its knobs are the ones
    ``sampling_inputs.build_sampling_batch`` turns into tensors, and the bans are
    ``sampling_inputs._banned_tokens``'s: the two change together."""
    if (
        params.temperature > GREEDY_TEMPERATURE
        or params.logprobs is not None
        or params.min_p > 0.0
        or uses_penalties(params)
        or params.logit_bias
        or params.allowed_token_ids
        or params.bad_words_token_ids
    ):
        return -1
    bans_before_min = params.stop_token_ids or (params.eos_token_ids and not params.ignore_eos)
    return params.min_tokens if bans_before_min else 0


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt + every token sampled so far (the worker's own copy)
    block_ids: list[int]  # the block table
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None = None  # set when the request has a seed
    num_prompt_tokens: int = -1  # -1: all of token_ids (set by __post_init__)
    output_history: TokenHistory | None = None  # kept only for requests with penalties
    # Collected across prefill chunks while the prompt runs; None when not asked for or sent.
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_token_set: torch.Tensor | None = field(default=None, repr=False)  # cache (sampler)
    # From this many output tokens on, the request's sample is its logits' argmax and nothing
    # else (no knob touches the logits, no logprobs); -1: never (set by __post_init__).
    plain_greedy_from: int = field(default=-1, init=False)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)
        if self.output_history is None and uses_penalties(self.sampling_params):
            self.output_history = TokenHistory(self.token_ids[self.num_prompt_tokens :])
        self.plain_greedy_from = plain_greedy_from(self.sampling_params)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def output_tail(self, n: int) -> list[int]:
        """The last ``n`` output tokens (fewer if there are fewer)."""
        n = min(n, self.num_output_tokens)
        return self.token_ids[len(self.token_ids) - n :] if n > 0 else []

    @property
    def plain_greedy(self) -> bool:
        """This step's sample is the argmax of its logits (``plain_greedy_from``)."""
        return 0 <= self.plain_greedy_from <= self.num_output_tokens

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.output_history is not None:
            self.output_history.append(token_id)


class RequestStates(dict[str, RequestState]):
    """request_id -> state, updated from each step's delta."""

    def apply(self, step: SchedulerOutput) -> None:
        for request_id in step.finished_request_ids:
            self.pop(request_id, None)
        for new in step.new_requests:
            params = new.sampling_params
            seed = params.seed
            # Prompt logprobs are owed once: on a resume with outputs they were sent already.
            wants_prompt_logprobs = params.prompt_logprobs is not None and not (
                new.num_output_tokens
            )
            self[new.request_id] = RequestState(
                request_id=new.request_id,
                token_ids=list(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=params,
                generator=None
                if seed is None
                else new_request_generator(seed, new.num_output_tokens),
                num_prompt_tokens=len(new.prompt_token_ids) - new.num_output_tokens,
                prompt_logprobs=[] if wants_prompt_logprobs else None,
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
    first_rows: list[int] = field(default_factory=list)  # per request_ids: its first token's row
    # Speculative decoding: a sampled request with proposals has 1 + len(proposals) logits
    # rows (its last token's, then each proposal's), in sampled_request_ids order.
    proposals: dict[str, list[int]] = field(default_factory=dict)


def build_step_inputs(
    step: SchedulerOutput, states: RequestStates, block_size: int, device: torch.device
) -> StepInputs:
    scheduled = [(states[rid], n) for rid, n in step.num_scheduled_tokens.items() if n > 0]
    decodes = [(state, n) for state, n in scheduled if n == 1]
    prefills = [(state, n) for state, n in scheduled if n > 1]

    input_ids: list[int] = []
    # Rows run decodes first, then prefills: a decode's one position and slot are plain ints
    # (no per-request tensors on the per-step path), a prefill's are a tensor each.
    decode_positions: list[int] = []
    decode_slots: list[int] = []
    prefill_positions: list[torch.Tensor] = []
    prefill_slots: list[torch.Tensor] = []
    request_ids: list[str] = []
    first_rows: list[int] = []
    sampled_ids: list[str] = []
    logits_rows: list[int] = []
    spans: list[PrefillSpan] = []
    proposals = step.scheduled_spec_decode_tokens
    for state, n in decodes + prefills:
        start = state.num_computed_tokens
        end = start + n
        drafts = proposals.get(state.request_id) if proposals else None
        token_ids = state.token_ids + drafts if drafts else state.token_ids
        if end > len(token_ids):
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
        input_ids.extend(token_ids[start:end])
        if n == 1:
            decode_positions.append(start)
            decode_slots.append(
                state.block_ids[start // block_size] * block_size + start % block_size
            )
        else:
            block_table = torch.tensor(state.block_ids[:num_blocks], dtype=torch.long)
            token_positions = torch.arange(start, end, dtype=torch.long)
            prefill_positions.append(token_positions)
            prefill_slots.append(
                block_table[token_positions // block_size] * block_size
                + token_positions % block_size
            )
            spans.append(
                PrefillSpan(
                    row,
                    n,
                    end,
                    upload(block_table, device),
                    past_prompt=end > state.num_prompt_tokens,
                )
            )
        request_ids.append(state.request_id)
        first_rows.append(row)
        if end == len(token_ids):
            sampled_ids.append(state.request_id)
            if drafts:  # the last known token's row and each proposal's
                logits_rows.extend(range(row + n - 1 - len(drafts), row + n))
            else:
                logits_rows.append(row + n - 1)

    metadata = AttentionMetadata(
        slot_mapping=upload(_joined(decode_slots, prefill_slots), device),
        decode=decode_batch([state for state, _ in decodes], block_size, device),
        prefills=spans,
    )
    return StepInputs(
        input_ids=upload(torch.tensor(input_ids, dtype=torch.long), device),
        positions=upload(_joined(decode_positions, prefill_positions), device),
        metadata=metadata,
        request_ids=request_ids,
        sampled_request_ids=sampled_ids,
        logits_rows=upload(torch.tensor(logits_rows, dtype=torch.long), device),
        first_rows=first_rows,
        proposals=proposals,
    )


def _joined(decode_values: list[int], prefill_values: list[torch.Tensor]) -> torch.Tensor:
    """The decodes' values, then the prefills' (no concatenation in a step of decodes only)."""
    decoded = torch.tensor(decode_values, dtype=torch.long)
    return torch.cat([decoded, *prefill_values]) if prefill_values else decoded


def decode_batch(
    states: list[RequestState],
    block_size: int,
    device: torch.device,
    positions: list[int] | None = None,
) -> DecodeBatch | None:
    """One query row per state, at ``positions`` (default: each state's next one)."""
    if not states:
        return None
    if positions is None:
        positions = [state.num_computed_tokens for state in states]
    context_lens = [position + 1 for position in positions]
    max_blocks = -(-max(context_lens) // block_size)
    table = [
        state.block_ids[:max_blocks] + [0] * (max_blocks - min(max_blocks, len(state.block_ids)))
        for state in states
    ]
    return DecodeBatch(
        block_table=upload(torch.tensor(table, dtype=torch.long), device),
        context_lens=upload(torch.tensor(context_lens, dtype=torch.long), device),
        max_context_len=max(context_lens),
        all_full_length=min(context_lens) == max(context_lens),
    )


def sampled_rows(hidden: torch.Tensor, logits_rows: torch.Tensor) -> torch.Tensor:
    """The rows of ``hidden`` that are sampled (``StepInputs.logits_rows``). In a step of
    decodes only that is every row, in order (the rows are distinct and ascending, so as many
    of them as ``hidden`` has rows means all): ``hidden`` itself, no gather. The gather is an
    OpenMP region, which waits out a scheduler time slice whenever another process holds the
    core its second thread needs (measured: 9 us median, 0.5 ms mean beside a busy gateway)."""
    if logits_rows.shape[0] == hidden.shape[0]:
        return hidden
    return hidden[logits_rows]

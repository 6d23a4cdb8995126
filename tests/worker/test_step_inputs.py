"""The rows a step samples: every row as it is in a step of decodes only, the last token of each
finished prompt otherwise."""

from __future__ import annotations

import torch

from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.step_msgs import CachedRequest, NewRequest, SchedulerOutput
from switchboard.worker.step_inputs import RequestStates, build_step_inputs, sampled_rows

BLOCK = 4
CPU = torch.device("cpu")


def _new(request_id: str, prompt: list[int], first_block: int) -> NewRequest:
    return NewRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
        block_ids=[first_block, first_block + 1, first_block + 2],
        num_computed_tokens=0,
    )


def _hidden(num_rows: int) -> torch.Tensor:
    return torch.arange(num_rows * 3, dtype=torch.float32).reshape(num_rows, 3)


def test_a_step_of_decodes_only_samples_every_row_without_a_copy() -> None:
    states = RequestStates()
    prefill = SchedulerOutput(
        step_id=0,
        new_requests=[_new("a", [5, 6, 7], 0), _new("b", [8, 9], 3)],
        num_scheduled_tokens={"a": 3, "b": 2},
        total_num_scheduled_tokens=5,
    )
    states.apply(prefill)
    build_step_inputs(prefill, states, BLOCK, CPU)
    states["a"].append_output_token(11)  # what the sampler did
    states["b"].append_output_token(12)
    decode = SchedulerOutput(
        step_id=1,
        cached_requests=[CachedRequest("a", [], 3), CachedRequest("b", [], 2)],
        num_scheduled_tokens={"a": 1, "b": 1},
        total_num_scheduled_tokens=2,
    )
    states.apply(decode)
    inputs = build_step_inputs(decode, states, BLOCK, CPU)
    hidden = _hidden(2)
    assert inputs.logits_rows.tolist() == [0, 1]
    assert sampled_rows(hidden, inputs.logits_rows) is hidden


def test_a_step_with_prompts_samples_the_last_row_of_each_finished_one() -> None:
    states = RequestStates()
    # "a" finishes its 3-token prompt, "b" schedules 2 of its 4 (a chunk: nothing sampled)
    step = SchedulerOutput(
        step_id=0,
        new_requests=[_new("a", [5, 6, 7], 0), _new("b", [8, 9, 10, 11], 3)],
        num_scheduled_tokens={"a": 3, "b": 2},
        total_num_scheduled_tokens=5,
    )
    states.apply(step)
    inputs = build_step_inputs(step, states, BLOCK, CPU)
    hidden = _hidden(5)
    assert inputs.sampled_request_ids == ["a"]
    assert torch.equal(sampled_rows(hidden, inputs.logits_rows), hidden[[2]])


def test_a_chunk_that_recomputes_generated_tokens_is_marked_past_the_prompt() -> None:
    """A resumed request (3 prompt tokens, 3 generated) recomputed in two chunks: the first,
    all prompt, is not past the prompt; the second, holding generated tokens, is (the CPU
    kernel attends it as the decode steps that made those tokens did)."""
    states = RequestStates()
    resumed = _new("r", [5, 6, 7, 20, 21, 22], 0)
    resumed.num_output_tokens = 3
    first = SchedulerOutput(
        step_id=0,
        new_requests=[resumed, _new("p", [8, 9, 10, 11], 3)],
        num_scheduled_tokens={"r": 3, "p": 4},
        total_num_scheduled_tokens=7,
    )
    states.apply(first)
    spans = build_step_inputs(first, states, BLOCK, CPU).metadata.prefills
    assert [span.past_prompt for span in spans] == [False, False]
    second = SchedulerOutput(
        step_id=1,
        cached_requests=[CachedRequest("r", [], 3)],
        num_scheduled_tokens={"r": 3},
        total_num_scheduled_tokens=3,
    )
    states.apply(second)
    (span,) = build_step_inputs(second, states, BLOCK, CPU).metadata.prefills
    assert span.past_prompt and span.context_len == 6

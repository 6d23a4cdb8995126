"""The model runner's logprobs against transformers: prompt logprobs across prefill chunks, and
the logprobs of sampled tokens, with ranks and top-N."""

from __future__ import annotations

import pytest
import torch

from switchboard.wire.engine_msgs import SamplingParams, TokenLogprobs
from switchboard.wire.step_msgs import CachedRequest, NewRequest, SchedulerOutput
from tests.tiny_checkpoint import tiny_llama_dir
from tests.worker.test_model_runner_parity import load_reference, make_runner

PROMPT = [0, *[(11 * i) % 1000 + 3 for i in range(20)]]  # 21 tokens: 6 blocks of 4


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    return tiny_llama_dir()


def reference_logprobs(model_dir: str, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of ``tokens``."""
    model = load_reference(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return logits.log_softmax(-1)


def assert_matches(entry: TokenLogprobs, reference: torch.Tensor, chosen: int, top_n: int):
    assert entry.token_ids[0] == chosen
    assert entry.logprobs[0] == pytest.approx(reference[chosen].item(), abs=1e-4)
    assert entry.ranks[0] == int((reference > reference[chosen] + 1e-5).sum()) + 1
    top = reference.topk(top_n)
    assert entry.token_ids[1:] == top.indices.tolist()
    assert entry.logprobs[1:] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert entry.ranks[1:] == list(range(1, top_n + 1))


def test_prompt_and_output_logprobs_across_chunks_match_transformers(tiny_dir):
    runner = make_runner(tiny_dir)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=3)
    # An ordinary request shares the steps, to show rows are attributed to the right request.
    other = NewRequest("other", [0, 5, 9], SamplingParams(temperature=0.0), [40], 0)
    steps = [
        SchedulerOutput(
            step_id=0,
            new_requests=[NewRequest("r", PROMPT, params, [1, 7, 3], 0), other],
            num_scheduled_tokens={"r": 12, "other": 3},
            total_num_scheduled_tokens=15,
        ),
        SchedulerOutput(
            step_id=1,
            cached_requests=[CachedRequest("r", [9, 2, 20], 12), CachedRequest("other", [], 3)],
            num_scheduled_tokens={"other": 1, "r": len(PROMPT) - 12},
            total_num_scheduled_tokens=1 + len(PROMPT) - 12,
        ),
    ]
    first = runner.execute_model(steps[0])
    assert first.prompt_logprobs == {} and "r" not in first.prompt_logprobs
    assert first.logprobs == []  # nobody that wants logprobs was sampled
    second = runner.execute_model(steps[1])
    prompt_logprobs = second.prompt_logprobs["r"]
    assert len(prompt_logprobs) == len(PROMPT) - 1
    row = second.request_ids.index("r")
    sampled = second.sampled_token_ids[row][0]
    reference = reference_logprobs(tiny_dir, [*PROMPT, sampled])
    for position, entry in enumerate(prompt_logprobs):
        assert_matches(entry, reference[position], PROMPT[position + 1], top_n=3)
    [output_entry] = second.logprobs[row]
    assert_matches(output_entry, reference[len(PROMPT) - 1], sampled, top_n=2)
    assert second.logprobs[second.request_ids.index("other")] == []
    # Decoding goes on: logprobs for each token, prompt logprobs never again.
    third = runner.execute_model(
        SchedulerOutput(
            step_id=2,
            cached_requests=[CachedRequest("r", [], len(PROMPT))],
            num_scheduled_tokens={"r": 1},
            total_num_scheduled_tokens=1,
            finished_request_ids=["other"],
        )
    )
    assert third.prompt_logprobs == {}
    next_token = third.sampled_token_ids[0][0]
    reference = reference_logprobs(tiny_dir, [*PROMPT, sampled, next_token])
    assert_matches(third.logprobs[0][0], reference[len(PROMPT)], next_token, top_n=2)


def test_a_resumed_request_does_not_send_prompt_logprobs_again(tiny_dir):
    runner = make_runner(tiny_dir)
    params = SamplingParams(temperature=0.0, prompt_logprobs=1)
    resumed = NewRequest("r", [*PROMPT, 5, 6], params, [1, 2, 3, 4, 5, 6], 0, num_output_tokens=2)
    output = runner.execute_model(
        SchedulerOutput(
            step_id=0,
            new_requests=[resumed],
            num_scheduled_tokens={"r": len(PROMPT) + 2},
            total_num_scheduled_tokens=len(PROMPT) + 2,
        )
    )
    assert len(output.sampled_token_ids[0]) == 1 and output.prompt_logprobs == {}

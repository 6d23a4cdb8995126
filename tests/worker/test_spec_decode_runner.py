"""Speculative decoding on real models (the scheduler and the model runner in one process): the
same tokens with speculation on and off, greedy and seeded, with proposals accepted (so the
comparison is not vacuous), and logprobs per accepted token."""

from __future__ import annotations

import json

import pytest

from switchboard.wire.engine_msgs import SamplingParams
from tests.tiny_checkpoint import tiny_checkpoint_dir
from tests.worker.spec_decode_loop import run_loop
from tests.worker.test_model_runner_parity import make_runner

NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
)
NUM_BLOCKS = 160
# A tiny random model's text does not repeat, but limited to a few tokens (allowed_token_ids
# keeps every position's meaning) it does, in part: proposals are both accepted and rejected.
ALLOWED = [5, 9, 33, 40, 41]
PROMPTS = {
    "loop": [0, 5, 9, 33, 5, 9, 33, 5, 9, 33, 5, 9],
    "counting": [0, *range(40, 63)],
    "odd": [0, 900, 3, 3, 3, 77, 512, 8, 1000, 64, 2],
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def runner(request):
    return make_runner(tiny_checkpoint_dir(request.param), NUM_BLOCKS)


# ahead: steps scheduled as the engine schedules them ahead (proposals then also come from
# lookups made before the latest token is known, which the model verifies like any others)
@pytest.mark.parametrize("ahead", [False, True])
def test_greedy_tokens_are_the_same_with_and_without_speculation(runner, ahead):
    params = SamplingParams(temperature=0.0, max_tokens=48, logprobs=2, allowed_token_ids=ALLOWED)
    off = run_loop(runner, PROMPTS, params, "", num_blocks=NUM_BLOCKS, ahead=ahead)
    on = run_loop(runner, PROMPTS, params, NGRAM, num_blocks=NUM_BLOCKS, ahead=ahead)
    for rid in PROMPTS:
        assert on.tokens(rid) == off.tokens(rid), rid
        assert on.logprobs(rid) == pytest.approx(off.logprobs(rid), abs=1e-4), rid
    assert 0 < on.num_accepted_tokens < on.num_draft_tokens  # accepted and rejected ones
    assert on.steps < off.steps
    if ahead:
        assert on.steps_ahead_proposing > 0 and off.steps_ahead > off.steps // 2


@pytest.mark.parametrize("ahead", [False, True])
def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(runner, ahead):
    params = SamplingParams(
        temperature=0.8, top_k=4, seed=1234, max_tokens=40, allowed_token_ids=ALLOWED
    )
    off = run_loop(runner, PROMPTS, params, "", num_blocks=NUM_BLOCKS, ahead=ahead)
    on = run_loop(runner, PROMPTS, params, NGRAM, num_blocks=NUM_BLOCKS, ahead=ahead)
    for rid in PROMPTS:
        assert on.tokens(rid) == off.tokens(rid), rid
    assert 0 < on.num_accepted_tokens < on.num_draft_tokens
    if ahead:
        assert on.steps_ahead_proposing > 0

"""Engine-side pieces of the sampling surface: min_tokens and repetition detection in the stop
check, logprobs carried from the worker to the outputs, no prefix-cache hit for prompt logprobs."""

from __future__ import annotations

import pytest
from test_scheduler import driver, make_request, make_scheduler, prompt, scripted

from switchboard.engine.stop_check import REPETITION_STOP_REASON, ends_in_repetition
from switchboard.wire.engine_msgs import FinishReason, RepetitionDetectionParams, TokenLogprobs
from switchboard.wire.step_msgs import ModelRunnerOutput


def detection(min_size: int, max_size: int, count: int) -> RepetitionDetectionParams:
    return RepetitionDetectionParams(min_size, max_size, count)


@pytest.mark.parametrize(
    ("tokens", "params", "expected"),
    [
        ([1, 2, 3, 3, 3], detection(1, 1, 3), True),
        ([1, 2, 3, 3], detection(1, 1, 3), False),  # only twice
        ([9, 4, 5, 4, 5, 4, 5], detection(1, 3, 3), True),  # "4 5" three times
        ([9, 4, 5, 4, 5, 4, 5], detection(3, 4, 2), False),  # sizes 3..4 only
        ([1, 2, 3, 1, 2, 3], detection(2, 4, 2), True),
        ([1, 2, 3, 1, 2, 4], detection(1, 4, 2), False),
        ([7, 7, 7, 7], detection(2, 2, 2), True),  # "7 7" twice: a shorter period counts too
        ([], detection(1, 3, 2), False),
        ([5], detection(1, 1, 2), False),
    ],
)
def test_ends_in_repetition(tokens, params, expected):
    assert ends_in_repetition(tokens, params) is expected


def test_repetition_ends_the_request_with_its_own_reason_after_min_tokens():
    sched = make_scheduler()
    loop = [8, 9] * 10
    d = driver(sched, scripted({"loop": [1, *loop], "early": list(loop), "off": list(loop)}))
    rd = detection(2, 2, 3)
    sched.add_request(make_request("loop", prompt(3), 20, repetition_detection=rd))
    sched.add_request(make_request("early", prompt(3), 20, repetition_detection=rd, min_tokens=8))
    sched.add_request(make_request("off", prompt(3), 12))
    d.run()
    assert d.tokens("loop") == [1, 8, 9, 8, 9, 8, 9]
    assert d.finish("loop").finish_reason == FinishReason.REPETITION
    assert d.finish("loop").stop_reason == REPETITION_STOP_REASON
    assert d.tokens("early") == loop[:8]  # not before min_tokens outputs
    assert d.finish("early").finish_reason == FinishReason.REPETITION
    assert d.finish("off").finish_reason == FinishReason.LENGTH


def test_min_tokens_holds_back_stop_tokens_too():
    sched = make_scheduler()
    d = driver(sched, scripted({"a": [42, 5, 42, 6]}))
    sched.add_request(make_request("a", prompt(3), 10, min_tokens=2, stop_token_ids=[42]))
    d.run()
    assert d.tokens("a") == [42, 5, 42]
    assert (d.finish("a").finish_reason, d.finish("a").stop_reason) == (FinishReason.STOP, 42)


def _lp(token_id: int) -> TokenLogprobs:
    return TokenLogprobs([token_id], [-0.5], [1])


def test_logprobs_and_prompt_logprobs_ride_on_the_outputs():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt(5), 2, stop_token_ids=[7], logprobs=1))
    sched.add_request(make_request("b", prompt(4, start=300), 5))
    step = sched.schedule()
    prompt_entries = [_lp(t) for t in prompt(5)[1:]]
    outputs = sched.update_from_output(
        step,
        ModelRunnerOutput(
            step.step_id,
            ["a", "b"],
            [[7, 3], [4]],  # "a" stops at its first token: the second logprob is dropped
            logprobs=[[_lp(7), _lp(3)], []],
            prompt_logprobs={"a": prompt_entries},
        ),
    )
    by_id = {o.request_id: o for o in outputs[0]}
    assert by_id["a"].new_token_ids == [7] and by_id["a"].new_logprobs == [_lp(7)]
    assert by_id["a"].prompt_logprobs == prompt_entries
    assert by_id["b"].new_logprobs is None and by_id["b"].prompt_logprobs is None


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    sched = make_scheduler()
    d = driver(sched)
    shared = prompt(20)
    sched.add_request(make_request("a", shared, max_tokens=1))
    d.run()
    sched.add_request(make_request("with-logprobs", shared, max_tokens=1, prompt_logprobs=2))
    sched.add_request(make_request("plain", shared, max_tokens=1))
    d.step()
    computed = {r.request_id: r.num_computed_tokens for r in d.sched_outputs[-1].new_requests}
    assert computed == {"with-logprobs": 0, "plain": 16}
    d.run()
    assert d.tokens("with-logprobs") == d.tokens("plain") == d.tokens("a")

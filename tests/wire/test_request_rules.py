"""The wire's request rules: every field a stray sender could set to crash a worker is bounded,
and a request the gateway would build passes."""

from __future__ import annotations

import msgspec
import pytest

from switchboard.wire.engine_msgs import (
    EngineCoreRequest,
    PoolingParams,
    RepetitionDetectionParams,
    SamplingParams,
)
from switchboard.wire.field_rules import (
    MAX_ENGINE_REQUEST_ID_CHARS,
    MAX_LOGPROBS,
    MAX_REQUEST_ID_CHARS,
    MAX_TOKEN_LIST,
)
from switchboard.wire.request_rules import RequestRuleError, check_engine_request

VOCAB, MAX_LEN = 1000, 128


def _request(**sampling: object) -> EngineCoreRequest:
    return EngineCoreRequest("r", [1, 2, 3], sampling_params=SamplingParams(**sampling))


def test_a_gateway_built_request_passes() -> None:
    check_engine_request(
        _request(
            temperature=0.7,
            top_p=0.9,
            top_k=50,
            seed=2**64 - 1,
            max_tokens=100,
            min_tokens=3,
            stop_token_ids=[5],
            eos_token_ids=[2],
            logit_bias={7: -100.0},
            allowed_token_ids=[1, 2, 999],
            bad_words_token_ids=[[4, 5]],
            logprobs=MAX_LOGPROBS,
            prompt_logprobs=0,
            repetition_detection=RepetitionDetectionParams(1, 4, 3),
        ),
        VOCAB,
        MAX_LEN,
    )
    pooled = EngineCoreRequest("e", [1, 2], pooling_params=PoolingParams(dimensions=8))
    check_engine_request(pooled, VOCAB, MAX_LEN)
    # The gateway's ids for the sequences of a call with the longest id the API takes.
    child_id = f"63_{'r' * MAX_REQUEST_ID_CHARS}"
    check_engine_request(
        EngineCoreRequest(child_id, [1], sampling_params=SamplingParams()), VOCAB, MAX_LEN
    )


@pytest.mark.parametrize(
    ("field", "broken"),
    [
        ("prompt_token_ids", EngineCoreRequest("r", [1, VOCAB], sampling_params=SamplingParams())),
        ("prompt_token_ids", EngineCoreRequest("r", [-1], sampling_params=SamplingParams())),
        ("prompt_token_ids", EngineCoreRequest("r", [], sampling_params=SamplingParams())),
        (
            "prompt_token_ids",
            EngineCoreRequest("r", [1] * (MAX_LEN + 1), sampling_params=SamplingParams()),
        ),
        ("request_id", EngineCoreRequest("", [1], sampling_params=SamplingParams())),
        (
            "request_id",
            EngineCoreRequest(
                "x" * (MAX_ENGINE_REQUEST_ID_CHARS + 1), [1], sampling_params=SamplingParams()
            ),
        ),
        ("sampling_params", EngineCoreRequest("r", [1])),
        ("priority", EngineCoreRequest("r", [1], sampling_params=SamplingParams(), priority=2**40)),
        (
            "lora_request",
            EngineCoreRequest("r", [1], sampling_params=SamplingParams(), lora_request={}),
        ),
        ("sampling_params.temperature", _request(temperature=-0.1)),
        ("sampling_params.temperature", _request(temperature=float("inf"))),
        ("sampling_params.top_p", _request(top_p=0.0)),
        ("sampling_params.top_p", _request(top_p=float("nan"))),
        ("sampling_params.top_k", _request(top_k=-2)),
        ("sampling_params.min_p", _request(min_p=1.5)),
        ("sampling_params.presence_penalty", _request(presence_penalty=3.0)),
        ("sampling_params.repetition_penalty", _request(repetition_penalty=0.0)),
        ("sampling_params.max_tokens", _request(max_tokens=0)),
        ("sampling_params.max_tokens", _request(max_tokens=MAX_LEN + 1)),
        ("sampling_params.min_tokens", _request(max_tokens=4, min_tokens=5)),
        ("sampling_params.seed", _request(seed=2**64)),
        ("sampling_params.stop_token_ids", _request(stop_token_ids=[VOCAB])),
        ("sampling_params.eos_token_ids", _request(eos_token_ids=[-5])),
        ("sampling_params.allowed_token_ids", _request(allowed_token_ids=[])),
        (
            "sampling_params.allowed_token_ids",
            _request(allowed_token_ids=[0] * (MAX_TOKEN_LIST + 1)),
        ),
        ("sampling_params.logit_bias", _request(logit_bias={VOCAB: 1.0})),
        ("sampling_params.logit_bias[3]", _request(logit_bias={3: 101.0})),
        ("sampling_params.bad_words_token_ids[0]", _request(bad_words_token_ids=[[]])),
        ("sampling_params.bad_words_token_ids[1]", _request(bad_words_token_ids=[[1], [VOCAB]])),
        (
            "sampling_params.bad_words_token_ids",
            _request(bad_words_token_ids=[[1]] * (MAX_TOKEN_LIST + 1)),
        ),
        (
            "sampling_params.bad_words_token_ids[1]",
            _request(bad_words_token_ids=[[1], [2] * (MAX_TOKEN_LIST + 1)]),
        ),
        ("sampling_params.stop_token_ids", _request(stop_token_ids=[1] * (MAX_TOKEN_LIST + 1))),
        ("sampling_params.logit_bias", _request(logit_bias=dict.fromkeys(range(5000), 0.0))),
        ("sampling_params.logprobs", _request(logprobs=10**6)),
        ("sampling_params.logprobs", _request(logprobs=-1)),
        ("sampling_params.prompt_logprobs", _request(prompt_logprobs=MAX_LOGPROBS + 1)),
        (
            "sampling_params.repetition_detection",
            _request(repetition_detection=RepetitionDetectionParams(0, 4, 2)),
        ),
        (
            "sampling_params.repetition_detection.min_count",
            _request(repetition_detection=RepetitionDetectionParams(1, 4, 1)),
        ),
        (
            "pooling_params.dimensions",
            EngineCoreRequest("e", [1], pooling_params=PoolingParams(dimensions=0)),
        ),
    ],
)
def test_each_broken_rule_is_named(field: str, broken: EngineCoreRequest) -> None:
    with pytest.raises(RequestRuleError) as raised:
        check_engine_request(broken, VOCAB, MAX_LEN)
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}: ")


def test_a_decoded_forgery_is_checked_like_a_built_one() -> None:
    """What arrives is msgpack: the checks work on what msgspec decodes (big ints included)."""
    forged = msgspec.msgpack.encode(_request(logprobs=2**63 - 1))
    decoded = msgspec.msgpack.decode(forged, type=EngineCoreRequest)
    with pytest.raises(RequestRuleError, match="logprobs"):
        check_engine_request(decoded, VOCAB, MAX_LEN)

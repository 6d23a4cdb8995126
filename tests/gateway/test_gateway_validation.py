"""Each validation rule ends in INVALID_ARGUMENT (or NOT_FOUND) with a message naming the field."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import grpc
import pytest
from google.rpc import error_details_pb2

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.model_facts import ModelFacts
from switchboard.gateway.pipeline.validation import (
    build_engine_request,
    plan_generate,
    resolve_prompt,
)
from switchboard.wire.engine_msgs import RepetitionDetectionParams

FACTS = ModelFacts(
    name="tiny",
    model_path="/models/tiny",
    max_model_len=64,
    vocab_size=300,
    eos_token_ids=(0, 2),
    bos_token_id=1,
    dtype="float32",
    generation_config={"temperature": 0.7},
    sampling_defaults={"temperature": 0.7},
)


def _request(**fields) -> pb.GenerateRequest:
    request = pb.GenerateRequest(text="hello")
    for path, value in fields.items():
        target = request
        *parents, leaf = path.split("__")
        for parent in parents:
            target = getattr(target, parent)
        if isinstance(value, list):
            getattr(target, leaf).extend(value)
        else:
            setattr(target, leaf, value)
    return request


def _engine_request(request: pb.GenerateRequest, prompt_len: int = 4):
    plan = plan_generate(request, "req-1", FACTS)
    ids = plan.prompt_token_ids if plan.prompt_token_ids is not None else [5] * prompt_len
    prompt = resolve_prompt(plan, ids, FACTS)
    return build_engine_request(plan, prompt, FACTS)


# (request builder, prompt length after tokenization, field named, words in the message)
CASES: list[tuple[str, Callable[[], pb.GenerateRequest], int, str, str]] = [
    ("no prompt", lambda: pb.GenerateRequest(), 4, "prompt", "set either text or token_ids"),
    ("empty text", lambda: _request(text=""), 4, "text", "must not be empty"),
    ("empty ids", lambda: pb.GenerateRequest(token_ids=pb.TokenIds()), 4, "token_ids", "empty"),
    ("negative temperature", lambda: _request(sampling__temperature=-0.5), 4,
     "sampling.temperature", ">= 0"),
    ("nan temperature", lambda: _request(sampling__temperature=math.nan), 4,
     "sampling.temperature", "finite"),
    ("top_p zero", lambda: _request(sampling__top_p=0.0), 4, "sampling.top_p", "(0, 1]"),
    ("top_p above one", lambda: _request(sampling__top_p=1.5), 4, "sampling.top_p", "(0, 1]"),
    ("top_k below -1", lambda: _request(sampling__top_k=-2), 4, "sampling.top_k", ">= -1"),
    ("n above the cap", lambda: _request(sampling__n=65), 4, "sampling.n", "[1, 64]"),
    ("n zero", lambda: _request(sampling__n=0), 4, "sampling.n", "[1, 64]"),
    ("min_p above one", lambda: _request(sampling__min_p=1.5), 4, "sampling.min_p", "[0, 1]"),
    ("min_p nan", lambda: _request(sampling__min_p=math.nan), 4, "sampling.min_p", "finite"),
    ("presence penalty", lambda: _request(sampling__presence_penalty=2.5), 4,
     "sampling.presence_penalty", "[-2.0, 2.0]"),
    ("frequency penalty", lambda: _request(sampling__frequency_penalty=-3.0), 4,
     "sampling.frequency_penalty", "[-2.0, 2.0]"),
    ("repetition penalty", lambda: _request(sampling__repetition_penalty=0.0), 4,
     "sampling.repetition_penalty", "> 0"),
    ("logit bias id", lambda: pb.GenerateRequest(
        text="hi", sampling=pb.SamplingParams(logit_bias={300: 1.0})), 4,
     "sampling.logit_bias[300]", "out of range"),
    ("logit bias value", lambda: pb.GenerateRequest(
        text="hi", sampling=pb.SamplingParams(logit_bias={3: 150.0})), 4,
     "sampling.logit_bias[3]", "[-100.0, 100.0]"),
    ("allowed token id", lambda: _request(sampling__allowed_token_ids=[1, 400]), 4,
     "sampling.allowed_token_ids[1]", "out of range"),
    ("empty bad word", lambda: _request(sampling__bad_words=["ok", ""]), 4,
     "sampling.bad_words[1]", "must not be empty"),
    ("max_tokens zero", lambda: _request(stopping__max_tokens=0), 4,
     "stopping.max_tokens", ">= 1"),
    ("min above max", lambda: _request(stopping__max_tokens=2, stopping__min_tokens=3), 4,
     "stopping.min_tokens", "<= stopping.max_tokens"),
    ("empty stop string", lambda: _request(stopping__stop=["ok", ""]), 4,
     "stopping.stop[1]", "must not be empty"),
    ("stop without text", lambda: pb.GenerateRequest(
        text="hi", stopping=pb.StoppingCriteria(stop=["x"]),
        output=pb.OutputOptions(detokenize=False)), 4, "stopping.stop", "detokenize"),
    ("repetition detection unset sizes", lambda: pb.GenerateRequest(
        text="hi", stopping=pb.StoppingCriteria(repetition_detection=pb.RepetitionDetection())),
     4, "stopping.repetition_detection.max_pattern_size", "got 0"),
    ("repetition detection max below min", lambda: pb.GenerateRequest(
        text="hi", stopping=pb.StoppingCriteria(repetition_detection=pb.RepetitionDetection(
            min_pattern_size=4, max_pattern_size=2, min_count=3))),
     4, "stopping.repetition_detection.max_pattern_size", "[4, 256]"),
    ("repetition detection count", lambda: pb.GenerateRequest(
        text="hi", stopping=pb.StoppingCriteria(repetition_detection=pb.RepetitionDetection(
            max_pattern_size=2, min_count=1))),
     4, "stopping.repetition_detection.min_count", "[2, 256]"),
    ("unknown output kind", lambda: _request(output__kind=9), 4, "output.kind", "unknown"),
    ("logprobs above the cap", lambda: _request(output__logprobs=21), 4, "output.logprobs",
     "at most 20"),
    ("prompt logprobs above the cap", lambda: _request(output__prompt_logprobs=50), 4,
     "output.prompt_logprobs", "at most 20"),
    ("structured output empty regex", lambda: pb.GenerateRequest(
        text="hi", structured_output=pb.StructuredOutput(regex="")), 4,
     "structured_output.regex", "must not be empty"),
    ("structured output schema not JSON", lambda: pb.GenerateRequest(
        text="hi", structured_output=pb.StructuredOutput(json_schema="{nope")), 4,
     "structured_output.json_schema", "not valid JSON"),
    ("structured output empty choice", lambda: pb.GenerateRequest(
        text="hi", structured_output=pb.StructuredOutput(choice=pb.StructuredOutput.Choices(
            values=["a", ""]))), 4,
     "structured_output.choice.values[1]", "must not be empty"),
    ("prompt too long", lambda: _request(), 64, "text", "max_model_len is 64"),
    ("prompt ids too long", lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 70)), 0,
     "token_ids.ids", "70 tokens"),
    ("token id out of vocab", lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 300])), 0,
     "token_ids.ids[1]", "300 is out of range"),
    ("max_tokens past max_model_len", lambda: _request(stopping__max_tokens=61), 4,
     "stopping.max_tokens", "exceeds max_model_len (64)"),
    ("stop token out of vocab", lambda: _request(stopping__stop_token_ids=[999]), 4,
     "stopping.stop_token_ids[0]", "out of range"),
    ("truncate zero", lambda: _request(truncate_prompt_tokens=0), 4,
     "truncate_prompt_tokens", ">= 1"),
    ("long request id", lambda: _request(request_id="x" * 300), 4, "request_id", "at most"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("build", "prompt_len", "field", "words"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_each_rule_is_invalid_argument_naming_the_field(build, prompt_len, field, words) -> None:
    request = build()
    with pytest.raises(ApiError) as caught:
        plan = plan_generate(request, request.request_id or "req-1", FACTS)
        ids = plan.prompt_token_ids if plan.prompt_token_ids is not None else [5] * prompt_len
        build_engine_request(plan, resolve_prompt(plan, ids, FACTS), FACTS)
    error = caught.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.message and words in error.message, error.message
    assert error.field.startswith(field.split("[")[0])


def test_details_carry_bad_request_and_error_info() -> None:
    with pytest.raises(ApiError) as caught:
        _engine_request(_request(), prompt_len=64)
    status = caught.value.status_proto()
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    info, bad_request = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
    assert status.details[0].Unpack(info) and info.reason == "PROMPT_TOO_LONG"
    assert status.details[1].Unpack(bad_request)
    assert bad_request.field_violations[0].field == "text"


def test_unknown_model_is_not_found() -> None:
    with pytest.raises(ApiError) as caught:
        plan_generate(_request(model="gpt-9"), "req-1", FACTS)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert "gpt-9" in caught.value.message


def test_defaults_come_from_the_model_and_max_tokens_fills_the_room() -> None:
    engine_request = _engine_request(_request(model="tiny"), prompt_len=10)
    sampling = engine_request.sampling_params
    assert sampling.temperature == pytest.approx(0.7)  # generation_config.json
    assert sampling.max_tokens == 64 - 10
    assert sampling.eos_token_ids == [0, 2]
    assert engine_request.prompt_token_ids == [5] * 10


def test_explicit_knobs_reach_the_engine_request() -> None:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[7, 8, 9]),
        sampling=pb.SamplingParams(temperature=0.0, top_p=0.5, top_k=-1, seed=42, n=1),
        stopping=pb.StoppingCriteria(
            max_tokens=5, min_tokens=1, stop_token_ids=[3], ignore_eos=True
        ),
        priority=-2,
        cache_salt="tenant-a",
        truncate_prompt_tokens=2,
    )
    engine_request = _engine_request(request)
    sampling = engine_request.sampling_params
    assert engine_request.prompt_token_ids == [8, 9]
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.0, 0.5, -1)
    assert (sampling.seed, sampling.max_tokens, sampling.min_tokens) == (42, 5, 1)
    assert sampling.stop_token_ids == [3] and sampling.ignore_eos
    assert engine_request.priority == -2 and engine_request.cache_salt == "tenant-a"


def test_no_op_values_are_accepted_and_unset_n_means_one() -> None:
    request = _request(sampling__repetition_penalty=1.0, sampling__min_p=0.0)
    assert _engine_request(request).sampling_params.max_tokens == 60
    assert plan_generate(request, "req-1", FACTS).n == 1
    assert plan_generate(_request(sampling__n=1), "req-1", FACTS).n == 1


def test_every_sampling_knob_reaches_the_engine_request() -> None:
    request = pb.GenerateRequest(
        text="hi",
        sampling=pb.SamplingParams(
            min_p=0.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            logit_bias={3: -5.0},
            allowed_token_ids=[3, 4, 5],
            n=3,
        ),
        stopping=pb.StoppingCriteria(
            repetition_detection=pb.RepetitionDetection(max_pattern_size=8, min_count=4)
        ),
        output=pb.OutputOptions(logprobs=0, prompt_logprobs=5),
    )
    plan = plan_generate(request, "req-1", FACTS)
    assert plan.n == 3
    engine_request = build_engine_request(
        plan, resolve_prompt(plan, [5] * 4, FACTS), FACTS, bad_words_token_ids=[[7, 8]]
    )
    p = engine_request.sampling_params
    assert (p.min_p, p.presence_penalty, p.frequency_penalty) == pytest.approx((0.1, 0.5, -0.5))
    assert p.repetition_penalty == pytest.approx(1.2)
    assert p.logit_bias == {3: -5.0} and p.allowed_token_ids == [3, 4, 5]
    assert p.bad_words_token_ids == [[7, 8]]
    assert (p.logprobs, p.prompt_logprobs) == (0, 5)
    assert p.repetition_detection == RepetitionDetectionParams(1, 8, 4)


def test_unset_penalties_take_the_models_defaults() -> None:
    facts = dataclasses.replace(FACTS, sampling_defaults={"min_p": 0.05, "repetition_penalty": 1.1})
    plan = plan_generate(_request(), "req-1", facts)
    p = build_engine_request(plan, resolve_prompt(plan, [5] * 4, facts), facts).sampling_params
    assert (p.min_p, p.repetition_penalty) == pytest.approx((0.05, 1.1))
    assert p.logit_bias is None and p.allowed_token_ids is None and p.logprobs is None

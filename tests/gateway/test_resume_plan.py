"""Which cut-off requests resume, and as what (gateway/engines/resume.py)."""

from __future__ import annotations

import msgspec

from switchboard.gateway.engines.resume import resume_plan
from switchboard.wire.engine_msgs import (
    EngineCoreRequest,
    PoolingParams,
    SamplingParams,
    StructuredOutputParams,
    TensorRef,
)


def request(**params: object) -> EngineCoreRequest:
    return EngineCoreRequest(
        "r", [1, 2, 3], sampling_params=SamplingParams(max_tokens=10, **params)
    )


def test_the_delivered_tokens_travel_as_output_with_every_parameter_kept() -> None:
    original = request(seed=7, temperature=0.8, min_tokens=4, presence_penalty=0.5)
    resumed, why = resume_plan(original, [4, 5])
    assert why == "" and resumed is not None
    assert resumed.prompt_token_ids == [1, 2, 3]
    assert resumed.output_token_ids == [4, 5]
    assert resumed.sampling_params == original.sampling_params  # max/min tokens count output
    assert resumed.request_id == "r"


def test_nothing_delivered_is_the_same_request_again() -> None:
    original = request(structured_output=StructuredOutputParams("regex", "a+"))
    assert resume_plan(original, []) == (original, "")
    pooling = EngineCoreRequest("e", [1], pooling_params=PoolingParams())
    assert resume_plan(pooling, []) == (pooling, "")


def test_a_structured_output_request_resumes_with_its_grammar_and_tokens() -> None:
    # the engine that takes it replays the delivered tokens through the grammar
    grammar = request(structured_output=StructuredOutputParams("regex", "a+"))
    resumed, why = resume_plan(grammar, [4, 5])
    assert why == "" and resumed is not None
    assert resumed.output_token_ids == [4, 5]
    assert resumed.sampling_params == grammar.sampling_params


def test_what_cannot_resume_says_why() -> None:
    embeds = msgspec.structs.replace(request(), prompt_embeds=TensorRef("<f4", [1, 8], 0))
    assert resume_plan(embeds, [4]) == (None, "prompt embeddings are not kept")
    assert resume_plan(request(), list(range(10)))[0] is None  # nothing left to generate
    assert resume_plan(None, [1])[0] is None

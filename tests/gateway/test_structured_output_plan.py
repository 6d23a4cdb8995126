"""The gateway's structured-output plan: the proto oneof -> the wire constraint, the grammar check
that runs before ADD, and the OpenAI ``response_format`` seam."""

from __future__ import annotations

import json

import grpc
import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.pipeline.constraint_check import (
    check_structured_output_plan,
    from_openai_response_format,
    plan_structured_output,
)
from switchboard.wire.engine_msgs import StructuredOutputParams

SO = pb.StructuredOutput


@pytest.mark.parametrize(
    ("so", "expected"),
    [
        (SO(), None),
        (SO(json_object=False), None),
        (SO(json_object=True), StructuredOutputParams("json_object", "")),
        (SO(regex=r"\d+"), StructuredOutputParams("regex", r"\d+")),
        (SO(json_schema='{"type": "integer"}'),
         StructuredOutputParams("json_schema", '{"type": "integer"}')),
        (SO(grammar='start: "a"'), StructuredOutputParams("grammar", 'start: "a"')),
        (SO(choice=SO.Choices(values=["x", "y z"])),
         StructuredOutputParams("choice", '["x", "y z"]')),
    ],
)  # fmt: skip
def test_each_kind_reaches_the_wire(so, expected) -> None:
    params = plan_structured_output(so)
    assert params == expected
    if params is not None:
        check_structured_output_plan(params)  # all of these compile


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        (StructuredOutputParams("json_schema", '{"type": "strng"}'), "json_schema", "strng"),
        (StructuredOutputParams("json_schema", '{"type": "object", "properties": 3}'),
         "json_schema", "properties"),
        (StructuredOutputParams("regex", "[0-9"), "regex", "unclosed"),
        (StructuredOutputParams("grammar", "start: undefined_rule"), "grammar", "undefined_rule"),
        (StructuredOutputParams("grammar", "root ::= ("), "grammar", ""),
        (StructuredOutputParams("structural_tag", '{"structures": []}'), "structural_tag",
         "structures"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_invalid_argument_naming_it(params, field, words) -> None:
    with pytest.raises(ApiError) as caught:
        check_structured_output_plan(params)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.field == f"structured_output.{field}"
    assert caught.value.message.startswith(f"structured_output.{field}")
    assert words in caught.value.message


def test_structural_tag_compiles() -> None:
    tag = {
        "structures": [{"begin": "<f=get>", "schema": {"type": "object"}, "end": "</f>"}],
        "triggers": ["<f="],
    }
    params = plan_structured_output(SO(structural_tag=json.dumps(tag)))
    assert params is not None and params.kind == "structural_tag"
    check_structured_output_plan(params)


def test_openai_response_format_seam() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert from_openai_response_format(None) is None
    assert from_openai_response_format({"type": "text"}) is None
    assert from_openai_response_format({"type": "json_object"}) == StructuredOutputParams(
        "json_object", ""
    )
    params = from_openai_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    )
    assert params == StructuredOutputParams("json_schema", json.dumps(schema))
    check_structured_output_plan(params)
    for bad, field in [
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": 5}}, "response_format.json_schema"),
        ("json", "response_format"),
    ]:
        with pytest.raises(ApiError) as caught:
            from_openai_response_format(bad)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.field.startswith(field)

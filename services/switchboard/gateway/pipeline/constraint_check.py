"""The request's ``structured_output`` -> the engine's constraint, checked before it is queued.

``plan_structured_output`` (on the event loop) reads the proto oneof and checks what costs
nothing (empty values, sizes, JSON that does not parse); ``check_structured_output_plan`` (in
the gateway's thread pool, before ADD) has llguidance validate the grammar it compiles to, so a
bad schema, regex or grammar is INVALID_ARGUMENT naming the problem and nothing is queued. The
engine compiles it against the tokenizer (``engine/constrained_decoding.py``).

``from_openai_response_format`` serves the OpenAI HTTP front (``gateway/http/openai_request.py``
sets the request's ``structured_output`` from it): ``response_format``
(``{"type": "json_schema", "json_schema": {"schema": ...}}``, ``{"type": "json_object"}``,
``{"type": "text"}``) -> the same plan.
"""

from __future__ import annotations

import json
from typing import Any

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.common.constraint_grammar import (
    MAX_CHOICES,
    StructuredOutputError,
    check_structured_output,
)
from switchboard.gateway.api_errors import invalid_argument
from switchboard.wire.engine_msgs import StructuredOutputParams
from switchboard.wire.field_rules import STRUCTURED_SPEC

FIELD = "structured_output"


def plan_structured_output(so: pb.StructuredOutput) -> StructuredOutputParams | None:
    """The constraint of a request (None: unconstrained; ``json_object: false`` is none)."""
    kind = so.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not so.json_object):
        return None
    field = f"{FIELD}.{kind}"
    if kind == "json_object":
        return StructuredOutputParams("json_object", "")
    if kind == "choice":
        values = list(so.choice.values)
        if not values:
            raise invalid_argument(f"{field}.values", f"{field}.values: at least one value")
        if len(values) > MAX_CHOICES:
            raise invalid_argument(f"{field}.values", f"{field}.values: at most {MAX_CHOICES}")
        for i, value in enumerate(values):
            if not value:
                raise invalid_argument(
                    f"{field}.values[{i}]", f"{field}.values[{i}]: must not be empty"
                )
        spec = json.dumps(values)
    else:
        spec = getattr(so, kind)
        if not spec.strip():
            raise invalid_argument(field, f"{field}: must not be empty")
    _check_spec_size(field, spec)
    if kind in ("json_schema", "structural_tag"):
        try:
            json.loads(spec)
        except ValueError as exc:
            raise invalid_argument(field, f"{field}: not valid JSON ({exc})") from None
    return StructuredOutputParams(kind, spec)


def _check_spec_size(field: str, spec: str) -> None:
    """The engine's bound on a spec (``wire/field_rules.py``), on the field it was made from."""
    error = STRUCTURED_SPEC.api_message(field, len(spec))
    if error is not None:
        raise invalid_argument(field, error)


def check_structured_output_plan(params: StructuredOutputParams) -> None:
    """Thread pool: compile-check the grammar; ApiError INVALID_ARGUMENT naming the problem."""
    try:
        check_structured_output(params.kind, params.spec)
    except StructuredOutputError as exc:
        field = f"{FIELD}.{params.kind}"
        raise invalid_argument(field, f"{FIELD}.{exc}") from None


def from_openai_response_format(response_format: Any) -> StructuredOutputParams | None:
    """OpenAI ``response_format`` (a parsed JSON object) -> the constraint; None for ``text``
    or no response_format. ApiError INVALID_ARGUMENT (field ``response_format``) otherwise."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise invalid_argument("response_format", "response_format: must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputParams("json_object", "")
    if kind == "json_schema":
        wrapper = response_format.get("json_schema")
        if not isinstance(wrapper, dict):
            raise invalid_argument(
                "response_format.json_schema",
                "response_format.json_schema: an object with a schema",
            )
        schema = wrapper.get("schema", {"type": "object"})  # OpenAI: schema is optional
        if not isinstance(schema, dict | bool):
            raise invalid_argument(
                "response_format.json_schema.schema",
                "response_format.json_schema.schema: a JSON Schema object",
            )
        spec = json.dumps(schema)
        _check_spec_size("response_format.json_schema.schema", spec)
        return StructuredOutputParams("json_schema", spec)
    raise invalid_argument(
        "response_format.type",
        f"response_format.type: one of text, json_object, json_schema, got {kind!r}",
    )

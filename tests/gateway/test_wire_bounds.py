"""Every bound of the engine's wire rules is the gateway's first, derived from the rules.

For each bound in ``wire/field_rules.BOUNDS``, a request just over it through each front (gRPC
Generate, the OpenAI HTTP API) is refused by the gateway, INVALID_ARGUMENT / 400 with a
``BadRequest`` naming the API field, and nothing reaches an engine; a request just under it is
served. The scripted engine applies the wire rules as an engine core does, so a bound the
gateway let through would end the call INTERNAL. A bound without an API field fails here unless
it is listed as one no client sets, and a field of ``SamplingParams`` without a bound fails
unless it is listed with where its rules are checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import msgspec
import pytest
from gateway_harness import WAIT_S, gateway_config, until
from gateway_scripted_engine import ScriptedEngine
from google.protobuf import descriptor
from google.rpc import error_details_pb2

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.config import GatewayConfig
from switchboard.gateway.errors import status_details
from switchboard.gateway.http.errors import openai_param
from switchboard.gateway.server import GatewayServer
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.field_rules import (
    BAD_WORD_TOKENS,
    BOUNDS,
    MAX_REQUEST_ID_CHARS,
    MAX_TOKEN_LIST,
    Bound,
    MaxEntries,
    Range,
)

F = descriptor.FieldDescriptor
VOCAB_SIZE = 2 * MAX_TOKEN_LIST  # room for a full list of distinct token ids
# The bounds no client sets, and why.
NOT_FROM_THE_API = {"sampling_params.eos_token_ids": "the model's EOS ids (its config files)"}
# The SamplingParams fields without a bound in BOUNDS, and where their rules are checked.
CHECKED_ELSEWHERE = {
    "max_tokens": "against max_model_len (test_gateway_validation.py)",
    "min_tokens": "against max_tokens (test_gateway_validation.py)",
    "ignore_eos": "a bool",
    "structured_output": "its spec's size and grammar (test_structured_output_plan.py)",
}
_TYPE_RANGES = {
    F.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    F.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    F.CPPTYPE_UINT32: (0, 2**32 - 1),
    F.CPPTYPE_UINT64: (0, 2**64 - 1),
}
_INTEGER_TYPES = tuple(_TYPE_RANGES)
# A message whose fields are bounded together: the valid rest of it, around the one under test.
VALID_MESSAGES = {
    "stopping.repetition_detection": pb.RepetitionDetection(max_pattern_size=4, min_count=2),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One request: ``value`` (a number, or a count of entries) in the API field of ``rule``;
    refused naming ``field``, or served."""

    rule: Bound
    value: Any
    refused: bool

    @property
    def field(self) -> str:
        assert self.rule.api is not None
        if isinstance(self.rule, MaxEntries) and self.rule.each:
            return f"{self.rule.api}[0]"
        return f"{self.rule.api}[5]" if self.rule.each else self.rule.api


def _field_descriptor(path: str) -> descriptor.FieldDescriptor:
    message = pb.GenerateRequest.DESCRIPTOR
    *parents, leaf = path.split(".")
    for name in parents:
        message = message.fields_by_name[name].message_type
    return message.fields_by_name[leaf]


def _range_cases(rule: Range) -> list[tuple[Any, bool, bool]]:
    """(value, refused, settable through gRPC) just inside and just outside each finite edge."""
    field = _field_descriptor(rule.api or "")
    if field.message_type is not None:  # a map: its values are the field
        field = field.message_type.fields_by_name["value"]
    integer = field.cpp_type in _INTEGER_TYPES
    type_low, type_high = _TYPE_RANGES.get(field.cpp_type, (-math.inf, math.inf))
    cases = []
    for edge, sign in ((rule.low, -1), (rule.high, 1)):
        if math.isinf(edge):
            continue
        step = 1 if integer else max(1e-3, abs(edge) * 1e-3)
        open_edge = rule.low_open and sign < 0
        inside = edge - sign * step if open_edge else edge
        outside = edge if open_edge else edge + sign * step
        # The proto field's type may keep this side already: then the inside value is the
        # type's own limit, and the outside one only the HTTP front's JSON can say.
        inside = min(max(inside, type_low), type_high)
        assert type_low <= inside <= type_high
        cases += [(inside, False, True), (outside, True, type_low <= outside <= type_high)]
    return cases


def cases() -> list[tuple[Case, bool]]:
    """(case, whether the gRPC API can say it) for every bound with an API field."""
    out: list[tuple[Case, bool]] = []
    for rule in BOUNDS:
        if rule.api is None:
            continue
        if isinstance(rule, Range):
            out += [(Case(rule, v, refused), grpc_ok) for v, refused, grpc_ok in _range_cases(rule)]
        else:
            out += [(Case(rule, rule.api_limit, False), True)]
            out += [(Case(rule, rule.api_limit + 1, True), True)]
    return out


def _entries(case: Case, tokenizer: Any) -> Any:
    """The value of the API field: a number, or a list / map / word of that many entries."""
    rule = case.rule
    if isinstance(rule, Range):
        return {5: case.value} if rule.each else case.value
    if rule is BAD_WORD_TOKENS:
        word = "Q" * case.value  # one token per letter: no merge of it was learned
        assert len(tokenizer.encode(word, add_special_tokens=False)) == case.value
        return [word]
    field = _field_descriptor(rule.api or "")
    if field.message_type is not None:  # a map of token ids
        return {token_id: 1.0 for token_id in range(case.value)}
    if field.type == F.TYPE_STRING:
        return ["one"] * case.value
    return list(range(case.value))


def _grpc_request(case: Case, value: Any, request_id: str) -> pb.GenerateRequest:
    request = pb.GenerateRequest(text="Hello", request_id=request_id)
    request.stopping.max_tokens = 1
    *parents, leaf = (case.rule.api or "").split(".")
    target: Any = request
    for depth, name in enumerate(parents):
        target = getattr(target, name)
        valid = VALID_MESSAGES.get(".".join(parents[: depth + 1]))
        if valid is not None:
            target.CopyFrom(valid)
    if isinstance(value, dict):
        getattr(target, leaf).update(value)
    elif isinstance(value, list):
        getattr(target, leaf).extend(value)
    else:
        setattr(target, leaf, value)
    return request


def _http_body(case: Case, value: Any) -> dict[str, Any]:
    name = openai_param(case.rule.api or "")
    assert name is not None
    if isinstance(value, dict):
        value = {str(key): item for key, item in value.items()}
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 1, name: value}


@dataclasses.dataclass
class Fronts:
    server: GatewayServer
    engine: ScriptedEngine
    stub: pb_grpc.GenerationServiceStub
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}/v1/completions"

    async def grpc_code(self, request: pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
        """The call's status and the field its BadRequest names ("" if none)."""
        try:
            async for _ in self.stub.Generate(request, timeout=WAIT_S):
                pass
        except grpc.aio.AioRpcError as error:
            return error.code(), _violated_field(error)
        return grpc.StatusCode.OK, ""

    async def http_status(
        self, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        async with self.http.post(self.url, data=json.dumps(body), headers=headers) as response:
            return response.status, await response.json()


def _wire_value(request: Any, path: str) -> Any:
    for name in path.split("."):
        request = getattr(request, name) if request is not None else None
    return request


def _violated_field(error: grpc.aio.AioRpcError) -> str:
    status = status_details(error)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            return bad_request.field_violations[0].field
    return ""


@pytest.fixture
async def fronts(checkpoint_dir: Path, run_dir: str) -> AsyncIterator[Fronts]:
    gateway = GatewayConfig(host="127.0.0.1", port=0, http_port=0)
    config = gateway_config(checkpoint_dir, run_dir, gateway=gateway)
    server = GatewayServer(config)
    await server.start()
    engine = ScriptedEngine(
        config.input_address, config.output_address, [5, 6, 7], vocab_size=VOCAB_SIZE
    )
    await engine.start()
    assert await server.engines.wait_until_ready(WAIT_S)
    await until(lambda: server.ready, "ready")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    session = aiohttp.ClientSession()
    try:
        yield Fronts(server, engine, pb_grpc.GenerationServiceStub(channel), session)
    finally:
        await session.close()
        await channel.close()
        with contextlib.suppress(Exception):
            await engine.close()
        await server.stop()


def test_every_bound_has_an_api_field_and_every_wire_field_a_rule() -> None:
    no_api = {rule.wire for rule in BOUNDS if rule.api is None}
    assert no_api == set(NOT_FROM_THE_API), "a bound no client can break? say why here"
    bounded = {rule.wire.removeprefix("sampling_params.").split(".")[0] for rule in BOUNDS}
    unbounded = {f.name for f in msgspec.structs.fields(SamplingParams)} - bounded
    assert unbounded == set(CHECKED_ELSEWHERE), "a wire field without rules"


async def test_just_over_each_bound_is_refused_by_the_gateway(fronts: Fronts) -> None:
    tokenizer = fronts.server.state.tokenizer
    served = 0
    for number, (case, grpc_can_say_it) in enumerate(cases()):
        value = _entries(case, tokenizer)
        request_id = f"bound-{number}"
        if grpc_can_say_it:
            code, field = await fronts.grpc_code(_grpc_request(case, value, request_id))
            if case.refused:
                assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, case.field), case
                assert request_id not in fronts.engine.added, case
            else:
                assert code == grpc.StatusCode.OK, (case, code, fronts.engine.rejected)
                served += 1
        http_id = f"http-{request_id}"
        status, body = await fronts.http_status(_http_body(case, value), {"X-Request-Id": http_id})
        if case.refused and status == 200:
            # The OpenAI front does not take this parameter: the engine never got the value.
            assert _wire_value(fronts.engine.added[http_id], case.rule.wire) is None, case
            continue
        expected = 400 if case.refused else 200
        assert status == expected, (case, body, fronts.engine.rejected)
        if case.refused:
            assert body["error"]["param"] == openai_param(case.field), (case, body)
    assert not fronts.engine.rejected
    assert served == sum(1 for case, grpc_ok in cases() if grpc_ok and not case.refused)


async def test_request_id_leaves_room_for_the_engine_request_ids(fronts: Fronts) -> None:
    """The longest request id the API takes, with n sequences (``<i>_<id>``) or several Embed
    inputs (``<id>-<index>``): the engine takes every id the gateway makes of it."""
    longest = "r" * MAX_REQUEST_ID_CHARS
    request = pb.GenerateRequest(text="Hello", request_id=longest)
    request.stopping.max_tokens = 1
    request.sampling.n = 64
    assert (await fronts.grpc_code(request))[0] == grpc.StatusCode.OK, fronts.engine.rejected
    request.request_id += "r"
    assert await fronts.grpc_code(request) == (grpc.StatusCode.INVALID_ARGUMENT, "request_id")
    embed = pb.EmbedRequest(request_id=longest, inputs=[pb.EmbedInput(text="a")] * 12)
    response = await fronts.stub.Embed(embed, timeout=WAIT_S)
    assert len(response.results) == 12
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1, "n": 64}
    status, answer = await fronts.http_status(body, {"X-Request-Id": "h" * MAX_REQUEST_ID_CHARS})
    assert status == 200, answer
    status, answer = await fronts.http_status(body, {"X-Request-Id": "h" * 257})
    assert status == 400 and answer["error"]["param"] == "x-request-id", answer
    assert not fronts.engine.rejected

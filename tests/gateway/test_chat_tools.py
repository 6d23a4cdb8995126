"""Tools in chat: the tools-capable tiny template rendered as transformers' apply_chat_template
(tools=...) renders it, through the OpenAI body -> GenerateRequest -> template path; the
``<tool_call>`` parser and its streaming half on crafted outputs; the forced-call schemas."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.chat.prompt import plan_chat, render_chat
from switchboard.gateway.chat.template import load_chat_template
from switchboard.gateway.chat.tools import (
    AutoToolStream,
    ToolPlan,
    call_schema,
    forced_call_schema,
    parse_forced_call,
    parse_tool_calls,
)
from switchboard.gateway.http.openai_request import chat_request
from tests.tiny_checkpoint import TINY_TOOLS_CHAT_TEMPLATE, tiny_llama_dir

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast <for> a city & 'its' region.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
NAMES = frozenset({"get_weather", "get_time"})
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'


def _history(arguments: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]


CASES = [
    ([{"role": "user", "content": "Hi"}], [WEATHER]),
    (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [WEATHER, CLOCK],
    ),
    (_history({"city": "Paris", "days": 2}), [WEATHER]),
    (_history({"city": "Paris", "days": 2}), None),
]


@pytest.fixture(scope="module")
def tools_dir() -> str:
    return tiny_llama_dir(chat_template=TINY_TOOLS_CHAT_TEMPLATE)


def _through_the_gateway(model_dir: str, messages: list[dict], tools: list | None) -> str:
    """The OpenAI body as a client sends it (arguments as JSON text) -> the prompt text."""
    wire_messages = json.loads(json.dumps(messages))
    for message in wire_messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    body: dict[str, Any] = {"model": "tiny", "messages": wire_messages}
    if tools is not None:
        body["tools"] = tools
    request, _ = chat_request(body, "r")
    request = pb.GenerateRequest.FromString(request.SerializeToString())  # as gRPC carries it
    template = load_chat_template(model_dir)
    assert template is not None
    chat = plan_chat(request, template, "tiny")
    assert chat is not None
    return render_chat(template, chat)


@pytest.mark.parametrize("messages, tools", CASES)
def test_rendering_with_tools_matches_transformers(tools_dir: str, messages, tools) -> None:
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(tools_dir).apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert _through_the_gateway(tools_dir, messages, tools) == expected
    if tools:
        assert "<tools>" in expected and tools[0]["function"]["description"] in expected


def test_tool_choice_none_leaves_the_tools_out() -> None:
    request, options = chat_request(
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [WEATHER],
            "tool_choice": "none",
        },
        "r",
    )
    assert not request.tools and options.tools is None


def test_tools_without_messages_are_refused() -> None:
    request = pb.GenerateRequest(text="Hi", tools=[pb.Tool(type="function")])
    with pytest.raises(ApiError, match="tools applies to messages only"):
        plan_chat(request, None, "tiny")


# -- the <tool_call> parser ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, content, names",
    [
        (f"<tool_call>\n{CALL}\n</tool_call>", None, ["get_weather"]),
        (f"Sure.\n<tool_call>{CALL}</tool_call>\n", "Sure.", ["get_weather"]),
        (
            f'<tool_call>{CALL}</tool_call>\n<tool_call>{{"name": "get_time", "arguments": {{}}}}'
            "</tool_call>",
            None,
            ["get_weather", "get_time"],
        ),
        (f"<tool_call>{CALL}", None, ["get_weather"]),  # unclosed at the end: stopped early
        ('<tool_call>{"name": "get_time", "parameters": {}}</tool_call>', None, ["get_time"]),
        ("No tools needed.", "No tools needed.", []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', None, []),  # not offered
        (
            f"a <tool_call>[1]</tool_call> b <tool_call>{CALL}</tool_call>",
            "a <tool_call>[1]</tool_call> b",
            ["get_weather"],
        ),
    ],
)
def test_parse_tool_calls(text: str, content: str | None, names: list[str]) -> None:
    got_content, calls = parse_tool_calls(text, NAMES)
    assert [c["function"]["name"] for c in calls] == names
    if not names:
        assert got_content == text  # nothing parsed: the text is untouched
    else:
        assert got_content == content
    for call in calls:
        assert (
            call["id"].startswith("call_") and len(call["id"]) > 10 and call["type"] == "function"
        )
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert len({c["id"] for c in calls}) == len(calls)


def test_parse_tool_calls_keeps_the_first_without_parallel_calls() -> None:
    text = f"<tool_call>{CALL}</tool_call><tool_call>{CALL}</tool_call>"
    _, calls = parse_tool_calls(text, NAMES, parallel=False)
    assert len(calls) == 1


@pytest.mark.parametrize("step", [1, 2, 3, 5, 100])
def test_auto_stream_holds_back_only_what_may_be_a_call(step: int) -> None:
    text = f"Let me <b>check</b> <tool_<tool_call>{CALL}</tool_call> done"
    stream = AutoToolStream(ToolPlan("auto", NAMES))
    sent = "".join(stream.feed(text[i : i + step]) for i in range(0, len(text), step))
    assert sent == "Let me <b>check</b> <tool_"  # the text before the call, at once
    rest, calls = stream.finish()
    assert rest == "done" and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_auto_stream_without_a_call_gives_everything_back() -> None:
    stream = AutoToolStream(ToolPlan("auto", NAMES))
    sent = stream.feed("ends with <tool")
    assert sent == "ends with "
    assert stream.finish() == ("<tool", [])
    stream = AutoToolStream(ToolPlan("auto", NAMES))
    assert stream.feed("x <tool_call>oops") == "x "
    assert stream.finish() == ("<tool_call>oops", [])


# -- forced calls -------------------------------------------------------------------------------


def test_forced_call_schemas_accept_calls_and_refuse_others() -> None:
    functions = {"get_weather": WEATHER["function"]["parameters"], "get_time": None}
    named = forced_call_schema(functions, "get_weather")
    jsonschema.validate(json.loads(CALL), named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_time", "arguments": {}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"days": 2}}, named)
    required = forced_call_schema(functions, None)
    jsonschema.validate({"name": "get_time", "arguments": {}}, required)
    jsonschema.validate(json.loads(CALL), required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "other", "arguments": {}}, required)
    assert forced_call_schema({"get_time": None}, None) == call_schema("get_time", None)


def test_parse_forced_call() -> None:
    call = parse_forced_call(CALL)
    assert call is not None and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert parse_forced_call('{"name": "get_weather", "argu') is None  # cut by max_tokens

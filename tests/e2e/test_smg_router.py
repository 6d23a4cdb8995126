"""The real router in front of two servers: SMG (``smg launch``, the Shepherd Model Gateway, a
test dependency) in gRPC mode reaches both over vLLM's engine service, tokenizes, renders the
chat template and parses tool calls itself: OpenAI chat and completions through it, streamed
and not, a tool call, both servers taking requests, and a client that goes away freeing the
engine it was on."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vgrpc

from tests.e2e import client_calls
from tests.e2e.server import RunningServer, free_port, start_server, wait_until
from tests.tiny_checkpoint import TINY_TOOLS_CHAT_TEMPLATE, tiny_llama_dir

pytestmark = pytest.mark.slow

SMG = shutil.which("smg", path=str(Path(sys.executable).parent))
TIMEOUT_S = 120.0
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def model_dir() -> str:
    # "]" favoured: SMG's schema for tool_choice "required" is an array of calls with no upper
    # bound, which a random model may go on filling until max_tokens; a model that closes the
    # array when it may gives one call, on any CPU's floats
    return tiny_llama_dir(chat_template=TINY_TOOLS_CHAT_TEMPLATE, favoured_token="]")


@pytest.fixture(scope="module")
def servers(
    model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RunningServer]]:
    started: list[RunningServer] = []
    try:
        for name in ("a", "b"):
            workdir = tmp_path_factory.mktemp(f"smg-{name}")
            started.append(
                start_server(model_dir, workdir, "--enable-admin", "--max-model-len", "512")
            )
        yield started
    finally:
        for server in started:
            assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def router(
    servers: list[RunningServer], model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    if SMG is None:
        pytest.skip("smg is not installed (the test extra pins it)")
    port = free_port()
    log_path = tmp_path_factory.mktemp("smg") / "smg.log"
    command = [
        SMG, "launch",
        "--worker-urls", *(f"grpc://{server.target}" for server in servers),
        "--model-path", model_dir,
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--policy", "round_robin",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _models(url, process, log_path), "smg lists the model", TIMEOUT_S, 0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _models(url: str, process: subprocess.Popen, log_path: Path) -> bool:
    assert process.poll() is None, f"smg exited\n{log_path.read_text(errors='replace')}"
    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
            return bool(client.models.list().data)
    except openai.APIError:
        return False


@pytest.fixture(scope="module")
def client(router: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{router}/v1", api_key="none", max_retries=0) as c:
        yield c


def last_receive(server: RunningServer) -> float:
    with server.channel() as channel:
        info = vgrpc.VllmEngineStub(channel).GetServerInfo(
            vpb.GetServerInfoRequest(), timeout=TIMEOUT_S
        )
    return info.last_receive_timestamp


def in_flight(server: RunningServer) -> int:
    with server.channel() as channel:
        info = vgrpc.VllmEngineStub(channel).GetServerInfo(
            vpb.GetServerInfoRequest(), timeout=TIMEOUT_S
        )
    return info.active_requests


def test_chat_and_completions_stream_or_not_on_both_servers(
    servers: list[RunningServer], client: openai.OpenAI
) -> None:
    model = client.models.list().data[0].id
    before = [last_receive(server) for server in servers]
    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 6
    pieces = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices) == completion.choices[0].text
    # round robin: four calls reached both servers, over vLLM's engine service
    assert all(last_receive(s) > b for s, b in zip(servers, before, strict=True))


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_a_tool_call_through_smgs_parser(client: openai.OpenAI, tool_choice: str) -> None:
    choice = (
        {"type": "function", "function": {"name": "get_weather"}}
        if tool_choice == "named"
        else "required"
    )
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice=choice,  # type: ignore[arg-type]
        max_tokens=200,  # one call is 38 tokens
        temperature=0,
    )
    message = chat.choices[0].message
    assert message.tool_calls, (chat.choices[0].finish_reason, message.content, chat.usage)
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")  # type: ignore[union-attr]
    assert chat.choices[0].finish_reason == "tool_calls"


def test_a_client_that_goes_away_frees_the_engine(
    servers: list[RunningServer], router: str, client: openai.OpenAI
) -> None:
    # Both engines asleep: the request surely waits in a queue when its client leaves.
    channels = [grpc.insecure_channel(server.target) for server in servers]
    for channel in channels:
        client_calls.utility(channel, "sleep", 1)
    try:
        connection = http.client.HTTPConnection(router.removeprefix("http://"), timeout=TIMEOUT_S)
        body = {
            "model": client.models.list().data[0].id,
            "prompt": "The capital of France is",
            "max_tokens": 200,
            "stream": True,
        }
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        wait_until(lambda: sum(in_flight(s) for s in servers) == 1, "the request is in flight")
        connection.close()  # the client goes away
        wait_until(lambda: sum(in_flight(s) for s in servers) == 0, "smg cancels it", TIMEOUT_S)
    finally:
        for channel in channels:
            client_calls.utility(channel, "wake_up")
            channel.close()
    assert any("client went away; sent ABORT" in server.log() for server in servers)

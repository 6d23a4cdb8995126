"""The OpenAI-compatible HTTP API in-process, driven by the official ``openai`` package.

The gateway runs in the test's event loop with ``http_port=0``; the engine is the scripted peer
(tests/gateway/gateway_scripted_engine.py), which emits " one two three ..." one token a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import openai
import pytest
from gateway_harness import (
    WAIT_S,
    connect_scripted,
    gateway_config,
    start_scripted,
    stop_scripted,
    until,
)
from gateway_scripted_engine import ScriptedEngine

from switchboard.config import GatewayConfig
from switchboard.gateway.grpc_server import GatewayServer
from tests.gateway.conftest import write_chat_checkpoint_dir

SCRIPT_TEXT = " one two three four five six seven eight nine ten"
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
TOOL = {"type": "function", "function": {"name": "f"}}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_checkpoint_dir(tmp_path_factory.mktemp("chat-model"), CHAT_TEMPLATE)


@dataclasses.dataclass
class HttpHarness:
    server: GatewayServer
    engine: ScriptedEngine
    client: openai.AsyncOpenAI

    def script_text(self, num_tokens: int) -> str:
        return self.server.state.tokenizer.decode(self.engine.script[:num_tokens])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"


StartHttp = Callable[..., Awaitable[HttpHarness]]


@pytest.fixture
async def start_http(
    checkpoint_dir: Path, chat_checkpoint_dir: Path, run_dir: str
) -> AsyncIterator[StartHttp]:
    started: list[HttpHarness] = []

    async def start(connect_engine: bool = True, chat: bool = False) -> HttpHarness:
        gateway = GatewayConfig(host="127.0.0.1", port=0, http_port=0)
        model_dir = chat_checkpoint_dir if chat else checkpoint_dir
        server, engine = await start_scripted(
            gateway_config(model_dir, run_dir, gateway=gateway), SCRIPT_TEXT
        )
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0
        )
        harness = HttpHarness(server, engine, client)
        started.append(harness)
        if connect_engine:
            await connect_scripted(server, engine)
        return harness

    yield start
    for harness in started:
        await harness.client.close()
        await stop_scripted(harness.server, harness.engine)


async def _get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


async def test_health_ready_and_models(start_http: StartHttp) -> None:
    h = await start_http(connect_engine=False)
    assert h.server.http_port
    assert (await _get(f"{h.url}/health"))[0] == 200
    status, body = await _get(f"{h.url}/ready")
    assert status == 503 and body == {"status": "not ready"}
    await h.engine.start()
    await until(lambda: h.server.ready, "an engine is READY")
    assert (await _get(f"{h.url}/ready"))[0] == 200
    models = await h.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == 64


async def test_completion_and_usage(start_http: StartHttp) -> None:
    h = await start_http()
    completion = await h.client.completions.create(
        model="tiny", prompt="Hello", max_tokens=4, temperature=0, seed=7
    )
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    (choice,) = completion.choices
    assert choice.text == h.script_text(4)
    assert choice.finish_reason == "length"
    usage = completion.usage
    assert usage.completion_tokens == 4 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + 4
    (added,) = h.engine.added.values()
    assert added.sampling_params.temperature == 0 and added.sampling_params.seed == 7
    counts = h.server.state.observability.counts  # the same observer as gRPC calls
    assert counts.generation_tokens == 4 and counts.requests_in_flight == 0


async def test_completion_default_max_tokens_is_16(start_http: StartHttp) -> None:
    h = await start_http()
    completion = await h.client.completions.create(model="tiny", prompt="Hi")
    assert completion.usage.completion_tokens == 16


async def test_completion_n_stop_and_logprobs(start_http: StartHttp) -> None:
    h = await start_http()
    completion = await h.client.completions.create(
        model="tiny", prompt="Hello", max_tokens=10, n=2, stop=["three"], logprobs=2
    )
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        assert choice.text == " one two "
        assert choice.finish_reason == "stop"
        assert choice.model_extra["stop_reason"] == "three"
        logprobs = choice.logprobs
        tokens = [h.script_text(1), h.server.state.tokenizer.decode(h.engine.script[1:2])]
        assert logprobs.tokens[:2] == tokens
        assert logprobs.text_offset[:2] == [0, len(tokens[0])]
        assert len(logprobs.top_logprobs[0]) == 2
    assert completion.usage.completion_tokens >= 4  # both sequences count
    await until(lambda: len(h.engine.aborted) == 2, "the stop string aborted both")


async def test_completion_stream_with_usage(start_http: StartHttp) -> None:
    h = await start_http()
    stream = await h.client.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == h.script_text(5)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


async def test_raw_sse_framing_ends_with_done(start_http: StartHttp) -> None:
    h = await start_http()
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{h.url}/v1/completions", json=body) as response,
    ):
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["X-Request-Id"].startswith("cmpl-")
        raw = (await response.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": 0}, "n"),
        ({"max_tokens": 500}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"echo": True}, "echo"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": []}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": BAD_SCHEMA}}},
            "response_format",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
async def test_bad_parameter_is_a_400_naming_it(
    start_http: StartHttp, fields: dict, param: str
) -> None:
    h = await start_http()
    with pytest.raises(openai.BadRequestError) as caught:
        await h.client.completions.create(model="tiny", prompt="Hello", extra_body=fields)
    error = caught.value.body
    assert caught.value.status_code == 400
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"]
    assert not h.engine.added


async def test_unknown_model_is_a_404(start_http: StartHttp) -> None:
    h = await start_http()
    with pytest.raises(openai.NotFoundError) as caught:
        await h.client.completions.create(model="gpt-9", prompt="Hello")
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["param"] == "model"


async def test_no_engine_is_a_503(start_http: StartHttp) -> None:
    h = await start_http(connect_engine=False)
    with pytest.raises(openai.InternalServerError) as caught:
        await h.client.completions.create(model="tiny", prompt="Hello")
    assert caught.value.status_code == 503
    assert caught.value.response.headers["Retry-After"] == "1"


async def test_invalid_json_is_a_400(start_http: StartHttp) -> None:
    h = await start_http()
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{h.url}/v1/completions", data=b"{nope") as response,
    ):
        assert response.status == 400
        assert (await response.json())["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_aborts_on_the_engine(start_http: StartHttp, stream) -> None:
    h = await start_http()
    h.engine.mode = "hang" if not stream else "normal"
    h.engine.step_s = 0.05
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 40, "stream": stream}
    headers = {"X-Request-Id": f"req-drop-{stream}"}
    first_chunk = asyncio.Event()

    async def call() -> None:
        async with session.post(f"{h.url}/v1/completions", json=body, headers=headers) as r:
            await r.content.readuntil(b"\n\n")  # streaming: the first token arrived
            first_chunk.set()
            await asyncio.sleep(3600)

    session = aiohttp.ClientSession()
    task = asyncio.create_task(call())
    try:
        await until(lambda: headers["X-Request-Id"] in h.engine.added, "the engine got ADD")
        if stream:
            await asyncio.wait_for(first_chunk.wait(), WAIT_S)
        task.cancel()  # drops the connection
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        await session.close()
    await until(lambda: headers["X-Request-Id"] in h.engine.aborted, "the engine got ABORT")
    await until(
        lambda: not h.server.engines.is_live(headers["X-Request-Id"]), "the gateway forgot it"
    )


async def test_stop_closes_the_http_port(start_http: StartHttp) -> None:
    h = await start_http()
    url = h.url
    await h.server.stop()
    with pytest.raises(aiohttp.ClientConnectionError):
        await asyncio.wait_for(_get(f"{url}/health"), WAIT_S)


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
]


def _rendered_ids(h: HttpHarness) -> list[int]:
    text = (
        "<|im_start|>system\nBe brief.<|endoftext|>\n<|im_start|>user\nHello<|endoftext|>\n"
        "<|im_start|>assistant\n"
    )
    return h.server.state.tokenizer.encode(text, add_special_tokens=False)


async def test_chat_completion(start_http: StartHttp) -> None:
    h = await start_http(chat=True)
    chat = await h.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=4, top_p=0.5
    )
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    (choice,) = chat.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == h.script_text(4)
    assert choice.finish_reason == "length"
    assert chat.usage.completion_tokens == 4
    (added,) = h.engine.added.values()
    assert added.prompt_token_ids == _rendered_ids(h)  # the template's text, no BOS added
    assert chat.usage.prompt_tokens == len(added.prompt_token_ids)
    assert added.sampling_params.top_p == pytest.approx(0.5)


async def test_chat_stream_n2_logprobs_and_usage(start_http: StartHttp) -> None:
    h = await start_http(chat=True)
    stream = await h.client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=3,
        n=2,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in chunks[2:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
        for entry in choice.logprobs.content:
            assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
    assert texts == {0: h.script_text(3), 1: h.script_text(3)}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


async def test_chat_without_a_template_is_a_400(start_http: StartHttp) -> None:
    h = await start_http(chat=False)
    with pytest.raises(openai.BadRequestError) as caught:
        await h.client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert "no chat template" in caught.value.body["message"]
    assert caught.value.body["param"] == "messages"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"messages": []}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [TOOL, TOOL]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),
        ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
        (
            {
                "tools": [TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]}, "messages"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
    ],
)
async def test_chat_bad_parameter_is_a_400(start_http: StartHttp, fields: dict, param) -> None:
    h = await start_http(chat=True)
    body = {"model": "tiny", "messages": MESSAGES, **fields}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{h.url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 400
        assert (await response.json())["error"]["param"] == param

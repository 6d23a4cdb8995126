"""Chat messages through the gateway in-process (real gRPC, real ZeroMQ, a scripted engine):
the engine gets the rendered prompt's ids, the errors have their codes, and ``switchboard chat``
(one-shot and interactive) talks to it. Parity of the rendering itself with transformers is in
test_chat_template.py; a real model answering is in tests/e2e/test_chat.py."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from gateway_harness import WAIT_S, gateway_config, until
from gateway_scripted_engine import ScriptedEngine
from google.protobuf import struct_pb2

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.cli.chat_client import run_chat
from switchboard.config import ModelConfig
from switchboard.gateway.api_errors import status_details
from switchboard.gateway.grpc_server import GatewayServer
from tests.gateway.conftest import write_chat_checkpoint_dir

SCRIPT_TEXT = " one two three four five six"
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}"
    "{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{% if greeting is defined %}{{ greeting }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_checkpoint_dir(tmp_path_factory.mktemp("chat-model"), TEMPLATE)


class Gateway:
    def __init__(self, server: GatewayServer, engine: ScriptedEngine) -> None:
        self.server = server
        self.engine = engine
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.target = f"127.0.0.1:{server.port}"

    def answer(self, num_tokens: int) -> str:
        """The text of the scripted engine's first ``num_tokens`` tokens."""
        return self.server.state.tokenizer.decode(self.engine.script[:num_tokens])

    def prompt_ids(self, text: str) -> list[int]:
        return self.server.state.tokenizer.encode(text, add_special_tokens=False)


StartGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def start_gateway(run_dir: str) -> AsyncIterator[StartGateway]:
    started: list[Gateway] = []

    async def start(checkpoint_dir: Path, chat_template: str = "") -> Gateway:
        model = ModelConfig(
            model=str(checkpoint_dir), served_model_name="tiny", chat_template=chat_template
        )
        config = gateway_config(checkpoint_dir, run_dir, model=model)
        server = GatewayServer(config)
        await server.start()
        script = server.state.tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
        engine = ScriptedEngine(config.input_address, config.output_address, script)
        gateway = Gateway(server, engine)
        started.append(gateway)
        await engine.start()
        assert await server.engines.wait_until_ready(WAIT_S)
        await until(lambda: server.state.facts.vocab_size == engine.vocab_size, "READY")
        return gateway

    yield start
    for gateway in started:
        await gateway.channel.close()
        with contextlib.suppress(Exception):
            await gateway.engine.close()
        await gateway.server.stop()


def _chat(*messages: tuple[str, str], max_tokens: int = 3, **fields) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role=r, content=c) for r, c in messages], **fields
    )
    request.stopping.max_tokens = max_tokens
    return request


async def _error(gateway: Gateway, request: pb.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in gateway.stub.Generate(request, timeout=WAIT_S):
            pass
    return caught.value


def _field(error: grpc.aio.AioRpcError) -> str:
    from google.rpc import error_details_pb2

    for detail in status_details(error).details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            return bad.field_violations[0].field
    return ""


async def test_messages_are_rendered_and_tokenized_without_special_tokens(
    start_gateway: StartGateway, chat_checkpoint_dir: Path
) -> None:
    g = await start_gateway(chat_checkpoint_dir)
    request = _chat(("system", "Be brief."), ("user", "Hello"), request_id="req-chat")
    responses = [r async for r in g.stub.Generate(request, timeout=WAIT_S)]
    text = "<|im_start|>system\nBe brief.<|endoftext|>\n<|im_start|>user\nHello<|endoftext|>\n"
    expected = g.prompt_ids(text + "<|im_start|>assistant\n")
    assert g.engine.added["req-chat"].prompt_token_ids == expected
    assert responses[0].prompt_info.num_prompt_tokens == len(expected)
    assert "".join(o.text for r in responses for o in r.outputs) == g.answer(3)


async def test_generation_prompt_continue_and_kwargs(
    start_gateway: StartGateway, chat_checkpoint_dir: Path
) -> None:
    g = await start_gateway(chat_checkpoint_dir)
    user = "<|im_start|>user\nHello<|endoftext|>\n"
    request = _chat(("user", "Hello"), request_id="no-gen", add_generation_prompt=False)
    request.chat_template_kwargs.update({"greeting": "Hi!"})
    [_ async for _ in g.stub.Generate(request, timeout=WAIT_S)]
    assert g.engine.added["no-gen"].prompt_token_ids == g.prompt_ids(user + "Hi!")

    request = _chat(("user", "Hello"), ("assistant", "Sure"), request_id="continued")
    request.continue_final_message = True  # and no generation prompt after it
    [_ async for _ in g.stub.Generate(request, timeout=WAIT_S)]
    prefilled = g.prompt_ids(user + "<|im_start|>assistant\nSure")
    assert g.engine.added["continued"].prompt_token_ids == prefilled


async def test_chat_errors(start_gateway: StartGateway, chat_checkpoint_dir: Path) -> None:
    g = await start_gateway(chat_checkpoint_dir)
    error = await _error(g, _chat(("tool", "42")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tool messages are not supported" in error.details()
    assert _field(error) == "messages"

    error = await _error(g, _chat(("user", "Hello"), text="Hello"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _field(error) == "messages" and "not both" in error.details()

    error = await _error(g, _chat(("", "Hello")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and _field(error) == "messages[0].role"

    request = _chat(("assistant", "Sure"), add_generation_prompt=True, continue_final_message=True)
    error = await _error(g, request)
    assert _field(error) == "continue_final_message"

    request = _chat(("user", "Hello"))
    request.chat_template_kwargs.update({"messages": []})
    assert _field(await _error(g, request)) == "chat_template_kwargs"

    request = pb.GenerateRequest(text="Hello", add_generation_prompt=True)  # chat option, no chat
    error = await _error(g, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _field(error) == "add_generation_prompt"
    request = pb.GenerateRequest(text="Hello", chat_template_kwargs=struct_pb2.Struct())
    assert _field(await _error(g, request)) == "chat_template_kwargs"

    error = await _error(g, pb.GenerateRequest())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages" in error.details()
    assert g.engine.added == {}


async def test_model_without_template_refuses_messages(
    start_gateway: StartGateway, checkpoint_dir: Path, tmp_path: Path
) -> None:
    g = await start_gateway(checkpoint_dir)  # tests/gateway/conftest.py's: no chat template
    error = await _error(g, _chat(("user", "Hello")))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has no chat template" in error.details() and "--chat-template FILE" in error.details()
    responses = [r async for r in g.stub.Generate(pb.GenerateRequest(text="Hello"), timeout=WAIT_S)]
    assert responses[-1].outputs[0].finish_reason  # raw completion still works


async def test_chat_template_file_overrides(
    start_gateway: StartGateway, checkpoint_dir: Path, tmp_path: Path
) -> None:
    override = tmp_path / "chat.jinja"
    override.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}>")
    g = await start_gateway(checkpoint_dir, chat_template=str(override))
    request = _chat(("user", "Hello"), request_id="req-override")
    [_ async for _ in g.stub.Generate(request, timeout=WAIT_S)]
    assert g.engine.added["req-override"].prompt_token_ids == g.prompt_ids("[user] Hello\n>")


async def test_chat_client_one_shot(start_gateway: StartGateway, chat_checkpoint_dir: Path) -> None:
    g = await start_gateway(chat_checkpoint_dir)
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(
        run_chat, g.target, "Hello", max_tokens=2, temperature=0.0, system="Be brief.",
        timeout_s=WAIT_S, out=out, err=err,
    )  # fmt: skip
    assert code == 0, err.getvalue()
    assert out.getvalue() == g.answer(2) + "\n"
    assert "[length; " in err.getvalue()
    (added,) = g.engine.added.values()
    assert added.sampling_params.temperature == 0.0
    system = "<|im_start|>system\nBe brief.<|endoftext|>\n"
    user = "<|im_start|>user\nHello<|endoftext|>\n<|im_start|>assistant\n"
    assert added.prompt_token_ids == g.prompt_ids(system + user)


async def test_chat_client_interactive_keeps_history(
    start_gateway: StartGateway, chat_checkpoint_dir: Path
) -> None:
    g = await start_gateway(chat_checkpoint_dir)
    lines = iter(["Hello", "", "More"])

    def read_line(prompt: str) -> str:
        out.write(prompt)
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line

    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(
        run_chat, g.target, max_tokens=2, read_line=read_line, timeout_s=WAIT_S, out=out, err=err
    )
    assert code == 0, err.getvalue()
    answer = g.answer(2)
    assert out.getvalue() == f">>> {answer}\n>>> >>> {answer}\n>>> \n"
    first, second = g.engine.added.values()  # two turns (the empty line sent nothing)
    turn = "<|im_start|>user\nHello<|endoftext|>\n"
    answer = f"<|im_start|>assistant\n{answer}<|endoftext|>\n"
    more = "<|im_start|>user\nMore<|endoftext|>\n<|im_start|>assistant\n"
    assert second.prompt_token_ids == g.prompt_ids(turn + answer + more)
    assert first.prompt_token_ids == g.prompt_ids(turn + "<|im_start|>assistant\n")

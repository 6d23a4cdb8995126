"""The OpenAI-compatible HTTP API of a real `switchboard serve` (tiny Llama with a chat
template, its weights quantized to int8 for decode), driven by the official ``openai`` package:
the same tokens as gRPC (one request path), chat rendered by the template, streaming, the
model's dtype and quantization on every front, a dropped connection freeing the engine, and a
stream interval grouping the tokens of both fronts."""

from __future__ import annotations

import array
import base64
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlparse

import openai
import pytest

import switchboard
from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.api.v1 import model_service_pb2 as model_pb
from switchboard.api.v1 import model_service_pb2_grpc as model_grpc
from switchboard.kernels import quant_gemm
from tests.e2e import client_calls
from tests.e2e.server import RunningServer, served, start_server, wait_until
from tests.e2e.test_serve import wait_until_idle
from tests.tiny_checkpoint import TINY_CHAT_TEMPLATE, tiny_llama_dir

pytestmark = pytest.mark.slow

PROMPT_IDS = [0, 5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model = tiny_llama_dir(chat_template=TINY_CHAT_TEMPLATE)
    workdir = tmp_path_factory.mktemp("http")
    yield from served(
        model, workdir, "--enable-admin", "--max-model-len", "256", "--quantization", "int8"
    )


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0) as c:
        yield c


def test_health_ready_and_the_log_line(server: RunningServer) -> None:
    for path in ("/health", "/ready"):
        with urllib.request.urlopen(f"{server.http_url}{path}", timeout=10) as response:
            assert response.status == 200
    assert f"HTTP (OpenAI-compatible) on {server.http_url}" in server.log()


def test_completion_is_the_grpc_generation(server: RunningServer, client: openai.OpenAI) -> None:
    (model,) = client.models.list().data
    completion = client.completions.create(
        model=model.id, prompt=PROMPT_IDS, max_tokens=12, temperature=0
    )
    with server.channel() as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = client_calls.greedy_request(PROMPT_IDS, 12)
        text = "".join(o.text for m in stub.Generate(request, timeout=60) for o in m.outputs)
    assert completion.choices[0].text == text
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens == len(PROMPT_IDS)


def test_chat_stream_and_not(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=8,
        temperature=0,
    )
    stream = client.chat.completions.create(
        model=chat.model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens == 8


def test_dtype_and_quantization_as_the_worker_runs_them(server: RunningServer) -> None:
    """The ready line, GetModelInfo and the /v1/models entry say what the worker resolved
    --dtype (auto) and --quantization to (int8 where the quantized kernel runs on this CPU)."""
    quantization = "int8" if quant_gemm.load() else "none"
    with urllib.request.urlopen(f"{server.http_url}/v1/models", timeout=10) as response:
        (entry,) = json.loads(response.read())["data"]
    assert (entry["dtype"], entry["quantization"]) == ("float32", quantization)
    with server.channel() as channel:
        stub = model_grpc.ModelServiceStub(channel)
        info = stub.GetModelInfo(model_pb.GetModelInfoRequest(), timeout=10)
    assert (info.dtype, info.quantization) == ("float32", quantization)
    runs_as = f"(dtype float32, quantization {quantization}): gRPC {server.target}"
    wait_until(lambda: "ready to serve" in server.log(), "the ready line", timeout_s=120)
    (line,) = [line for line in server.log().splitlines() if "ready to serve" in line]
    assert runs_as in line


def test_bad_parameter_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="", prompt="Hi", temperature=-1)
    assert caught.value.body["param"] == "temperature"


def test_dropped_connection_frees_the_engine(tmp_path) -> None:
    # A stream far longer than the time the gateway can fall behind on a loaded machine: with a
    # short one, the engine had finished it before the gateway saw the client go (nothing to
    # abort), which failed a run.
    model = tiny_llama_dir(chat_template=TINY_CHAT_TEMPLATE, max_position_embeddings=4096)
    server = start_server(model, tmp_path, "--enable-admin", "--max-model-len", "4096")
    try:
        _drop_a_stream_and_check_the_abort(server)
    finally:
        assert server.stop() == 0, server.log()


def _drop_a_stream_and_check_the_abort(server: RunningServer) -> None:
    url = urlparse(server.http_url)
    body = b'{"prompt": [0, 1, 2, 3], "max_tokens": 4000, "stream": true, "ignore_eos": true}'
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(request)
        received = b""
        while received.count(b"data: ") < 3:  # a few tokens streamed
            received += sock.recv(4096)
    time.sleep(0.2)
    stats = wait_until_idle(server)
    assert stats.get("running", stats.get("num_running")) == 0, stats
    assert "client went away; sent ABORT" in server.log()


def test_a_stream_interval_groups_tokens_on_both_fronts(tmp_path) -> None:
    """--stream-interval 4: a stream's first token comes alone, then groups of 4 (several groups
    in one message when the call fell behind) and the rest with the end; the tokens and text are
    those of one final-only message. The HTTP stream groups its chunks the same way."""
    model = tiny_llama_dir(chat_template=TINY_CHAT_TEMPLATE)
    max_tokens = 21
    server = start_server(model, tmp_path, "--max-model-len", "256", "--stream-interval", "4")
    try:
        with server.channel() as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            request = client_calls.greedy_request(PROMPT_IDS, max_tokens, return_token_ids=True)
            messages = list(stub.Generate(request, timeout=60))
            request.output.kind = pb.OUTPUT_KIND_FINAL_ONLY
            (final,) = list(stub.Generate(request, timeout=60))
        counts = [len(m.outputs[0].token_ids) for m in messages]
        assert sum(counts) == max_tokens, counts
        # Every message but the last ends on a group boundary: after the first token, after
        # 1 + 4k. (How many groups share a message depends on timing: a call that fell behind
        # sends what queued up at once, the first message included.)
        ends = [sum(counts[: i + 1]) for i in range(len(counts) - 1)]
        assert all(end % 4 == 1 for end in ends), counts
        assert client_calls.streamed_token_ids(messages) == list(final.outputs[0].token_ids)
        assert "".join(m.outputs[0].text for m in messages) == final.outputs[0].text

        with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none") as client:
            (served_model,) = client.models.list().data
            chunks = list(
                client.completions.create(
                    model=served_model.id,
                    prompt=PROMPT_IDS,
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
        assert "".join(texts) == final.outputs[0].text
        assert len(texts) <= 1 + -(-(max_tokens - 1) // 4), texts
    finally:
        assert server.stop() == 0, server.log()


# ---------------------------------------------------------------- vLLM's other routes


def post_json(server: RunningServer, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{server.http_url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_tokenize_and_detokenize_are_the_grpc_ones(server: RunningServer) -> None:
    with server.channel() as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        grpc_ids = list(stub.Tokenize(pb.TokenizeRequest(text="hello world"), timeout=60).token_ids)
        grpc_text = stub.Detokenize(
            pb.DetokenizeRequest(token_ids=grpc_ids, skip_special_tokens=False), timeout=60
        ).text
    status, tokenized = post_json(
        server, "/tokenize", {"prompt": "hello world", "return_token_strs": True}
    )
    assert status == 200
    assert tokenized["tokens"] == grpc_ids and tokenized["count"] == len(grpc_ids)
    assert tokenized["max_model_len"] == 256
    assert len(tokenized["token_strs"]) == len(grpc_ids)
    status, plain = post_json(server, "/tokenize", {"prompt": "hello world"})
    assert plain["token_strs"] is None
    status, bare = post_json(
        server, "/tokenize", {"prompt": "hello world", "add_special_tokens": False}
    )
    assert len(bare["tokens"]) < len(grpc_ids)  # no BOS
    status, detokenized = post_json(server, "/detokenize", {"tokens": grpc_ids})
    assert status == 200 and detokenized == {"prompt": grpc_text}
    status, refused = post_json(server, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and refused["error"]["param"] == "tokens"


def test_tokenize_messages_is_the_chat_prompt(server: RunningServer, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    status, tokenized = post_json(server, "/tokenize", {"messages": messages})
    assert status == 200
    completion = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=1,  # type: ignore[arg-type]
    )
    assert completion.usage is not None
    assert tokenized["count"] == completion.usage.prompt_tokens


def test_embeddings_are_the_grpc_embed(server: RunningServer, client: openai.OpenAI) -> None:
    texts = ["hello world", "the cat sits outside"]
    with server.channel() as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in texts])
        expected = stub.Embed(request, timeout=60)
    model = client.models.list().data[0].id
    created = client.embeddings.create(model=model, input=texts)
    assert [e.index for e in created.data] == [0, 1]
    for got, want in zip(created.data, expected.results, strict=True):
        assert got.embedding == pytest.approx(list(want.data), abs=1e-6)
    assert created.usage.prompt_tokens == expected.usage.prompt_tokens
    as_base64 = client.embeddings.create(model=model, input=PROMPT_IDS, encoding_format="base64")
    as_floats = client.embeddings.create(model=model, input=PROMPT_IDS)
    # float32, little-endian, base64: the same floats.
    encoded = as_base64.data[0].embedding
    assert isinstance(encoded, str)
    decoded = array.array("f", base64.b64decode(encoded)).tolist()
    assert decoded == pytest.approx(as_floats.data[0].embedding, abs=1e-6)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=model, input=[])
    assert refused.value.body["param"] == "input"  # type: ignore[index]


def test_version_and_no_metrics_without_a_metrics_port(server: RunningServer) -> None:
    with urllib.request.urlopen(f"{server.http_url}/version", timeout=10) as reply:
        assert json.loads(reply.read()) == {"version": switchboard.__version__}
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10)
    assert missing.value.code == 404

"""LoRA adapters in a real `switchboard serve` (tiny Llama, adapters written by peft):

* base and adapter requests at once, each with its own greedy tokens (peft's), by ``model``
  (gRPC and OpenAI HTTP) and by ``GenerateRequest.lora_adapter``;
* the models listed with their parent; an unknown adapter NOT_FOUND / 404 naming it;
* an adapter loaded while serving (vLLM's HTTP route and AdminService), a bad one refused with
  its reason, an adapter in use refused unloading (409, naming the request) while the engine
  sleeps with it waiting, and ``lora_requests_info`` listing it as waiting meanwhile.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from switchboard.api.v1 import admin_service_pb2 as admin_pb
from switchboard.api.v1 import admin_service_pb2_grpc as admin_grpc
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.api.v1 import model_service_pb2 as model_pb
from switchboard.api.v1 import model_service_pb2_grpc as model_grpc
from tests.e2e.client_calls import greedy_request, scrape, streamed_token_ids, utility
from tests.e2e.server import RunningServer, free_port, served, wait_until
from tests.tiny_checkpoint import tiny_llama_dir
from tests.tiny_lora import load_peft_reference, peft_generate, tiny_lora_dir

pytestmark = pytest.mark.slow

PROMPT = [0, 5, 6, 7, 8, 9, 10, 11, 300, 301]
MAX_TOKENS = 8
RPC_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def adapters() -> dict[str, str]:
    base = tiny_llama_dir()
    return {
        "sql": tiny_lora_dir(base, rank=8, alpha=16.0, seed=11),
        "chat": tiny_lora_dir(base, rank=16, alpha=8.0, targets=["q_proj", "v_proj"], seed=12),
        "too-big": tiny_lora_dir(base, rank=32, alpha=32.0, seed=13),
    }


@pytest.fixture(scope="module")
def expected(adapters) -> dict[str, list[int]]:
    reference = load_peft_reference(
        tiny_llama_dir(), {"sql": adapters["sql"], "chat": adapters["chat"]}
    )
    return {
        name: peft_generate(reference, name, PROMPT, MAX_TOKENS) for name in ("", "sql", "chat")
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapters) -> Iterator[RunningServer]:
    metrics_port = free_port()
    workdir = tmp_path_factory.mktemp("lora")
    server_iter = served(
        tiny_llama_dir(),
        workdir,
        "--enable-lora",
        "--lora-modules",
        f"sql={adapters['sql']}",
        "--max-loras",
        "2",
        "--enable-admin",
        "--metrics-port",
        str(metrics_port),
    )
    server = next(server_iter)
    server.metrics_port = metrics_port  # type: ignore[attr-defined]
    yield server
    next(server_iter, None)


def generate(server: RunningServer, **fields) -> list[int]:
    with server.channel() as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = greedy_request(PROMPT, MAX_TOKENS, return_token_ids=True, **fields)
        return streamed_token_ids(stub.Generate(request, timeout=RPC_TIMEOUT_S))


def http(server: RunningServer, path: str, body: dict | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        server.http_url + path, data=data, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=RPC_TIMEOUT_S) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_base_and_adapter_requests_at_once_get_their_own_tokens(server, expected):
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # the adapters matter
    asks = [{}, {"model": "sql"}, {"lora_adapter": "sql"}, {}, {"model": "sql"}]
    with ThreadPoolExecutor(len(asks)) as pool:
        outputs = list(pool.map(lambda fields: generate(server, **fields), asks))
    for fields, tokens in zip(asks, outputs, strict=True):
        assert tokens == expected["sql" if fields else ""], fields
    status, body = http(
        server,
        "/v1/completions",
        {"model": "sql", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
    )
    assert status == 200, body
    assert json.loads(body)["model"] == "sql"


def test_models_list_adapters_with_their_parent(server, adapters):
    status, body = http(server, "/v1/models")
    models = {m["id"]: m for m in json.loads(body)["data"]}
    base = next(m for m in models.values() if m["parent"] is None)["id"]
    assert models["sql"]["parent"] == base and models["sql"]["root"] == adapters["sql"]
    with server.channel() as channel:
        listed = model_grpc.ModelServiceStub(channel).ListModels(model_pb.ListModelsRequest())
    assert [(m.name, m.parent) for m in listed.models] == [(base, ""), ("sql", base)]


def test_an_unknown_adapter_is_not_found_naming_it(server):
    with pytest.raises(grpc.RpcError) as error:
        generate(server, model="nope")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope'" in error.value.details()
    with pytest.raises(grpc.RpcError) as by_field:
        generate(server, lora_adapter="nope")
    assert by_field.value.code() == grpc.StatusCode.NOT_FOUND
    assert by_field.value.details().startswith("LoRA adapter 'nope' is not loaded")
    status, body = http(
        server, "/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2}
    )
    assert status == 404 and "nope" in json.loads(body)["error"]["message"]


def test_adapters_load_and_unload_while_serving(server, adapters, expected):
    status, body = http(
        server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]}
    )
    assert status == 200, body
    assert generate(server, model="chat") == expected["chat"]
    status, body = http(
        server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": adapters["too-big"]}
    )
    assert status == 400 and "rank 32 is above --max-lora-rank 16" in body, body
    with server.channel() as channel:
        admin = admin_grpc.AdminServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            admin.LoadLoraAdapter(
                admin_pb.LoadLoraAdapterRequest(lora_name="big", lora_path=adapters["too-big"]),
                timeout=RPC_TIMEOUT_S,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        listed = admin.ListLoraAdapters(admin_pb.ListLoraAdaptersRequest(), timeout=30)
        assert sorted(a.name for a in listed.adapters) == ["chat", "sql"]
        assert utility(channel, "list_loras") == {"sql": adapters["sql"], "chat": adapters["chat"]}
    status, body = http(server, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 200, body
    with pytest.raises(grpc.RpcError) as gone:
        generate(server, model="chat")
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert generate(server, model="sql") == expected["sql"]  # the other adapter is untouched


def test_an_adapter_in_use_is_not_unloaded(server, expected):
    """While the engine sleeps a request for "sql" waits in it: unloading "sql" is refused,
    naming the request, and lora_requests_info lists "sql" as waiting."""
    metrics_port = server.metrics_port  # type: ignore[attr-defined]
    with server.channel() as channel, ThreadPoolExecutor(1) as pool:
        utility(channel, "sleep", 1)
        try:
            waiting = pool.submit(generate, server, model="sql", request_id="held-by-sql")
            wait_until(
                lambda: utility(channel, "get_stats")["num_waiting"] == 1, "the request waits"
            )
            status, body = http(server, "/v1/unload_lora_adapter", {"lora_name": "sql"})
            assert status == 409 and "'held-by-sql'" in body, body

            def lora_waiting() -> bool:
                return any(
                    name == "vllm:lora_requests_info"
                    and dict(labels).get("waiting_lora_adapters") == "sql"
                    for name, labels in scrape(metrics_port)
                )

            wait_until(lora_waiting, "lora_requests_info lists sql as waiting")
        finally:
            utility(channel, "wake_up")
        assert waiting.result(RPC_TIMEOUT_S) == expected["sql"]
    assert generate(server, model="sql") == expected["sql"]  # still served

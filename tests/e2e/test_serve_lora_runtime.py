"""LoRA adapters loaded while serving, in a real `switchboard serve --api-servers 2` (tiny Llama,
an adapter written by peft, no ``--lora-modules``):

* loaded through gateway 1's HTTP route, the adapter is served through gateway 0 too (which
  asks the engine about a name it does not know before answering 404), with the same tokens;
* after the engine core is killed (-9) and restarted by the supervisor, the adapter loaded at
  run time is still served, with the same tokens (the engine reloads what it served);
* unloaded through gateway 1, the adapter gateway 0 still names is refused by the engine:
  404 naming it, and gateway 0 forgets it.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from grpc_health.v1 import health_pb2

from tests.e2e.server import RunningServer, served, wait_until
from tests.tiny_checkpoint import tiny_llama_dir
from tests.tiny_lora import tiny_lora_dir

pytestmark = pytest.mark.slow

PROMPT = [0, 5, 6, 7, 8, 9, 10, 11, 300, 301]
MAX_TOKENS = 8
TIMEOUT_S = 120.0
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def adapter() -> str:
    return tiny_lora_dir(tiny_llama_dir(), rank=8, alpha=16.0, seed=11)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    workdir = tmp_path_factory.mktemp("lora-runtime")
    yield from served(
        tiny_llama_dir(), workdir, "--enable-lora", "--enable-admin", "--api-servers", "2"
    )


def http(server: RunningServer, gateway: int, path: str, body: dict | None = None):
    """(status, parsed body) from gateway ``gateway``'s own HTTP port."""
    base, port = server.http_url.rsplit(":", 1)
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{base}:{int(port) + gateway}{path}",
        data=data,
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
            status, text = reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def completion(server: RunningServer, gateway: int, model: str) -> tuple[int, object]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, reply = http(server, gateway, "/v1/completions", body)
    if status != 200:
        return status, reply
    assert isinstance(reply, dict)
    return status, reply["choices"][0]["text"]


def base_model(server: RunningServer) -> str:
    status, reply = http(server, 0, "/v1/models")
    assert status == 200, reply
    return reply["data"][0]["id"]


def test_an_adapter_loaded_through_one_gateway_is_served_by_the_other(server, adapter):
    base = completion(server, 0, base_model(server))
    status, reply = http(
        server, 1, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": adapter}
    )
    assert status == 200, reply
    on_loader = completion(server, 1, "sql")
    on_other = completion(server, 0, "sql")
    assert on_loader[0] == 200, on_loader
    assert on_other == on_loader, server.log()
    assert on_other != base  # the adapter changes what the model says
    status, listed = http(server, 0, "/v1/models")
    assert "sql" in [m["id"] for m in listed["data"]]
    status, reply = completion(server, 0, "nope")  # unknown to the engines too: still 404
    assert status == 404 and "nope" in reply["error"]["message"], reply


def test_an_adapter_loaded_while_serving_survives_an_engine_restart(server, adapter):
    before = completion(server, 0, "sql")
    assert before[0] == 200, before
    engine = server.titled_processes()["switchboard::EngineCore_DP0"]
    os.kill(engine, signal.SIGKILL)
    wait_until(
        lambda: f"EngineCore_DP0 (pid {engine}) exited with code -9" in server.log(),
        "the supervisor sees the engine go",
        TIMEOUT_S,
    )
    wait_until(
        lambda: server.titled_processes().get("switchboard::EngineCore_DP0", engine) != engine,
        "the engine is restarted",
        TIMEOUT_S,
    )
    wait_until(lambda: server.health() == SERVING, "the restarted engine is ready", TIMEOUT_S)
    for gateway in (0, 1):
        assert completion(server, gateway, "sql") == before, server.log()
    assert "LoRA adapters after a restart: sql" in server.log()


def test_an_adapter_unloaded_through_one_gateway_is_not_found_on_the_other(server):
    status, tokens = http(server, 0, "/tokenize", {"model": "sql", "prompt": "hello"})
    assert status == 200 and tokens["tokens"], tokens  # an adapter tokenizes as its base model
    status, reply = http(server, 1, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 200, reply
    status, reply = completion(server, 0, "sql")  # gateway 0 still names it: the engine refuses
    assert status == 404 and reply["error"]["message"] == "LoRA adapter 'sql' is not loaded", reply
    status, reply = http(server, 0, "/tokenize", {"model": "sql", "prompt": "hello"})
    assert status == 404 and "'sql'" in reply["error"]["message"], reply  # forgotten
    status, listed = http(server, 0, "/v1/models")
    assert "sql" not in [m["id"] for m in listed["data"]]

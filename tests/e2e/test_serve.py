"""`switchboard serve` end to end: gRPC client -> gateway -> engine core -> worker, all real.

One server (tiny random Llama checkpoint, admin enabled) serves every test in this module;
tests that kill or stop a server start their own (tests/e2e/test_fate.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from transformers import AutoModelForCausalLM

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e import client_calls
from tests.e2e.client_calls import streamed_token_ids, utility
from tests.e2e.server import RunningServer, served, wait_until

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    workdir = tmp_path_factory.mktemp("serve")
    yield from served(tiny_model, workdir, "--enable-admin", "--max-model-len", str(MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[pb_grpc.GenerationServiceStub]:
    with server.channel() as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def greedy_request(prompt: list[int] | str, max_tokens: int, **stopping) -> pb.GenerateRequest:
    request = client_calls.greedy_request(prompt, max_tokens, return_token_ids=True)
    for name, value in stopping.items():
        if name == "stop":
            request.stopping.stop.extend(value)
        else:
            setattr(request.stopping, name, value)
    return request


def collect(responses) -> tuple[list[int], str, list[pb.GenerateResponse]]:
    messages = list(responses)
    ids = streamed_token_ids(messages)
    text = "".join(o.text for m in messages for o in m.outputs)
    return ids, text, messages


def reference_greedy(model_dir: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers, greedy, EOS ignored: the ids our server must reproduce."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt_ids])
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            next_id = int(model(ids).logits[0, -1].argmax())
            out.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out


def test_processes_match_the_formula(server: RunningServer) -> None:
    assert sorted(server.titled_processes()) == [
        "switchboard::EngineCore_DP0",
        "switchboard::Gateway_0",
        "switchboard::Worker_DP0_PP0_TP0",
    ]


def test_the_worker_runs_with_a_passive_openmp_team(server: RunningServer) -> None:
    """Its OpenMP threads sleep at once when torch's operators leave them (the decode loops run
    on the kernels' pool), unless the operator chose a policy; its start line says which."""
    expected = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    assert f"OpenMP wait policy {expected}," in server.log()


def test_ps_command_lists_the_processes(server: RunningServer) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "switchboard.cli", "ps"], capture_output=True, text=True, timeout=30
    ).stdout
    for title, pid in server.titled_processes().items():
        role = title.removeprefix("switchboard::").split("_")[0]
        assert any(
            line.split()[:1] == [role] and str(pid) in line.split() for line in out.splitlines()
        )


def test_health_is_serving(server: RunningServer) -> None:
    assert server.health("") == health_pb2.HealthCheckResponse.SERVING
    assert server.health() == health_pb2.HealthCheckResponse.SERVING


def test_streams_the_same_tokens_as_transformers(
    stub: pb_grpc.GenerationServiceStub, tiny_model: str
) -> None:
    prompt = [0, 17, 99, 250, 3, 42, 7, 511, 8, 64, 300, 12, 5, 77, 901, 33, 21, 2, 44]
    ids, _, messages = collect(stub.Generate(greedy_request(prompt, 24), timeout=60))
    # How many messages carry the 24 tokens depends on timing: a call that falls behind its
    # engine gets the steps that queued up in one message (tests/gateway/test_stream_messages.py
    # hands steps over one by one and checks the pattern); here every message carries a token.
    assert all(o.token_ids for m in messages for o in m.outputs), messages
    assert ids == reference_greedy(tiny_model, prompt, 24)
    last = messages[-1]
    assert last.outputs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(prompt)
    assert last.usage.completion_tokens == 24
    assert messages[0].prompt_info.num_prompt_tokens == len(prompt)


def test_text_prompt_and_detokenized_stream(stub: pb_grpc.GenerationServiceStub) -> None:
    request = greedy_request("def main():\n    return", 10)
    ids, text, _ = collect(stub.Generate(request, timeout=60))
    assert len(ids) == 10
    detok = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=10).text
    assert text == detok


def test_stop_string_ends_the_stream_and_aborts(
    stub: pb_grpc.GenerationServiceStub, server: RunningServer
) -> None:
    prompt = [0, 5, 6, 7, 8, 9, 10]
    _, full_text, _ = collect(stub.Generate(greedy_request(prompt, 40), timeout=60))
    # A stop string whose first occurrence is well inside the text, spanning some characters.
    start = next(
        i for i in range(3, len(full_text) - 3) if full_text.find(full_text[i : i + 3]) == i
    )
    stop = full_text[start : start + 3]
    _, text, messages = collect(stub.Generate(greedy_request(prompt, 40, stop=[stop]), timeout=60))
    assert text == full_text[:start]
    final = messages[-1].outputs[-1]
    assert final.finish_reason == pb.FINISH_REASON_STOP
    assert final.stop_string == stop
    request = greedy_request(prompt, 40, stop=[stop], include_stop_str_in_output=True)
    _, text, _ = collect(stub.Generate(request, timeout=60))
    assert text == full_text[: start + 3]
    wait_until_idle(server)


def wait_until_idle(server: RunningServer, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    with server.channel() as channel:
        while True:
            stats = utility(channel, "get_stats", timeout_s=10)
            if stats.get("running", stats.get("num_running", 1)) == 0:
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.2)


def test_cancel_aborts_the_request_in_the_engine(
    stub: pb_grpc.GenerationServiceStub, server: RunningServer
) -> None:
    call = stub.Generate(greedy_request([0, 1, 2, 3], MAX_MODEL_LEN - 8), timeout=60)
    received = 0
    for _ in call:
        received += 1
        if received == 2:
            call.cancel()
            break
    stats = wait_until_idle(server)
    assert stats.get("running", stats.get("num_running")) == 0, stats


def test_deadline_aborts_the_request_in_the_engine(
    stub: pb_grpc.GenerationServiceStub, server: RunningServer
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(greedy_request([0, 9, 9], MAX_MODEL_LEN - 8), timeout=0.1))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = wait_until_idle(server)
    assert stats.get("running", stats.get("num_running")) == 0, stats


@pytest.mark.parametrize("how", ["cancel", "disconnect", "deadline"])
def test_only_the_abort_can_take_a_request_out_of_a_sleeping_engine(
    stub: pb_grpc.GenerationServiceStub, server: RunningServer, how: str
) -> None:
    """The two tests above would also pass if the request simply ran to its end. Here the engine
    sleeps, so a request it holds can never finish by itself: if it leaves, the ABORT the gateway
    sent for the cancelled (disconnected, expired) call took it out. ``disconnect``: a client
    process killed mid-call, so only its closed connection tells the gateway."""
    with server.channel() as channel:

        def waiting() -> int:
            return utility(channel, "get_stats")["num_waiting"]

        utility(channel, "sleep", 1)
        client = None
        try:
            if how == "deadline":
                with pytest.raises(grpc.RpcError) as err:
                    collect(stub.Generate(greedy_request([0, 4, 2], 8), timeout=2.0))
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            elif how == "cancel":
                call = stub.Generate(greedy_request([0, 4, 2], 8), timeout=60)
                wait_until(lambda: waiting() == 1, "the engine holds the request")
                call.cancel()
            else:
                command = [sys.executable, "-m", "switchboard.cli", "generate", "def f(x):",
                           "--target", server.target, "--max-tokens", "8"]  # fmt: skip
                client = subprocess.Popen(
                    command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                wait_until(lambda: waiting() == 1, "the engine holds the request")
                client.kill()
                client.wait(30)
            wait_until(lambda: waiting() == 0, "the ABORT removed the request from the engine")
        finally:
            if client is not None and client.poll() is None:
                client.kill()
                client.wait(30)
            utility(channel, "wake_up")
    stats = wait_until_idle(server)
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0), stats


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: setattr(r.sampling, "temperature", -1.0), "temperature"),
        (lambda r: setattr(r.sampling, "top_p", 1.5), "top_p"),
        (lambda r: setattr(r.sampling, "top_k", -2), "top_k"),
        (lambda r: setattr(r.stopping, "max_tokens", 0), "max_tokens"),
        (lambda r: setattr(r.stopping, "max_tokens", MAX_MODEL_LEN), "max_tokens"),
        (lambda r: r.token_ids.ids.extend([0] * MAX_MODEL_LEN), "prompt"),
        (lambda r: r.token_ids.ids.append(10**6), "token"),
    ],
)
def test_invalid_arguments_are_refused_clearly(
    stub: pb_grpc.GenerationServiceStub, mutate, field: str
) -> None:
    request = greedy_request([0, 1, 2], 4)
    mutate(request)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def test_bad_requests_do_not_disturb_others(stub: pb_grpc.GenerationServiceStub) -> None:
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i], _, _ = collect(stub.Generate(greedy_request([0, i + 1, 7], 16), timeout=60))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for _ in range(5):
        bad = greedy_request([0, 1], 4)
        bad.sampling.temperature = -3
        with pytest.raises(grpc.RpcError):
            collect(stub.Generate(bad, timeout=30))
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(6))
    assert all(len(ids) == 16 for ids in results.values())
    alone, _, _ = collect(stub.Generate(greedy_request([0, 3, 7], 16), timeout=60))
    assert results[2] == alone


def test_generate_command_streams_to_the_terminal(server: RunningServer, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "switchboard.cli",
            "generate",
            "def f(x):",
            "--target",
            server.target,
            "--max-tokens",
            "8",
            "--temperature",
            "0",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "completion tokens" in done.stderr


def test_grpcurl_calls_the_api_through_reflection(server: RunningServer) -> None:
    grpcurl = Path(sys.prefix) / "bin" / "grpcurl"
    listed = subprocess.run(
        [grpcurl, "-plaintext", server.target, "list"], capture_output=True, text=True, timeout=30
    )
    assert listed.returncode == 0, listed.stderr
    assert {"switchboard.v1.GenerationService", "grpc.health.v1.Health"} <= set(
        listed.stdout.split()
    )
    body = '{"text": "Hello", "sampling": {"temperature": 0}, "stopping": {"max_tokens": 3}}'
    called = subprocess.run(
        [
            grpcurl,
            "-plaintext",
            "-d",
            body,
            server.target,
            "switchboard.v1.GenerationService/Generate",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert called.returncode == 0, called.stderr
    assert '"completionTokens": 3' in called.stdout or '"completion_tokens": 3' in called.stdout

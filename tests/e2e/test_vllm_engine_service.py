"""vLLM's engine gRPC service (``vllm.grpc.engine.VllmEngine``) on a real `switchboard serve`,
called with the ``smg-grpc-proto`` package's own stubs, as an inference router calls it: the
same tokens as ``switchboard.v1`` (one request path), streamed and not, n > 1, stops, logprobs,
constraints, the refusals naming vLLM's fields, the info and load calls, the tokenizer bundle,
Abort, FlushCache, health under the service's name."""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vgrpc
from smg_grpc_proto.generated import common_pb2

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.gateway.text import Tokenizer
from tests.e2e import client_calls
from tests.e2e.server import RunningServer, served, wait_until
from tests.tiny_checkpoint import TINY_CHAT_TEMPLATE, tiny_llama_dir

pytestmark = pytest.mark.slow

SERVICE = "vllm.grpc.engine.VllmEngine"
PROMPT_IDS = [0, *range(5, 45)]  # more than two KV blocks: a repeat finds them cached
TIMEOUT_S = 120.0
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_llama_dir(chat_template=TINY_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    workdir = tmp_path_factory.mktemp("vllm-engine")
    yield from served(model_dir, workdir, "--enable-admin", "--max-model-len", str(MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def channel(server: RunningServer) -> Iterator[grpc.Channel]:
    with server.channel() as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> vgrpc.VllmEngineStub:
    return vgrpc.VllmEngineStub(channel)


def greedy(
    max_tokens: int, *, stream: bool = False, request_id: str = "", **params: object
) -> vpb.GenerateRequest:
    sampling = vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for name, value in params.items():
        if name == "logit_bias":
            sampling.logit_bias.update(value)  # type: ignore[call-overload]
        elif isinstance(value, list):
            getattr(sampling, name).extend(value)
        else:
            setattr(sampling, name, value)
    return vpb.GenerateRequest(
        request_id=request_id,
        tokenized=vpb.TokenizedInput(input_ids=PROMPT_IDS),
        sampling_params=sampling,
        stream=stream,
    )


def completes(responses: Iterator[vpb.GenerateResponse]) -> list[vpb.GenerateComplete]:
    return [r.complete for r in responses if r.WhichOneof("response") == "complete"]


def switchboard_tokens(channel: grpc.Channel, max_tokens: int) -> list[int]:
    stub = pb_grpc.GenerationServiceStub(channel)
    request = client_calls.greedy_request(PROMPT_IDS, max_tokens, return_token_ids=True)
    return client_calls.streamed_token_ids(stub.Generate(request, timeout=TIMEOUT_S))


def refusal(call: Callable[[], object], streamed: bool = True) -> grpc.RpcError:
    """The error ``call`` ends with (a streamed one read to its end)."""
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if streamed:
            list(result)  # type: ignore[call-overload]
    return caught.value


def test_reflection_and_health_name_the_service(
    server: RunningServer, channel: grpc.Channel
) -> None:
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (answer,) = reflection.ServerReflectionInfo(iter([request]), timeout=TIMEOUT_S)
    assert SERVICE in {s.name for s in answer.list_services_response.service}
    assert server.health(SERVICE) == health_pb2.HealthCheckResponse.SERVING
    stub = vgrpc.VllmEngineStub(channel)
    health = stub.HealthCheck(vpb.HealthCheckRequest(), timeout=TIMEOUT_S)
    assert health.healthy and health.message


def test_unary_and_streamed_generate_are_the_switchboard_tokens(
    channel: grpc.Channel, stub: vgrpc.VllmEngineStub
) -> None:
    expected = switchboard_tokens(channel, 12)
    (complete,) = completes(stub.Generate(greedy(12), timeout=TIMEOUT_S))
    assert list(complete.output_ids) == expected
    assert complete.finish_reason == "length"
    assert (complete.prompt_tokens, complete.completion_tokens) == (len(PROMPT_IDS), 12)

    responses = list(stub.Generate(greedy(12, stream=True), timeout=TIMEOUT_S))
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    assert [t for c in chunks for t in c.token_ids] == expected
    assert sum(c.completion_tokens for c in chunks) == 12
    assert all(c.prompt_tokens == len(PROMPT_IDS) for c in chunks)
    assert responses[-1].WhichOneof("response") == "complete"
    assert responses[-1].complete.finish_reason == "length"
    # the second identical prompt found its prefix cached
    assert responses[-1].complete.cached_tokens > 0


def test_text_input_and_n_sequences(stub: vgrpc.VllmEngineStub, model_dir: str) -> None:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    request = vpb.GenerateRequest(
        text="The capital of France is",
        sampling_params=vpb.SamplingParams(temperature=1.0, seed=7, max_tokens=6, n=3),
        stream=True,
    )
    done = completes(stub.Generate(request, timeout=TIMEOUT_S))
    assert sorted(c.index for c in done) == [0, 1, 2]
    assert {c.prompt_tokens for c in done} == {len(tokenizer.encode("The capital of France is"))}


def test_stop_token_and_stop_string_are_reported(
    channel: grpc.Channel, stub: vgrpc.VllmEngineStub, model_dir: str
) -> None:
    expected = switchboard_tokens(channel, 12)
    (complete,) = completes(
        stub.Generate(greedy(12, stop_token_ids=[expected[3]]), timeout=TIMEOUT_S)
    )
    assert complete.finish_reason == "stop"
    assert complete.WhichOneof("matched_stop") == "matched_token_id"
    assert complete.matched_token_id == expected[3]
    assert list(complete.output_ids) == expected[: expected.index(expected[3]) + 1]

    text = Tokenizer.from_model_dir(model_dir).decode(expected)
    stop = text.strip()[-3:]
    (complete,) = completes(stub.Generate(greedy(12, stop=[stop]), timeout=TIMEOUT_S))
    assert complete.finish_reason == "stop"
    assert complete.matched_stop_str == stop


def test_logprobs_and_prompt_logprobs(stub: vgrpc.VllmEngineStub) -> None:
    (complete,) = completes(
        stub.Generate(greedy(5, logprobs=3, prompt_logprobs=2), timeout=TIMEOUT_S)
    )
    out = complete.output_logprobs
    assert list(out.token_ids) == list(complete.output_ids)
    assert len(out.token_logprobs) == 5 and all(lp <= 0 for lp in out.token_logprobs)
    assert [len(top.token_ids) for top in out.top_logprobs] == [3] * 5
    # greedy: the chosen token is the most likely one
    assert all(
        max(top.values) <= lp + 1e-4
        for top, lp in zip(out.top_logprobs, out.token_logprobs, strict=True)
    )
    prompt = complete.input_logprobs
    assert list(prompt.token_ids) == PROMPT_IDS
    assert not prompt.token_logprobs[0].HasField("value")  # the first token has none
    assert all(entry.HasField("value") for entry in prompt.token_logprobs[1:])


def test_constraint_logit_bias_and_truncation(stub: vgrpc.VllmEngineStub, model_dir: str) -> None:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    request = greedy(20)
    request.sampling_params.ignore_eos = False
    request.sampling_params.choice.choices.extend(["Paris", "London"])
    (complete,) = completes(stub.Generate(request, timeout=TIMEOUT_S))
    assert tokenizer.decode(list(complete.output_ids)) in ("Paris", "London")

    (complete,) = completes(stub.Generate(greedy(4, logit_bias={42: 100.0}), timeout=TIMEOUT_S))
    assert list(complete.output_ids) == [42] * 4

    (complete,) = completes(stub.Generate(greedy(2, truncate_prompt_tokens=3), timeout=TIMEOUT_S))
    assert complete.prompt_tokens == 3


def test_refusals_name_vllm_fields(stub: vgrpc.VllmEngineStub) -> None:
    cases: list[tuple[vpb.GenerateRequest, str]] = []
    request = greedy(4)
    request.kv_transfer_params_json = "{}"
    cases.append((request, "kv_transfer_params_json"))
    request = greedy(4)
    request.mm_inputs.im_token_id = 3
    cases.append((request, "mm_inputs"))
    cases.append((greedy(4, logprobs=-1), "sampling_params.logprobs"))
    cases.append((greedy(4, top_p=1.5), "sampling_params.top_p"))
    cases.append((greedy(MAX_MODEL_LEN), "sampling_params.max_tokens"))
    request = greedy(4)
    request.tokenized.input_ids.append(10**6)
    cases.append((request, "tokenized.input_ids"))
    request = greedy(4)
    request.data_parallel_rank = 3
    cases.append((request, "data_parallel_rank"))
    for request, field in cases:
        error = refusal(lambda r=request: stub.Generate(r, timeout=TIMEOUT_S))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, error.details())
        assert field in error.details(), (field, error.details())


def test_model_server_info_and_loads(stub: vgrpc.VllmEngineStub, model_dir: str) -> None:
    info = stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=TIMEOUT_S)
    assert info.is_generation and info.served_model_name
    assert info.max_context_length == MAX_MODEL_LEN
    assert info.model_path == info.tokenizer_path == model_dir
    assert info.vocab_size > 0 and list(info.eos_token_ids)
    server = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=TIMEOUT_S)
    assert server.server_type == "switchboard" and server.data_parallel_size == 1
    assert server.block_size > 0 and server.max_num_seqs > 0 and server.uptime_seconds > 0
    loads = stub.GetLoads(vpb.GetLoadsRequest(include=["core"]), timeout=TIMEOUT_S)
    assert loads.dp_rank_count == 1
    (load,) = loads.loads
    assert load.dp_rank == 0 and load.max_total_num_tokens > 0 and load.max_running_requests > 0
    error = refusal(
        lambda: stub.GetLoads(vpb.GetLoadsRequest(dp_rank=5), timeout=TIMEOUT_S), streamed=False
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "dp_rank" in error.details()


def test_tokenizer_bundle_is_the_checkpoints(stub: vgrpc.VllmEngineStub, model_dir: str) -> None:
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT_S))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.read("tokenizer.json") == (Path(model_dir) / "tokenizer.json").read_bytes()
        assert "tokenizer_config.json" in archive.namelist()


def test_abort_ends_a_waiting_request_and_flush_cache(
    channel: grpc.Channel, stub: vgrpc.VllmEngineStub
) -> None:
    # It waits in the queue of a sleeping engine (certain, not likely) when the Abort comes.
    client_calls.utility(channel, "sleep", 1)
    try:
        waiting = stub.Generate(greedy(8, stream=True, request_id="vllm-abort"), timeout=TIMEOUT_S)
        wait_until(
            lambda: client_calls.utility(channel, "get_stats")["num_waiting"] == 1, "it waits"
        )
        stub.Abort(vpb.AbortRequest(request_ids=["vllm-abort"]), timeout=TIMEOUT_S)
        responses = list(waiting)
    finally:
        client_calls.utility(channel, "wake_up")
    assert responses[-1].complete.finish_reason == "abort"
    flushed = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=30), timeout=TIMEOUT_S)
    assert flushed.success, flushed.message


def test_kv_events_and_profiles_say_unimplemented(stub: vgrpc.VllmEngineStub) -> None:
    request = common_pb2.SubscribeKvEventsRequest()
    error = refusal(lambda: stub.SubscribeKvEvents(request, timeout=TIMEOUT_S))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED and "KV cache events" in error.details()
    assert "--kv-events-config" in error.details()
    start = common_pb2.StartProfileRequest()
    error = refusal(lambda: stub.StartProfile(start, timeout=TIMEOUT_S), streamed=False)
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED


def test_embed_is_the_switchboard_embedding(
    channel: grpc.Channel, stub: vgrpc.VllmEngineStub
) -> None:
    request = vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=PROMPT_IDS))
    embedded = stub.Embed(request, timeout=TIMEOUT_S)
    ours = pb_grpc.GenerationServiceStub(channel).Embed(
        pb.EmbedRequest(inputs=[pb.EmbedInput(token_ids=pb.TokenIds(ids=PROMPT_IDS))]),
        timeout=TIMEOUT_S,
    )
    assert list(embedded.embedding) == list(ours.results[0].data)
    assert embedded.embedding_dim == len(embedded.embedding) > 0
    assert embedded.prompt_tokens == len(PROMPT_IDS)
    error = refusal(lambda: stub.Embed(vpb.EmbedRequest(), timeout=TIMEOUT_S), streamed=False)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokenized" in error.details()

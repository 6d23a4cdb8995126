"""The sampling surface end to end: gRPC client -> gateway -> engine core -> worker, all real.

One server (tiny random Llama checkpoint) serves the whole module. A small token budget makes a
long prompt prefill in several chunks, so prompt logprobs cross chunk boundaries here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.api.v1 import model_service_pb2 as model_pb
from switchboard.api.v1 import model_service_pb2_grpc as model_grpc
from tests.e2e.server import RunningServer, served

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
RPC_TIMEOUT_S = 60
PROMPT = [0, *[(13 * i) % 900 + 5 for i in range(40)]]  # 41 tokens: 3 chunks of 16


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    yield from served(
        tiny_model,
        tmp_path_factory.mktemp("serve"),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-batched-tokens", "16",
    )  # fmt: skip


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[pb_grpc.GenerationServiceStub]:
    with server.channel() as channel:
        yield pb_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def model_info(server: RunningServer) -> model_pb.GetModelInfoResponse:
    with server.channel() as channel:
        stub = model_grpc.ModelServiceStub(channel)
        return stub.GetModelInfo(model_pb.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)


def request(prompt: list[int] = PROMPT[:6], max_tokens: int = 12, **sampling) -> pb.GenerateRequest:
    message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt))
    message.stopping.max_tokens = max_tokens
    message.stopping.ignore_eos = True
    message.output.return_token_ids = True
    for name, value in sampling.items():
        if name == "logit_bias":
            message.sampling.logit_bias.update(value)
        elif isinstance(value, list):
            getattr(message.sampling, name).extend(value)
        else:
            setattr(message.sampling, name, value)
    return message


def generate(stub, message: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(stub.Generate(message, timeout=RPC_TIMEOUT_S))


def token_ids(responses: list[pb.GenerateResponse], index: int = 0) -> list[int]:
    return [t for r in responses for o in r.outputs if o.index == index for t in o.token_ids]


def final(responses: list[pb.GenerateResponse], index: int = 0) -> pb.SequenceOutput:
    return [o for r in responses for o in r.outputs if o.index == index and o.finish_reason][-1]


def test_seeded_sampling_gives_the_same_text_alone_and_in_a_busy_batch(stub) -> None:
    seeded = request(max_tokens=24, seed=1234, temperature=1.0, top_p=0.95, top_k=50)
    alone = token_ids(generate(stub, seeded))
    neighbours = [
        request(PROMPT[: 5 + i], max_tokens=30, temperature=1.0, presence_penalty=0.5)
        for i in range(3)
    ] + [request(PROMPT, max_tokens=30, temperature=0.0), request(max_tokens=30, seed=7)]
    results: dict[int, list[int]] = {}

    def run(i: int, message: pb.GenerateRequest) -> None:
        results[i] = token_ids(generate(stub, message))

    threads = [threading.Thread(target=run, args=(i, m)) for i, m in enumerate(neighbours)]
    for thread in threads:
        thread.start()
    in_batch = token_ids(generate(stub, seeded))
    for thread in threads:
        thread.join(RPC_TIMEOUT_S)
    assert len(results) == len(neighbours)
    assert in_batch == alone
    assert len(set(alone)) > 3  # really sampled, not a greedy loop


def test_n_sequences_carry_indices_and_the_first_matches_its_seed(stub) -> None:
    responses = generate(stub, request(max_tokens=8, n=2, seed=99, temperature=1.0))
    assert {o.index for r in responses for o in r.outputs} == {0, 1}
    assert responses[-1].usage.completion_tokens == 16
    assert responses[-1].usage.prompt_tokens == 6
    single = token_ids(generate(stub, request(max_tokens=8, seed=99, temperature=1.0)))
    assert token_ids(responses, 0) == single
    assert token_ids(responses, 1) != single  # seed + 1


def test_n_sequences_compute_their_shared_prompt_once(stub) -> None:
    fresh_prompt = [0, *[(17 * i) % 900 + 7 for i in range(40)]]  # 41 tokens: 2 full blocks
    responses = generate(stub, request(fresh_prompt, max_tokens=3, n=3, temperature=0.0))
    # The first sequence computes the prompt; the others take its full blocks from the prefix
    # cache (those sent in the same step wait one step for them), whatever the timing.
    assert responses[-1].usage.cached_prompt_tokens == 32
    assert token_ids(responses, 0) == token_ids(responses, 1) == token_ids(responses, 2)


def test_logprobs_and_prompt_logprobs_match_transformers(stub, tiny_model) -> None:
    message = request(PROMPT, max_tokens=4, temperature=0.0)
    message.output.logprobs = 3
    message.output.prompt_logprobs = 2
    first = generate(stub, message)
    again = generate(stub, message)  # its prompt is in the prefix cache now: still all there
    ids = token_ids(first)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        reference = model(torch.tensor([PROMPT + ids])).logits[0].log_softmax(-1)
    for responses in (first, again):
        prompt_logprobs = responses[0].prompt_info.prompt_logprobs
        assert [lp.token_id for lp in prompt_logprobs] == PROMPT[1:]
        for position, lp in enumerate(prompt_logprobs):
            assert lp.logprob == pytest.approx(reference[position, lp.token_id].item(), abs=1e-4)
            # a rank is defined up to float rounding: tokens within the logprob tolerance of
            # this one may fall on either side of it
            above_surely = int((reference[position] > lp.logprob + 1e-4).sum())
            above_maybe = int((reference[position] > lp.logprob - 1e-4).sum())
            assert above_surely + 1 <= lp.rank <= above_maybe + 1
            assert [t.rank for t in lp.top] == [1, 2]
            assert [t.token_id for t in lp.top] == reference[position].topk(2).indices.tolist()
        logprobs = [lp for r in responses for o in r.outputs for lp in o.logprobs]
        assert [lp.token_id for lp in logprobs] == ids
        for step, lp in enumerate(logprobs):
            position = len(PROMPT) - 1 + step
            assert lp.rank == 1  # greedy picks the most likely token
            assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id
            assert lp.logprob == pytest.approx(reference[position, lp.token_id].item(), abs=1e-4)
            assert lp.token != "" and lp.top[1].token != ""
    assert token_ids(again) == ids


def test_min_tokens_holds_back_eos(stub, model_info) -> None:
    eos = model_info.eos_token_ids[0]
    forced = request(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0})
    forced.stopping.ignore_eos = False
    responses = generate(stub, forced)
    assert token_ids(responses) == [eos]
    assert final(responses).finish_reason == pb.FINISH_REASON_STOP
    forced.stopping.min_tokens = 5
    responses = generate(stub, forced)
    ids = token_ids(responses)
    assert len(ids) == 6 and eos not in ids[:5] and ids[5] == eos
    assert final(responses).finish_reason == pb.FINISH_REASON_STOP


def test_stop_token_ids_end_the_request(stub) -> None:
    greedy = token_ids(generate(stub, request(max_tokens=12, temperature=0.0)))
    stop_id = greedy[3]
    message = request(max_tokens=12, temperature=0.0)
    message.stopping.stop_token_ids.append(stop_id)
    responses = generate(stub, message)
    assert token_ids(responses) == greedy[: greedy.index(stop_id) + 1]
    assert final(responses).finish_reason == pb.FINISH_REASON_STOP
    assert final(responses).stop_token_id == stop_id


def test_repetition_detection_and_allowed_token_ids(stub) -> None:
    message = request(max_tokens=30, temperature=0.0, allowed_token_ids=[77])
    message.stopping.repetition_detection.max_pattern_size = 2
    message.stopping.repetition_detection.min_count = 4
    responses = generate(stub, message)
    assert token_ids(responses) == [77] * 4
    assert final(responses).finish_reason == pb.FINISH_REASON_REPETITION


def test_bad_words_and_logit_bias(stub) -> None:
    tokens = stub.Tokenize(pb.TokenizeRequest(text="def", add_special_tokens=False))
    assert len(tokens.token_ids) == 1  # one token in the tiny checkpoint's vocabulary
    word = tokens.token_ids[0]
    forced = request(max_tokens=6, temperature=0.0, logit_bias={word: 100.0})
    assert token_ids(generate(stub, forced)) == [word] * 6
    forced.sampling.bad_words.append("def")
    assert word not in token_ids(generate(stub, forced))


def test_every_knob_at_once_is_served(stub) -> None:
    message = request(
        max_tokens=10,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.02,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        seed=5,
        logit_bias={3: -1.0},
        bad_words=["import"],
    )
    message.stopping.min_tokens = 2
    responses = generate(stub, message)
    assert len(token_ids(responses)) == 10
    assert final(responses).finish_reason == pb.FINISH_REASON_LENGTH


def test_output_kinds_agree(stub) -> None:
    texts = {}
    for kind in (pb.OUTPUT_KIND_DELTA, pb.OUTPUT_KIND_CUMULATIVE, pb.OUTPUT_KIND_FINAL_ONLY):
        message = request(max_tokens=10, temperature=0.0)
        message.output.kind = kind
        responses = generate(stub, message)
        assert responses[-1].HasField("usage") and responses[-1].HasField("metrics")
        assert not any(r.HasField("usage") for r in responses[:-1])
        if kind == pb.OUTPUT_KIND_DELTA:
            texts[kind] = "".join(o.text for r in responses for o in r.outputs)
        else:
            texts[kind] = responses[-1].outputs[0].text
        if kind == pb.OUTPUT_KIND_FINAL_ONLY:
            assert len(responses) == 1
        metrics = responses[-1].metrics
        for field in ("queue_time", "time_to_first_token", "prefill_time", "e2e_latency"):
            assert metrics.HasField(field), field
    assert len(set(texts.values())) == 1 and texts[pb.OUTPUT_KIND_DELTA]


# (field set on the request, value, field named in the error)
INVALID = [
    ("temperature", -0.1, "sampling.temperature"),
    ("top_p", 0.0, "sampling.top_p"),
    ("top_p", 1.5, "sampling.top_p"),
    ("top_k", -2, "sampling.top_k"),
    ("min_p", 1.5, "sampling.min_p"),
    ("presence_penalty", 3.0, "sampling.presence_penalty"),
    ("frequency_penalty", -2.5, "sampling.frequency_penalty"),
    ("repetition_penalty", 0.0, "sampling.repetition_penalty"),
    ("n", 100, "sampling.n"),
    ("n", 0, "sampling.n"),
    ("logit_bias", {10**6: 1.0}, "sampling.logit_bias"),
    ("logit_bias", {5: 1000.0}, "sampling.logit_bias"),
    ("allowed_token_ids", [10**6], "sampling.allowed_token_ids"),
    ("bad_words", [""], "sampling.bad_words"),
    ("max_tokens", MAX_MODEL_LEN, "stopping.max_tokens"),
    ("stop_token_ids", [10**6], "stopping.stop_token_ids"),
    ("repetition_detection", (0, 1), "stopping.repetition_detection"),
    ("logprobs", 21, "output.logprobs"),
    ("prompt_logprobs", 21, "output.prompt_logprobs"),
    ("prompt", list(range(3, MAX_MODEL_LEN + 3)), "token_ids.ids"),
    ("prompt", [10**6], "token_ids.ids"),
]


@pytest.mark.parametrize(
    ("knob", "value", "field"), INVALID, ids=[f"{k}={v}"[:40] for k, v, _ in INVALID]
)
def test_each_invalid_value_is_invalid_argument(stub, knob, value, field) -> None:
    message = request()
    if knob == "prompt":
        message.token_ids.ids[:] = value
    elif knob in ("max_tokens", "stop_token_ids"):
        target = message.stopping.stop_token_ids if knob == "stop_token_ids" else None
        if target is None:
            message.stopping.max_tokens = value
        else:
            target.extend(value)
    elif knob == "repetition_detection":
        message.stopping.repetition_detection.max_pattern_size = value[0]
        message.stopping.repetition_detection.min_count = value[1]
    elif knob in ("logprobs", "prompt_logprobs"):
        setattr(message.output, knob, value)
    elif knob == "logit_bias":
        message.sampling.logit_bias.update(value)
    elif isinstance(value, list):
        getattr(message.sampling, knob).extend(value)
    else:
        setattr(message.sampling, knob, value)
    with pytest.raises(grpc.RpcError) as caught:
        generate(stub, message)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details(), caught.value.details()

"""The gateway's side of the sampling surface, over real gRPC and ZeroMQ with a scripted engine:
n > 1 fan-out, logprobs to the API, bad words tokenized, every knob sent to the engine."""

from __future__ import annotations

import grpc
import pytest
from gateway_harness import WAIT_S, until
from test_gateway_server import StartGateway, _collect, _generate, start_gateway

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.pipeline.bad_words import tokenize_bad_words

__all__ = ["start_gateway"]  # the fixture, imported for its side effect


async def test_n_sequences_fan_out_with_indices_and_summed_usage(
    start_gateway: StartGateway,
) -> None:
    h = await start_gateway()
    request = _generate(
        max_tokens=4,
        request_id="req-n",
        sampling=pb.SamplingParams(n=3, seed=10, temperature=0.8),
        output=pb.OutputOptions(return_token_ids=True),
    )
    responses = await _collect(h.stub.Generate(request, timeout=WAIT_S))
    assert sorted(h.engine.added) == ["0_req-n", "1_req-n", "2_req-n"]
    seeds = sorted(r.sampling_params.seed for r in h.engine.added.values())
    assert seeds == [10, 11, 12]
    by_index: dict[int, list[int]] = {}
    for response in responses:
        assert response.request_id == "req-n" and len(response.outputs) == 1
        by_index.setdefault(response.outputs[0].index, []).extend(response.outputs[0].token_ids)
    assert sorted(by_index) == [0, 1, 2]
    assert all(ids == h.engine.script[:4] for ids in by_index.values())
    assert [r.HasField("prompt_info") for r in responses].count(True) == 1
    assert responses[0].HasField("prompt_info")
    assert [r.HasField("usage") for r in responses] == [False] * (len(responses) - 1) + [True]
    last = responses[-1]
    assert last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == len(h.tokenizer.encode("Hello"))
    assert last.metrics.HasField("time_to_first_token") and last.metrics.HasField("e2e_latency")
    finishes = [o.finish_reason for r in responses for o in r.outputs if o.finish_reason]
    assert finishes == [pb.FINISH_REASON_LENGTH] * 3


async def test_n_sequences_final_only_is_one_message(start_gateway: StartGateway) -> None:
    h = await start_gateway()
    request = _generate(
        max_tokens=3,
        sampling=pb.SamplingParams(n=2),
        output=pb.OutputOptions(kind=pb.OUTPUT_KIND_FINAL_ONLY),
    )
    [response] = await _collect(h.stub.Generate(request, timeout=WAIT_S))
    assert [o.index for o in response.outputs] == [0, 1]
    expected = h.tokenizer.decode(h.engine.script[:3])
    assert [o.text for o in response.outputs] == [expected, expected]
    assert response.usage.completion_tokens == 6
    assert response.HasField("prompt_info") and response.HasField("metrics")


async def test_abort_rpc_and_cancellation_reach_every_sequence(
    start_gateway: StartGateway,
) -> None:
    h = await start_gateway()
    h.engine.mode = "hang"
    call = h.stub.Generate(
        _generate(max_tokens=20, request_id="req-ab", sampling=pb.SamplingParams(n=2)),
        timeout=WAIT_S,
    )
    await until(lambda: len(h.engine.added) == 2, "the engine got both ADDs")
    reply = await h.stub.Abort(pb.AbortRequest(request_ids=["req-ab"]), timeout=WAIT_S)
    assert list(reply.aborted_request_ids) == ["req-ab"]
    responses = await _collect(call)
    finishes = sorted(o.index for r in responses for o in r.outputs if o.finish_reason)
    assert finishes == [0, 1]
    assert responses[-1].HasField("usage")
    await until(lambda: {"0_req-ab", "1_req-ab"} <= set(h.engine.aborted), "both aborted")

    cancelled = h.stub.Generate(
        _generate(max_tokens=20, request_id="req-cx", sampling=pb.SamplingParams(n=2)),
        timeout=WAIT_S,
    )
    await until(lambda: "1_req-cx" in h.engine.added, "the engine got the ADDs")
    cancelled.cancel()
    await until(lambda: {"0_req-cx", "1_req-cx"} <= set(h.engine.aborted), "both aborted")


async def test_a_stop_string_ends_and_aborts_each_sequence_on_its_own(
    start_gateway: StartGateway,
) -> None:
    h = await start_gateway()
    request = _generate(max_tokens=20, request_id="req-ss", sampling=pb.SamplingParams(n=2))
    request.stopping.stop.append("three")
    responses = await _collect(h.stub.Generate(request, timeout=WAIT_S))
    finals = {o.index: o for r in responses for o in r.outputs if o.finish_reason}
    assert {i: o.stop_string for i, o in finals.items()} == {0: "three", 1: "three"}
    await until(lambda: {"0_req-ss", "1_req-ss"} <= set(h.engine.aborted), "ABORTs")


async def test_a_stop_string_within_min_tokens_does_not_stop(start_gateway: StartGateway) -> None:
    h = await start_gateway()
    tokens_to_three = len(h.tokenizer.encode(" one two three", add_special_tokens=False))
    request = _generate(max_tokens=len(h.engine.script), request_id="req-min")
    request.stopping.stop.append("three")
    request.stopping.min_tokens = tokens_to_three
    responses = await _collect(h.stub.Generate(request, timeout=WAIT_S))
    [final] = [o for r in responses for o in r.outputs if o.finish_reason]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and not final.stop_string
    assert "".join(o.text for r in responses for o in r.outputs) == h.tokenizer.decode(
        h.engine.script
    )


@pytest.mark.parametrize(
    "kind", [pb.OUTPUT_KIND_DELTA, pb.OUTPUT_KIND_CUMULATIVE, pb.OUTPUT_KIND_FINAL_ONLY]
)
async def test_logprobs_reach_the_api_with_token_strings(
    start_gateway: StartGateway, kind: int
) -> None:
    h = await start_gateway()
    request = _generate(
        max_tokens=4,
        output=pb.OutputOptions(kind=kind, logprobs=2, prompt_logprobs=1),
    )
    responses = await _collect(h.stub.Generate(request, timeout=WAIT_S))
    sent = h.engine.added[next(iter(h.engine.added))].sampling_params
    assert (sent.logprobs, sent.prompt_logprobs) == (2, 1)
    if kind == pb.OUTPUT_KIND_DELTA:
        logprobs = [lp for r in responses for lp in r.outputs[0].logprobs]
    else:
        logprobs = list(responses[-1].outputs[0].logprobs)
    script = h.engine.script[:4]
    assert [lp.token_id for lp in logprobs] == script
    for lp, token_id in zip(logprobs, script, strict=True):
        assert (lp.rank, lp.logprob) == (2, -1.0)
        assert lp.token == h.tokenizer.decode([token_id], skip_special_tokens=False)
        assert [t.token_id for t in lp.top] == [token_id + 1, token_id]
        assert [t.rank for t in lp.top] == [1, 2]
        assert lp.top[0].token == h.tokenizer.decode([token_id + 1], skip_special_tokens=False)
    prompt = h.tokenizer.encode("Hello")
    prompt_logprobs = responses[0].prompt_info.prompt_logprobs
    assert [lp.token_id for lp in prompt_logprobs] == prompt[1:]
    assert all(len(lp.top) == 1 for lp in prompt_logprobs)


async def test_bad_words_are_tokenized_for_the_engine(start_gateway: StartGateway) -> None:
    h = await start_gateway()
    request = _generate(max_tokens=2, sampling=pb.SamplingParams(bad_words=["two", "Paris"]))
    await _collect(h.stub.Generate(request, timeout=WAIT_S))
    sent = next(iter(h.engine.added.values())).sampling_params.bad_words_token_ids
    assert h.tokenizer.encode("two", add_special_tokens=False) in sent
    assert h.tokenizer.encode(" two", add_special_tokens=False) in sent
    assert h.tokenizer.encode("Paris", add_special_tokens=False) in sent


def test_tokenize_bad_words_rules(byte_level_tokenizer) -> None:
    tok = byte_level_tokenizer
    sequences = tokenize_bad_words(tok, ["two"], tok.vocab_size)
    assert sequences[0] == tok.encode("two", add_special_tokens=False)
    with pytest.raises(ApiError) as caught:
        tokenize_bad_words(tok, ["ok", "   "], tok.vocab_size)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.bad_words[1]" in caught.value.message

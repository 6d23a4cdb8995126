"""A call that fell behind its engine sends the steps that queued up as one message; with a
stream interval of k, a stream sends its first token at once, then one message per k tokens;
under the gateway's message budget a call waits its share of it between messages, and sends
what came meanwhile as one.

The gateway here is the real one (its state, engine client, tokenizer, observer), with a
scripted engine peer that takes the ADD and never answers: the test plays the engine client's
part and puts the steps' outputs into the request's channel itself, so what is queued when the
call reads is exactly what the test put there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from gateway_harness import WAIT_S, gateway_config
from gateway_scripted_engine import ScriptedEngine, fake_logprobs

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.config import GatewayConfig, GatewayRoleConfig
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.engines.types import StepOutput
from switchboard.gateway.grpc_server import GatewayServer
from switchboard.gateway.pipeline.generate_call import GenerateCall, GenerateCalls
from switchboard.wire.engine_msgs import (
    EngineCoreEvent,
    EngineCoreOutput,
    EventType,
    FinishReason,
)

TEXT = " one two three four"


class _TestFront:
    """A front with no headers and no deadline (what a ``CallContext`` asks of gRPC or HTTP)."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def peer(self) -> str:
        return "test"

    def code(self) -> grpc.StatusCode | None:
        return None

    def time_remaining(self) -> float | None:
        return None


@pytest.fixture
async def calls(checkpoint_dir: Path, run_dir: str) -> AsyncIterator[GenerateCalls]:
    async with _serving(gateway_config(checkpoint_dir, run_dir)) as served:
        yield served


@pytest.fixture
async def calls_every_3(checkpoint_dir: Path, run_dir: str) -> AsyncIterator[GenerateCalls]:
    """A gateway with ``--stream-interval 3``."""
    gateway = GatewayConfig(host="127.0.0.1", port=0, stream_interval=3)
    async with _serving(gateway_config(checkpoint_dir, run_dir, gateway=gateway)) as served:
        yield served


@pytest.fixture
async def calls_paced(checkpoint_dir: Path, run_dir: str) -> AsyncIterator[GenerateCalls]:
    """A gateway whose message budget leaves a call ~17 minutes between messages."""
    gateway = GatewayConfig(host="127.0.0.1", port=0, stream_messages_per_s=0.001)
    async with _serving(gateway_config(checkpoint_dir, run_dir, gateway=gateway)) as served:
        yield served


@contextlib.asynccontextmanager
async def _serving(config: GatewayRoleConfig) -> AsyncIterator[GenerateCalls]:
    server = GatewayServer(config)
    await server.start()
    engine = ScriptedEngine(config.input_address, config.output_address, [0])
    engine.mode = "hang"  # takes ADDs, sends nothing: the test sends the steps
    await engine.start()
    try:
        assert await server.engines.wait_until_ready(WAIT_S)
        yield GenerateCalls(server.state)
    finally:
        with contextlib.suppress(Exception):
            await engine.close()
        await server.stop()


def _request(
    kind: int = pb.OUTPUT_KIND_DELTA, logprobs: int | None = None, max_tokens: int = 4
) -> pb.GenerateRequest:
    output = pb.OutputOptions(kind=kind, return_token_ids=True)
    if logprobs is not None:
        output.logprobs = logprobs
    return pb.GenerateRequest(
        text="Hello", stopping=pb.StoppingCriteria(max_tokens=max_tokens), output=output
    )


def _output(
    request_id: str,
    token_id: int,
    *,
    first: bool = False,
    finish: FinishReason | None = None,
    logprobs: int | None = None,
) -> StepOutput:
    """One engine step's output for a request."""
    now = time.monotonic_ns()
    output = EngineCoreOutput(request_id, [token_id], finish_reason=finish)
    if first:
        output.events = [
            EngineCoreEvent(EventType.QUEUED, now),
            EngineCoreEvent(EventType.SCHEDULED, now),
        ]
    if logprobs is not None:
        output.new_logprobs = [fake_logprobs(token_id, logprobs)]
    return StepOutput(output, now)


def _step(call: GenerateCall, token_id: int, **output: Any) -> None:
    """Put one engine step's output for the call's request into its channel."""
    channel = call.group.channels[0]
    channel.delivered.append(token_id)
    channel.put(_output(channel.request_id, token_id, **output))


def _steps(call: GenerateCall, token_ids: list[int], logprobs: int | None = None) -> None:
    for i, token_id in enumerate(token_ids):
        last = i == len(token_ids) - 1
        finish = FinishReason.LENGTH if last else None
        _step(call, token_id, first=i == 0, finish=finish, logprobs=logprobs)


async def test_steps_queued_before_the_call_reads_go_out_as_one_message(
    calls: GenerateCalls,
) -> None:
    tokenizer = calls.state.tokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:4]
    async with calls.open(_request(logprobs=1), "req-behind", time.time(), _TestFront()) as call:
        _steps(call, ids, logprobs=1)
        responses = [response async for response in call.responses()]

    assert len(responses) == 1
    (response,) = responses
    sequence = response.outputs[0]
    assert list(sequence.token_ids) == ids
    assert sequence.text == tokenizer.decode(ids)
    assert [entry.token_id for entry in sequence.logprobs] == ids
    assert sequence.finish_reason == pb.FINISH_REASON_LENGTH
    assert response.prompt_info.token_ids == tokenizer.encode("Hello")
    assert response.usage.completion_tokens == 4
    assert response.metrics.HasField("time_to_first_token")


async def test_held_steps_are_read_when_their_message_is_built(calls: GenerateCalls) -> None:
    """Steps that queued up are detokenized together when their message is built: its text is
    theirs, and the step after it starts where they ended."""
    tokenizer = calls.state.tokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:4]
    async with calls.open(_request(), "req-held", time.time(), _TestFront()) as call:
        responses = call.responses()
        for i, token_id in enumerate(ids[:3]):
            _step(call, token_id, first=i == 0)
        held = await anext(responses)
        _step(call, ids[3], finish=FinishReason.LENGTH)
        last = await anext(responses)

    assert list(held.outputs[0].token_ids) == ids[:3]
    assert held.outputs[0].text == tokenizer.decode(ids[:3])
    assert held.outputs[0].text + last.outputs[0].text == tokenizer.decode(ids)
    assert last.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH


async def test_a_call_that_keeps_up_sends_one_message_a_step(calls: GenerateCalls) -> None:
    tokenizer = calls.state.tokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:4]
    async with calls.open(_request(), "req-live", time.time(), _TestFront()) as call:
        responses = call.responses()
        received = []
        for i, token_id in enumerate(ids):
            last = i == len(ids) - 1
            _step(call, token_id, first=i == 0, finish=FinishReason.LENGTH if last else None)
            received.append(await anext(responses))
        with pytest.raises(StopAsyncIteration):
            await anext(responses)

    assert [list(r.outputs[0].token_ids) for r in received] == [[t] for t in ids]
    assert received[0].HasField("prompt_info") and not received[1].HasField("prompt_info")
    assert [r.HasField("usage") for r in received] == [False, False, False, True]


async def test_cumulative_steps_that_queued_up_send_the_last_whole(calls: GenerateCalls) -> None:
    tokenizer = calls.state.tokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:4]
    request = _request(kind=pb.OUTPUT_KIND_CUMULATIVE)
    async with calls.open(request, "req-cumulative", time.time(), _TestFront()) as call:
        _steps(call, ids)
        responses = [response async for response in call.responses()]

    assert len(responses) == 1
    assert list(responses[0].outputs[0].token_ids) == ids
    assert responses[0].outputs[0].text == tokenizer.decode(ids)
    assert responses[0].HasField("prompt_info") and responses[0].HasField("usage")


async def test_what_queued_before_a_failed_step_goes_out_before_the_error(
    calls: GenerateCalls,
) -> None:
    tokenizer = calls.state.tokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:3]
    received: list[pb.GenerateResponse] = []
    with pytest.raises(ApiError) as failed:
        async with calls.open(_request(), "req-failing", time.time(), _TestFront()) as call:
            _step(call, ids[0], first=True)
            _step(call, ids[1])
            _step(call, ids[2], finish=FinishReason.ERROR)
            async for response in call.responses():
                received.append(response)

    assert failed.value.code == grpc.StatusCode.INTERNAL
    assert len(received) == 1
    assert list(received[0].outputs[0].token_ids) == ids[:2]
    assert received[0].outputs[0].text == tokenizer.decode(ids[:2])


async def test_a_stream_interval_sends_the_first_token_then_one_message_per_k_tokens(
    calls_every_3: GenerateCalls,
) -> None:
    """Steps handed to the call's stream one by one (as a call that keeps up sees them): what
    each step gives, message or nothing."""
    tokenizer = calls_every_3.state.tokenizer
    ids = tokenizer.encode(TEXT * 2, add_special_tokens=False)[:8]
    request = _request(logprobs=1, max_tokens=len(ids))
    async with calls_every_3.open(request, "req-every-3", time.time(), _TestFront()) as call:
        (stream,), (rid,) = call.group.streams, call.group.request_ids
        last = len(ids) - 1
        sent = [
            stream.handle(
                _output(rid, t, finish=FinishReason.LENGTH if i == last else None, logprobs=1)
            )
            for i, t in enumerate(ids)
        ]

    held = [response is None for response in sent]
    assert held == [False, True, True, False, True, True, False, False]
    messages = [response for response in sent if response is not None]
    groups = [ids[:1], ids[1:4], ids[4:7], ids[7:]]
    assert [list(m.outputs[0].token_ids) for m in messages] == groups
    assert [[e.token_id for e in m.outputs[0].logprobs] for m in messages] == groups
    assert "".join(m.outputs[0].text for m in messages) == tokenizer.decode(ids)
    assert [m.HasField("prompt_info") for m in messages] == [True, False, False, False]
    assert [m.HasField("usage") for m in messages] == [False, False, False, True]
    assert messages[-1].outputs[0].finish_reason == pb.FINISH_REASON_LENGTH


async def test_steps_queued_under_an_interval_send_their_whole_groups_and_hold_the_rest(
    calls_every_3: GenerateCalls,
) -> None:
    """Queued steps go out as one message that ends on a group of the interval: the first
    token and the whole groups after it; the tokens past the last whole group wait for the
    next steps (here the end)."""
    tokenizer = calls_every_3.state.tokenizer
    ids = tokenizer.encode(TEXT * 2, add_special_tokens=False)[:9]
    request = _request(logprobs=1, max_tokens=len(ids))
    async with calls_every_3.open(request, "req-queued-3", time.time(), _TestFront()) as call:
        responses = call.responses()
        for i, token_id in enumerate(ids[:6]):  # the first token, a group of 3, 2 more
            _step(call, token_id, first=i == 0, logprobs=1)
        queued = await anext(responses)
        for token_id in ids[6:-1]:
            _step(call, token_id, logprobs=1)
        _step(call, ids[-1], finish=FinishReason.LENGTH, logprobs=1)
        rest = [response async for response in responses]

    assert list(queued.outputs[0].token_ids) == ids[:4]
    assert [e.token_id for e in queued.outputs[0].logprobs] == ids[:4]
    assert queued.HasField("prompt_info") and not queued.HasField("usage")
    assert [list(m.outputs[0].token_ids) for m in rest] == [ids[4:]]
    assert queued.outputs[0].text + rest[0].outputs[0].text == tokenizer.decode(ids)
    assert rest[0].usage.completion_tokens == len(ids)


async def test_a_stream_that_ends_inside_an_interval_sends_what_it_held_with_the_end(
    calls_every_3: GenerateCalls,
) -> None:
    tokenizer = calls_every_3.state.tokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:3]
    async with calls_every_3.open(_request(), "req-short", time.time(), _TestFront()) as call:
        (stream,), (rid,) = call.group.streams, call.group.request_ids
        last = len(ids) - 1
        sent = [
            stream.handle(_output(rid, t, finish=FinishReason.STOP if i == last else None))
            for i, t in enumerate(ids)
        ]

    first, held, last = sent
    assert first is not None and held is None and last is not None
    assert list(last.outputs[0].token_ids) == ids[1:]
    assert first.outputs[0].text + last.outputs[0].text == tokenizer.decode(ids)
    assert last.outputs[0].finish_reason == pb.FINISH_REASON_STOP


async def test_a_paced_call_sends_its_first_step_at_once_and_the_rest_with_the_end(
    calls_paced: GenerateCalls,
) -> None:
    """Steps that come one by one while the call waits out its interval go out together, and
    the step that ends the call ends the wait: no message is held past the end."""
    tokenizer = calls_paced.state.tokenizer
    ids = tokenizer.encode(TEXT * 2, add_special_tokens=False)[:6]
    request = _request(logprobs=1, max_tokens=len(ids))
    async with calls_paced.open(request, "req-paced", time.time(), _TestFront()) as call:
        responses = call.responses()
        _step(call, ids[0], first=True, logprobs=1)
        first = await anext(responses)
        rest = asyncio.ensure_future(anext(responses))
        for token_id in ids[1:-1]:
            _step(call, token_id, logprobs=1)
            await asyncio.sleep(0)  # the call takes the step and waits again
        assert not rest.done()  # held: the interval has not passed, the call has not ended
        _step(call, ids[-1], finish=FinishReason.LENGTH, logprobs=1)
        second = await asyncio.wait_for(rest, WAIT_S)
        with pytest.raises(StopAsyncIteration):
            await anext(responses)

    assert list(first.outputs[0].token_ids) == ids[:1]
    assert list(second.outputs[0].token_ids) == ids[1:]
    assert [e.token_id for e in second.outputs[0].logprobs] == ids[1:]
    assert first.outputs[0].text + second.outputs[0].text == tokenizer.decode(ids)
    assert first.HasField("prompt_info") and not second.HasField("prompt_info")
    assert second.usage.completion_tokens == len(ids)
    assert second.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH


async def test_the_interval_is_the_calls_share_of_the_budget(
    calls_paced: GenerateCalls,
) -> None:
    async with calls_paced.open(_request(), "req-a", time.time(), _TestFront()):
        async with calls_paced.open(_request(), "req-b", time.time(), _TestFront()) as call:
            pacing = call._pacing
            assert pacing is not None
            assert pacing.interval() == pytest.approx(2 / 0.001)
        assert pacing.interval() == pytest.approx(1 / 0.001)

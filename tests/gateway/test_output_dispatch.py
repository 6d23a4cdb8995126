"""The gateway's hand-off of one engine step's outputs to the request streams: a request's first
tokens wake its stream before the other streams' next ones, and every output still arrives, in
order per request, with finished requests forgotten."""

from __future__ import annotations

import asyncio

from switchboard.gateway.engines.client import EngineClient
from switchboard.gateway.engines.types import EngineHandle, RequestChannel, StepOutput
from switchboard.wire.engine_msgs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineReady,
    FinishReason,
)


def _client_with_engine() -> tuple[EngineClient, EngineHandle]:
    client = EngineClient("inproc://unused-in", "inproc://unused-out")
    engine = EngineHandle(identity=b"e0", ready=EngineReady("e0", 0, 64, 8, 16, 128, 0, 0))
    client.engines[0] = engine
    return client, engine


def _open(client: EngineClient, engine: EngineHandle, request_id: str) -> RequestChannel:
    channel = RequestChannel(request_id, engine)
    client._requests[request_id] = channel
    return channel


async def test_first_tokens_wake_their_streams_before_the_running_ones() -> None:
    client, engine = _client_with_engine()
    running = [_open(client, engine, f"run-{i}") for i in range(3)]
    for channel in running:
        channel.delivered = [1, 2]  # already streaming
    new = [_open(client, engine, f"new-{i}") for i in range(2)]
    woken: list[str] = []

    async def stream(channel: RequestChannel) -> None:
        event = await channel.get()
        assert isinstance(event, StepOutput)
        woken.append(event.output.request_id)

    tasks = [asyncio.create_task(stream(c)) for c in running + new]
    await asyncio.sleep(0)  # every stream waits on its channel
    # The engine lists running requests first and new ones last, as its scheduler does.
    outputs = [EngineCoreOutput(c.request_id, [7]) for c in running + new]
    client._dispatch(EngineCoreOutputs(engine_index=0, timestamp_ns=1, outputs=outputs))
    await asyncio.gather(*tasks)

    assert woken == ["new-0", "new-1", "run-0", "run-1", "run-2"]
    assert [c.delivered for c in new] == [[7], [7]]
    assert [c.delivered for c in running] == [[1, 2, 7]] * 3


async def test_a_step_delivers_every_output_and_forgets_finished_requests() -> None:
    client, engine = _client_with_engine()
    first = _open(client, engine, "first")
    done = _open(client, engine, "done")
    done.delivered = [3]
    outputs = [
        EngineCoreOutput("done", [4], finish_reason=FinishReason.LENGTH),
        EngineCoreOutput("first", [9]),
        EngineCoreOutput("unknown", [1]),  # finished or aborted here already: dropped
    ]
    client._dispatch(EngineCoreOutputs(engine_index=0, timestamp_ns=5, outputs=outputs))

    event = await done.get()
    assert isinstance(event, StepOutput) and event.output.finish_reason == FinishReason.LENGTH
    assert event.timestamp_ns == 5
    assert (await first.get()).output.new_token_ids == [9]
    assert "done" not in client._requests and "first" in client._requests

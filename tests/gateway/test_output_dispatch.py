"""The gateway's hand-off of one engine step's outputs to the request streams: a request's first
tokens wake its stream before the other streams' next ones, and every output still arrives, in
order per request, with finished requests forgotten."""

from __future__ import annotations

import asyncio
from typing import Any

from switchboard.gateway.engines.membership import EngineMembership
from switchboard.gateway.engines.routing import RequestRouter
from switchboard.gateway.engines.types import EngineHandle, RequestChannel, StepOutput
from switchboard.wire.engine_msgs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    RequestType,
)


def _router_with_engine() -> tuple[RequestRouter, EngineHandle]:
    """A router over one READY engine; its sends go nowhere (the hand-off back is under test)."""
    membership = EngineMembership(
        heartbeat_timeout_s=10.0,
        resume_timeout_s=0.0,
        on_changed=lambda: None,
        on_dead=lambda _engine, _why: None,
    )
    engine = EngineHandle(identity=b"e0", ready=EngineReady("e0", 0, 64, 8, 16, 128, 0, 0))
    membership.engines[0] = engine

    def send(_engine: EngineHandle, _type: RequestType, _body: Any) -> bool:
        return True

    return RequestRouter(membership, send), engine


def _open(router: RequestRouter, request_id: str) -> RequestChannel:
    return router.add_request(EngineCoreRequest(request_id=request_id, prompt_token_ids=[1]))


async def test_first_tokens_wake_their_streams_before_the_running_ones() -> None:
    router, engine = _router_with_engine()
    running = [_open(router, f"run-{i}") for i in range(3)]
    for channel in running:
        channel.delivered = [1, 2]  # already streaming
    new = [_open(router, f"new-{i}") for i in range(2)]
    woken: list[str] = []

    async def stream(channel: RequestChannel) -> None:
        event = await channel.get()
        assert isinstance(event, StepOutput)
        woken.append(event.output.request_id)

    tasks = [asyncio.create_task(stream(c)) for c in running + new]
    await asyncio.sleep(0)  # every stream waits on its channel
    # The engine lists running requests first and new ones last, as its scheduler does.
    outputs = [EngineCoreOutput(c.request_id, [7]) for c in running + new]
    router.deliver(engine, EngineCoreOutputs(engine_index=0, timestamp_ns=1, outputs=outputs))
    await asyncio.gather(*tasks)

    assert woken == ["new-0", "new-1", "run-0", "run-1", "run-2"]
    assert [c.delivered for c in new] == [[7], [7]]
    assert [c.delivered for c in running] == [[1, 2, 7]] * 3


async def test_a_step_delivers_every_output_and_forgets_finished_requests() -> None:
    router, engine = _router_with_engine()
    first = _open(router, "first")
    done = _open(router, "done")
    done.delivered = [3]
    outputs = [
        EngineCoreOutput("done", [4], finish_reason=FinishReason.LENGTH),
        EngineCoreOutput("first", [9]),
        EngineCoreOutput("unknown", [1]),  # finished or aborted here already: dropped
    ]
    router.deliver(engine, EngineCoreOutputs(engine_index=0, timestamp_ns=5, outputs=outputs))

    event = await done.get()
    assert isinstance(event, StepOutput) and event.output.finish_reason == FinishReason.LENGTH
    assert event.timestamp_ns == 5
    assert (await first.get()).output.new_token_ids == [9]
    assert not router.is_live("done") and router.is_live("first")
    assert engine.num_requests == 1  # the finished request no longer counts in its load


async def test_a_wait_for_the_end_sleeps_through_steps_and_wakes_at_the_last() -> None:
    """A paced stream waits for its last step without being woken by the steps before it;
    they stay queued, in order, for the message that follows."""
    router, engine = _router_with_engine()
    channel = _open(router, "paced")
    woke: list[int] = []

    async def wait_for_end() -> None:
        await channel.end_arrival()
        woke.append(len(woke))

    waiter = asyncio.create_task(wait_for_end())
    await asyncio.sleep(0)  # it waits
    for token_id in (5, 6):
        step = EngineCoreOutputs(0, 1, [EngineCoreOutput("paced", [token_id])])
        router.deliver(engine, step)
        await asyncio.sleep(0)
    assert not waiter.done() and not channel.end_queued()
    last = EngineCoreOutput("paced", [7], finish_reason=FinishReason.STOP)
    router.deliver(engine, EngineCoreOutputs(0, 2, [last]))
    await asyncio.wait_for(waiter, 10.0)
    assert woke == [0] and channel.end_queued()
    await channel.end_arrival()  # already queued: returns at once
    got = [await channel.get() for _ in range(3)]
    assert [e.output.new_token_ids for e in got if isinstance(e, StepOutput)] == [[5], [6], [7]]


async def test_a_wait_for_the_end_with_a_deadline_returns_at_whichever_comes_first() -> None:
    """The pacing's wait: at its deadline while steps keep coming (no error raised, the steps
    still queued), or at the last step if that comes before the deadline."""
    router, engine = _router_with_engine()
    channel = _open(router, "deadline")
    loop = asyncio.get_running_loop()
    router.deliver(engine, EngineCoreOutputs(0, 1, [EngineCoreOutput("deadline", [5])]))
    started = loop.time()
    await asyncio.wait_for(channel.end_arrival(started + 0.05), 10.0)
    assert loop.time() >= started + 0.05 and not channel.end_queued()

    waiter = asyncio.create_task(channel.end_arrival(loop.time() + 60.0))
    await asyncio.sleep(0)
    last = EngineCoreOutput("deadline", [6], finish_reason=FinishReason.STOP)
    router.deliver(engine, EngineCoreOutputs(0, 2, [last]))
    await asyncio.wait_for(waiter, 10.0)  # long before its deadline
    assert channel.end_queued()
    got = [await channel.get() for _ in range(2)]
    assert [e.output.new_token_ids for e in got if isinstance(e, StepOutput)] == [[5], [6]]

"""Engine choice: power of two choices on load reports and own in-flight counts; pinning."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import zmq
import zmq.asyncio

from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.engines.engine_client import EngineClient
from switchboard.gateway.engines.pool import (
    LoadSubscriber,
    apply_load_report,
    choose_engine,
    engine_score,
)
from switchboard.gateway.engines.types import EngineHandle, EngineState, RequestFailed
from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import (
    EngineCoreRequest,
    EngineLoad,
    EngineReady,
    LoadReport,
    SchedulerStats,
)

WAIT_S = 30.0


def handle(rank: int, **fields) -> EngineHandle:
    ready = EngineReady(f"e{rank}", rank, 512, 64, 16, 1024, 0, 0)
    return EngineHandle(identity=bytes([rank, 0]), ready=ready, **fields)


def test_score_is_the_larger_of_own_and_reported_load() -> None:
    assert engine_score(handle(0)) == 0
    assert engine_score(handle(0, num_requests=3)) == 3
    reported = handle(0, num_requests=1, load=EngineLoad(0, 2, 4), added_since_load=1)
    assert engine_score(reported) == 7  # 2 waiting + 4 running + 1 sent since the report
    full = handle(0, load=EngineLoad(0, 2, 0, kv_cache_usage=1.0))
    assert engine_score(full) == pytest.approx(2 + 2 * 6 * 0.5)  # waiting on a full KV cache


def test_two_engines_the_less_loaded_wins() -> None:
    engines = {0: handle(0, num_requests=5), 1: handle(1, num_requests=1)}
    rng = random.Random(0)
    assert {choose_engine(engines, None, rng).engine_id for _ in range(20)} == {"e1"}


def test_power_of_two_choices_never_picks_the_busiest_of_three() -> None:
    engines = {r: handle(r, num_requests=n) for r, n in enumerate([0, 4, 9])}
    rng = random.Random(1)
    picks = [choose_engine(engines, None, rng).engine_id for _ in range(300)]
    assert "e2" not in picks
    assert {"e0", "e1"} == set(picks)  # e1 wins its draws against e2


def test_dead_engines_are_skipped_and_none_ready_is_unavailable() -> None:
    engines = {0: handle(0, state=EngineState.DEAD), 1: handle(1, num_requests=50)}
    assert choose_engine(engines, None, random.Random()).engine_id == "e1"
    engines[1].state = EngineState.DEAD
    with pytest.raises(ApiError) as error:
        choose_engine(engines, None, random.Random())
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def test_pinned_rank() -> None:
    engines = {0: handle(0), 1: handle(1, num_requests=99)}
    assert choose_engine(engines, 1, random.Random()).engine_id == "e1"
    for rank in (2, 0):
        if rank == 0:
            engines[0].state = EngineState.DEAD
        with pytest.raises(ApiError) as error:
            choose_engine(engines, rank, random.Random())
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
        assert f"data_parallel_rank {rank}" in error.value.message


def test_reports_update_engines_but_not_a_restarted_one() -> None:
    engines = {0: handle(0, added_since_load=4), 1: handle(1, added_since_load=2)}
    report = LoadReport(1, [EngineLoad(0, 1, 2, 0.5, "e0"), EngineLoad(1, 3, 3, 0.5, "old-e1")])
    apply_load_report(engines, report)
    assert engines[0].load == EngineLoad(0, 1, 2, 0.5, "e0") and engines[0].added_since_load == 0
    assert engines[1].load is None and engines[1].added_since_load == 2


def test_an_engine_a_report_does_not_cover_is_scored_on_own_counts() -> None:
    """A restarted coordinator has not heard from every engine yet: the load its predecessor
    reported for the others must not stay behind."""
    engines = {0: handle(0, num_requests=1), 1: handle(1, num_requests=2)}
    apply_load_report(
        engines, LoadReport(1, [EngineLoad(0, 0, 9, 0.1, "e0"), EngineLoad(1, 0, 9, 0.1, "e1")])
    )
    assert engine_score(engines[1]) == 9
    apply_load_report(engines, LoadReport(1, [EngineLoad(0, 0, 5, 0.1, "e0")]))
    assert engine_score(engines[0]) == 5
    assert engines[1].load is None and engine_score(engines[1]) == 2


async def test_loads_are_forgotten_as_soon_as_the_coordinator_goes_away() -> None:
    """The coordinator's process dies (its PUB closes): the gateway routes on its own counts at
    once, not after the staleness timeout, and uses the reports of the restarted coordinator
    (the same address) as they come."""
    engines = {0: handle(0), 1: handle(1)}
    ctx = zmq.asyncio.Context()
    pub = zmq_channel.make_socket(ctx, zmq.PUB, "tcp://127.0.0.1:0", bind=True)
    address = zmq_channel.bound_address(pub)
    subscriber = LoadSubscriber(ctx, address, lambda: engines, stale_after_s=3600.0)
    task = asyncio.create_task(subscriber.run())
    busy = LoadReport(1, [EngineLoad(0, 5, 9, 0.1, "e0"), EngineLoad(1, 0, 1, 0.1, "e1")])
    try:
        async with asyncio.timeout(WAIT_S):
            while engines[0].load is None:  # PUB drops messages until the SUB has joined
                await pub.send(zmq_channel.encode(busy))
                await asyncio.sleep(0.05)
            pub.close(linger=0)  # the coordinator died
            while subscriber.fresh:
                await asyncio.sleep(0.05)
        assert engines[0].load is None and engines[1].load is None
        pub = zmq_channel.make_socket(ctx, zmq.PUB, address, bind=True)  # restarted
        async with asyncio.timeout(WAIT_S):
            while engines[0].load is None:
                await pub.send(zmq_channel.encode(busy))
                await asyncio.sleep(0.05)
        assert subscriber.fresh and engine_score(engines[0]) == 14
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close(linger=0)
        ctx.term()


async def test_loads_are_forgotten_when_the_coordinator_goes_quiet() -> None:
    """A coordinator that stops publishing (dead, restarting) must not leave its last counts
    behind: they would grow with every request sent and skew the choice for good."""
    engines = {0: handle(0), 1: handle(1)}
    ctx = zmq.asyncio.Context()
    pub = zmq_channel.make_socket(ctx, zmq.PUB, "tcp://127.0.0.1:0", bind=True)
    subscriber = LoadSubscriber(
        ctx, zmq_channel.bound_address(pub), lambda: engines, stale_after_s=0.5
    )
    task = asyncio.create_task(subscriber.run())
    busy = LoadReport(1, [EngineLoad(0, 5, 9, 0.1, "e0"), EngineLoad(1, 0, 1, 0.1, "e1")])
    try:
        async with asyncio.timeout(WAIT_S):
            while engines[0].load is None:  # PUB drops messages until the SUB has joined
                await pub.send(zmq_channel.encode(busy))
                await asyncio.sleep(0.05)
            assert subscriber.fresh and subscriber.reported_ranks == [0, 1]
            engines[0].added_since_load = 7
            while subscriber.fresh:  # nothing published any more
                await asyncio.sleep(0.05)
        assert engines[0].load is None and engines[1].load is None
        assert engines[0].added_since_load == 0 and engine_score(engines[0]) == 0
        async with asyncio.timeout(WAIT_S):  # reports resume: counts are used again
            while engines[0].load is None:
                await pub.send(zmq_channel.encode(busy))
                await asyncio.sleep(0.05)
        assert subscriber.fresh and engine_score(engines[0]) == 14
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close(linger=0)
        ctx.term()


def client_with(
    engines: dict[int, EngineHandle], resume_timeout_s: float, engines_restart: bool = False
) -> EngineClient:
    client = EngineClient(
        "ipc:///unused-in",
        "ipc:///unused-out",
        resume_timeout_s=resume_timeout_s,
        engines_restart=engines_restart,
    )
    client.engines.update(engines)
    return client


async def test_a_new_request_waits_for_a_dead_engine_to_come_back() -> None:
    engines = {0: handle(0, state=EngineState.DEAD)}
    client = client_with(engines, resume_timeout_s=WAIT_S)
    assert client.restart_expected
    waiting = asyncio.ensure_future(client.wait_until_routable(WAIT_S))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # nothing is routable yet: it waits, it does not refuse
    engines[0].state = EngineState.READY  # the restarted engine's READY re-admits it
    await asyncio.wait_for(waiting, WAIT_S)
    assert not client.restart_expected


async def test_a_restarted_gateway_waits_for_its_engines_first_ready() -> None:
    """Under serve (engines_restart) a request that reaches a restarted gateway before its
    engines' READY waits for them; elsewhere (a gateway of its own) it is refused at once."""
    waits = client_with({}, resume_timeout_s=WAIT_S, engines_restart=True)
    assert waits.restart_expected
    waiting = asyncio.ensure_future(waits.wait_until_routable(WAIT_S))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    waits.engines[0] = handle(0)  # READY
    await asyncio.wait_for(waiting, WAIT_S)
    alone = client_with({}, resume_timeout_s=WAIT_S)
    assert not alone.restart_expected
    with pytest.raises(ApiError) as error:
        await asyncio.wait_for(alone.wait_until_routable(WAIT_S), 1.0)
    assert error.value.message == "no engine core is ready"


async def test_the_wait_for_a_restart_is_bounded_and_says_so() -> None:
    client = client_with({0: handle(0, state=EngineState.DEAD)}, resume_timeout_s=WAIT_S)
    with pytest.raises(ApiError) as error:
        await client.wait_until_routable(0.2)  # the call's deadline is the shorter bound
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no engine core is ready" in error.value.message
    assert "waited 0.2s for an engine to restart" in error.value.message


async def test_no_wait_without_resume_or_for_a_stalled_engine() -> None:
    off = client_with({0: handle(0, state=EngineState.DEAD)}, resume_timeout_s=0.0)
    assert not off.restart_expected
    with pytest.raises(ApiError) as error:
        await asyncio.wait_for(off.wait_until_routable(WAIT_S), 1.0)
    assert "waited" not in error.value.message
    stats = SchedulerStats(stalled_worker_rank=0, stalled_worker_pid=4321, stalled_for_s=9.0)
    stalled = client_with({0: handle(0, scheduler_stats=stats)}, resume_timeout_s=WAIT_S)
    assert not stalled.restart_expected  # alive but stalled: it may never answer
    with pytest.raises(ApiError) as error:
        await asyncio.wait_for(stalled.wait_until_routable(WAIT_S), 1.0)
    assert "worker rank 0 (pid 4321) has not answered a step" in error.value.message


async def test_an_add_that_cannot_be_sent_fails_over_like_a_cut_off_stream(tmp_path) -> None:
    """The chosen engine's connection is gone (its process died a moment ago): the send fails,
    the engine is marked dead, and the request waits to be resumed, or with resume off ends
    UNAVAILABLE saying it delivered nothing; add_request itself never raises for it."""
    for resume_timeout_s in (WAIT_S, 0.0):
        client = EngineClient(
            f"ipc://{tmp_path}/in-{resume_timeout_s}",
            f"ipc://{tmp_path}/out-{resume_timeout_s}",
            resume_timeout_s=resume_timeout_s,
        )
        await client.start()
        try:
            client.engines[0] = handle(0)  # READY once, no longer connected
            request = EngineCoreRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
            channel = client.add_request(request)
            assert not client.engines[0].alive
            if resume_timeout_s:
                assert client.is_live("r1") and client.restart_expected  # waits to resume
                client.abort(["r1"])
            else:
                event = await asyncio.wait_for(channel.get(), WAIT_S)
                assert isinstance(event, RequestFailed)
                assert event.error.code == grpc.StatusCode.UNAVAILABLE
                assert "0 tokens were delivered" in event.error.message
        finally:
            await client.close()

"""The engine core's async scheduling (the default) against one step at a time, on the tiny
model with a real worker: the same greedy tokens for a batch whose requests end at different
steps, and a stop token ends its request with nothing after it."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from test_core_frames import PROMPT, EngineUnderTest, greedy
from test_scheduler import make_request, make_scheduler, prompt

from switchboard.config import SchedulerConfig
from switchboard.engine.core import EngineCore
from switchboard.wire.engine_msgs import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    RequestType,
    SamplingParams,
)
from tests.tiny_checkpoint import tiny_llama_dir

MAX_TOKENS = [3, 9, 17, 30]  # each request ends at another step


def run_batch(engine: EngineUnderTest, requests: list[EngineCoreRequest]) -> dict[str, list]:
    for request in requests:
        engine.send(RequestType.ADD, request)
    outputs: dict[str, list[EngineCoreOutput]] = {r.request_id: [] for r in requests}
    while any(not o or o[-1].finish_reason is None for o in outputs.values()):
        received = engine.recv()
        assert received is not None, "engine died"
        for output in received.outputs:
            outputs[output.request_id].append(output)
    return outputs


def tokens(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, EngineUnderTest]]:
    model_dir = tiny_llama_dir()
    started = {}
    try:
        for name, ahead in (("ahead", True), ("in-turn", False)):
            started[name] = EngineUnderTest(
                model_dir,
                scheduler=SchedulerConfig(
                    max_num_seqs=8, max_num_batched_tokens=512, async_scheduling=ahead
                ),
            )
        yield started
    finally:
        for engine in started.values():
            engine.close()


def test_scheduling_ahead_gives_the_tokens_of_one_step_at_a_time(engines) -> None:
    results = {}
    for name, engine in engines.items():
        batch = [greedy(f"{name}-{n}", max_tokens=n) for n in MAX_TOKENS]
        outputs = run_batch(engine, batch)
        results[name] = [tokens(outputs[r.request_id]) for r in batch]
        for request, n in zip(batch, MAX_TOKENS, strict=True):
            assert outputs[request.request_id][-1].finish_reason == FinishReason.LENGTH
            assert len(tokens(outputs[request.request_id])) == n
    assert results["ahead"] == results["in-turn"]
    assert "Traceback" not in engines["ahead"].log()


def test_a_stop_token_ends_the_request_at_once_when_scheduled_ahead(engines) -> None:
    engine = engines["ahead"]
    reference = tokens(run_batch(engine, [greedy("reference", max_tokens=12)])["reference"])
    stop_at = next((i for i in range(3, 12) if reference[i] not in reference[:i]), None)
    assert stop_at is not None, f"no token of {reference} is new after the third"
    stopped = EngineCoreRequest(
        "stopped",
        PROMPT,
        sampling_params=SamplingParams(
            temperature=0.0, max_tokens=12, stop_token_ids=[reference[stop_at]]
        ),
    )
    outputs = run_batch(engine, [stopped, greedy("beside", max_tokens=12)])
    assert tokens(outputs["stopped"]) == reference[: stop_at + 1]  # nothing after the stop
    assert outputs["stopped"][-1].finish_reason == FinishReason.STOP
    assert tokens(outputs["beside"]) == reference  # its neighbour is undisturbed
    stats = engine.call_utility(900, "get_stats").result
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_no_step_is_scheduled_ahead_while_requests_wait_for_one() -> None:
    """The engine's decision, on a real scheduler: ahead while every request runs; not while
    an arrival waits that the next step could take (it joins that step, not the one after);
    ahead again while the waiting ones wait for a sequence slot."""
    sched = make_scheduler(max_num_seqs=1)
    engine = SimpleNamespace(
        config=SimpleNamespace(scheduler=SchedulerConfig(async_scheduling=True)), scheduler=sched
    )
    sched.add_request(make_request("a", prompt(5), 8))
    assert not EngineCore._may_schedule_ahead(engine)  # type: ignore[arg-type]
    sched.schedule()
    assert EngineCore._may_schedule_ahead(engine)  # type: ignore[arg-type]
    sched.add_request(make_request("b", prompt(5), 8))
    assert EngineCore._may_schedule_ahead(engine)  # type: ignore[arg-type]  # no free slot


def test_a_request_arriving_while_the_step_ahead_is_held_back_joins_the_next_step() -> None:
    """The step ahead waits for most of the running step (engine/ahead_hold.py): a request that
    arrives meanwhile is taken in, and the step after the running one is scheduled when that
    one ends, with it, not ahead without it; with no arrival the step ahead is scheduled."""
    sched = make_scheduler(max_num_seqs=4)
    sched.add_request(make_request("a", prompt(5), 8))
    sched.schedule()
    inputs: queue.Queue = queue.Queue()
    engine = SimpleNamespace(
        config=SimpleNamespace(scheduler=SchedulerConfig(async_scheduling=True)),
        scheduler=sched,
        executor=SimpleNamespace(step_done=lambda timeout_ms: time.sleep(timeout_ms / 1e3)),
        input_queue=inputs,
        _handle_input=lambda kind, request: sched.add_request(request),
        _deferred=[],
        _step_period=0.05,
    )
    engine._may_schedule_ahead = lambda: EngineCore._may_schedule_ahead(engine)  # type: ignore[arg-type]
    running = SimpleNamespace(submitted=object())
    hold = EngineCore._hold_ahead
    assert hold(engine, running, time.perf_counter())  # type: ignore[arg-type]  # nobody came
    inputs.put((RequestType.ADD, make_request("b", prompt(5), 8)))
    assert not hold(engine, running, time.perf_counter())  # type: ignore[arg-type]
    assert sched.has_admissible_waiting() and inputs.empty()

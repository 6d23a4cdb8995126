"""Pooling (embedding) requests in the scheduler: prefill only, finished with their vector."""

from __future__ import annotations

import itertools

from switchboard.config import CacheConfig, SchedulerConfig
from switchboard.engine.request import Request
from switchboard.engine.scheduler import Scheduler
from switchboard.wire.engine_msgs import (
    EngineCoreRequest,
    FinishReason,
    PoolingParams,
    PoolingType,
    SamplingParams,
)
from switchboard.wire.step_msgs import ModelRunnerOutput, SchedulerOutput

BS = 4
_arrival = itertools.count(1)
POOLING = PoolingParams(PoolingType.MEAN, normalize=True, dimensions=3)


def make_scheduler(max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
        CacheConfig(block_size=BS, enable_prefix_caching=True),
        num_blocks=64,
        max_model_len=128,
    )


def make_request(rid: str, prompt: list[int], pooling: PoolingParams | None = POOLING) -> Request:
    sampling = None if pooling is not None else SamplingParams(max_tokens=4)
    engine_request = EngineCoreRequest(
        rid, prompt, sampling_params=sampling, pooling_params=pooling, client_index=0
    )
    return Request.from_engine_core_request(engine_request, BS, next(_arrival))


def run_step(
    scheduler: Scheduler, vectors: dict[str, list[float]] | None = None
) -> tuple[SchedulerOutput, dict]:
    """One step with a worker that pools whatever completes and samples token 7 otherwise."""
    step = scheduler.schedule()
    ids = [rid for rid, n in step.num_scheduled_tokens.items() if n > 0]
    pooling = {r.request_id for r in step.new_requests if r.pooling_params is not None}
    output = ModelRunnerOutput(
        step.step_id,
        request_ids=ids,
        sampled_token_ids=[[] if rid in pooling or rid.startswith("p") else [7] for rid in ids],
        pooled_outputs=vectors or {},
    )
    return step, scheduler.update_from_output(step, output)


def test_a_pooling_request_finishes_after_its_prompt_with_its_vector() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("p", list(range(10, 20))))
    step, outputs = run_step(scheduler, {"p": [0.6, 0.8, 0.0]})
    assert step.new_requests[0].pooling_params == POOLING  # the worker learns what to pool
    (output,) = outputs[0]
    assert output.finish_reason == FinishReason.STOP
    assert output.pooled_output == [0.6, 0.8, 0.0]
    assert output.new_token_ids == []
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == 64
    assert scheduler.schedule().finished_request_ids == ["p"]  # the worker drops its state


def test_a_chunked_pooling_prompt_finishes_on_its_last_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("p", list(range(10, 30))))  # 20 tokens: 8 + 8 + 4
    for _ in range(2):
        _, outputs = run_step(scheduler)
        assert outputs == {}
    step, outputs = run_step(scheduler, {"p": [1.0]})
    assert step.num_scheduled_tokens == {"p": 4}
    assert outputs[0][0].pooled_output == [1.0]


def test_pooling_requests_never_take_prefix_cache_hits() -> None:
    scheduler = make_scheduler()
    prompt = list(range(10, 30))
    scheduler.add_request(make_request("g", prompt, pooling=None))
    run_step(scheduler)  # the generation request's prompt blocks are cached now
    scheduler.add_request(make_request("p", prompt))
    step, _ = run_step(scheduler, {"p": [1.0]})
    (new,) = step.new_requests
    assert new.num_computed_tokens == 0
    assert step.num_scheduled_tokens["p"] == len(prompt)


def test_a_missing_vector_ends_the_request_with_error() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("p", [1, 2, 3]))
    _, outputs = run_step(scheduler, {})
    assert outputs[0][0].finish_reason == FinishReason.ERROR
    assert not scheduler.has_unfinished_requests()


def test_an_aborted_pooling_request_produces_nothing() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("p", list(range(12))))
    run_step(scheduler)
    scheduler.finish_requests("p", FinishReason.ABORT)
    _, outputs = run_step(scheduler, {"p": [1.0]})
    assert outputs == {}

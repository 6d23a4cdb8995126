"""Worker sleep levels: 1 frees the KV cache, 2 drops the weights too; wake_up restores both."""

from __future__ import annotations

import pytest

from switchboard.config import EngineConfig, ModelConfig, WorkerConfig
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.step_msgs import NewRequest, SchedulerOutput
from switchboard.worker.worker import Worker
from tests.tiny_checkpoint import tiny_llama_dir

PROMPT = [0, 5, 9, 33, 100, 7, 8]


def prefill(step_id: int, request_id: str) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step_id,
        new_requests=[NewRequest(request_id, PROMPT, SamplingParams(temperature=0.0), [3, 7], 0)],
        num_scheduled_tokens={request_id: len(PROMPT)},
        total_num_scheduled_tokens=len(PROMPT),
    )


@pytest.fixture()
def worker() -> Worker:
    config = EngineConfig(
        model=ModelConfig(model=tiny_llama_dir()), worker=WorkerConfig(device="cpu")
    )
    worker = Worker(config, rank=0)
    worker.load_model()
    worker.initialize_kv_cache(8, 4)
    return worker


def test_level_1_frees_the_kv_cache_and_keeps_the_weights(worker: Worker) -> None:
    before = worker.execute_model(prefill(1, "a")).sampled_token_ids
    model = worker.runner.model
    worker.sleep(1)
    assert worker.runner.kv_caches == [] and len(worker.runner.requests) == 0
    assert worker.runner.model is model
    worker.wake_up()
    assert len(worker.runner.kv_caches) == 2  # one per layer of the tiny model
    assert worker.runner.kv_caches[0].shape[1:3] == (8, 4)  # (K|V, blocks, block size, ...)
    assert worker.execute_model(prefill(2, "a")).sampled_token_ids == before


def test_level_2_drops_the_weights_and_wake_up_reloads_them(worker: Worker) -> None:
    before = worker.execute_model(prefill(1, "a")).sampled_token_ids
    worker.sleep(2)
    assert worker.runner.model is None and worker.runner.kv_caches == []
    assert worker.sleep_level == 2
    with pytest.raises(RuntimeError):
        worker.execute_model(prefill(2, "b"))
    worker.wake_up()
    assert worker.runner.model is not None and worker.sleep_level == 0
    assert worker.execute_model(prefill(3, "c")).sampled_token_ids == before


def test_unknown_sleep_level_is_refused(worker: Worker) -> None:
    with pytest.raises(ValueError, match="1 or 2"):
        worker.sleep(3)
    assert worker.runner.model is not None and worker.runner.kv_caches

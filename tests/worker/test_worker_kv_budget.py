"""How many KV blocks a worker offers: the configured budget, the CPU default, or a share of the
device memory left free after loading (the engine sizes its KV cache from this number). The
CUDA path runs here with ``torch.cuda.mem_get_info`` stubbed: the arithmetic is the worker's,
only the number is fake."""

from __future__ import annotations

import pytest
import torch

from switchboard.config import CacheConfig, EngineConfig, ModelConfig, WorkerConfig
from switchboard.worker import worker as worker_module
from switchboard.worker.worker import CPU_KV_CACHE_DEFAULT_BYTES, Worker
from tests.tiny_checkpoint import tiny_llama_dir

BLOCK_SIZE = 16


def loaded_worker(gpu_memory_utilization: float = 0.9) -> Worker:
    config = EngineConfig(
        model=ModelConfig(model=tiny_llama_dir()),
        cache=CacheConfig(gpu_memory_utilization=gpu_memory_utilization),
        worker=WorkerConfig(device="cpu"),
    )
    worker = Worker(config, rank=0)
    worker.load_model()
    return worker


def bytes_per_block(worker: Worker) -> int:
    return BLOCK_SIZE * worker.runner.kv_cache_bytes_per_token()


def test_a_configured_budget_wins() -> None:
    worker = loaded_worker()
    budget = 3 << 20
    assert worker.determine_num_kv_blocks(BLOCK_SIZE, budget) == budget // bytes_per_block(worker)


def test_cpu_without_a_budget_takes_the_default() -> None:
    worker = loaded_worker()
    expected = CPU_KV_CACHE_DEFAULT_BYTES // bytes_per_block(worker)
    assert worker.determine_num_kv_blocks(BLOCK_SIZE, None) == expected


def test_cuda_takes_the_configured_share_of_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = loaded_worker(gpu_memory_utilization=0.5)
    free_bytes = 10 << 30
    asked: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return free_bytes, 80 << 30

    monkeypatch.setattr(worker_module.torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(worker, "device", torch.device("cuda", 0))
    num_blocks = worker.determine_num_kv_blocks(BLOCK_SIZE, None)
    assert num_blocks == (free_bytes // 2) // bytes_per_block(worker)
    assert asked == [torch.device("cuda", 0)]
    # A configured budget is used as is, even on a device.
    assert worker.determine_num_kv_blocks(BLOCK_SIZE, 1 << 20) == (1 << 20) // bytes_per_block(
        worker
    )
    assert len(asked) == 1

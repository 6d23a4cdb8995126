"""A target for ``parallel_ranks.run_on_ranks``: a LoRA model runner on this rank's share of the
model, driving requests of the base model and of several adapters in the same steps."""

from __future__ import annotations

from typing import Any

from tests.parallel_ranks import BLOCK_SIZE, NUM_BLOCKS, PlannedRequest, drive_runner


def generate_with_adapters(
    parallel,
    models: list[tuple[str, dict[str, str]]],  # (checkpoint, its adapters: name -> directory)
    requests: list[PlannedRequest],
) -> list[dict[str, Any]]:
    import torch

    from switchboard.config import ModelConfig
    from switchboard.config.lora import LoraConfig
    from switchboard.worker.model_runner import ModelRunner

    results = []
    for model_dir, adapters in models:
        lora = LoraConfig(enable_lora=True, max_loras=len(adapters), max_lora_rank=16)
        config = ModelConfig(model=model_dir, lora=lora)
        runner = ModelRunner(config, torch.device("cpu"), parallel)
        runner.load_model()
        runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
        assert runner.lora is not None
        for name, path in adapters.items():
            runner.lora.manager.add(name, path)
        results.append(drive_runner(runner, requests))
    return results

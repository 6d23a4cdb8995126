"""For the LoRA tests at the model (a Llama and a GPT-2 checkpoint): a manager over a checkpoint,
a copy of an adapter with its config edited, the check that a projection adds exactly an
adapter's delta to the rows that run it, and what the tensor-parallel checks start from."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from switchboard.config import ModelConfig
from switchboard.models.lora.manager import LoraLimits, LoraManager
from switchboard.models.lora.stacks import LoraBatch
from switchboard.models.parallel import ParallelState
from switchboard.worker.model_loading import load_runner_model

CPU = torch.device("cpu")


def lora_manager(model_dir: str, quantization: str = "none", max_rank: int = 16) -> LoraManager:
    """A manager of two slots, ranks up to ``max_rank``, over the model of ``model_dir``."""
    model, config, _, _ = load_runner_model(
        ModelConfig(model=model_dir, quantization=quantization), CPU
    )
    return LoraManager(model, config, LoraLimits(2, max_rank, 2), ParallelState())


def adapter_config(adapter_dir: str) -> dict[str, object]:
    with open(os.path.join(adapter_dir, "adapter_config.json")) as file:
        config: dict[str, object] = json.load(file)
    return config


def edited_copy(adapter_dir: str, tmp_path: Path, **config_changes: object) -> str:
    """A copy of the adapter under ``tmp_path`` with ``config_changes`` in its config."""
    copy = str(tmp_path / "adapter")
    shutil.copytree(adapter_dir, copy)
    config = {**adapter_config(copy), **config_changes}
    with open(os.path.join(copy, "adapter_config.json"), "w") as file:
        json.dump(config, file)
    return copy


def assert_adapter_delta(
    manager: LoraManager,
    projection: Callable[[torch.Tensor], torch.Tensor],
    in_features: int,
    modules: list[str],
) -> None:
    """Of three random rows through ``projection``, the middle one runs adapter ``a`` (in layer
    1): it gets exactly the delta of the PEFT ``modules`` (its output's parts, in order), and
    the base rows are untouched."""
    adapter = manager.cpu["a"]
    x = torch.randn(3, in_features)
    manager.prepare([], CPU)
    base = projection(x)
    manager.prepare([("", 1), ("a", 1), ("", 1)], CPU)  # row 1 runs the adapter
    adapted = projection(x)
    expected = torch.cat(
        [x[1] @ a.T @ b.T * adapter.scaling for a, b in (adapter.layers[1][m] for m in modules)]
    )
    torch.testing.assert_close(adapted[1] - base[1], expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(adapted[0], base[0]) and torch.equal(adapted[2], base[2])


def layer_zero_of(
    base_dir: str, adapter_dir: str
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float, LoraBatch]:
    """Seeded: the adapter's layer-0 matrices (PEFT module -> (A, B)) as a manager loads them,
    its scaling, and a batch of three rows whose middle one runs slot 1."""
    torch.manual_seed(0)
    manager = lora_manager(base_dir)
    manager.add("a", adapter_dir)
    adapter = manager.cpu["a"]
    return adapter.layers[0], adapter.scaling, LoraBatch(torch.tensor([-1, 1, -1]), CPU)

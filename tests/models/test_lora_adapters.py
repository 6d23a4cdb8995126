"""LoRA adapters at the model: refusals at load, the delta on every base path, TP shards.

* An adapter the server cannot serve is refused when it is read, with a message naming the
  problem: rank above the maximum, DoRA, a target module the model lacks, a shape that does not
  match the base model, a corrupt weights file.
* Where a step has adapter rows, a projection's base path still runs however it runs (here:
  int8 quantized panels for a decode-sized batch) and exactly the adapter's delta is added to
  its rows; base rows are untouched.
* Tensor parallelism: each rank's slice of the delta, put together, is the whole delta.
"""

from __future__ import annotations

import os

import pytest
import torch

from switchboard.kernels.quant_gemm import QuantPanels
from switchboard.models.lora.adapter import AdapterError
from switchboard.models.lora.stacks import column_stack, row_stack
from switchboard.models.parallel import ParallelState
from switchboard.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from tests.models.lora_model_checks import (
    assert_adapter_delta,
    edited_copy,
    layer_zero_of,
    lora_manager,
)
from tests.tiny_checkpoint import tiny_llama_dir
from tests.tiny_lora import tiny_lora_dir


@pytest.fixture(scope="module")
def base_dir() -> str:
    return tiny_llama_dir()


@pytest.fixture(scope="module")
def adapter_dir(base_dir) -> str:
    return tiny_lora_dir(base_dir, rank=8, alpha=16.0, seed=5)


def test_refusals_name_the_problem(base_dir, adapter_dir, tmp_path):
    manager = lora_manager(base_dir, max_rank=4)
    with pytest.raises(AdapterError, match="rank 8 is above --max-lora-rank 4"):
        manager.add("a", adapter_dir)
    manager = lora_manager(base_dir)
    cases = {
        "use_dora is true": dict(use_dora=True),
        "target module 'lm_head': the model has no such layer": dict(
            target_modules=["q_proj", "lm_head"]
        ),
        "only bias 'none'": dict(bias="all"),
    }
    for i, (message, changes) in enumerate(cases.items()):
        with pytest.raises(AdapterError, match=message):
            manager.add(f"bad{i}", edited_copy(adapter_dir, tmp_path / str(i), **changes))
    # an adapter of rank 8 whose config says 4: every matrix has the wrong shape
    with pytest.raises(AdapterError, match=r"layer 0 \w+_proj: shape mismatch with the base model"):
        manager.add("wrong-rank", edited_copy(adapter_dir, tmp_path / "r", r=4))
    corrupt = edited_copy(adapter_dir, tmp_path / "c")
    with open(os.path.join(corrupt, "adapter_model.safetensors"), "r+b") as file:
        file.truncate(100)
    with pytest.raises(AdapterError, match="adapter_model.safetensors is corrupt or unreadable"):
        manager.add("corrupt", corrupt)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        manager.add("empty", str(tmp_path))
    assert manager.names() == []  # nothing refused was registered


def test_an_adapter_for_another_base_model_is_refused(adapter_dir):
    other = lora_manager(tiny_llama_dir(hidden_size=32, intermediate_size=64))
    with pytest.raises(AdapterError, match="shape mismatch with the base model"):
        other.add("a", adapter_dir)


def test_the_quantized_base_path_runs_and_the_delta_is_added(base_dir, adapter_dir):
    manager = lora_manager(base_dir, quantization="int8")
    manager.add("a", adapter_dir)
    layer = manager.model.model.layers[1]
    cases = [  # (projection, its input size, the PEFT modules of its output parts)
        (layer.self_attn.qkv_proj, 64, ["q_proj", "k_proj", "v_proj"]),
        (layer.mlp.down_proj, 128, ["down_proj"]),
    ]
    assert all(isinstance(p.small_batch, QuantPanels) for p, _, _ in cases)
    for projection, in_features, modules in cases:
        assert_adapter_delta(manager, projection, in_features, modules)


def test_tensor_parallel_shards_put_together_give_the_whole_delta(base_dir, adapter_dir):
    pairs, scaling, batch = layer_zero_of(base_dir, adapter_dir)

    def delta(stack, x: torch.Tensor) -> torch.Tensor:
        output = torch.zeros(x.shape[0], stack.b.shape[-1])
        stack.add_delta(x, output, batch)
        return output

    x = torch.randn(3, 64)
    whole_qkv = ColumnParallelLinear(64, _qkv_shards(ParallelState()), bias=False)
    expected = column_stack(whole_qkv, 2, 16, ParallelState())
    expected.load(1, pairs, scaling)
    whole = delta(expected, x).split([64, 32, 32], dim=-1)
    parts = []
    for rank in range(2):
        parallel = ParallelState(tp_rank=rank, tp_size=2)
        stack = column_stack(
            ColumnParallelLinear(64, _qkv_shards(parallel), bias=False), 2, 16, parallel
        )
        stack.load(1, pairs, scaling)
        parts.append(delta(stack, x).split([32, 16, 16], dim=-1))
    for index, module in enumerate(["q_proj", "k_proj", "v_proj"]):  # each rank's rows of each
        torch.testing.assert_close(torch.cat([p[index] for p in parts], -1), whole[index])
        a, b = pairs[module]
        torch.testing.assert_close(whole[index][1], x[1] @ a.T @ b.T * scaling)
    assert torch.count_nonzero(whole[0][0]) == 0 and torch.count_nonzero(whole[0][2]) == 0
    # row-parallel (o_proj): the ranks' partial shrinks sum to the whole shrink (the all-reduce)
    attended = torch.randn(3, 64)
    shrink, expand = 0.0, None
    for rank in range(2):
        parallel = ParallelState(tp_rank=rank, tp_size=2)
        o_proj = RowParallelLinear(parallel.split(64, "o"), 64, bias=False, parallel=parallel)
        stack = row_stack(o_proj, "o_proj", 2, 16, parallel)
        stack.load(1, pairs, scaling)
        shrink = shrink + attended[1, rank * 32 : rank * 32 + 32] @ stack.a[1].T
        expand = stack.b[1]
    a, b = pairs["o_proj"]
    torch.testing.assert_close(shrink @ expand, attended[1] @ a.T @ b.T * scaling)


def _qkv_shards(parallel: ParallelState) -> dict:
    heads = parallel.split(4, "heads").scaled(16)
    kv_heads = parallel.kv_head_shard(2).scaled(16)
    return {"q": heads, "k": kv_heads, "v": kv_heads}

"""LoRA adapters on GPT-2 at the model: PEFT's Conv1D modules (``c_attn``, ``attn.c_proj``,
``mlp.c_fc``, ``mlp.c_proj``) map onto GPT-2's projections, ``c_attn`` as one module over the
fused q/k/v; an adapter of another family is refused by name; under tensor parallelism each
rank's slice of the fused ``c_attn`` delta, put together, is the whole delta."""

from __future__ import annotations

import pytest
import torch

from switchboard.models.lora.adapter import AdapterError
from switchboard.models.lora.stacks import fused_stack
from switchboard.models.parallel import ParallelState
from switchboard.models.parallel_layers import ColumnParallelLinear
from tests.models.lora_model_checks import (
    adapter_config,
    assert_adapter_delta,
    edited_copy,
    layer_zero_of,
    lora_manager,
)
from tests.tiny_checkpoint import tiny_checkpoint_dir, tiny_llama_dir
from tests.tiny_lora import tiny_lora_dir

HIDDEN = 64  # the tiny GPT-2's


@pytest.fixture(scope="module")
def base_dir() -> str:
    return tiny_checkpoint_dir("gpt2")


@pytest.fixture(scope="module")
def adapter_dir(base_dir) -> str:
    return tiny_lora_dir(base_dir, rank=8, alpha=16.0, targets=["c_attn", "c_proj", "c_fc"], seed=7)


def test_every_module_maps_onto_its_projection(base_dir, adapter_dir):
    manager = lora_manager(base_dir)
    described = manager.add("a", adapter_dir)
    assert described["target_modules"] == ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    block = manager.model.transformer.h[1]
    cases = [  # (projection, its input size, the PEFT module of its whole output)
        (block.attn.c_attn, HIDDEN, "attn.c_attn"),
        (block.attn.c_proj, HIDDEN, "attn.c_proj"),
        (block.mlp.c_fc, HIDDEN, "mlp.c_fc"),
        (block.mlp.c_proj, 4 * HIDDEN, "mlp.c_proj"),
    ]
    for projection, in_features, module in cases:
        assert_adapter_delta(manager, projection, in_features, [module])
    manager.finish()


def test_an_adapter_of_another_family_is_refused(base_dir):
    manager = lora_manager(base_dir)
    llama_adapter = tiny_lora_dir(tiny_llama_dir(), rank=8, alpha=16.0, seed=5)
    refused = r"target module '\w+_proj': the model has no such layer"
    with pytest.raises(AdapterError, match=refused):
        manager.add("llama", llama_adapter)
    assert manager.names() == []


def test_tensor_parallel_slices_of_the_fused_c_attn_give_the_whole_delta(adapter_dir, base_dir):
    pairs, scaling, batch = layer_zero_of(base_dir, adapter_dir)

    def delta(parallel: ParallelState) -> list[torch.Tensor]:
        rows = parallel.split(4, "heads").scaled(HIDDEN // 4)
        c_attn = ColumnParallelLinear(HIDDEN, {"q": rows, "k": rows, "v": rows}, bias=False)
        stack = fused_stack(c_attn, "attn.c_attn", 2, 16, parallel)
        stack.load(1, pairs, scaling)
        output = torch.zeros(3, 3 * rows.size)
        stack.add_delta(x, output, batch)
        return list(output.split(rows.size, dim=-1))

    x = torch.randn(3, HIDDEN)
    whole = delta(ParallelState())
    a, b = pairs["attn.c_attn"]
    torch.testing.assert_close(torch.cat(whole, -1)[1], x[1] @ a.T @ b.T * scaling)
    assert torch.count_nonzero(whole[0][0]) == 0 and torch.count_nonzero(whole[0][2]) == 0
    ranks = [delta(ParallelState(tp_rank=rank, tp_size=2)) for rank in range(2)]
    for index in range(3):  # q, k, v: each rank's columns of each, in rank order
        torch.testing.assert_close(torch.cat([r[index] for r in ranks], -1), whole[index])


def test_fan_in_fan_out_is_served_either_way_as_peft_does(base_dir, adapter_dir, tmp_path):
    """peft writes ``fan_in_fan_out: true`` for GPT-2's Conv1D and, loading an adapter that says
    false, sets it true itself (a warning): its matrices are ``[r, in]`` / ``[out, r]`` either
    way, so both load to the same matrices."""
    manager = lora_manager(base_dir)
    manager.add("as-written", adapter_dir)
    assert adapter_config(adapter_dir)["fan_in_fan_out"] is True
    manager.add("flag-false", edited_copy(adapter_dir, tmp_path, fan_in_fan_out=False))
    written, flipped = manager.cpu["as-written"].layers, manager.cpu["flag-false"].layers
    for layer, pairs in written.items():
        for module, (a, b) in pairs.items():
            assert torch.equal(flipped[layer][module][0], a)
            assert torch.equal(flipped[layer][module][1], b)

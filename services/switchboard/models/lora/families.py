"""The decoder families that take LoRA adapters: which projections PEFT adapts, how it names
their tensors, and the stacks that add the deltas on this model's projections.

* Llama, Mistral, Qwen2: ``q_proj``, ``k_proj``, ``v_proj`` (parts of the fused ``qkv_proj``),
  ``o_proj``, ``gate_proj``, ``up_proj`` (parts of ``gate_up_proj``), ``down_proj``.
* GPT-2: ``attn.c_attn`` (one module over the fused q/k/v: one ``A``, one ``B`` of ``3 *
  hidden`` rows), ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``. The base checkpoint stores
  these as ``Conv1D`` (``[in, out]``; PEFT's ``fan_in_fan_out``), but PEFT's ``lora_A`` /
  ``lora_B`` are stored as for a linear layer, ``[r, in]`` / ``[out, r]``, whatever the
  adapter's ``fan_in_fan_out`` says (PEFT corrects that flag for ``Conv1D`` itself), so the
  flag changes nothing here.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from switchboard.models.gpt2 import GPT2LMHeadModel
from switchboard.models.hf_config import TransformerConfig
from switchboard.models.lora.adapter import AdapterError, AdapterLayout, ProjectionShape
from switchboard.models.lora.stacks import (
    ActiveBatch,
    LoraStack,
    attach,
    column_stack,
    fused_stack,
    row_stack,
)
from switchboard.models.parallel import ParallelState

_LLAMA_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight$"
)
_GPT2_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?transformer\.h\.(\d+)\.((?:attn|mlp)\.\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight$"
)


def llama_layout(config: TransformerConfig) -> AdapterLayout:
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    hidden, intermediate = config.hidden_size, config.intermediate_size
    projections = {
        "q_proj": ProjectionShape(hidden, q_size),
        "k_proj": ProjectionShape(hidden, kv_size),
        "v_proj": ProjectionShape(hidden, kv_size),
        "o_proj": ProjectionShape(q_size, hidden),
        "gate_proj": ProjectionShape(hidden, intermediate),
        "up_proj": ProjectionShape(hidden, intermediate),
        "down_proj": ProjectionShape(intermediate, hidden),
    }
    return AdapterLayout(projections, _LLAMA_TENSOR)


def gpt2_layout(config: TransformerConfig) -> AdapterLayout:
    hidden, intermediate = config.hidden_size, config.intermediate_size
    projections = {
        "attn.c_attn": ProjectionShape(hidden, 3 * hidden),
        "attn.c_proj": ProjectionShape(hidden, hidden),
        "mlp.c_fc": ProjectionShape(hidden, intermediate),
        "mlp.c_proj": ProjectionShape(intermediate, hidden),
    }
    return AdapterLayout(projections, _GPT2_TENSOR)


def adapter_layout(model: nn.Module, config: TransformerConfig) -> AdapterLayout:
    return gpt2_layout(config) if isinstance(model, GPT2LMHeadModel) else llama_layout(config)


def attach_stacks(
    model: nn.Module, slots: int, rank: int, parallel: ParallelState, active: ActiveBatch
) -> dict[int, list[LoraStack]]:
    """A stack on each projection of this stage's decoder layers, by layer index."""
    if isinstance(model, GPT2LMHeadModel):
        return _attach(model.transformer.h, _gpt2_stacks, slots, rank, parallel, active)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise AdapterError(f"LoRA adapters are not supported for {type(model).__name__}")
    return _attach(layers, _llama_stacks, slots, rank, parallel, active)


_LayerStacks = Callable[
    [nn.Module, int, int, ParallelState], list[tuple[nn.Module, LoraStack]] | None
]


def _attach(
    layers: nn.ModuleList,
    stacks_of: _LayerStacks,
    slots: int,
    rank: int,
    parallel: ParallelState,
    active: ActiveBatch,
) -> dict[int, list[LoraStack]]:
    stacks: dict[int, list[LoraStack]] = {}
    for index, layer in enumerate(layers):
        projections = stacks_of(layer, slots, rank, parallel)
        if projections is None:
            continue  # another pipeline stage's layer
        for projection, stack in projections:
            attach(projection, stack, active)
        stacks[index] = [stack for _, stack in projections]
    return stacks


def _llama_stacks(
    layer: nn.Module, slots: int, rank: int, parallel: ParallelState
) -> list[tuple[nn.Module, LoraStack]] | None:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attention is None or mlp is None:
        return None
    return [
        (attention.qkv_proj, column_stack(attention.qkv_proj, slots, rank, parallel)),
        (attention.o_proj, row_stack(attention.o_proj, "o_proj", slots, rank, parallel)),
        (mlp.gate_up_proj, column_stack(mlp.gate_up_proj, slots, rank, parallel)),
        (mlp.down_proj, row_stack(mlp.down_proj, "down_proj", slots, rank, parallel)),
    ]


def _gpt2_stacks(
    layer: nn.Module, slots: int, rank: int, parallel: ParallelState
) -> list[tuple[nn.Module, LoraStack]] | None:
    attention, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
    if attention is None or mlp is None:
        return None
    return [
        (attention.c_attn, fused_stack(attention.c_attn, "attn.c_attn", slots, rank, parallel)),
        (attention.c_proj, row_stack(attention.c_proj, "attn.c_proj", slots, rank, parallel)),
        (mlp.c_fc, column_stack(mlp.c_fc, slots, rank, parallel, {"fc": "mlp.c_fc"})),
        (mlp.c_proj, row_stack(mlp.c_proj, "mlp.c_proj", slots, rank, parallel)),
    ]

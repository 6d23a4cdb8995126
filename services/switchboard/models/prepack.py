"""Lay a loaded model's matmul weights out for oneDNN once, before serving (CPU, float32).

Every linear layer's weight is replaced by its ``gemm.pack``-ed copy, so no dense copy stays
behind; the LM head's matrix is packed in place too when it is its own, and packed beside the
dense one when it is tied to the token embedding (the embedding lookup needs the dense rows).
Packing runs after the checkpoint is loaded: a packed weight cannot be loaded into, sliced or
read back, and every step after it multiplies through oneDNN (``kernels/gemm.py``). Each layer
with a packed weight also gets the small-batch kernel's panels of it (its ``small_batch``) when
that kernel is in use (``kernels/small_batch_gemm.py``: decode-sized products), unless it
already has quantized panels (``quantized.py``), which serve those products instead.

A model in bfloat16 keeps its weights for torch's bfloat16 matmul (oneDNN, on AMX tiles where the
CPU has them: prefill) and gets the bfloat16 kernel's panels beside them (``bf16_gemm.py``:
decode-sized products, half the bytes of float32).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from switchboard.kernels import bf16_gemm, gemm, small_batch_gemm
from switchboard.models.gpt2 import GPT2LMHeadModel
from switchboard.models.layers import Linear
from switchboard.models.llama import LlamaForCausalLM
from switchboard.models.parallel_layers import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)

_PACKED_IN_PLACE = (Linear, RowParallelLinear, ParallelLMHead)


def prepack_weights(model: nn.Module) -> tuple[int, float]:
    """Pack ``model``'s matmul weights where oneDNN can take them. Returns (matrices packed,
    seconds taken); (0, 0.0) when oneDNN is off or the weights are not float32 on CPU.
    Packing loads the small-batch kernel (built on first use). A bfloat16 model's matrices
    get the bfloat16 kernel's panels instead (counted too)."""
    started = time.monotonic()
    if _bf16_panels(model):
        return _attach_bf16_panels(model), time.monotonic() - started
    packed = 0
    small_batch = small_batch_gemm.load()
    for module in model.modules():
        if isinstance(module, _PACKED_IN_PLACE) and gemm.packable(module.weight):
            dense = module.weight
            module.weight = nn.Parameter(gemm.pack(dense), requires_grad=False)
            if small_batch and module.small_batch is None:
                module.small_batch = small_batch_gemm.pack(dense)
            packed += 1
    head = _logits_head(model)
    if (
        head is not None
        and not isinstance(head, ParallelLMHead)
        and head.packed_logits_weight is None
        and gemm.packable(head.weight)
    ):
        head.packed_logits_weight = gemm.pack(head.weight)
        if small_batch and head.small_batch is None:
            head.small_batch = small_batch_gemm.pack(head.weight)
        packed += 1
    return packed, time.monotonic() - started


def _bf16_panels(model: nn.Module) -> bool:
    """Whether ``model``'s matrices are bfloat16 on CPU and the bfloat16 kernel loads."""
    weights = [m.weight for m in model.modules() if isinstance(m, _PACKED_IN_PLACE)]
    if not weights or weights[0].dtype != torch.bfloat16 or weights[0].device.type != "cpu":
        return False
    return bf16_gemm.load()


def _attach_bf16_panels(model: nn.Module) -> int:
    attached = 0
    for module in model.modules():
        if isinstance(module, _PACKED_IN_PLACE) and bf16_gemm.packable(module.weight):
            if module.small_batch is None:
                module.small_batch = bf16_gemm.pack(module.weight)
                attached += 1
    head = _logits_head(model)
    if (
        head is not None
        and not isinstance(head, ParallelLMHead)
        and head.small_batch is None
        and bf16_gemm.packable(head.weight)
    ):
        head.small_batch = bf16_gemm.pack(head.weight)
        attached += 1
    return attached


def _logits_head(model: nn.Module) -> VocabParallelEmbedding | None:
    """The matrix that computes the logits, on a model (and stage) that has one."""
    if not isinstance(model, LlamaForCausalLM | GPT2LMHeadModel):
        return None  # an encoder: no logits
    try:
        return model.logits_head()
    except RuntimeError:
        return None  # a pipeline stage before the last

"""A Llama-family decode step's decoder layers in one C call, for a few rows on CPU.

At decode sizes a layer is a dozen small operations, and the time between them — Python, the
module calls, torch's dispatch — was a quarter of SmolLM2's decode step at one request (about
7 of 27 ms over 30 layers, measured on a 2-core EPYC). This runs the whole stack of layers of a
decode-only step in C (``csrc/decode_stack.c``): per layer RMSNorm, the QKV matmul, the rotary
embedding, the KV-cache write, paged decode attention, the output matmul and residual add,
RMSNorm, gate/up, SiLU-and-mul, down and residual add. It calls the same C functions the layers
call one by one (``small_batch_gemm``, ``paged_decode``, ``fused_ops``), in the same order on the
same floats, so the hidden states are bit-identical to the layer-by-layer path.

A model hands over its layers as :class:`StackLayer` records (``LlamaForCausalLM``'s
``decode_stack_layers``) and keeps a :class:`DecodeStack`, which turns them into a plan once
per set of KV caches (``stack_plan.py``). The stack applies to a step whose every row is one
query token (decodes, and chunks of a few tokens such as a decode with its proposed tokens:
each token a row that sees the keys up to its own position; the model checks), with at most
``MAX_ROWS`` rows,
float32 on CPU, every matrix with its small-batch panels, and the three kernels loaded (so their
off switches hold here too); anything else takes the layer-by-layer path. Up to
``gemm.SMALL_BATCH_MAX_ROWS`` rows (``MAX_ROWS``) the layers use
the same matmul kernel (the quantized one for a matrix with quantized panels,
``models/quantized.py``), so both paths give the same floats, and the stack is batch-invariant (a
row's floats do not depend on the rows beside it). Its loops run on the kernels' work pool: a
late thread is not waited for. ``SWITCHBOARD_DECODE_STACK=off`` turns it off alone.

A bfloat16 model runs here too, on its matrices' bfloat16 panels (``bf16_gemm.py``, up to
``gemm.bf16_max_rows()`` rows: with the kernel's amx variant 256, so that a step of 64 decodes
beside a shared budget's prompt tokens stays one call, 1.4-1.9x as fast as the layers in
process): the stack takes its hidden states as float32 and hands them back
rounded, so its activations stay float32 between the operations (the layer-by-layer path rounds
each to bfloat16: the two agree to bfloat16 rounding, not bit for bit). Its KV caches may be
bfloat16 (``--kv-cache-dtype``): written rounded, read widened in registers.

A step with rows of LoRA adapters runs here too (float32 adapters, ``lora_delta.py``): the
stack adds their deltas after each of the four matmuls, as the projections' hooks do on the
layer-by-layer path (the same C kernel, so the two agree bit for bit).

A float32 step whose every row is sampled (decodes) may end in the same call with the model's
final norm and LM head (:class:`StackHead`): the hidden states come back normed and the logits
beside them, the floats of the model's own norm and ``compute_logits``. At one user that saves
a return to Python and two calls after the layers: the first Python after 96 MB of weights runs
from cold caches (the final norm's call took 84-114 us there, 30-37 in a loop of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from switchboard.kernels import (
    bf16_gemm,
    fused_ops,
    gemm,
    library,
    lora_delta,
    paged_decode,
    small_batch_gemm,
)
from switchboard.kernels.lora_delta import StackLora
from switchboard.kernels.stack_plan import (
    Plan,
    StackHead,
    StackLayer,
    StackMatmul,
    make_plan,
    stack_head,
)

__all__ = ["MAX_ROWS", "DecodeStack", "StackHead", "StackLayer", "StackMatmul", "stack_head"]

# Rows a step may have. The kernel takes the rows 8 at a time (AVX-512; 6 with AVX2) over each
# cached panel, as fast as oneDNN with AVX-512 (SmolLM2's matmuls, 2 threads: 16 rows 0.95x,
# 32 rows 0.97x, 64 rows 1.00x) and faster with AVX2 alone (gemm.SMALL_BATCH_MAX_ROWS),
# and the step saves the time between the operations. A whole decode step, 2 threads, ms, stack /
# layer by layer: tiny-llama 65 rows 9.6 / 16.0, 128 rows 18.2 / 27.0; SmolLM2-135M 65 rows
# 136 / 178, 96 rows 225 / 229, 128 rows 274-284 / 274-301; with AVX2 alone tiny-llama 256 rows
# 37.5-38.3 / 41.5-49.5: never slower, so as many as the layers' matmuls take the same kernel
# for, and the two paths agree bit for bit.
MAX_ROWS = gemm.SMALL_BATCH_MAX_ROWS

# Where the stack takes a bfloat16 model's steps: its activations are float32 inside.
_HIDDEN_DTYPES = (torch.float32, torch.bfloat16)

_stack = library.SwitchedFunction("decode_stack_f32", "SWITCHBOARD_DECODE_STACK")


def load() -> bool:
    """Load the stack; True when in use. Needs the three kernels it calls loaded first (their
    off switches turn this off too). Idempotent."""
    if _stack.function is not None:
        return True
    if not (
        (small_batch_gemm.max_rows() or bf16_gemm.max_rows()) and paged_decode.status() == "in use"
    ):
        _stack.status = "unavailable: needs the small-batch matmul and decode-attention kernels"
        return False
    if fused_ops.status() != "in use":
        _stack.status = "unavailable: needs the fused CPU layer operations"
        return False
    return _stack.load()


def status() -> str:
    return _stack.status


def unload() -> None:
    """Back to the layer-by-layer path (tests compare the two)."""
    _stack.unload()


class DecodeStack:
    """One model's stack: the plan, made on the first step it applies to and again when the KV
    caches change; a model whose layers the stack cannot run is asked only once."""

    def __init__(self) -> None:
        self._plan: Plan | None = None
        self._unusable = False

    def run(
        self,
        layers: Callable[[], Sequence[StackLayer] | None],
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        lora: StackLora | None = None,
        head: StackHead | None = None,
        logits: torch.Tensor | None = None,
    ) -> bool:
        """Run the decoder layers on ``hidden`` ``[rows, hidden_size]`` in place, one query
        token per row; False (nothing done) where the stack does not apply and the caller loops
        over the layers. ``layers`` is asked for the model's layers when a plan is made.
        ``lora``: the step's adapter rows (None: every row on the base model). With ``head``
        and ``logits`` (float32 ``[rows, head.columns]``, float32 ``hidden`` only): ``hidden``
        comes back normed by the head's norm and ``logits`` filled."""
        if _stack.function is None or self._unusable:
            return False
        rows = hidden.shape[0]
        if (
            block_table.shape[0] != rows
            or not 1 <= rows <= max(MAX_ROWS, gemm.bf16_max_rows())
            or hidden.dtype not in _HIDDEN_DTYPES
            or hidden.device.type != "cpu"
            or not hidden.is_contiguous()
        ):
            return False
        plan = self._plan
        cache_ptrs = tuple(cache.data_ptr() for cache in kv_caches)
        if plan is None or plan.cache_ptrs != cache_ptrs:
            stack_layers = layers()
            plan = None if stack_layers is None else make_plan(stack_layers, kv_caches, MAX_ROWS)
            self._plan, self._unusable = plan, plan is None
            if plan is None:
                return False
        slots = slot_mapping.contiguous()
        if slots.dtype != torch.int64 or slots.shape[0] != rows or rows > plan.max_rows:
            return False
        if lora is not None and (
            lora.fields.shape[0] != plan.fields.shape[0] or lora.row_slots.shape[0] != rows
        ):
            return False
        if hidden.dtype == torch.float32:
            if head is not None and not _fits_head(head, logits, rows):
                return False
            _call(
                plan,
                hidden,
                cos,
                sin,
                kv_caches[0],
                slots,
                block_table,
                context_lens,
                lora,
                head=head,
                logits=logits,
            )
            return True
        if head is not None:
            return False
        work = fused_ops.to_dtype(hidden, torch.float32)
        cos, sin = cos.float(), sin.float()
        _call(plan, work, cos, sin, kv_caches[0], slots, block_table, context_lens, lora)
        fused_ops.to_dtype(work, hidden.dtype, out=hidden)
        return True


def _call(
    plan: Plan,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    lora: StackLora | None,
    head: StackHead | None = None,
    logits: torch.Tensor | None = None,
) -> None:
    stack = _stack.function
    assert stack is not None
    cos, sin = cos.contiguous(), sin.contiguous()
    block_table = block_table.contiguous()
    context_lens = context_lens.contiguous()
    hidden_size, heads, kv_heads, head_dim, intermediate = plan.dims
    _, num_blocks, block_size, _, _ = kv_cache.shape
    code = stack(
        hidden.data_ptr(),
        hidden.shape[0],
        plan.fields.shape[0],
        plan.fields.data_ptr(),
        hidden_size,
        heads,
        kv_heads,
        head_dim,
        intermediate,
        plan.eps,
        plan.scale,
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        block_table.data_ptr(),
        context_lens.data_ptr(),
        block_table.shape[1],
        num_blocks,
        block_size,
        int(plan.kv_bf16),
        *_lora_arguments(lora),
        0 if head is None else head.fields.data_ptr(),
        0.0 if head is None else head.norm_eps,
        0 if head is None or logits is None else logits.data_ptr(),
    )
    if code == -2:
        raise IndexError("decode stack: a slot outside the KV cache")
    if code in (-3, -4):
        raise ValueError(f"decode stack: LoRA: {lora_delta.error(code)}")
    if code != 0:
        raise MemoryError(f"decode stack failed ({code}): out of scratch memory")


def _fits_head(head: StackHead, logits: torch.Tensor | None, rows: int) -> bool:
    return (
        logits is not None
        and logits.shape == (rows, head.columns)
        and logits.dtype == torch.float32
        and logits.is_contiguous()
    )


def _lora_arguments(lora: StackLora | None) -> tuple[int, int, int, int, int]:
    """The C side's LoRA arguments: the fields, each row's slot, the slots, their ranks and the
    largest rank (the fields' address 0: no adapter row)."""
    if lora is None:
        return 0, 0, 0, 0, 0
    slots = lora_delta.slot_arguments(lora.row_slots, lora.slots, lora.slot_ranks, lora.max_rank)
    return lora.fields.data_ptr(), *slots

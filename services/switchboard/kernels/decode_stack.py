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
``decode_stack_layers``) and keeps a :class:`DecodeStack`, which turns them into a plan once per
set of KV caches. The stack applies to a step whose every row is one query token (decodes,
and chunks of a few tokens such as a decode with its proposed tokens: each token a row that
sees the keys up to its own position; the model checks), with at most ``MAX_ROWS`` rows,
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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from switchboard.kernels import (
    bf16_gemm,
    fused_ops,
    gemm,
    library,
    lora_delta,
    paged_decode,
    quant_gemm,
    small_batch_gemm,
)
from switchboard.kernels.gemm import MatmulPanels
from switchboard.kernels.lora_delta import StackLora

# Rows a step may have. The kernel takes the rows 8 at a time (AVX-512; 6 with AVX2) over each
# cached panel, as fast as oneDNN with AVX-512 (SmolLM2's matmuls, 2 threads: 16 rows 0.95x,
# 32 rows 0.97x, 64 rows 1.00x) and faster with AVX2 alone (gemm.SMALL_BATCH_MAX_ROWS),
# and the step saves the time between the operations. A whole decode step, 2 threads, ms, stack /
# layer by layer: tiny-llama 65 rows 9.6 / 16.0, 128 rows 18.2 / 27.0; SmolLM2-135M 65 rows
# 136 / 178, 96 rows 225 / 229, 128 rows 274-284 / 274-301; with AVX2 alone tiny-llama 256 rows
# 37.5-38.3 / 41.5-49.5: never slower, so as many as the layers' matmuls take the same kernel
# for, and the two paths agree bit for bit.
MAX_ROWS = gemm.SMALL_BATCH_MAX_ROWS

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


@dataclass(frozen=True)
class StackMatmul:
    panels: MatmulPanels  # float32 or quantized: each matmul of a layer may be either
    bias: torch.Tensor | None


@dataclass(frozen=True)
class StackLayer:
    """What the stack reads of one decoder layer: pre-norm attention (fused QKV, rotary
    embedding, paged attention, output projection) and a SwiGLU MLP (fused gate/up, down)."""

    input_norm: torch.Tensor  # RMSNorm weights [hidden]
    input_norm_eps: float
    qkv: StackMatmul
    o: StackMatmul
    post_attention_norm: torch.Tensor
    post_attention_norm_eps: float
    gate_up: StackMatmul
    down: StackMatmul
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None


_LAYER_FIELDS = 16  # the C side's LAYER_FIELDS
_BF16_PANELS = -1  # the C side's kind of bfloat16 panels
_DOT_PANELS = 1024  # csrc/decode_stack.c's kind of dot product panels: this plus the block
_DOT4_PANELS = 2048  # the same with 4-bit values
# Where the stack takes a bfloat16 model's steps: its activations are float32 inside.
_HIDDEN_DTYPES = (torch.float32, torch.bfloat16)
_Dims = tuple[int, int, int, int, int]  # hidden, heads, KV heads, head_dim, intermediate


@dataclass(frozen=True)
class _Plan:
    """The addresses the C stack reads, with the layers whose weights they point into (held
    here, so they live as long)."""

    layers: tuple[StackLayer, ...]  # whose weights ``fields`` points into
    cache_ptrs: tuple[int, ...]  # the KV caches it was made for (not held: the worker owns them)
    fields: torch.Tensor  # [layers, _LAYER_FIELDS] int64 addresses (and the windows)
    dims: _Dims
    eps: float
    scale: float
    kv_bf16: bool  # the caches hold bfloat16
    max_rows: int  # the most rows its matmul kernels take


class DecodeStack:
    """One model's stack: the plan, made on the first step it applies to and again when the KV
    caches change; a model whose layers the stack cannot run is asked only once."""

    def __init__(self) -> None:
        self._plan: _Plan | None = None
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
    ) -> bool:
        """Run the decoder layers on ``hidden`` ``[rows, hidden_size]`` in place, one query
        token per row; False (nothing done) where the stack does not apply and the caller loops
        over the layers. ``layers`` is asked for the model's layers when a plan is made.
        ``lora``: the step's adapter rows (None: every row on the base model)."""
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
            plan = None if stack_layers is None else _make_plan(stack_layers, kv_caches)
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
            _call(plan, hidden, cos, sin, kv_caches[0], slots, block_table, context_lens, lora)
            return True
        work = fused_ops.to_dtype(hidden, torch.float32)
        cos, sin = cos.float(), sin.float()
        _call(plan, work, cos, sin, kv_caches[0], slots, block_table, context_lens, lora)
        fused_ops.to_dtype(work, hidden.dtype, out=hidden)
        return True


def _call(
    plan: _Plan,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    lora: StackLora | None,
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
    )
    if code == -2:
        raise IndexError("decode stack: a slot outside the KV cache")
    if code in (-3, -4):
        raise ValueError(f"decode stack: LoRA: {lora_delta.error(code)}")
    if code != 0:
        raise MemoryError(f"decode stack failed ({code}): out of scratch memory")


def _lora_arguments(lora: StackLora | None) -> tuple[int, int, int, int, int]:
    """The C side's LoRA arguments: the fields, each row's slot, the slots, their ranks and the
    largest rank (the fields' address 0: no adapter row)."""
    if lora is None:
        return 0, 0, 0, 0, 0
    slots = lora_delta.slot_arguments(lora.row_slots, lora.slots, lora.slot_ranks, lora.max_rank)
    return lora.fields.data_ptr(), *slots


def _make_plan(layers: Sequence[StackLayer], kv_caches: Sequence[torch.Tensor]) -> _Plan | None:
    """None when some layer or cache is not one the stack can run, or the layers' shapes differ."""
    if not layers or len(layers) != len(kv_caches):
        return None
    rows = [_layer_fields(layer, cache) for layer, cache in zip(layers, kv_caches, strict=True)]
    shapes = {row[1] for row in rows if row is not None}
    if any(row is None for row in rows) or len(shapes) != 1:
        return None
    if len({cache.dtype for cache in kv_caches}) != 1:
        return None
    dims, eps, scale = shapes.pop()
    kinds = {
        isinstance(m.panels, bf16_gemm.Bf16Panels)
        for layer in layers
        for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
    }
    return _Plan(
        layers=tuple(layers),
        cache_ptrs=tuple(cache.data_ptr() for cache in kv_caches),
        fields=torch.tensor([row[0] for row in rows if row is not None], dtype=torch.int64),
        dims=dims,
        eps=eps,
        scale=scale,
        kv_bf16=kv_caches[0].dtype == torch.bfloat16,
        max_rows=_max_rows(kinds),
    )


def _max_rows(bf16_kinds: set[bool]) -> int:
    """The most rows of a plan whose matrices' panels are bfloat16 or not (``bf16_kinds``:
    whether each is): every matrix bfloat16, as many as the bfloat16 kernel takes (the amx
    variant's 256: a step of 64 decodes beside a prompt chunk stays one call); float32 or
    quantized panels among them, ``MAX_ROWS``."""
    if bf16_kinds == {True}:
        return gemm.bf16_max_rows()
    return min(MAX_ROWS, gemm.bf16_max_rows()) if True in bf16_kinds else MAX_ROWS


def _dense_f32(tensor: torch.Tensor | None) -> bool:
    return tensor is None or (
        tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()
    )


def _layer_fields(
    layer: StackLayer, cache: torch.Tensor
) -> tuple[list[int], tuple[_Dims, float, float]] | None:
    """The layer's row of addresses for the C stack, and its shape; None when the stack cannot
    run it."""
    matmuls = (layer.qkv, layer.o, layer.gate_up, layer.down)
    norms = (layer.input_norm, layer.post_attention_norm)
    if not all(_dense_f32(t) for t in (*norms, *(m.bias for m in matmuls))):
        return None
    if cache.dtype not in paged_decode.CACHE_DTYPES or not cache.is_contiguous():
        return None
    if cache.device.type != "cpu":
        return None
    if layer.input_norm_eps != layer.post_attention_norm_eps:
        return None
    hidden_size = layer.input_norm.shape[0]
    heads, kv_heads, head_dim = layer.heads, layer.kv_heads, layer.head_dim
    qkv_rows = (heads + 2 * kv_heads) * head_dim
    if [m.panels.out_features for m in (layer.qkv, layer.o, layer.down)] != [
        qkv_rows,
        hidden_size,
        hidden_size,
    ]:
        return None
    if cache.shape[3:] != (kv_heads, head_dim):
        return None
    # in the C side's field order
    addresses = [
        layer.input_norm.data_ptr(),
        *_addresses(layer.qkv),
        *_addresses(layer.o),
        layer.post_attention_norm.data_ptr(),
        *_addresses(layer.gate_up),
        *_addresses(layer.down),
        cache.data_ptr(),
        layer.sliding_window or 0,
        *(_block(matmul) for matmul in matmuls),
    ]
    assert len(addresses) == _LAYER_FIELDS
    dims = (hidden_size, heads, kv_heads, head_dim, layer.gate_up.panels.out_features // 2)
    return addresses, (dims, float(layer.input_norm_eps), float(layer.scale))


def _block(matmul: StackMatmul) -> int:
    """The C side's kind of panels: 0 float32, -1 bfloat16, else the quantized panels' block
    size (plus ``_DOT_PANELS`` or ``_DOT4_PANELS`` for the dot product kernel's, with its
    float16-factors flag)."""
    panels = matmul.panels
    if isinstance(panels, bf16_gemm.Bf16Panels):
        return _BF16_PANELS
    if isinstance(panels, quant_gemm.QuantPanels):
        if not panels.dot:
            return panels.block
        return panels.kernel_block + (_DOT4_PANELS if panels.bits == 4 else _DOT_PANELS)
    return 0


def _addresses(matmul: StackMatmul) -> tuple[int, int]:
    """Its panels' address and its bias's (0: none)."""
    bias = 0 if matmul.bias is None else matmul.bias.data_ptr()
    return matmul.panels.data.data_ptr(), bias

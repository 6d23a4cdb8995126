"""What the one-call decode stack (``decode_stack.py``) reads: a model's layers and its final
norm and LM head as records of weights and panels, and the plan of addresses the C side
(``csrc/decode_stack.c``) takes, its field order and kinds of panels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from switchboard.kernels import bf16_gemm, gemm, paged_decode, quant_gemm
from switchboard.kernels.gemm import MatmulPanels


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
_HEAD_FIELDS = 4  # the C side's HEAD_FIELDS
_BF16_PANELS = -1  # the C side's kind of bfloat16 panels
_DOT_PANELS = 1024  # csrc/decode_stack.c's kind of dot product panels: this plus the block
_DOT4_PANELS = 2048  # the same with 4-bit values
_Dims = tuple[int, int, int, int, int]  # hidden, heads, KV heads, head_dim, intermediate


@dataclass(frozen=True)
class StackHead:
    """The model's final RMSNorm and LM head as the stack runs them (:func:`stack_head`)."""

    norm: torch.Tensor  # held: ``fields`` points into it and the panels
    norm_eps: float
    panels: MatmulPanels
    columns: int  # the logits' columns
    fields: torch.Tensor  # [_HEAD_FIELDS] int64: the C side's head


def stack_head(
    norm: torch.Tensor, norm_eps: float, weight: torch.Tensor, panels: MatmulPanels | None
) -> StackHead | None:
    """The final norm and LM head for the stack, where it computes the floats the model's own
    calls do (``RMSNorm`` and ``gemm.linear`` on a step's rows): the head's quantized panels, or
    its float32 small-batch panels beside a oneDNN-packed weight (``linear`` takes them then);
    None otherwise (no panels, bfloat16 ones, a weight ``linear`` multiplies itself)."""
    if panels is None or isinstance(panels, bf16_gemm.Bf16Panels) or not dense_f32(norm):
        return None
    if not isinstance(panels, quant_gemm.QuantPanels) and not weight.is_mkldnn:
        return None
    if weight.shape[-1] != norm.shape[0]:
        return None
    matmul = StackMatmul(panels, None)
    fields = [norm.data_ptr(), _block(matmul), _addresses(matmul)[0], panels.out_features]
    assert len(fields) == _HEAD_FIELDS
    return StackHead(
        norm=norm,
        norm_eps=float(norm_eps),
        panels=panels,
        columns=panels.out_features,
        fields=torch.tensor(fields, dtype=torch.int64),
    )


@dataclass(frozen=True)
class Plan:
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


def make_plan(
    layers: Sequence[StackLayer], kv_caches: Sequence[torch.Tensor], kernel_rows: int
) -> Plan | None:
    """None when some layer or cache is not one the stack can run, or the layers' shapes differ.
    ``kernel_rows``: the most rows the float32 and quantized matmul kernels take."""
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
    return Plan(
        layers=tuple(layers),
        cache_ptrs=tuple(cache.data_ptr() for cache in kv_caches),
        fields=torch.tensor([row[0] for row in rows if row is not None], dtype=torch.int64),
        dims=dims,
        eps=eps,
        scale=scale,
        kv_bf16=kv_caches[0].dtype == torch.bfloat16,
        max_rows=max_rows(kinds, kernel_rows),
    )


def max_rows(bf16_kinds: set[bool], kernel_rows: int) -> int:
    """The most rows of a plan whose matrices' panels are bfloat16 or not (``bf16_kinds``:
    whether each is): every matrix bfloat16, as many as the bfloat16 kernel takes (the amx
    variant's 256: a step of 64 decodes beside a prompt chunk stays one call); float32 or
    quantized panels among them, ``kernel_rows`` (the float32 and quantized kernels')."""
    if bf16_kinds == {True}:
        return gemm.bf16_max_rows()
    return min(kernel_rows, gemm.bf16_max_rows()) if True in bf16_kinds else kernel_rows


def dense_f32(tensor: torch.Tensor | None) -> bool:
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
    if not all(dense_f32(t) for t in (*norms, *(m.bias for m in matmuls))):
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

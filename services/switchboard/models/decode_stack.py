"""A Llama-family decode step's decoder layers in one C call, for a few rows on CPU.

At decode sizes a layer is a dozen small operations, and the time between them — Python, the
module calls, torch's dispatch — was a quarter of SmolLM2's decode step at one request (about
7 of 27 ms over 30 layers, measured on a 2-core EPYC). This runs the whole stack of layers of a
decode-only step in C: per layer RMSNorm, the QKV matmul, the rotary embedding, the KV-cache
write, paged decode attention, the output matmul and residual add, RMSNorm, gate/up, SiLU-and-mul,
down and residual add. It calls the same C functions the layers call one by one
(``small_batch_gemm``, ``cpu_decode_kernel``, ``fused_ops``: their sources are compiled together
here), in the same order on the same floats, so the hidden states are bit-identical to the
layer-by-layer path.

It applies to a step whose every row decodes (no prefill chunk), with at most ``MAX_ROWS``
rows, float32 on CPU, one process (no tensor or pipeline parallelism), every matrix with its
small-batch panels, and the three kernels loaded (so their off switches hold here too); anything
else takes the layer-by-layer path. Up to ``gemm.SMALL_BATCH_MAX_ROWS`` rows (``MAX_ROWS``) the
layers use the same matmul kernel, so both paths give the same floats, and the stack is
batch-invariant (a row's floats do not depend on the rows beside it). Its loops run on the
kernels' work pool (``work_pool.py``): a late thread is not waited for.
``SWITCHBOARD_DECODE_STACK=off`` turns it off alone.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from switchboard.models import cpu_decode_kernel, fused_ops, gemm, small_batch_gemm
from switchboard.models.attention import AttentionMetadata
from switchboard.models.native_build import VECTOR_EXP_C, load_library

STACK_SOURCE = r"""
#include <stdlib.h>

/* Per layer, the addresses (as integers, 0 = none) of: */
enum {
    LN1, QKV, QKV_BIAS, O, O_BIAS, LN2, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, KV, WINDOW,
    LAYER_FIELDS
};

/* x [M, H]: the hidden states in, the last layer's out. Returns 0; -1 out of memory; -2 a
   slot outside the KV cache. */
int decode_stack_f32(float *x, int64_t M, int64_t layers, const int64_t *fields, int64_t H,
                     int64_t nH, int64_t nKV, int64_t D, int64_t I, float eps, float scale,
                     const float *cos_half, const float *sin_half, const int64_t *slots,
                     const int64_t *block_table, const int64_t *context_lens, int64_t MB,
                     int64_t NB, int64_t BS) {
    const int64_t qkv_n = (nH + 2 * nKV) * D, attn_n = nH * D;
    /* scratch kept from call to call (one worker per process calls this, from one thread):
       a new allocation of this size each step would be fresh pages, faulted in every time */
    static float *buffer = NULL;
    static size_t capacity = 0;
    const size_t needed = (size_t)(M * (H + qkv_n + attn_n + H + 3 * I));
    if (needed > capacity) {
        free(buffer);
        buffer = malloc(sizeof(float) * needed);
        capacity = buffer == NULL ? 0 : needed;
        if (buffer == NULL) return -1;
    }
    float *h = buffer, *qkv = h + M * H, *attn = qkv + M * qkv_n, *tmp = attn + M * attn_n;
    float *gate_up = tmp + M * H, *act = gate_up + M * 2 * I;
    int code = 0;
    for (int64_t l = 0; l < layers && code == 0; l++) {
        const int64_t *f = fields + l * LAYER_FIELDS;
#define PTR(i) ((float *)(intptr_t)f[i])
        float *kv = PTR(KV);
        rms_norm_f32(x, H, PTR(LN1), h, M, H, eps);
        code = small_batch_linear(h, H, PTR(QKV), PTR(QKV_BIAS), qkv, M, H, qkv_n);
        if (code != 0) break;
        rotary_f32(qkv, qkv_n, M, nH, D, cos_half, sin_half);
        rotary_f32(qkv + nH * D, qkv_n, M, nKV, D, cos_half, sin_half);
        if (write_kv_f32(qkv + nH * D, qkv_n, qkv + (nH + nKV) * D, qkv_n, slots, M, nKV * D,
                         kv, kv + NB * BS * nKV * D, NB * BS) != 0) {
            code = -2;
            break;
        }
        code = paged_decode_f32(qkv, qkv_n, kv, block_table, context_lens, attn, M, nH, nKV, D,
                                NB, BS, MB, scale, f[WINDOW]);
        if (code != 0) break;
        code = small_batch_linear(attn, attn_n, PTR(O), PTR(O_BIAS), tmp, M, attn_n, H);
        if (code != 0) break;
        for (int64_t i = 0; i < M * H; i++) x[i] = x[i] + tmp[i];
        rms_norm_f32(x, H, PTR(LN2), h, M, H, eps);
        code = small_batch_linear(h, H, PTR(GATE_UP), PTR(GATE_UP_BIAS), gate_up, M, H, 2 * I);
        if (code != 0) break;
        silu_and_mul_f32(gate_up, 2 * I, act, M, I);
        code = small_batch_linear(act, I, PTR(DOWN), PTR(DOWN_BIAS), tmp, M, I, H);
        if (code != 0) break;
        for (int64_t i = 0; i < M * H; i++) x[i] = x[i] + tmp[i];
#undef PTR
    }
    return code;
}
"""

_LAYER_FIELDS = 12
# Rows a step may have. The kernel takes the rows 8 at a time (AVX-512; 6 with AVX2) over each
# cached panel, as fast as oneDNN with AVX-512 (SmolLM2's matmuls, 2 threads: 16 rows 0.95x,
# 32 rows 0.97x, 64 rows 1.00x) and faster with AVX2 alone (gemm.SMALL_BATCH_MAX_ROWS),
# and the step saves the time between the operations. A whole decode step, 2 threads, ms, stack /
# layer by layer: tiny-llama 65 rows 9.6 / 16.0, 128 rows 18.2 / 27.0; SmolLM2-135M 65 rows
# 136 / 178, 96 rows 225 / 229, 128 rows 274-284 / 274-301; with AVX2 alone tiny-llama 256 rows
# 37.5-38.3 / 41.5-49.5: never slower, so as many as the layers' matmuls take the same kernel
# for, and the two paths agree bit for bit.
MAX_ROWS = gemm.SMALL_BATCH_MAX_ROWS
_I64, _VOID, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ARGTYPES: list[Any] = [_VOID, _I64, _I64, _VOID, _I64, _I64, _I64, _I64, _I64, _F32, _F32]
_ARGTYPES += [_VOID] * 5 + [_I64] * 3

_stack: Callable[..., int] | None = None
_status = "not loaded"


def load() -> bool:
    """Build (once per machine) and load; True when in use. Needs the three kernels it calls
    loaded first (their off switches turn this off too). Idempotent."""
    global _stack, _status
    if _stack is not None:
        return True
    if not (small_batch_gemm.max_rows and cpu_decode_kernel.status() == "in use"):
        _status = "unavailable: needs the small-batch matmul and decode-attention kernels"
        return False
    if fused_ops.status() != "in use":
        _status = "unavailable: needs the fused CPU layer operations"
        return False
    source = (
        VECTOR_EXP_C
        + small_batch_gemm.SOURCE
        + cpu_decode_kernel.SOURCE
        + fused_ops.SOURCE  # last of the three: its fp-contract=off holds from there on
        + STACK_SOURCE
    )
    library, _status = load_library(
        "decode_stack", source, "decode-layer stack", ("SWITCHBOARD_DECODE_STACK", "off")
    )
    if library is None:
        return False
    function = library.decode_stack_f32
    function.argtypes = _ARGTYPES
    function.restype = ctypes.c_int
    _stack = function
    return True


def status() -> str:
    return _status


def unload() -> None:
    """Back to the layer-by-layer path (tests compare the two)."""
    global _stack, _status
    _stack, _status = None, "not loaded"


@dataclass
class _Plan:
    """What one model's stack needs from its layers, with the KV caches it was made for."""

    cache_ptrs: tuple[int, ...]
    # [layers, _LAYER_FIELDS] int64 addresses (and the windows) into the model's weights (the
    # plan lives on the model, so they live as long) and the worker's caches (cache_ptrs)
    fields: torch.Tensor
    dims: tuple[int, int, int, int, int]  # H, heads, kv heads, head_dim, intermediate
    eps: float
    scale: float


_PLAN_ATTR = "_switchboard_decode_stack_plan"


def run(
    model: nn.Module,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    metadata: AttentionMetadata,
) -> bool:
    """Run ``model``'s decoder layers on ``hidden`` ``[rows, hidden_size]`` in place; False
    (nothing done) where the stack does not apply and the caller loops over the layers."""
    if _stack is None:
        return False
    decode = metadata.decode
    rows = hidden.shape[0]
    if (
        decode is None
        or metadata.prefills
        or (metadata.backend is not None and metadata.backend.name != "reference")
        or decode.size != rows
        or not 1 <= rows <= MAX_ROWS
        or hidden.dtype != torch.float32
        or hidden.device.type != "cpu"
        or not hidden.is_contiguous()
    ):
        return False
    plan = _plan_for(model, kv_caches)
    if plan is None:
        return False
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = metadata.slot_mapping.contiguous()
    block_table = decode.block_table.contiguous()
    context_lens = decode.context_lens.contiguous()
    if slots.dtype != torch.int64 or slots.shape[0] != rows:
        return False
    hidden_size, heads, kv_heads, head_dim, intermediate = plan.dims
    _, num_blocks, block_size, _, _ = kv_caches[0].shape
    code = _stack(
        hidden.data_ptr(),
        rows,
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
    )
    if code == -2:
        raise IndexError("decode stack: a slot outside the KV cache")
    if code != 0:
        raise MemoryError(f"decode stack failed ({code}): out of scratch memory")
    return True


def _plan_for(model: nn.Module, kv_caches: Sequence[torch.Tensor]) -> _Plan | None:
    cache_ptrs = tuple(cache.data_ptr() for cache in kv_caches)
    cached = getattr(model, _PLAN_ATTR, None)
    if cached is not None and (cached is False or cached.cache_ptrs == cache_ptrs):
        return cached or None
    plan = _make_plan(model, kv_caches, cache_ptrs)
    setattr(model, _PLAN_ATTR, plan if plan is not None else False)
    return plan


def _make_plan(
    model: nn.Module, kv_caches: Sequence[torch.Tensor], cache_ptrs: tuple[int, ...]
) -> _Plan | None:
    """None when some layer is not a Llama-style decoder layer the stack can run."""
    parallel = getattr(model, "parallel", None)
    layers = list(getattr(getattr(model, "model", None), "stage_layers", []) or [])
    if parallel is None or parallel.world_size != 1 or not layers:
        return None
    if len(layers) != len(kv_caches):
        return None
    rows = [_layer_fields(layer, cache) for layer, cache in zip(layers, kv_caches, strict=True)]
    shapes = {row[1] for row in rows if row is not None}
    if any(row is None for row in rows) or len(shapes) != 1:
        return None  # a layer the stack cannot run, or layers of different shapes
    (hidden_size, heads, kv_heads, head_dim, intermediate), eps, scale = shapes.pop()
    return _Plan(
        cache_ptrs=cache_ptrs,
        fields=torch.tensor([row[0] for row in rows if row is not None], dtype=torch.int64),
        dims=(hidden_size, heads, kv_heads, head_dim, intermediate),
        eps=eps,
        scale=scale,
    )


_LayerShape = tuple[tuple[int, int, int, int, int], float, float]  # dims, eps, scale


def _layer_fields(layer: nn.Module, cache: torch.Tensor) -> tuple[list[int], _LayerShape] | None:
    """The layer's row of addresses for the C stack and its shape; None when the stack cannot
    run it."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norm1 = getattr(layer, "input_layernorm", None)
    norm2 = getattr(layer, "post_attention_layernorm", None)
    needed = ("qkv_proj", "o_proj", "num_heads", "num_kv_heads", "head_dim", "scale")
    if attn is None or mlp is None or not all(hasattr(attn, name) for name in needed):
        return None
    if not (hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj")):
        return None
    norms: list[Any] = [norm1, norm2]
    if not all(hasattr(norm, "eps") and hasattr(norm, "weight") for norm in norms):
        return None
    if any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in norms):
        return None
    if norms[0].eps != norms[1].eps:
        return None
    if cache.dtype != torch.float32 or cache.device.type != "cpu" or not cache.is_contiguous():
        return None
    matmuls = []  # (panels address, bias address or 0, output features) of qkv, o, gate_up, down
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        weight, bias = getattr(linear, "weight", None), getattr(linear, "bias", None)
        attached = gemm.small_batch_panels(weight) if isinstance(weight, torch.Tensor) else None
        if attached is None:
            return None
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            return None
        panels, out_features = attached
        matmuls.append((panels.data_ptr(), 0 if bias is None else bias.data_ptr(), out_features))
    qkv, o, gate_up, down = matmuls
    hidden_size = norms[0].weight.shape[0]
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if [qkv[2], o[2], down[2]] != [(heads + 2 * kv_heads) * head_dim, hidden_size, hidden_size]:
        return None
    if cache.shape[3:] != (kv_heads, head_dim):
        return None
    window = getattr(attn, "sliding_window", None) or 0
    row = [norms[0].weight.data_ptr(), *qkv[:2], *o[:2], norms[1].weight.data_ptr()]
    row += [*gate_up[:2], *down[:2], cache.data_ptr(), int(window)]
    dims = (hidden_size, heads, kv_heads, head_dim, gate_up[2] // 2)
    return row, (dims, float(norms[0].eps), float(attn.scale))

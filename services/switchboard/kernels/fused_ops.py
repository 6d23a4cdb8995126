"""A layer's small float32 operations on CPU as C loops: RMSNorm, rotary embedding, SiLU-and-mul,
the KV-cache write, and the greedy pick (the first index of each row's largest logit).

At decode sizes these operations are a few thousand floats each, and torch spends more time
dispatching them (and, for the ones it parallelises, waking its thread team) than computing:
measured on a 2-core EPYC with two threads, 8 tokens of SmolLM2, per layer: rotary embedding of
the queries and keys 83 us (nine operators each), RMSNorm 38 us twice, SiLU-and-mul 20 us —
about 5.5 ms of a 45 ms decode step over 30 layers. Here each is one call (a few us), on the
calling thread for small inputs and on the kernels' work pool for large ones (a long prefill).

The rotary embedding computes exactly torch's products and sums (no fused multiply-add:
``fp-contract=off``), so it gives the same floats as the reference's ``x * cos +
rotate_half(x) * sin``; RMSNorm's sum of squares and SiLU's exponential agree with torch's to
float32 rounding. The greedy pick is torch.argmax's answer (the first largest value; a NaN
counts as the largest): torch took 400 us for 32 rows of tiny-llama's 16,000 logits and 1.1 ms
for SmolLM2's 49,152 on this machine, two threads; eight lanes compared at a time, one thread,
take a tenth of that. C in ``csrc/fused_ops.c``, in the kernels' one library (``library.py``);
without a compiler, or with ``SWITCHBOARD_FUSED_OPS=off``, the layers use their torch code.

A model in bfloat16 gets RMSNorm, the rotary embedding and SiLU-and-mul on its bfloat16 tensors
too (``csrc/fused_ops_bf16.c``): computed in float32 and rounded to bfloat16 wherever torch's
bfloat16 operators round, so the same values as the torch code but for RMSNorm's sum order. The
KV-cache write also stores float32 keys and values into a bfloat16 cache (``--kv-cache-dtype``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from switchboard.kernels import library

_rms_norm: Callable[..., Any] | None = None
_rotary: Callable[..., Any] | None = None
_silu_and_mul: Callable[..., Any] | None = None
_write_kv: Callable[..., Any] | None = None
_write_kv_bf16: Callable[..., Any] | None = None
# bfloat16 twins of the first three (csrc/fused_ops_bf16.c)
_rms_norm_bf16: Callable[..., Any] | None = None
_rotary_bf16: Callable[..., Any] | None = None
_silu_and_mul_bf16: Callable[..., Any] | None = None
# bfloat16 rows <-> float32 rows (the bfloat16 matmul kernel's input and output)
_widen_bf16: Callable[..., Any] | None = None
_narrow_f32: Callable[..., Any] | None = None
_add: Callable[..., Any] | None = None
_add_bf16: Callable[..., Any] | None = None
_argmax: Callable[..., Any] | None = None
_status = "not loaded"


def load() -> bool:
    """Load the kernels (built once per machine); True when they are in use. Idempotent."""
    global _rms_norm, _rotary, _silu_and_mul, _write_kv, _write_kv_bf16, _argmax, _status
    if _rms_norm is not None:
        return True
    loaded, _status = library.load_switched("SWITCHBOARD_FUSED_OPS", "off")
    if loaded is None:
        return False
    _rms_norm, _rotary = loaded.rms_norm_f32, loaded.rotary_f32
    _silu_and_mul, _write_kv = loaded.silu_and_mul_f32, loaded.write_kv_f32
    _write_kv_bf16 = loaded.write_kv_bf16
    global _rms_norm_bf16, _rotary_bf16, _silu_and_mul_bf16
    _rms_norm_bf16, _rotary_bf16 = loaded.rms_norm_bf16, loaded.rotary_bf16
    _silu_and_mul_bf16 = loaded.silu_and_mul_bf16
    global _widen_bf16, _narrow_f32
    _widen_bf16, _narrow_f32 = loaded.bf16_rows_to_f32, loaded.f32_rows_to_bf16
    global _add, _add_bf16
    _add, _add_bf16 = loaded.add_f32, loaded.add_bf16
    _argmax = loaded.argmax_rows_f32
    return True


def status() -> str:
    return _status


def unload() -> None:
    """Back to torch's operators (tests compare the two)."""
    global _rms_norm, _rotary, _silu_and_mul, _write_kv, _write_kv_bf16, _argmax, _status
    _rms_norm = _rotary = _silu_and_mul = _write_kv = _write_kv_bf16 = _argmax = None
    global _rms_norm_bf16, _rotary_bf16, _silu_and_mul_bf16, _widen_bf16, _narrow_f32
    _rms_norm_bf16 = _rotary_bf16 = _silu_and_mul_bf16 = _widen_bf16 = _narrow_f32 = None
    global _add, _add_bf16
    _add = _add_bf16 = None
    _status = "not loaded"


def _usable(*tensors: torch.Tensor) -> bool:
    return _rms_norm is not None and all(
        t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors
    )


def _kernel_for(
    f32: Callable[..., Any] | None, bf16: Callable[..., Any] | None, *tensors: torch.Tensor
) -> Callable[..., Any] | None:
    """The float32 or the bfloat16 kernel for ``tensors`` (all of one dtype, on CPU); None
    where neither applies."""
    dtype = tensors[0].dtype
    if any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        return None
    return f32 if dtype == torch.float32 else bf16 if dtype == torch.bfloat16 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of ``x`` ``[rows, H]`` (last dim contiguous), float32 or bfloat16 (weight of
    the same dtype); None where the kernel does not apply (the caller computes it with
    torch)."""
    kernel = _kernel_for(_rms_norm, _rms_norm_bf16, x, weight)
    if x.dim() != 2 or x.stride(1) != 1 or kernel is None or not weight.is_contiguous():
        return None
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype)
    kernel(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, hidden, eps)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate ``x`` ``[tokens, heads, D]`` in place (heads contiguous, any token stride) by
    ``cos``/``sin`` ``[tokens, D / 2]``; False where the kernel does not apply."""
    kernel = _kernel_for(_rotary, _rotary_bf16, x, cos, sin)
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2] or kernel is None:
        return False
    cos, sin = cos.contiguous(), sin.contiguous()
    tokens, heads, head_dim = x.shape
    kernel(x.data_ptr(), x.stride(0), tokens, heads, head_dim, cos.data_ptr(), sin.data_ptr())
    return True


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``gate_up`` ``[rows, 2 * I]`` (last dim contiguous); None where
    the kernel does not apply."""
    kernel = _kernel_for(_silu_and_mul, _silu_and_mul_bf16, gate_up)
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2 or kernel is None:
        return None
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width // 2)
    return out


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` of two ``[rows, cols]`` tensors of one dtype (last dims contiguous), float32
    or bfloat16 in the kernel (torch's sums, rounded as torch rounds); torch's add otherwise."""
    kernel = _kernel_for(_add, _add_bf16, a, b)
    if kernel is None or a.dim() != 2 or a.shape != b.shape or a.stride(1) != 1 or b.stride(1) != 1:
        return a + b
    rows, cols = a.shape
    out = torch.empty(rows, cols, dtype=a.dtype)
    if rows:
        kernel(a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), out.data_ptr(), rows, cols)
    return out


def to_dtype(x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[rows, cols]`` (last dim contiguous) as ``dtype``, bfloat16 <-> float32 in the
    kernel (the values torch's ``.to`` gives, without waking its thread team); torch's ``.to``
    for anything else. ``out``: a contiguous tensor of ``dtype`` and ``x``'s shape to write
    into (returned)."""
    if out is not None and (out.dtype != dtype or out.shape != x.shape or not out.is_contiguous()):
        raise ValueError("to_dtype: out must be a contiguous tensor of dtype and x's shape")
    kernel = {
        (torch.bfloat16, torch.float32): _widen_bf16,
        (torch.float32, torch.bfloat16): _narrow_f32,
    }.get((x.dtype, dtype))
    if kernel is None or x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu":
        if out is not None:
            return out.copy_(x)
        return x if x.dtype == dtype else x.to(dtype)
    rows, cols = x.shape
    if out is None:
        out = torch.empty(rows, cols, dtype=dtype)
    if rows:
        kernel(x.data_ptr(), x.stride(0), out.data_ptr(), rows, cols)
    return out


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Store float32 ``key``/``value`` ``[tokens, kv_heads, head_dim]`` (any token stride) in
    their slots of ``kv_cache`` ``[2, blocks, block_size, kv_heads, head_dim]``, float32 or
    bfloat16 (rounded to nearest even, as ``Tensor.to``); False where the kernel does not
    apply. A slot outside the cache raises IndexError, nothing written."""
    bf16_cache = kv_cache.dtype == torch.bfloat16
    write = _write_kv_bf16 if bf16_cache else _write_kv
    if (
        write is None
        or not _usable(key, value)
        or not (bf16_cache or _usable(kv_cache))
        or kv_cache.device.type != "cpu"
        or not kv_cache.is_contiguous()
        or slot_mapping.dtype != torch.int64
        or slot_mapping.device.type != "cpu"
        or key.shape != value.shape
        or key.shape[1:] != kv_cache.shape[3:]
    ):
        return False
    _, kv_heads, head_dim = key.shape
    if any(t.stride(2) != 1 or t.stride(1) != head_dim for t in (key, value)):
        return False
    slots = slot_mapping.contiguous()
    if slots.shape[0] != key.shape[0]:
        return False
    values_at = kv_cache[1]
    code = write(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        slots.data_ptr(),
        key.shape[0],
        kv_heads * head_dim,
        kv_cache.data_ptr(),
        values_at.data_ptr(),
        kv_cache.shape[1] * kv_cache.shape[2],
    )
    if code != 0:
        raise IndexError("write_kv: a slot outside the KV cache")
    return True


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` of float32 ``x`` ``[rows, V]`` (last dim contiguous), int64; None
    where the kernel does not apply."""
    if x.dim() != 2 or x.stride(1) != 1 or not _usable(x) or _argmax is None or 0 in x.shape:
        return None
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    _argmax(x.data_ptr(), x.stride(0), rows, vocab, out.data_ptr())
    return out

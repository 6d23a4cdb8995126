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
take a tenth of that. Built like the other kernels (``native_build``); without a compiler, or
with ``SWITCHBOARD_FUSED_OPS=off``, the layers use their torch code.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from switchboard.models import work_pool
from switchboard.models.native_build import VECTOR_EXP_C, load_library

SOURCE = (
    work_pool.API_C
    + r"""
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* at least this many floats: split the rows across the work pool's threads */
#define PARALLEL_FLOATS 65536

/* rows of a chunk: inputs of fewer than PARALLEL_FLOATS floats stay on the calling thread */
static inline int64_t min_rows(int64_t floats_per_row) {
    return PARALLEL_FLOATS / (floats_per_row > 0 ? floats_per_row : 1);
}

struct rms_task {
    const float *x, *weight;
    float *out;
    int64_t ldx, H;
    float eps;
};

static void rms_rows(void *arg, int64_t r0, int64_t r1) {
    const struct rms_task *t = arg;
    const int64_t H = t->H;
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = t->x + r * t->ldx, *weight = t->weight;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < H; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)H + t->eps);
        float *o = t->out + r * H;
#pragma omp simd
        for (int64_t i = 0; i < H; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}

/* out [rows, H] = x * rsqrt(mean(x^2) + eps) * weight; rows of x at stride ldx */
void rms_norm_f32(const float *x, int64_t ldx, const float *weight, float *out, int64_t rows,
                  int64_t H, float eps) {
    struct rms_task task = {x, weight, out, ldx, H, eps};
    switchboard_parallel_for(rows, min_rows(H), rms_rows, &task);
}

struct rotary_task {
    float *x;
    const float *cos_half, *sin_half;
    int64_t ldx, heads, D;
};

static void rotary_tokens(void *arg, int64_t t0, int64_t t1) {
    const struct rotary_task *task = arg;
    const int64_t half = task->D / 2, D = task->D;
    for (int64_t t = t0; t < t1; t++) {
        const float *c = task->cos_half + t * half, *s = task->sin_half + t * half;
        for (int64_t h = 0; h < task->heads; h++) {
            float *x1 = task->x + t * task->ldx + h * D, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* In place, "rotate half": x [tokens, heads, D] at token stride ldx (heads contiguous);
   cos, sin [tokens, D / 2]. x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. */
void rotary_f32(float *x, int64_t ldx, int64_t tokens, int64_t heads, int64_t D,
                const float *cos_half, const float *sin_half) {
    struct rotary_task task = {x, cos_half, sin_half, ldx, heads, D};
    switchboard_parallel_for(tokens, min_rows(heads * D), rotary_tokens, &task);
}

struct silu_task {
    const float *x;
    float *out;
    int64_t ldx, I;
};

/* no-tree-pre: gcc's partial-redundancy pass otherwise splits the division over exp_f32's
   clamp and computes gate / (1 + e^88.3) for every element as well, a denormal quotient that
   takes a microcode assist: 3x slower on a Zen 3 EPYC (256 x 688: 1.7 -> 0.65 ns an element).
   The values computed are the same. */
__attribute__((optimize("no-tree-pre"))) static void silu_rows(void *arg, int64_t r0,
                                                              int64_t r1) {
    const struct silu_task *t = arg;
    const int64_t I = t->I;
    for (int64_t r = r0; r < r1; r++) {
        const float *gate = t->x + r * t->ldx, *up = gate + I;
        float *o = t->out + r * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = gate[i] / (1.0f + exp_f32(-gate[i])) * up[i];
    }
}

/* out [rows, I] = silu(gate) * up, torch's silu(x) = x / (1 + e^-x); gate = x[:, :I] and
   up = x[:, I:2I], rows of x at stride ldx */
void silu_and_mul_f32(const float *x, int64_t ldx, float *out, int64_t rows, int64_t I) {
    struct silu_task task = {x, out, ldx, I};
    switchboard_parallel_for(rows, min_rows(I), silu_rows, &task);
}

/* cache_k/v [slots, row] <- key/value [tokens, row] (token strides ldk/ldv): what
   index_copy_ does, bounds-checked. Returns 0, or -1 (nothing written) for a slot outside
   the cache. */
int write_kv_f32(const float *key, int64_t ldk, const float *value, int64_t ldv,
                 const int64_t *slots, int64_t tokens, int64_t row, float *cache_k,
                 float *cache_v, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(cache_k + slots[t] * row, key + t * ldk, sizeof(float) * (size_t)row);
        memcpy(cache_v + slots[t] * row, value + t * ldv, sizeof(float) * (size_t)row);
    }
    return 0;
}

struct argmax_task {
    const float *x;
    int64_t *out;
    int64_t ldx, V;
};

static void argmax_rows(void *arg, int64_t r0, int64_t r1) {
    const struct argmax_task *t = arg;
    const float *x = t->x;
    int64_t *out = t->out;
    const int64_t ldx = t->ldx, V = t->V;
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * ldx;
        float best = xr[0];
        int64_t best_i = 0, i = 0;
#ifdef __AVX2__
        if (V >= 16) {
            __m256 bv = _mm256_loadu_ps(xr);
            __m256i bi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = bi;
            const __m256i eight = _mm256_set1_epi32(8);
            __m256 nan = _mm256_cmp_ps(bv, bv, _CMP_UNORD_Q);
            for (i = 8; i + 8 <= V; i += 8) {
                idx = _mm256_add_epi32(idx, eight);
                const __m256 v = _mm256_loadu_ps(xr + i);
                const __m256 gt = _mm256_cmp_ps(v, bv, _CMP_GT_OQ);
                bv = _mm256_blendv_ps(bv, v, gt);
                bi = _mm256_blendv_epi8(bi, idx, _mm256_castps_si256(gt));
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            }
            if (_mm256_movemask_ps(nan)) {
                i = 0; /* a NaN among them: the scalar loop finds the first */
            } else {
                float lane_v[8];
                int32_t lane_i[8];
                _mm256_storeu_ps(lane_v, bv);
                _mm256_storeu_si256((__m256i *)lane_i, bi);
                best = lane_v[0];
                best_i = lane_i[0];
                for (int k = 1; k < 8; k++)
                    if (lane_v[k] > best || (lane_v[k] == best && lane_i[k] < best_i)) {
                        best = lane_v[k];
                        best_i = lane_i[k];
                    }
            }
        }
#endif
        for (; i < V; i++) { /* the tail, or the whole row */
            const float v = xr[i];
            if (v != v) {
                best_i = i;
                break;
            }
            if (v > best) {
                best = v;
                best_i = i;
            }
        }
        out[r] = best_i;
    }
}

/* out[r] = the first index of the largest value of row r of x [rows, V] (row stride ldx), as
   torch.argmax: a NaN is the largest (the first NaN wins). Eight lanes keep their own largest
   value and its index (a later equal value does not replace it); the lanes then agree on the
   largest, the smallest index among equals. */
void argmax_rows_f32(const float *x, int64_t ldx, int64_t rows, int64_t V, int64_t *out) {
    struct argmax_task task = {x, out, ldx, V};
    switchboard_parallel_for(rows, 16 * min_rows(V), argmax_rows, &task);
}

"""
)

_I64, _VOID, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_rms_norm: Callable[..., Any] | None = None
_rotary: Callable[..., Any] | None = None
_silu_and_mul: Callable[..., Any] | None = None
_write_kv: Callable[..., Any] | None = None
_argmax: Callable[..., Any] | None = None
_status = "not loaded"


def load() -> bool:
    """Build (once per machine) and load the kernels; True when they are in use. Idempotent."""
    global _rms_norm, _rotary, _silu_and_mul, _write_kv, _argmax, _status
    if _rms_norm is not None:
        return True
    library, _status = load_library(
        "fused_ops",
        VECTOR_EXP_C + SOURCE,
        "fused CPU layer operations",
        ("SWITCHBOARD_FUSED_OPS", "off"),
    )
    if library is None:
        return False
    library.rms_norm_f32.argtypes = [_VOID, _I64, _VOID, _VOID, _I64, _I64, _F32]
    library.rotary_f32.argtypes = [_VOID, _I64, _I64, _I64, _I64, _VOID, _VOID]
    library.silu_and_mul_f32.argtypes = [_VOID, _I64, _VOID, _I64, _I64]
    library.write_kv_f32.argtypes = [_VOID, _I64, _VOID, _I64, _VOID, _I64, _I64, _VOID, _VOID]
    library.write_kv_f32.argtypes += [_I64]
    library.write_kv_f32.restype = ctypes.c_int
    library.argmax_rows_f32.argtypes = [_VOID, _I64, _I64, _I64, _VOID]
    for function in (
        library.rms_norm_f32,
        library.rotary_f32,
        library.silu_and_mul_f32,
        library.argmax_rows_f32,
    ):
        function.restype = None
    _rms_norm, _rotary = library.rms_norm_f32, library.rotary_f32
    _silu_and_mul, _write_kv = library.silu_and_mul_f32, library.write_kv_f32
    _argmax = library.argmax_rows_f32
    return True


def status() -> str:
    return _status


def unload() -> None:
    """Back to torch's operators (tests compare the two)."""
    global _rms_norm, _rotary, _silu_and_mul, _write_kv, _argmax, _status
    _rms_norm = _rotary = _silu_and_mul = _write_kv = _argmax = None
    _status = "not loaded"


def _usable(*tensors: torch.Tensor) -> bool:
    return _rms_norm is not None and all(
        t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of ``x`` ``[rows, H]`` (last dim contiguous); None where the kernel does not
    apply (the caller computes it with torch)."""
    if x.dim() != 2 or x.stride(1) != 1 or not _usable(x, weight) or _rms_norm is None:
        return None
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=torch.float32)
    _rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, hidden, eps)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate ``x`` ``[tokens, heads, D]`` in place (heads contiguous, any token stride) by
    ``cos``/``sin`` ``[tokens, D / 2]``; False where the kernel does not apply."""
    if (
        x.dim() != 3
        or x.stride(2) != 1
        or x.stride(1) != x.shape[2]
        or not _usable(x, cos, sin)
        or _rotary is None
    ):
        return False
    cos, sin = cos.contiguous(), sin.contiguous()
    tokens, heads, head_dim = x.shape
    _rotary(x.data_ptr(), x.stride(0), tokens, heads, head_dim, cos.data_ptr(), sin.data_ptr())
    return True


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``gate_up`` ``[rows, 2 * I]`` (last dim contiguous); None where
    the kernel does not apply."""
    if (
        gate_up.dim() != 2
        or gate_up.stride(1) != 1
        or gate_up.shape[1] % 2
        or not _usable(gate_up)
        or _silu_and_mul is None
    ):
        return None
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    _silu_and_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width // 2)
    return out


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Store ``key``/``value`` ``[tokens, kv_heads, head_dim]`` (any token stride) in their
    slots of ``kv_cache`` ``[2, blocks, block_size, kv_heads, head_dim]``; False where the
    kernel does not apply. A slot outside the cache raises IndexError, nothing written."""
    if (
        _write_kv is None
        or not _usable(kv_cache, key, value)
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
    code = _write_kv(
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

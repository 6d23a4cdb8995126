"""Matmuls of a few rows (decode at low concurrency) at the memory's speed: a C kernel.

A decode step of one request multiplies one row by every weight matrix: the work is reading
the weights, and oneDNN's kernels (``models/gemm.py``) read them at about half the memory's
speed on a 2-core EPYC. This kernel streams each weight once, in panels of 16 output columns
laid out for it (``[ceil(out / 16), in, 16]``, made at load by ``pack``), and keeps the rows'
sums in registers: two AVX2 vectors per row, ``max_rows`` rows at a time (8 where AVX-512's 32
vector registers hold them, else 6; more rows go in groups over each panel while it is in the
core's cache, so the weight is still read once). Measured on that machine (it has AVX-512),
two threads, a SmolLM2-135M-shaped stack (30 layers and the LM head, cold weights), ms:

    rows            1      2      4      6      8
    oneDNN packed   25.7   29.7   23.6   22.9   27.7
    this kernel     17.1   17.8   20.0   22.0   24.3

and 2.5x / 2.3x / 1.6x / 1.5x / 1.6x faster on tiny-llama's small matrices. There (AVX-512),
from about eight rows oneDNN is as fast (16 / 32 / 64 rows: 0.95x / 0.97x / 1.00x);
``gemm.linear`` uses this up to ``gemm.SMALL_BATCH_MAX_ROWS`` rows (128; 512 with AVX2 alone,
where it measured faster than oneDNN up to 1,024 rows), the one-call decode layer stack
(``decode_stack.py``) likewise: its loops run on the kernels' work pool, never waiting at an
OpenMP barrier for a thread another process holds off its core.

The kernel prefetches each panel's lines 2 KB ahead of its loop (``PREFETCH_AHEAD``, measured
there and in docs/operations.md).

Every output is one fused multiply-add chain over the inputs in order, so a row's result does
not depend on which rows share the call (batch-invariant). The panels are a second copy of
each weight beside oneDNN's (the memory the weights take doubles); ``SWITCHBOARD_SMALL_BATCH_GEMM
=off`` does without it. Built like the decode-attention kernel (``native_build``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from switchboard.models import work_pool
from switchboard.models.native_build import cpu_flags, load_library

PANEL = 16
# Rows one call takes, read from the library at load (8 with AVX-512's registers, else 6);
# 0 while the kernel is not loaded.
max_rows = 0

SOURCE = (
    work_pool.API_C
    + r"""
#include <immintrin.h>
#include <stdint.h>

#define PW 16 /* output columns per panel: two AVX2 vectors */
/* Rows per call: the sums take two vector registers per row; AVX-512's 32 registers hold eight
   rows' worth with room to spare. AVX2's 16 hold six (twelve sums, the panel's two vectors and
   a broadcast): with four, eight independent sums were too few to cover the multiply-add's
   latency on two FMA pipes, and each panel was read from L2 once per four rows. Six rows
   measured 1.3-1.6x faster at 16-64 rows on a Zen 3 EPYC (warm, one thread). */
#ifdef __AVX512VL__
#define MAX_ROWS 8
#else
#define MAX_ROWS 6
#endif

int small_batch_max_rows(void) { return MAX_ROWS; }

/* The weights of a decode step come from memory (they are larger than the caches), and the
   hardware's prefetcher alone left the kernel waiting on them: a software prefetch 2 KB ahead
   made cold-weight products 20-45 % faster at 8 rows and 10-20 % at 32 on the 2-core EPYC
   (LM-head and MLP shapes, 1 and 2 threads); 1 and 4 KB ahead measured about the same. */
#define PREFETCH_AHEAD 32

/* weight [N, K] row-major -> panels [ceil(N / 16), K, 16], zero-padded past N */
void small_batch_pack(const float *w, float *p, int64_t N, int64_t K) {
    const int64_t panels = (N + PW - 1) / PW;
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < panels; q++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < PW; j++) {
                const int64_t n = q * PW + j;
                p[(q * K + k) * PW + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* R rows times one panel, R a constant where it is inlined. The sums are named variables:
   GCC kept an array of them on the stack, storing eight vectors on every step of k. */
#define ROW_FMA(r)                                                                       \
    if (R > r) {                                                                         \
        const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);                           \
        lo##r = _mm256_fmadd_ps(b, w0, lo##r);                                           \
        hi##r = _mm256_fmadd_ps(b, w1, hi##r);                                           \
    }
/* A whole panel's sums go straight to y (the bias added as a vector: the same float sums); the
   last, partial panel through t. Through t for every panel, the copy compiled into `rep movs`,
   whose start-up cost on 64 bytes was about a tenth of the kernel's time in a decode step of 32
   rows. */
#define ROW_STORE(r)                                                                     \
    if (R > r) {                                                                         \
        if (ncols == PW) {                                                               \
            if (bias) {                                                                  \
                lo##r = _mm256_add_ps(lo##r, _mm256_loadu_ps(bias));                     \
                hi##r = _mm256_add_ps(hi##r, _mm256_loadu_ps(bias + 8));                 \
            }                                                                            \
            _mm256_storeu_ps(y + r * ldy, lo##r);                                        \
            _mm256_storeu_ps(y + r * ldy + 8, hi##r);                                    \
        } else {                                                                         \
            _mm256_storeu_ps(t, lo##r);                                                  \
            _mm256_storeu_ps(t + 8, hi##r);                                              \
            for (int64_t j = 0; j < ncols; j++)                                          \
                y[r * ldy + j] = bias ? t[j] + bias[j] : t[j];                           \
        }                                                                                \
    }
static inline __attribute__((always_inline)) void panel_rows(
    const int R, const float *x, int64_t ldx, const float *p, const float *ahead,
    const int ahead_is_next, int64_t K, float *y, int64_t ldy, int64_t ncols,
    const float *bias) {
    __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0,
           lo3 = lo0, hi3 = lo0, lo4 = lo0, hi4 = lo0, lo5 = lo0, hi5 = lo0, lo6 = lo0,
           hi6 = lo0, lo7 = lo0, hi7 = lo0;
    for (int64_t k = 0; k < K; k++) {
        /* One line (a k-row of a panel) a step: see linear_panels for which. A hint never
           faults past the last panel. */
        if (ahead_is_next)
            _mm_prefetch((const char *)(ahead + k * PW), _MM_HINT_T1);
        else
            _mm_prefetch((const char *)(ahead + k * PW), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(p + k * PW), w1 = _mm256_loadu_ps(p + k * PW + 8);
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5) ROW_FMA(6) ROW_FMA(7)
    }
    float t[PW];
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3)
    ROW_STORE(4) ROW_STORE(5) ROW_STORE(6) ROW_STORE(7)
}

/* At most MAX_ROWS rows times one panel. */
static inline void panel_group(int64_t M, const float *x, int64_t ldx, const float *pq,
                               const float *ahead, int ahead_is_next, int64_t K, float *yq,
                               int64_t N, int64_t ncols, const float *bq) {
    switch (M) {
        case 1: panel_rows(1, x, ldx, pq, ahead, ahead_is_next, K, yq, N, ncols, bq); break;
        case 2: panel_rows(2, x, ldx, pq, ahead, ahead_is_next, K, yq, N, ncols, bq); break;
        case 3: panel_rows(3, x, ldx, pq, ahead, ahead_is_next, K, yq, N, ncols, bq); break;
        case 4: panel_rows(4, x, ldx, pq, ahead, ahead_is_next, K, yq, N, ncols, bq); break;
        case 5: panel_rows(5, x, ldx, pq, ahead, ahead_is_next, K, yq, N, ncols, bq); break;
        case 6: panel_rows(6, x, ldx, pq, ahead, ahead_is_next, K, yq, N, ncols, bq); break;
#if MAX_ROWS > 6
        case 7: panel_rows(7, x, ldx, pq, ahead, ahead_is_next, K, yq, N, ncols, bq); break;
        case 8: panel_rows(8, x, ldx, pq, ahead, ahead_is_next, K, yq, N, ncols, bq); break;
#endif
    }
}

struct linear_task {
    const float *x, *p, *bias;
    float *y;
    int64_t ldx, M, K, N;
};

/* panels [q0, q1) of one matmul, every row. The rows go in as few groups as MAX_ROWS allows,
   of nearly equal size (8 rows as 4 + 4, not 6 + 2: a group of few rows does few multiply-adds
   per load of the panel).
   The first group reads the panel from memory, asking for its lines PREFETCH_AHEAD k-rows ahead
   (into the next panel near its end: the panels are contiguous). The later groups read it from
   the caches, and meanwhile ask for the next panel into L2, so that memory works while they
   compute (a step's weights are larger than the caches: otherwise every first group waited on
   memory and every later one left it idle). */
static void linear_panels(void *arg, int64_t q0, int64_t q1) {
    const struct linear_task *t = arg;
    const int64_t groups = (t->M + MAX_ROWS - 1) / MAX_ROWS;
    const int64_t base = t->M / groups, wider = t->M % groups; /* `wider` groups of base + 1 */
    for (int64_t q = q0; q < q1; q++) {
        const int64_t ncols = t->N - q * PW < PW ? t->N - q * PW : PW;
        const float *pq = t->p + q * t->K * PW, *bq = t->bias ? t->bias + q * PW : 0;
        for (int64_t g = 0, r0 = 0; g < groups; g++) {
            const int64_t rows = base + (g < wider);
            const float *ahead = g == 0 ? pq + PREFETCH_AHEAD * PW : pq + t->K * PW;
            panel_group(rows, t->x + r0 * t->ldx, t->ldx, pq, ahead, g > 0, t->K,
                        t->y + r0 * t->N + q * PW, t->N, ncols, bq);
            r0 += rows;
        }
    }
}

/* y [M, N] = x [M, K] (row stride ldx) @ weight^T (+ bias); M >= 1, else -1. More rows than
   MAX_ROWS are taken MAX_ROWS at a time, each group over the same panel while it is still in
   the core's cache (the weight is read from memory once). The panels are split across the
   pool's threads, a chunk being at least PANEL_WORK multiply-adds. */
#define PANEL_WORK 32768
int small_batch_linear(const float *x, int64_t ldx, const float *p, const float *bias, float *y,
                       int64_t M, int64_t K, int64_t N) {
    if (M < 1) return -1;
    const struct linear_task task = {x, p, bias, y, ldx, M, K, N};
    const int64_t per_panel = M * K * PW, min_panels = PANEL_WORK / (per_panel ? per_panel : 1);
    switchboard_parallel_for((N + PW - 1) / PW, min_panels, linear_panels, (void *)&task);
    return 0;
}

"""
)

_I64 = ctypes.c_int64
_VOID = ctypes.c_void_p
_pack: Callable[..., Any] | None = None
_linear: Callable[..., int] | None = None
_status = "not loaded"


def load() -> bool:
    """Build (once per machine) and load the kernel; True when it is in use. Idempotent."""
    global _pack, _linear, _status, max_rows
    if _linear is not None:
        return True
    if not {"avx2", "fma"} <= cpu_flags():
        _status = "unavailable: the CPU has no AVX2 and FMA"
        return False
    library, _status = load_library(
        "small_batch_gemm",
        SOURCE,
        "small-batch matmul kernel",
        ("SWITCHBOARD_SMALL_BATCH_GEMM", "off"),
    )
    if library is None:
        return False
    library.small_batch_pack.argtypes = [_VOID, _VOID, _I64, _I64]
    library.small_batch_pack.restype = None
    library.small_batch_linear.argtypes = [_VOID, _I64, _VOID, _VOID, _VOID, _I64, _I64, _I64]
    library.small_batch_linear.restype = ctypes.c_int
    library.small_batch_max_rows.argtypes = []
    library.small_batch_max_rows.restype = ctypes.c_int
    _pack, _linear = library.small_batch_pack, library.small_batch_linear
    max_rows = library.small_batch_max_rows()
    _status = f"in use ({max_rows} rows at a time)"
    return True


def status() -> str:
    return _status


def unload() -> None:
    """Back to oneDNN alone (tests compare the two)."""
    global _pack, _linear, _status, max_rows
    _pack = _linear = None
    max_rows = 0
    _status = "not loaded"


def packable(weight: torch.Tensor) -> bool:
    return (
        _pack is not None
        and weight.dim() == 2
        and weight.layout == torch.strided
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` as the kernel's panels (a flat float32 tensor)."""
    if not packable(weight) or _pack is None:
        raise ValueError("small-batch pack needs the kernel loaded and a dense float32 CPU matrix")
    out_features, in_features = weight.shape
    dense = weight.detach().contiguous()
    panels = torch.empty(-(-out_features // PANEL) * PANEL * in_features, dtype=torch.float32)
    _pack(dense.data_ptr(), panels.data_ptr(), out_features, in_features)
    return panels


def linear(
    x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W^T + b`` for ``x`` ``[rows, in]`` float32 on CPU (``max_rows`` at a time)."""
    assert _linear is not None, "small_batch_gemm.linear before load()"
    rows, in_features = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(rows, out_features, dtype=torch.float32)
    if rows == 0:  # a step whose prefill chunk samples nothing
        return y
    code = _linear(
        x.data_ptr(),
        x.stride(0),
        panels.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        rows,
        in_features,
        out_features,
    )
    if code != 0:
        raise ValueError(f"small-batch matmul: {rows} rows")
    return y

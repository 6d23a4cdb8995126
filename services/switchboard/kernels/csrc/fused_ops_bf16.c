/* fused_ops.c's operations on bfloat16 tensors (a model run in bfloat16): RMSNorm, rotary
   embedding and SiLU-and-mul, each computed in float32 and rounded to bfloat16 where torch's
   bfloat16 operators round (so the same values but for the order of RMSNorm's sum of squares),
   and the KV-cache write into a bfloat16 cache from float32 keys and values. One call each, on
   the calling thread for small inputs and on the work pool for large ones: torch's operators
   each wake its thread team, which at decode and short-prefill sizes cost more than the
   arithmetic. */
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "bf16.h"
#include "vector_exp.h"
#include "work_pool.h"

#pragma GCC optimize("fp-contract=off")
#include "kernels.h"

#define PARALLEL_ELEMENTS 65536

static inline int64_t min_rows(int64_t per_row) {
    return PARALLEL_ELEMENTS / (per_row > 0 ? per_row : 1);
}

struct rms_task {
    const uint16_t *x, *weight;
    uint16_t *out;
    int64_t ldx, H;
    float eps;
};

/* models/layers.py's RMSNorm in bfloat16: weight * (x * rsqrt(mean(x^2) + eps)).to(bfloat16),
   the normalised value rounded, then the product */
static void rms_rows(void *arg, int64_t r0, int64_t r1) {
    const struct rms_task *t = arg;
    const int64_t H = t->H;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *xr = t->x + r * t->ldx;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < H; i++) sum += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
        const float inv = 1.0f / sqrtf(sum / (float)H + t->eps);
        uint16_t *o = t->out + r * H;
#pragma omp simd
        for (int64_t i = 0; i < H; i++)
            o[i] = bf16_from_f32(bf16_to_f32(t->weight[i]) * bf16_round(bf16_to_f32(xr[i]) * inv));
    }
}

void rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *weight, uint16_t *out,
                   int64_t rows, int64_t H, float eps) {
    struct rms_task task = {x, weight, out, ldx, H, eps};
    switchboard_parallel_for(rows, min_rows(H), rms_rows, &task);
}

struct rotary_task {
    uint16_t *x;
    const uint16_t *cos_half, *sin_half;
    int64_t ldx, heads, D;
};

/* torch's x1 * cos - x2 * sin and x2 * cos + x1 * sin in bfloat16: every product and sum
   rounded */
static void rotary_tokens(void *arg, int64_t t0, int64_t t1) {
    const struct rotary_task *task = arg;
    const int64_t half = task->D / 2, D = task->D;
    for (int64_t t = t0; t < t1; t++) {
        const uint16_t *c = task->cos_half + t * half, *s = task->sin_half + t * half;
        for (int64_t h = 0; h < task->heads; h++) {
            uint16_t *x1 = task->x + t * task->ldx + h * D, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
                const float ci = bf16_to_f32(c[i]), si = bf16_to_f32(s[i]);
                x1[i] = bf16_from_f32(bf16_round(a * ci) - bf16_round(b * si));
                x2[i] = bf16_from_f32(bf16_round(b * ci) + bf16_round(a * si));
            }
        }
    }
}

void rotary_bf16(uint16_t *x, int64_t ldx, int64_t tokens, int64_t heads, int64_t D,
                 const uint16_t *cos_half, const uint16_t *sin_half) {
    struct rotary_task task = {x, cos_half, sin_half, ldx, heads, D};
    switchboard_parallel_for(tokens, min_rows(heads * D), rotary_tokens, &task);
}

struct silu_task {
    const uint16_t *x;
    uint16_t *out;
    int64_t ldx, I;
};

/* torch's silu(gate) * up in bfloat16: silu computed in float32 and rounded, then the
   product rounded (no-tree-pre and the vector width: see fused_ops.c) */
__attribute__((optimize("no-tree-pre"), target("prefer-vector-width=512"))) static void
silu_rows(void *arg, int64_t r0, int64_t r1) {
    const struct silu_task *t = arg;
    const int64_t I = t->I;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *gate = t->x + r * t->ldx, *up = gate + I;
        uint16_t *o = t->out + r * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            const float g = bf16_to_f32(gate[i]);
            o[i] = bf16_from_f32(bf16_round(g / (1.0f + exp_f32(-g))) * bf16_to_f32(up[i]));
        }
    }
}

void silu_and_mul_bf16(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t rows, int64_t I) {
    struct silu_task task = {x, out, ldx, I};
    switchboard_parallel_for(rows, min_rows(I), silu_rows, &task);
}

/* write_kv_f32 into a bfloat16 cache: each float rounded to nearest even */
int write_kv_bf16(const float *key, int64_t ldk, const float *value, int64_t ldv,
                  const int64_t *slots, int64_t tokens, int64_t row, uint16_t *cache_k,
                  uint16_t *cache_v, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        uint16_t *k = cache_k + slots[t] * row, *v = cache_v + slots[t] * row;
        const float *kt = key + t * ldk, *vt = value + t * ldv;
#pragma omp simd
        for (int64_t i = 0; i < row; i++) {
            k[i] = bf16_from_f32(kt[i]);
            v[i] = bf16_from_f32(vt[i]);
        }
    }
    return 0;
}

/* Rows of bfloat16 widened to float32 and float32 sums rounded to bfloat16 (as torch's `.to`
   rounds): the bfloat16 matmul kernel's input and output in a bfloat16 layer. torch's copy
   wakes its OpenMP team for anything past 32,768 values, whose second thread then waits for a
   core the kernels' pool holds: in a step of 64 decodes and a 32-token prompt (llama-100m)
   those copies took a quarter of the layers' time. */
struct convert_task {
    const void *x;
    void *out;
    int64_t ldx, cols;
};

static void widen_rows(void *arg, int64_t r0, int64_t r1) {
    const struct convert_task *t = arg;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *xr = (const uint16_t *)t->x + r * t->ldx;
        float *o = (float *)t->out + r * t->cols;
        for (int64_t i = 0; i < t->cols; i++) o[i] = bf16_to_f32(xr[i]);
    }
}

static void narrow_rows(void *arg, int64_t r0, int64_t r1) {
    const struct convert_task *t = arg;
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = (const float *)t->x + r * t->ldx;
        uint16_t *o = (uint16_t *)t->out + r * t->cols;
        int64_t i = 0;
#ifdef __AVX512F__
        /* bf16_from_f32 sixteen at a time (the compiler left its NaN test scalar) */
        const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff),
                      abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000),
                      qnan = _mm512_set1_epi32(0x7fc0);
        for (; i + 16 <= t->cols; i += 16) {
            const __m512i u = _mm512_loadu_si512(xr + i);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
            __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, half), odd), 16);
            const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
            h = _mm512_mask_mov_epi32(h, nan, qnan);
            _mm256_storeu_si256((__m256i *)(o + i), _mm512_cvtepi32_epi16(h));
        }
#endif
        for (; i < t->cols; i++) o[i] = bf16_from_f32(xr[i]);
    }
}

void bf16_rows_to_f32(const uint16_t *x, int64_t ldx, float *out, int64_t rows, int64_t cols) {
    struct convert_task task = {x, out, ldx, cols};
    switchboard_parallel_for(rows, min_rows(cols), widen_rows, &task);
}

void f32_rows_to_bf16(const float *x, int64_t ldx, uint16_t *out, int64_t rows, int64_t cols) {
    struct convert_task task = {x, out, ldx, cols};
    switchboard_parallel_for(rows, min_rows(cols), narrow_rows, &task);
}

/* out = a + b in bfloat16: each sum in float32 rounded once, as torch adds bfloat16 tensors */
struct add_bf16_task {
    const uint16_t *a, *b;
    uint16_t *out;
    int64_t lda, ldb, cols;
};

static void add_bf16_rows(void *arg, int64_t r0, int64_t r1) {
    const struct add_bf16_task *t = arg;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *ar = t->a + r * t->lda, *br = t->b + r * t->ldb;
        uint16_t *o = t->out + r * t->cols;
        for (int64_t i = 0; i < t->cols; i++)
            o[i] = bf16_from_f32(bf16_to_f32(ar[i]) + bf16_to_f32(br[i]));
    }
}

void add_bf16(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, uint16_t *out,
              int64_t rows, int64_t cols) {
    struct add_bf16_task task = {a, b, out, lda, ldb, cols};
    switchboard_parallel_for(rows, min_rows(cols), add_bf16_rows, &task);
}

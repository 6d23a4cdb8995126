/* fused_ops.c's operations on bfloat16 tensors (a model run in bfloat16): RMSNorm, rotary
   embedding and SiLU-and-mul, each computed in float32 and rounded to bfloat16 where torch's
   bfloat16 operators round (so the same values but for the order of RMSNorm's sum of squares),
   and the KV-cache write into a bfloat16 cache from float32 keys and values. One call each, on
   the calling thread for small inputs and on the work pool for large ones: torch's operators
   each wake its thread team, which at decode and short-prefill sizes cost more than the
   arithmetic. */
#include <math.h>
#include <stdint.h>

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
   product rounded (no-tree-pre: see fused_ops.c) */
__attribute__((optimize("no-tree-pre"))) static void silu_rows(void *arg, int64_t r0,
                                                              int64_t r1) {
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

/* A layer's small float32 operations on CPU: RMSNorm, rotary embedding, SiLU-and-mul, the
   KV-cache write, and the greedy pick (the first index of each row's largest logit). Each is one
   call, on the calling thread for small inputs and on the work pool for large ones.

   Everything below exp_f32 is built without fused multiply-adds (fp-contract=off): the rotary
   embedding then computes exactly torch's products and sums. exp_f32 itself is defined before
   the pragma, as the other kernels have it. */
#include <stdint.h>
#include <string.h>

#include "vector_exp.h"
#include "work_pool.h"

#pragma GCC optimize("fp-contract=off")
#include "kernels.h"
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

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
   The values computed are the same.
   prefer-vector-width=512: where the CPU has AVX-512, sixteen elements a vector instead of the
   eight gcc's -march=native picks (each element's arithmetic unchanged, so are the values):
   bfloat16 64 x 1536 on one thread 87 -> 60 us on a Xeon with AMX. Ignored without AVX-512. */
__attribute__((optimize("no-tree-pre"), target("prefer-vector-width=512"))) static void
silu_rows(void *arg, int64_t r0, int64_t r1) {
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

/* The independent chains of compares the greedy pick keeps (8 floats each): one chain's
   compare-and-blend waits on the one before it. */
#define ARGMAX_CHAINS 4

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
        if (V >= 8 * ARGMAX_CHAINS) {
            /* ARGMAX_CHAINS vectors of eight lanes, each lane its own positions (i + lane,
               ARGMAX_CHAINS * 8 apart): the chains' compare-and-blend wait on each other's
               latency only every ARGMAX_CHAINS loads */
            __m256 bv[ARGMAX_CHAINS], nan = _mm256_setzero_ps();
            __m256i bi[ARGMAX_CHAINS], idx[ARGMAX_CHAINS];
            const __m256i step = _mm256_set1_epi32(8 * ARGMAX_CHAINS);
            for (int c = 0; c < ARGMAX_CHAINS; c++) {
                bv[c] = _mm256_loadu_ps(xr + 8 * c);
                bi[c] = idx[c] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                   _mm256_set1_epi32(8 * c));
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(bv[c], bv[c], _CMP_UNORD_Q));
            }
            for (i = 8 * ARGMAX_CHAINS; i + 8 * ARGMAX_CHAINS <= V; i += 8 * ARGMAX_CHAINS)
                for (int c = 0; c < ARGMAX_CHAINS; c++) {
                    idx[c] = _mm256_add_epi32(idx[c], step);
                    const __m256 v = _mm256_loadu_ps(xr + i + 8 * c);
                    const __m256 gt = _mm256_cmp_ps(v, bv[c], _CMP_GT_OQ);
                    bv[c] = _mm256_blendv_ps(bv[c], v, gt);
                    bi[c] = _mm256_blendv_epi8(bi[c], idx[c], _mm256_castps_si256(gt));
                    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                }
            if (_mm256_movemask_ps(nan)) {
                i = 0; /* a NaN among them: the scalar loop finds the first */
            } else {
                float lane_v[8 * ARGMAX_CHAINS];
                int32_t lane_i[8 * ARGMAX_CHAINS];
                for (int c = 0; c < ARGMAX_CHAINS; c++) {
                    _mm256_storeu_ps(lane_v + 8 * c, bv[c]);
                    _mm256_storeu_si256((__m256i *)(lane_i + 8 * c), bi[c]);
                }
                best = lane_v[0];
                best_i = lane_i[0];
                for (int k = 1; k < 8 * ARGMAX_CHAINS; k++)
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
   torch.argmax: a NaN is the largest (the first NaN wins). 32 lanes (rows of at least 32
   values) keep their own largest value and its index (a later equal value does not replace
   it); the lanes then agree on the largest, the smallest index among equals. */
void argmax_rows_f32(const float *x, int64_t ldx, int64_t rows, int64_t V, int64_t *out) {
    struct argmax_task task = {x, out, ldx, V};
    switchboard_parallel_for(rows, 16 * min_rows(V), argmax_rows, &task);
}

/* out = a + b, rows of cols floats (a layer's residual add): torch's add wakes its OpenMP team
   past 32,768 values, whose second thread then waits for a core the kernels' pool holds. */
struct add_task {
    const float *a, *b;
    float *out;
    int64_t lda, ldb, cols;
};

static void add_rows(void *arg, int64_t r0, int64_t r1) {
    const struct add_task *t = arg;
    for (int64_t r = r0; r < r1; r++) {
        const float *ar = t->a + r * t->lda, *br = t->b + r * t->ldb;
        float *o = t->out + r * t->cols;
        for (int64_t i = 0; i < t->cols; i++) o[i] = ar[i] + br[i];
    }
}

void add_f32(const float *a, int64_t lda, const float *b, int64_t ldb, float *out, int64_t rows,
             int64_t cols) {
    struct add_task task = {a, b, out, lda, ldb, cols};
    switchboard_parallel_for(rows, min_rows(cols), add_rows, &task);
}

/* Decode attention on CPU that reads the paged KV cache in place.

   The torch path gathers every request's whole context out of the cache into a new tensor, per
   layer per step, before attending; this walks each request's block table instead and reads
   every key and value once, where it lies: one task per request (per request and KV head when
   requests are fewer than threads) computes the scores of its query heads, a float32 softmax
   (max subtracted) and the weighted sum of the values. The tasks run on the work pool. */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "vector_exp.h"
#include "work_pool.h"

/* The end of token t's block (or len), and where KV head h0 of token t lies in the cache. */
static inline int64_t block_stop(int64_t t, int64_t BS, int64_t len) {
    const int64_t end = t - t % BS + BS;
    return end < len ? end : len;
}

static inline int64_t slot_at(const int64_t *table, int64_t t, int64_t BS, int64_t KVH,
                              int64_t h0, int64_t D) {
    return ((table[t / BS] * BS + t % BS) * KVH + h0) * D;
}

/* Element i of a cache of float32 (bf16 == 0) or bfloat16 values (bf16 a constant where
   inlined): a bfloat16 is a float32's high half, widened by a shift. */
static inline float load1(const void *cache, int64_t i, const int bf16) {
    if (!bf16) return ((const float *)cache)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)cache)[i] << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

/* Each of the nq rows of scores [nq, L] in place: a float32 softmax, its max subtracted. */
static inline void softmax_rows(float *scores, int64_t nq, int64_t L) {
    for (int64_t j = 0; j < nq; j++) {
        float *s = scores + j * L;
        float max = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : max)
        for (int64_t i = 0; i < L; i++) max = s[i] > max ? s[i] : max;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < L; i++) {
            s[i] = exp_f32(s[i] - max);
            sum += s[i];
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma omp simd
        for (int64_t i = 0; i < L; i++) s[i] *= inv;
    }
}

/* One task: request b's query heads of KV heads h0 .. h0 + nkv - 1 (query head j = h * G + g
   reads KV head h). scores [nq, L] and acc [nq, D] are the task's scratch. Inlined with D a
   constant for the common head sizes (32, 64, 128), so the dot products and sums unroll into
   registers.
   Blocks are walked one at a time: the block table is read and divided once per block, then
   the block's slots follow each other in memory. */
static inline __attribute__((always_inline)) void attend(
    const float *q, const void *keys, const void *values, const int bf16, const int64_t *table,
    float *o, float *scores, float *acc, int64_t start, int64_t len, int64_t nkv, int64_t G,
    int64_t KVH, int64_t BS, int64_t h0, const int64_t D, float scale) {
    const int64_t L = len - start, nq = nkv * G, slot_stride = KVH * D;
    for (int64_t t = start; t < len;) {
        const int64_t stop = block_stop(t, BS, len);
        int64_t slot = slot_at(table, t, BS, KVH, h0, D);
        for (; t < stop; t++, slot += slot_stride) {
            for (int64_t h = 0; h < nkv; h++) {
                const int64_t kh = slot + h * D;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t j = h * G + g;
                    const float *qj = q + j * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qj[d] * load1(keys, kh + d, bf16);
                    scores[j * L + (t - start)] = dot * scale;
                }
            }
        }
    }
    softmax_rows(scores, nq, L);
    for (int64_t i = 0; i < nq * D; i++) acc[i] = 0.0f;
    for (int64_t t = start; t < len;) {
        const int64_t stop = block_stop(t, BS, len);
        int64_t slot = slot_at(table, t, BS, KVH, h0, D);
        for (; t < stop; t++, slot += slot_stride) {
            for (int64_t h = 0; h < nkv; h++) {
                const int64_t vh = slot + h * D;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t j = h * G + g;
                    const float p = scores[j * L + (t - start)];
                    float *a = acc + j * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] += p * load1(values, vh + d, bf16);
                }
            }
        }
    }
    for (int64_t i = 0; i < nq * D; i++) o[i] = acc[i];
}

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_ATTEND_VEC 1
/* The eight sums of a0 .. a7's lanes, in that order. */
static inline __m256 sum8_lanes(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4,
                                __m256 a5, __m256 a6, __m256 a7) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

static inline float sum_lanes(__m256 a) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* Eight elements of the cache from element i, as float32 (see load1). */
static inline __m256 load8(const void *cache, int64_t i, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)cache + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* q . k over D floats (D a multiple of 8; k an element index) as one vector of partial sums. */
#define DOT_LANES(qv, k, D, out)                                                         \
    do {                                                                                 \
        out = _mm256_mul_ps(qv[0], load8(keys, k, bf16));                                \
        for (int64_t c = 1; c < (D) / 8; c++)                                            \
            out = _mm256_fmadd_ps(qv[c], load8(keys, (k) + 8 * c, bf16), out);           \
    } while (0)

/* attend() for D a multiple of 8 (up to 128), in AVX2 vectors: the scores of eight keys at a
   time (one vector of partial sums per key, then one transposing reduction for all eight,
   instead of a horizontal sum per key), and each query head's weighted sum of the values kept
   in registers across the context (instead of a load and a store of the sums per value row). */
static inline __attribute__((always_inline)) void attend_vec(
    const float *q, const void *keys, const void *values, const int bf16, const int64_t *table,
    float *o, float *scores, int64_t start, int64_t len, int64_t nkv, int64_t G, int64_t KVH,
    int64_t BS, int64_t h0, const int64_t D, float scale) {
    const int64_t L = len - start, nq = nkv * G, slot_stride = KVH * D;
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (int64_t h = 0; h < nkv; h++) {
        for (int64_t t = start; t < len;) {
            const int64_t stop = block_stop(t, BS, len);
            const int64_t slot = slot_at(table, t, BS, KVH, h0 + h, D);
            for (int64_t g = 0; g < G; g++) {
                const int64_t j = h * G + g;
                __m256 qv[16];
                for (int64_t c = 0; c < D / 8; c++) qv[c] = _mm256_loadu_ps(q + j * D + 8 * c);
                float *sj = scores + j * L;
                int64_t k = slot;
                int64_t u = t;
                for (; u + 8 <= stop; u += 8, k += 8 * slot_stride) {
                    __m256 a0, a1, a2, a3, a4, a5, a6, a7;
                    DOT_LANES(qv, k, D, a0);
                    DOT_LANES(qv, k + slot_stride, D, a1);
                    DOT_LANES(qv, k + 2 * slot_stride, D, a2);
                    DOT_LANES(qv, k + 3 * slot_stride, D, a3);
                    DOT_LANES(qv, k + 4 * slot_stride, D, a4);
                    DOT_LANES(qv, k + 5 * slot_stride, D, a5);
                    DOT_LANES(qv, k + 6 * slot_stride, D, a6);
                    DOT_LANES(qv, k + 7 * slot_stride, D, a7);
                    _mm256_storeu_ps(sj + (u - start),
                                     _mm256_mul_ps(sum8_lanes(a0, a1, a2, a3, a4, a5, a6, a7),
                                                   scale8));
                }
                for (; u < stop; u++, k += slot_stride) {
                    __m256 a;
                    DOT_LANES(qv, k, D, a);
                    sj[u - start] = sum_lanes(a) * scale;
                }
            }
            t = stop;
        }
    }
    softmax_rows(scores, nq, L);
    for (int64_t h = 0; h < nkv; h++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t j = h * G + g;
            const float *sj = scores + j * L;
            __m256 acc[16];
            for (int64_t c = 0; c < D / 8; c++) acc[c] = _mm256_setzero_ps();
            for (int64_t t = start; t < len;) {
                const int64_t stop = block_stop(t, BS, len);
                int64_t v = slot_at(table, t, BS, KVH, h0 + h, D);
                for (; t < stop; t++, v += slot_stride) {
                    const __m256 p = _mm256_set1_ps(sj[t - start]);
                    for (int64_t c = 0; c < D / 8; c++)
                        acc[c] = _mm256_fmadd_ps(p, load8(values, v + 8 * c, bf16), acc[c]);
                }
            }
            for (int64_t c = 0; c < D / 8; c++) _mm256_storeu_ps(o + j * D + 8 * c, acc[c]);
        }
}
#endif

/* One task's attention (bf16 a constant where inlined): the vector version for the head
   sizes it takes, D a constant for the common ones. */
static inline __attribute__((always_inline)) void attend_any(
    const float *q, const void *kv, const void *values, const int bf16, const int64_t *table,
    float *o, float *scores, float *acc, int64_t start, int64_t len, int64_t nkv, int64_t G,
    int64_t KVH, int64_t BS, int64_t h0, int64_t D, float scale) {
#ifdef HAVE_ATTEND_VEC
    if (D == 32)
        attend_vec(q, kv, values, bf16, table, o, scores, start, len, nkv, G, KVH, BS, h0, 32,
                   scale);
    else if (D == 64)
        attend_vec(q, kv, values, bf16, table, o, scores, start, len, nkv, G, KVH, BS, h0, 64,
                   scale);
    else if (D == 128)
        attend_vec(q, kv, values, bf16, table, o, scores, start, len, nkv, G, KVH, BS, h0, 128,
                   scale);
    else if (D % 8 == 0 && D <= 128)
        attend_vec(q, kv, values, bf16, table, o, scores, start, len, nkv, G, KVH, BS, h0, D,
                   scale);
    else
#endif
        attend(q, kv, values, bf16, table, o, scores, acc, start, len, nkv, G, KVH, BS, h0, D,
               scale);
}

/* query [B, H, D] (rows at stride ldq); kv [2, NB, BS, KVH, D] (keys, then values);
   block_table [B, MB]; context_lens [B]; out [B, H, D]. window > 0: a query at position
   len - 1 sees keys at positions > len - 1 - window. Returns 0, or -1 when scratch memory could
   not be allocated.
   A task is one request and a run of its KV heads: all of them when there are requests enough
   to keep every thread busy (each key/value slot is then read as one contiguous run, which the
   prefetcher streams), one head each otherwise. */
struct decode_task {
    const float *query;
    const void *kv, *values; /* float32 or bfloat16 (bf16) */
    int bf16;
    const int64_t *block_table, *context_lens;
    float *out;
    int64_t ldq, H, KVH, D, G, BS, MB, window, heads_per_task, tasks_per_row;
    float scale;
    _Atomic int failed;
};

static void decode_tasks(void *arg, int64_t first, int64_t stop) {
    struct decode_task *t = arg;
    const float *query = t->query;
    const void *kv = t->kv, *values = t->values;
    const int bf16 = t->bf16;
    const int64_t *block_table = t->block_table, *context_lens = t->context_lens;
    float *out = t->out;
    const int64_t ldq = t->ldq, H = t->H, KVH = t->KVH, D = t->D, G = t->G, BS = t->BS;
    const int64_t MB = t->MB, window = t->window, heads_per_task = t->heads_per_task;
    const int64_t tasks_per_row = t->tasks_per_row;
    const float scale = t->scale;
    for (int64_t task = first; task < stop; task++) {
        const int64_t b = task / tasks_per_row;
        const int64_t h0 = (task % tasks_per_row) * heads_per_task;
        const int64_t nq = heads_per_task * G;
        const int64_t len = context_lens[b];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int64_t L = len - start;
        float *scores = malloc(sizeof(float) * (size_t)(nq * (L > 0 ? L : 1) + nq * D));
        if (scores == NULL) {
            atomic_store(&t->failed, 1);
            continue;
        }
        float *acc = scores + nq * L;
        const float *q = query + b * ldq + h0 * G * D; /* this task's nq query heads */
        float *o = out + (b * H + h0 * G) * D;
        const int64_t *table = block_table + b * MB;
        if (bf16)
            attend_any(q, kv, values, 1, table, o, scores, acc, start, len, heads_per_task, G,
                       KVH, BS, h0, D, scale);
        else
            attend_any(q, kv, values, 0, table, o, scores, acc, start, len, heads_per_task, G,
                       KVH, BS, h0, D, scale);
        free(scores);
    }
}

static int paged_decode(const float *query, int64_t ldq, const void *kv, int bf16,
                        const int64_t *block_table, const int64_t *context_lens, float *out,
                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t NB, int64_t BS,
                        int64_t MB, float scale, int64_t window) {
    const int64_t heads_per_task = B >= omp_get_max_threads() ? KVH : 1;
    const int64_t element = bf16 ? 2 : 4;
    struct decode_task task = {
        query, kv, (const char *)kv + NB * BS * KVH * D * element, bf16, block_table,
        context_lens, out, ldq, H, KVH, D, H / KVH, BS, MB, window, heads_per_task,
        KVH / heads_per_task, scale, 0};
    switchboard_parallel_for(B * task.tasks_per_row, 1, decode_tasks, &task);
    return atomic_load(&task.failed) ? -1 : 0;
}

int paged_decode_f32(const float *query, int64_t ldq, const float *kv, const int64_t *block_table,
                     const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t KVH,
                     int64_t D, int64_t NB, int64_t BS, int64_t MB, float scale,
                     int64_t window) {
    return paged_decode(query, ldq, kv, 0, block_table, context_lens, out, B, H, KVH, D, NB, BS,
                        MB, scale, window);
}

int paged_decode_bf16kv(const float *query, int64_t ldq, const uint16_t *kv,
                        const int64_t *block_table, const int64_t *context_lens, float *out,
                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t NB, int64_t BS,
                        int64_t MB, float scale, int64_t window) {
    return paged_decode(query, ldq, kv, 1, block_table, context_lens, out, B, H, KVH, D, NB, BS,
                        MB, scale, window);
}

/* Decode attention on CPU that reads the paged KV cache in place.

   The torch path gathers every request's whole context out of the cache into a new tensor, per
   layer per step, before attending; this walks each request's block table instead and reads
   every key and value once, where it lies: one task per request (per request and KV head when
   requests are fewer than threads) computes the scores of its query heads, a float32 softmax
   (max subtracted) and the weighted sum of the values. Rows that read the same keys (a decode
   with its speculative proposals, a prompt chunk: one block table, each row's context ending
   at its own position) go in groups, which read each block once for up to 16 rows while it is
   in cache; each row's floats are what it gets alone. The tasks run on the work pool. Where
   the compiler targets AVX-512, paged_decode_512.h takes the head sizes it can (a bfloat16 block
   widened once for all the rows and query heads that read it); the AVX2 code below the rest. */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "vector_exp.h"
#include "work_pool.h"

/* CALL(D) with D a constant for the common head sizes (32, 64, 128), so that a vector kernel's
   loops over a head unroll into registers; other sizes pass D as it is. */
#define BY_HEAD_SIZE(CALL, D) \
    do {                      \
        if ((D) == 32)        \
            CALL(32);         \
        else if ((D) == 64)   \
            CALL(64);         \
        else if ((D) == 128)  \
            CALL(128);        \
        else                  \
            CALL(D);          \
    } while (0)

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

/* Each of the nq rows of L scores (stride apart) in place: a float32 softmax, its max
   subtracted. */
static inline void softmax_rows(float *scores, int64_t nq, int64_t stride, int64_t L) {
    for (int64_t j = 0; j < nq; j++) {
        float *s = scores + j * stride;
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
    softmax_rows(scores, nq, L, L);
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

/* One query row's scaled scores against the keys of positions t..stop of one block (the first
   at slot k0), into scores[t - start .. stop - start]: eight keys at a time, then one by one. */
static inline __attribute__((always_inline)) void score_keys(
    const __m256 *qv, const void *keys, const int bf16, int64_t k0, int64_t t, int64_t stop,
    int64_t start, int64_t slot_stride, const int64_t D, float scale, float *scores) {
    const __m256 scale8 = _mm256_set1_ps(scale);
    int64_t k = k0;
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
        _mm256_storeu_ps(scores + (u - start),
                         _mm256_mul_ps(sum8_lanes(a0, a1, a2, a3, a4, a5, a6, a7), scale8));
    }
    for (; u < stop; u++, k += slot_stride) {
        __m256 a;
        DOT_LANES(qv, k, D, a);
        scores[u - start] = sum_lanes(a) * scale;
    }
}

/* attend() for D a multiple of 8 (up to 128), in AVX2 vectors: the scores of eight keys at a
   time (one vector of partial sums per key, then one transposing reduction for all eight,
   instead of a horizontal sum per key), and each query head's weighted sum of the values kept
   in registers across the context (instead of a load and a store of the sums per value row). */
static inline __attribute__((always_inline)) void attend_vec(
    const float *q, const void *keys, const void *values, const int bf16, const int64_t *table,
    float *o, float *scores, int64_t start, int64_t len, int64_t nkv, int64_t G, int64_t KVH,
    int64_t BS, int64_t h0, const int64_t D, float scale) {
    const int64_t L = len - start, nq = nkv * G, slot_stride = KVH * D;
    for (int64_t h = 0; h < nkv; h++) {
        for (int64_t t = start; t < len;) {
            const int64_t stop = block_stop(t, BS, len);
            const int64_t slot = slot_at(table, t, BS, KVH, h0 + h, D);
            for (int64_t g = 0; g < G; g++) {
                const int64_t j = h * G + g;
                __m256 qv[16];
                for (int64_t c = 0; c < D / 8; c++) qv[c] = _mm256_loadu_ps(q + j * D + 8 * c);
                float *sj = scores + j * L;
                score_keys(qv, keys, bf16, slot, t, stop, start, slot_stride, D, scale, sj);
            }
            t = stop;
        }
    }
    softmax_rows(scores, nq, L, L);
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

/* attend_vec for R rows that read the same keys (one block table, one window start: a decode
   and its proposed tokens, or a prompt chunk) and one KV head h, each row to its own len: a
   block's keys and values are read for every row while they are in cache, where a task per row
   read the whole context again. Each row's floats are attend_vec's alone: the same dot products
   over the same keys in the same eights, the same softmax, and each head's weighted sum of the
   values in the order of the keys (held in acc [R, G, D] between blocks: a store and a load
   change no float). scores [R, G, Lmax]. */
static inline __attribute__((always_inline)) void attend_rows_vec(
    const float *query, int64_t ldq, const void *keys, const void *values, const int bf16,
    const int64_t *table, const int64_t *lens, int64_t R, float *out, int64_t H, float *scores,
    float *acc, int64_t start, int64_t Lmax, int64_t G, int64_t KVH, int64_t BS, int64_t h,
    const int64_t D, float scale) {
    const int64_t slot_stride = KVH * D, end = start + Lmax;
    for (int64_t t = start; t < end;) {
        const int64_t block_end = t - t % BS + BS;
        const int64_t slot = slot_at(table, t, BS, KVH, h, D);
        for (int64_t r = 0; r < R; r++) {
            const int64_t len = lens[r];
            if (t >= len) continue;
            const int64_t stop = block_end < len ? block_end : len;
            for (int64_t g = 0; g < G; g++) {
                const float *qj = query + r * ldq + (h * G + g) * D;
                __m256 qv[16];
                for (int64_t c = 0; c < D / 8; c++) qv[c] = _mm256_loadu_ps(qj + 8 * c);
                float *sj = scores + (r * G + g) * Lmax;
                score_keys(qv, keys, bf16, slot, t, stop, start, slot_stride, D, scale, sj);
            }
        }
        t = block_end;
    }
    for (int64_t r = 0; r < R; r++) softmax_rows(scores + r * G * Lmax, G, Lmax, lens[r] - start);
    for (int64_t i = 0; i < R * G * D; i++) acc[i] = 0.0f;
    for (int64_t t = start; t < end;) {
        const int64_t block_end = t - t % BS + BS;
        const int64_t slot = slot_at(table, t, BS, KVH, h, D);
        for (int64_t r = 0; r < R; r++) {
            const int64_t len = lens[r];
            if (t >= len) continue;
            const int64_t stop = block_end < len ? block_end : len;
            for (int64_t g = 0; g < G; g++) {
                const float *sj = scores + (r * G + g) * Lmax;
                float *aj = acc + (r * G + g) * D;
                __m256 a[16];
                for (int64_t c = 0; c < D / 8; c++) a[c] = _mm256_loadu_ps(aj + 8 * c);
                int64_t v = slot;
                for (int64_t u = t; u < stop; u++, v += slot_stride) {
                    const __m256 p = _mm256_set1_ps(sj[u - start]);
                    for (int64_t c = 0; c < D / 8; c++)
                        a[c] = _mm256_fmadd_ps(p, load8(values, v + 8 * c, bf16), a[c]);
                }
                for (int64_t c = 0; c < D / 8; c++) _mm256_storeu_ps(aj + 8 * c, a[c]);
            }
        }
        t = block_end;
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++)
                out[(r * H + h * G + g) * D + d] = acc[(r * G + g) * D + d];
}

/* Whether attend_rows_vec takes rows of head size D (else a group's rows are tasks of their
   own). */
static inline int rows_grouped(int64_t D) { return D % 8 == 0 && D <= 128; }

/* attend_rows_vec with D a constant for the common head sizes (D: one rows_grouped takes). */
static inline __attribute__((always_inline)) void attend_rows_any(
    const float *query, int64_t ldq, const void *keys, const void *values, const int bf16,
    const int64_t *table, const int64_t *lens, int64_t R, float *out, int64_t H, float *scores,
    float *acc, int64_t start, int64_t Lmax, int64_t G, int64_t KVH, int64_t BS, int64_t h,
    int64_t D, float scale) {
#define ROWS_CALL(DD)                                                                         \
    attend_rows_vec(query, ldq, keys, values, bf16, table, lens, R, out, H, scores, acc, start, \
                    Lmax, G, KVH, BS, h, DD, scale)
    BY_HEAD_SIZE(ROWS_CALL, D);
#undef ROWS_CALL
}
#else
static inline int rows_grouped(int64_t D) { (void)D; return 0; }
#endif

#if defined(HAVE_ATTEND_VEC) && defined(__AVX512F__)
#define HAVE_ATTEND_512 1
#include "paged_decode_512.h"
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
   prefetcher streams), one head each otherwise. Consecutive rows with the same block table and
   window start (a decode with its proposed tokens, a prompt chunk) are a group instead: a task
   is up to GROUP_ROWS of its rows and one KV head, which reads each key once for its rows
   (attend_rows_vec) where a task per row read the context once per row. A row's floats are the
   same either way. */
/* The most rows of a group a task takes, and the most scores (rows x G x context floats): a
   task of a long context takes fewer rows */
#define GROUP_ROWS 16
#define GROUP_SCORES (1 << 20)
#define UNIT_FIELDS 4 /* a task of a grouped step: first row, rows, first KV head, KV heads */

struct decode_task {
    const float *query;
    const void *kv, *values; /* float32 or bfloat16 (bf16) */
    int bf16;
    const int64_t *block_table, *context_lens;
    float *out;
    int64_t ldq, H, KVH, D, G, BS, MB, window, heads_per_task, tasks_per_row;
    float scale;
    const int64_t *units; /* NULL: task i is row i / tasks_per_row, heads_per_task of its heads */
    _Atomic int failed;
};

static inline int64_t window_start(int64_t len, int64_t window) {
    return (window > 0 && len > window) ? len - window : 0;
}

static void decode_tasks(void *arg, int64_t first, int64_t stop) {
    struct decode_task *t = arg;
    const float *query = t->query;
    const void *kv = t->kv, *values = t->values;
    const int bf16 = t->bf16;
    const int64_t *block_table = t->block_table, *context_lens = t->context_lens;
    float *out = t->out;
    const int64_t ldq = t->ldq, H = t->H, KVH = t->KVH, D = t->D, G = t->G, BS = t->BS;
    const int64_t MB = t->MB, window = t->window;
    const int64_t tasks_per_row = t->tasks_per_row;
    const float scale = t->scale;
    for (int64_t task = first; task < stop; task++) {
        int64_t b, rows, h0, heads;
        if (t->units != NULL) {
            const int64_t *unit = t->units + task * UNIT_FIELDS;
            b = unit[0], rows = unit[1], h0 = unit[2], heads = unit[3];
        } else {
            b = task / tasks_per_row, rows = 1;
            h0 = (task % tasks_per_row) * t->heads_per_task, heads = t->heads_per_task;
        }
        const int64_t *table = block_table + b * MB;
        const int64_t start = window_start(context_lens[b], window);
        int64_t L = 0;
        for (int64_t r = 0; r < rows; r++)
            L = context_lens[b + r] - start > L ? context_lens[b + r] - start : L;
#ifdef HAVE_ATTEND_512
        if (takes512(D, bf16)) { /* one task's rows (one, or a group's), head by head */
            float *scratch = malloc(sizeof(float) * (size_t)scratch512(rows, G, L, D, BS));
            if (scratch == NULL) {
                atomic_store(&t->failed, 1);
                continue;
            }
            for (int64_t h = h0; h < h0 + heads; h++) {
                if (bf16)
                    attend512_any(query + b * ldq, ldq, kv, values, 1, table, context_lens + b,
                                  rows, out + b * H * D, H, scratch, start, L, G, KVH, BS, h, D,
                                  scale);
                else
                    attend512_any(query + b * ldq, ldq, kv, values, 0, table, context_lens + b,
                                  rows, out + b * H * D, H, scratch, start, L, G, KVH, BS, h, D,
                                  scale);
            }
            free(scratch);
            continue;
        }
#endif
        const int64_t nq = rows == 1 ? heads * G : rows * G;
        float *scores = malloc(sizeof(float) * (size_t)(nq * (L > 0 ? L : 1) + nq * D));
        if (scores == NULL) {
            atomic_store(&t->failed, 1);
            continue;
        }
        float *acc = scores + nq * L;
        if (rows > 1) { /* a group's rows, each of its KV heads (only where rows_grouped) */
#ifdef HAVE_ATTEND_VEC
            const float *q = query + b * ldq;
            float *o = out + b * H * D;
            const int64_t *lens = context_lens + b;
            for (int64_t h = h0; h < h0 + heads; h++) {
                if (bf16)
                    attend_rows_any(q, ldq, kv, values, 1, table, lens, rows, o, H, scores, acc,
                                    start, L, G, KVH, BS, h, D, scale);
                else
                    attend_rows_any(q, ldq, kv, values, 0, table, lens, rows, o, H, scores, acc,
                                    start, L, G, KVH, BS, h, D, scale);
            }
#endif
            free(scores);
            continue;
        }
        const int64_t len = context_lens[b];
        const float *q = query + b * ldq + h0 * G * D; /* this task's nq query heads */
        float *o = out + (b * H + h0 * G) * D;
        if (bf16)
            attend_any(q, kv, values, 1, table, o, scores, acc, start, len, heads, G, KVH, BS, h0,
                       D, scale);
        else
            attend_any(q, kv, values, 0, table, o, scores, acc, start, len, heads, G, KVH, BS, h0,
                       D, scale);
        free(scores);
    }
}

/* Whether rows a and b read the same keys: the same block table and window start. */
static inline int same_keys(const int64_t *block_table, const int64_t *context_lens, int64_t MB,
                            int64_t window, int64_t a, int64_t b) {
    return window_start(context_lens[a], window) == window_start(context_lens[b], window) &&
           memcmp(block_table + a * MB, block_table + b * MB, sizeof(int64_t) * (size_t)MB) == 0;
}

/* The tasks of a step with a group of rows (see above) in units [n, UNIT_FIELDS]; returns n,
   0 when no two consecutive rows read the same keys (the tasks are then one row each), -1 out
   of memory. */
static int64_t group_units(const int64_t *block_table, const int64_t *context_lens, int64_t B,
                           int64_t KVH, int64_t G, int64_t D, int64_t MB, int64_t window,
                           int64_t heads_per_task, int64_t threads, int64_t **units_out) {
    *units_out = NULL;
    if (!rows_grouped(D)) return 0;
    int64_t b = 1;
    while (b < B && !same_keys(block_table, context_lens, MB, window, b - 1, b)) b++;
    if (b >= B) return 0;
    int64_t *units = malloc(sizeof(int64_t) * UNIT_FIELDS * (size_t)(B * KVH));
    if (units == NULL) return -1;
    int64_t n = 0;
    for (b = 0; b < B;) {
        int64_t e = b + 1;
        while (e < B && same_keys(block_table, context_lens, MB, window, b, e)) e++;
        const int64_t R = e - b;
        if (R == 1) {
            for (int64_t h = 0; h < KVH; h += heads_per_task, n++) {
                int64_t *u = units + n * UNIT_FIELDS;
                u[0] = b, u[1] = 1, u[2] = h, u[3] = heads_per_task;
            }
        } else {
            /* at most GROUP_ROWS rows a task, and GROUP_SCORES scores, in parts enough for
               every thread to have one */
            int64_t L = 1;
            for (int64_t r = b; r < e; r++) {
                const int64_t len = context_lens[r] - window_start(context_lens[r], window);
                L = len > L ? len : L;
            }
            int64_t most = GROUP_SCORES / (G * L);
            most = most < 1 ? 1 : most > GROUP_ROWS ? GROUP_ROWS : most;
            int64_t parts = (R + most - 1) / most;
            const int64_t balanced = (2 * threads + KVH - 1) / KVH;
            parts = parts > balanced ? parts : balanced < R ? balanced : R;
            for (int64_t s = 0, r0 = b; s < parts; s++) {
                const int64_t rows = R / parts + (s < R % parts);
                for (int64_t h = 0; h < KVH; h++, n++) {
                    int64_t *u = units + n * UNIT_FIELDS;
                    u[0] = r0, u[1] = rows, u[2] = h, u[3] = 1;
                }
                r0 += rows;
            }
        }
        b = e;
    }
    *units_out = units;
    return n;
}

static int paged_decode(const float *query, int64_t ldq, const void *kv, int bf16,
                        const int64_t *block_table, const int64_t *context_lens, float *out,
                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t NB, int64_t BS,
                        int64_t MB, float scale, int64_t window) {
    const int64_t threads = omp_get_max_threads();
    const int64_t heads_per_task = B >= threads ? KVH : 1;
    const int64_t element = bf16 ? 2 : 4;
    int64_t *units;
    const int64_t n_units = group_units(block_table, context_lens, B, KVH, H / KVH, D, MB, window,
                                        heads_per_task, threads, &units);
    if (n_units < 0) return -1;
    struct decode_task task = {
        query, kv, (const char *)kv + NB * BS * KVH * D * element, bf16, block_table,
        context_lens, out, ldq, H, KVH, D, H / KVH, BS, MB, window, heads_per_task,
        KVH / heads_per_task, scale, units, 0};
    switchboard_parallel_for(units != NULL ? n_units : B * task.tasks_per_row, 1, decode_tasks,
                             &task);
    free(units);
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

/* paged_decode.c's attention in AVX2 vectors (included by it where the compiler targets AVX2 and
   FMA): one query row's keys scored eight at a time (a vector of partial sums per key, then one
   transposing reduction of eight keys), its weighted sum of the values in registers; and the
   rows of a group (a decode with its proposed tokens, a prompt chunk) block by block, each row's
   floats the same as alone. */
#ifndef SWITCHBOARD_PAGED_DECODE_AVX2_H
#define SWITCHBOARD_PAGED_DECODE_AVX2_H
#include <immintrin.h>
#include <stdint.h>

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
#endif

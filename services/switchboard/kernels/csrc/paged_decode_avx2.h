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

/* The weighted sums of KV head h's values over the keys start..len-1 for N query heads (a
   constant: 1, or 2 where a head is at most 32 floats) whose scores are s (N rows, L apart),
   into o (N heads, D apart). Each head's sums stay in registers across the context, in the
   order of the keys. Two heads a pass load each value row once for both, and their sums are
   independent multiply-add chains, twice as many in flight: with one head of 32 floats a pass,
   its four chains, each waiting on its last multiply-add, set the pace (tiny-llama's decode
   attention, head size 32, two query heads per KV head, 8-64 rows at 40-110 tokens of context:
   5-7 % less, old and new alternated call by call in a C harness on the AVX2-only EPYC). */
static inline __attribute__((always_inline)) void weigh_values(
    const int N, const float *s, int64_t L, const void *values, const int bf16,
    const int64_t *table, int64_t start, int64_t len, int64_t BS, int64_t KVH, int64_t h,
    const int64_t D, float *o) {
    const int64_t slot_stride = KVH * D;
    __m256 acc[2][16];
    for (int n = 0; n < N; n++)
        for (int64_t c = 0; c < D / 8; c++) acc[n][c] = _mm256_setzero_ps();
    for (int64_t t = start; t < len;) {
        const int64_t stop = block_stop(t, BS, len);
        int64_t v = slot_at(table, t, BS, KVH, h, D);
        for (; t < stop; t++, v += slot_stride) {
            __m256 p[2];
            for (int n = 0; n < N; n++) p[n] = _mm256_set1_ps(s[n * L + t - start]);
            for (int64_t c = 0; c < D / 8; c++) {
                const __m256 x = load8(values, v + 8 * c, bf16);
                for (int n = 0; n < N; n++) acc[n][c] = _mm256_fmadd_ps(p[n], x, acc[n][c]);
            }
        }
    }
    for (int n = 0; n < N; n++)
        for (int64_t c = 0; c < D / 8; c++) _mm256_storeu_ps(o + n * D + 8 * c, acc[n][c]);
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
        for (int64_t g = 0; g < G;) {
            const int64_t j = h * G + g;
            if (D <= 32 && g + 2 <= G) { /* see weigh_values */
                weigh_values(2, scores + j * L, L, values, bf16, table, start, len, BS, KVH,
                             h0 + h, D, o + j * D);
                g += 2;
            } else {
                weigh_values(1, scores + j * L, L, values, bf16, table, start, len, BS, KVH,
                             h0 + h, D, o + j * D);
                g += 1;
            }
        }
}

/* Parts of a long context. A row whose keys start..len-1 reach past one span of PART_KEYS
   positions (rounded up to whole blocks; spans counted from position 0) is attended part by
   part: each part's scores, their exponentials after the part's own max subtracted and summed,
   and the values weighed by them; then the parts merged in order (each scaled by e to its max
   less the largest). A long context's parts are tasks of their own (paged_decode.c), so one
   request's KV heads no longer leave a thread idle. A row within one span is attended as
   before. Alone, in a group, on any number of threads: the same floats. */
#define PART_KEYS 256
static inline int64_t part_span(int64_t BS) { return (PART_KEYS + BS - 1) / BS * BS; }
static inline int64_t parts_of(int64_t start, int64_t len, int64_t C) {
    return len <= start ? 1 : (len - 1) / C - start / C + 1;
}
static inline int64_t part_lo(int64_t start, int64_t p, int64_t C) {
    const int64_t lo = (start / C + p) * C;
    return lo > start ? lo : start;
}
static inline int64_t part_hi(int64_t start, int64_t len, int64_t p, int64_t C) {
    const int64_t hi = (start / C + p + 1) * C;
    return hi < len ? hi : len;
}

/* A part's L scores in place: their exponentials after the max subtracted; the max and sum
   out. Not inlined, nor merge_parts: one compiled body for every caller (inlined into each,
   the compiler evaluated their sums differently, and a row's floats alone and in a group
   must agree). */
static __attribute__((noinline)) void exp_part(float *s, int64_t L, float *max_out,
                                               float *sum_out) {
    float max = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : max)
    for (int64_t i = 0; i < L; i++) max = s[i] > max ? s[i] : max;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < L; i++) {
        s[i] = exp_f32(s[i] - max);
        sum += s[i];
    }
    *max_out = max;
    *sum_out = sum;
}

/* One query head's P parts (each D weighed values, then its max and sum: PART_FLOATS(D)
   floats) merged into out [D] (each part's max is overwritten by its weight). */
#define PART_FLOATS(D) ((D) + 2)
static __attribute__((noinline)) void merge_parts(float *parts, int64_t P, int64_t D,
                                                  float *out) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t p = 0; p < P; p++) {
        const float m = parts[p * PART_FLOATS(D) + D];
        top = m > top ? m : top;
    }
    for (int64_t p = 0; p < P; p++) {
        float *part = parts + p * PART_FLOATS(D);
        part[D] = exp_f32(part[D] - top);
        total += part[D] * part[D + 1];
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < D; d++) {
        float sum = 0.0f;
        for (int64_t p = 0; p < P; p++) {
            const float *part = parts + p * PART_FLOATS(D);
            sum += part[D] * part[d];
        }
        out[d] = sum * inv;
    }
}

/* The G query heads of KV head h (q: the first's, D apart), their part lo..hi-1 each into
   parts + g * P * PART_FLOATS(D) (P: the row's parts); scores: G x (hi - lo) floats. A block's
   keys are scored for every query head while they are in cache, as attend_vec does. */
static inline __attribute__((always_inline)) void attend_part_vec(
    const float *q, const void *keys, const void *values, const int bf16, const int64_t *table,
    float *parts, int64_t P, float *scores, int64_t lo, int64_t hi, int64_t G, int64_t KVH,
    int64_t BS, int64_t h, const int64_t D, float scale) {
    const int64_t slot_stride = KVH * D, L = hi - lo;
    for (int64_t t = lo; t < hi;) {
        const int64_t stop = block_stop(t, BS, hi);
        const int64_t slot = slot_at(table, t, BS, KVH, h, D);
        for (int64_t g = 0; g < G; g++) {
            __m256 qv[16];
            for (int64_t c = 0; c < D / 8; c++) qv[c] = _mm256_loadu_ps(q + g * D + 8 * c);
            score_keys(qv, keys, bf16, slot, t, stop, lo, slot_stride, D, scale, scores + g * L);
        }
        t = stop;
    }
    for (int64_t g = 0; g < G; g++) {
        float *part = parts + g * P * PART_FLOATS(D);
        const float *sg = scores + g * L;
        exp_part(scores + g * L, L, part + D, part + D + 1);
        weigh_values(1, sg, L, values, bf16, table, lo, hi, BS, KVH, h, D, part);
    }
}

static inline __attribute__((always_inline)) void attend_part_any(
    const float *q, const void *keys, const void *values, const int bf16, const int64_t *table,
    float *parts, int64_t P, float *scores, int64_t lo, int64_t hi, int64_t G, int64_t KVH,
    int64_t BS, int64_t h, int64_t D, float scale) {
#define PART_CALL(DD)                                                                          \
    attend_part_vec(q, keys, values, bf16, table, parts, P, scores, lo, hi, G, KVH, BS, h, DD, \
                    scale)
    BY_HEAD_SIZE(PART_CALL, D);
#undef PART_CALL
}

/* KV heads h0 .. h0 + nkv - 1 of one row (q: its query head h0 * G's), part p of its keys: query
   head j (counted from h0 * G) into parts + (j * P + p) * PART_FLOATS(D); scores: G x
   part_span(BS) floats. */
static inline __attribute__((always_inline)) void attend_heads_part(
    const float *q, const void *keys, const void *values, const int bf16, const int64_t *table,
    float *parts, float *scores, int64_t start, int64_t len, int64_t p, int64_t P, int64_t h0,
    int64_t nkv, int64_t G, int64_t KVH, int64_t BS, int64_t D, float scale) {
    const int64_t C = part_span(BS), lo = part_lo(start, p, C), hi = part_hi(start, len, p, C);
    for (int64_t h = 0; h < nkv; h++)
        attend_part_any(q + h * G * D, keys, values, bf16, table,
                        parts + (h * G * P + p) * PART_FLOATS(D), P, scores, lo, hi, G, KVH, BS,
                        h0 + h, D, scale);
}

/* attend_vec for R rows that read the same keys (one block table, one window start: a decode
   and its proposed tokens, or a prompt chunk) and one KV head h, each row to its own len: a
   block's keys and values are read for every row while they are in cache, where a task per row
   read the whole context again. Each row's floats are attend_vec's alone (or, for a row of
   several parts, attend_part_vec's and merge_parts'): the same dot products over the same keys
   in the same eights, the same softmax, and each head's weighted sum of the values in the order
   of the keys (held in acc [R, G, D] between blocks: a store and a load change no float).
   scores [R, G, Lmax]; parts [R, G, P, PART_FLOATS(D)] for the P parts of start .. start +
   Lmax - 1. */
static inline __attribute__((always_inline)) void attend_rows_vec(
    const float *query, int64_t ldq, const void *keys, const void *values, const int bf16,
    const int64_t *table, const int64_t *lens, int64_t R, float *out, int64_t H, float *scores,
    float *acc, float *parts, int64_t start, int64_t Lmax, int64_t G, int64_t KVH, int64_t BS,
    int64_t h, const int64_t D, float scale) {
    const int64_t slot_stride = KVH * D, end = start + Lmax, C = part_span(BS);
    const int64_t P = parts_of(start, end, C);
    for (int64_t p = 0; p < P; p++) {
        const int64_t lo = part_lo(start, p, C), hi = part_hi(start, end, p, C);
        for (int64_t t = lo; t < hi; t = block_stop(t, BS, hi)) {
            const int64_t slot = slot_at(table, t, BS, KVH, h, D);
            for (int64_t r = 0; r < R; r++) {
                const int64_t len = lens[r];
                if (t >= len) continue;
                const int64_t stop = block_stop(t, BS, len);
                for (int64_t g = 0; g < G; g++) {
                    const float *qj = query + r * ldq + (h * G + g) * D;
                    __m256 qv[16];
                    for (int64_t c = 0; c < D / 8; c++) qv[c] = _mm256_loadu_ps(qj + 8 * c);
                    float *sj = scores + (r * G + g) * Lmax;
                    score_keys(qv, keys, bf16, slot, t, stop, lo, slot_stride, D, scale, sj);
                }
            }
        }
        for (int64_t r = 0; r < R; r++) {
            if (lo >= lens[r]) continue;
            const int64_t L = (hi < lens[r] ? hi : lens[r]) - lo;
            if (parts_of(start, lens[r], C) == 1) {
                softmax_rows(scores + r * G * Lmax, G, Lmax, L);
                continue;
            }
            for (int64_t g = 0; g < G; g++) {
                float *part = parts + ((r * G + g) * P + p) * PART_FLOATS(D);
                exp_part(scores + (r * G + g) * Lmax, L, part + D, part + D + 1);
            }
        }
        for (int64_t r = 0; r < R; r++)
            if (lo < lens[r])
                for (int64_t i = 0; i < G * D; i++) acc[r * G * D + i] = 0.0f;
        for (int64_t t = lo; t < hi; t = block_stop(t, BS, hi)) {
            const int64_t slot = slot_at(table, t, BS, KVH, h, D);
            for (int64_t r = 0; r < R; r++) {
                const int64_t len = lens[r];
                if (t >= len) continue;
                const int64_t stop = block_stop(t, BS, len);
                for (int64_t g = 0; g < G; g++) {
                    const float *sj = scores + (r * G + g) * Lmax;
                    float *aj = acc + (r * G + g) * D;
                    __m256 a[16];
                    for (int64_t c = 0; c < D / 8; c++) a[c] = _mm256_loadu_ps(aj + 8 * c);
                    int64_t v = slot;
                    for (int64_t u = t; u < stop; u++, v += slot_stride) {
                        const __m256 w = _mm256_set1_ps(sj[u - lo]);
                        for (int64_t c = 0; c < D / 8; c++)
                            a[c] = _mm256_fmadd_ps(w, load8(values, v + 8 * c, bf16), a[c]);
                    }
                    for (int64_t c = 0; c < D / 8; c++) _mm256_storeu_ps(aj + 8 * c, a[c]);
                }
            }
        }
        for (int64_t r = 0; r < R; r++) {
            if (lo >= lens[r]) continue;
            const int single = parts_of(start, lens[r], C) == 1;
            for (int64_t g = 0; g < G; g++) {
                const float *aj = acc + (r * G + g) * D;
                float *to = single ? out + (r * H + h * G + g) * D
                                   : parts + ((r * G + g) * P + p) * PART_FLOATS(D);
                for (int64_t d = 0; d < D; d++) to[d] = aj[d];
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t Pr = parts_of(start, lens[r], C);
        if (Pr == 1) continue;
        for (int64_t g = 0; g < G; g++)
            merge_parts(parts + (r * G + g) * P * PART_FLOATS(D), Pr, D,
                        out + (r * H + h * G + g) * D);
    }
}

/* Whether attend_rows_vec takes rows of head size D (else a group's rows are tasks of their
   own). */
static inline int rows_grouped(int64_t D) { return D % 8 == 0 && D <= 128; }

/* attend_rows_vec with D a constant for the common head sizes (D: one rows_grouped takes). */
static inline __attribute__((always_inline)) void attend_rows_any(
    const float *query, int64_t ldq, const void *keys, const void *values, const int bf16,
    const int64_t *table, const int64_t *lens, int64_t R, float *out, int64_t H, float *scores,
    float *acc, float *parts, int64_t start, int64_t Lmax, int64_t G, int64_t KVH, int64_t BS,
    int64_t h, int64_t D, float scale) {
#define ROWS_CALL(DD)                                                                        \
    attend_rows_vec(query, ldq, keys, values, bf16, table, lens, R, out, H, scores, acc, parts, \
                    start, Lmax, G, KVH, BS, h, DD, scale)
    BY_HEAD_SIZE(ROWS_CALL, D);
#undef ROWS_CALL
}
#endif

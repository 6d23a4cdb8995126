/* paged_decode.c's attention in AVX-512 vectors (included by it where the compiler targets
   AVX-512F). A task's rows and query heads of one KV head read each block of the cache once:

   - A bfloat16 block (its keys, then its values) is widened to float32 once, into L1 scratch,
     for every query head and row that reads it (the AVX2 code widens a key once per query head:
     three times for a model with three query heads to a KV head, and that widening was most of
     its work). 32 bfloat16 values widen in two instructions, a shift and a mask, into their even
     and their odd elements: the scratch holds each 32 of a head's values in that order ("lane
     order"), the queries are put in the same order, and the weighted sums of the values come
     out in it and are put back in head order at the end. A float32 cache is read where it lies
     (its lane order is head order).
   - A key's score is one vector of 16 partial sums (a multiply-add for each 16 values of the head),
     summed across by a transposing reduction of eight keys at once; a block's last keys are
     padded to eight with zeros, so that a key's score is the same sums whichever eight it is in.
   - Each query head's weighted sum of the values goes by block, keys in order, in registers
     within a block and in scratch between blocks (a store and a load change no float). Where
     their sums fit the registers (two to four query heads a KV head, heads of up to 128), the
     KV head's query heads take both passes together: each key and value is read where it lies
     and widened in registers once for all of them (no scratch), and their chains of
     multiply-adds are in flight together (a head of 64 floats alone is four chains, each
     waiting on its last). The floats are the same either way.

   A row's floats depend on its own query and its own keys only: the same alone or in a group
   of rows that read the same keys (a decode with its proposed tokens, a prompt chunk). */
#ifndef SWITCHBOARD_PAGED_DECODE_512_H
#define SWITCHBOARD_PAGED_DECODE_512_H
#include <immintrin.h>
#include <stdint.h>

/* Whether the AVX-512 code takes heads of size D from a cache of bfloat16 (bf16) or float32
   values: whole 32s of bfloat16 (one widening), whole 16s of float32, at most 256 (the sums of
   one query head stay in registers). */
static inline int takes512(int64_t D, int bf16) { return D % (bf16 ? 32 : 16) == 0 && D <= 256; }

/* The widening of 32 bfloat16 values at p: their even elements, then their odd ones. */
static inline void widen32(const uint16_t *p, float *out) {
    const __m512i x = _mm512_loadu_si512((const void *)p);
    _mm512_storeu_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
    _mm512_storeu_ps(out + 16,
                     _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000))));
}

/* n heads of D bfloat16 values, `stride` elements apart from `src`, widened into `dst` [n, D]
   in lane order. */
static inline __attribute__((always_inline)) void widen_heads(const uint16_t *src, int64_t stride,
                                                              int64_t n, const int64_t D,
                                                              float *dst) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < D; c += 32) widen32(src + i * stride + c, dst + i * D + c);
}

/* Asks for the lines of n heads of D values, `stride` elements apart from element `first`. */
static inline void prefetch_heads(const void *cache, int bf16, int64_t first, int64_t stride,
                                  int64_t n, int64_t D) {
    const int64_t element = bf16 ? 2 : 4;
    const char *base = (const char *)cache + first * element;
    for (int64_t i = 0; i < n; i++)
        for (int64_t byte = 0; byte < D * element; byte += 64)
            _mm_prefetch(base + i * stride * element + byte, _MM_HINT_T0);
}

/* A head of D values (D a multiple of 32) from head order into lane order, and back. */
static inline void to_lane_order(const float *x, int64_t D, float *out) {
    for (int64_t c = 0; c < D; c += 32)
        for (int64_t i = 0; i < 16; i++) {
            out[c + i] = x[c + 2 * i];
            out[c + 16 + i] = x[c + 2 * i + 1];
        }
}

static inline void from_lane_order(const float *x, int64_t D, float *out) {
    for (int64_t c = 0; c < D; c += 32)
        for (int64_t i = 0; i < 16; i++) {
            out[c + 2 * i] = x[c + i];
            out[c + 2 * i + 1] = x[c + 16 + i];
        }
}

/* The 16 lanes of a folded onto 8 (lane i + lane i + 8). */
static inline __m256 fold16(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* q . k of one key as 16 partial sums (k a head of D floats in lane order). */
static inline __attribute__((always_inline)) __m512 dot16(const __m512 *qv, const float *k,
                                                         const int64_t D) {
    __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
    for (int64_t c = 1; c < D / 16; c++) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a);
    return a;
}

/* A head of D values at element i of the cache (D a multiple of 16, at most 128), as D / 16
   vectors in lane order: a bfloat16 head widened in registers (as widen32 lays it out), a
   float32 one as it lies. */
static inline __attribute__((always_inline)) void load_head512(const void *cache, const int bf16,
                                                               int64_t i, const int64_t D,
                                                               __m512 *out) {
    if (!bf16) {
        const float *src = (const float *)cache + i;
        for (int64_t c = 0; c < D / 16; c++) out[c] = _mm512_loadu_ps(src + 16 * c);
        return;
    }
    const uint16_t *src = (const uint16_t *)cache + i;
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000);
    for (int64_t c = 0; c < D / 32; c++) {
        const __m512i x = _mm512_loadu_si512((const void *)(src + 32 * c));
        out[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        out[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
    }
}

/* The first n (at most 8) of eight scores to dst. */
static inline void store_scores8(float *dst, __m256 s, int64_t n) {
    if (n >= 8) {
        _mm256_storeu_ps(dst, s);
        return;
    }
    float tail[8];
    _mm256_storeu_ps(tail, s);
    for (int64_t j = 0; j < n; j++) dst[j] = tail[j];
}

/* One query head's scaled scores against n keys (heads of D floats in lane order, `stride`
   floats apart), into scores[0 .. n): eight keys at a time, the last eight padded. */
static inline __attribute__((always_inline)) void score_keys512(const float *q, const float *k,
                                                                int64_t stride, int64_t n,
                                                                const int64_t D, float scale,
                                                                float *scores) {
    __m512 qv[16];
    for (int64_t c = 0; c < D / 16; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (int64_t u = 0; u < n; u += 8) {
        __m256 a[8];
        for (int64_t j = 0; j < 8; j++)
            a[j] = u + j < n ? fold16(dot16(qv, k + (u + j) * stride, D)) : _mm256_setzero_ps();
        const __m256 s = _mm256_mul_ps(sum8_lanes(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]),
                                       scale8);
        store_scores8(scores + u, s, n - u);
    }
}

/* acc [D] (lane order) += p[i] * value i for n values (heads of D floats in lane order,
   `stride` floats apart). */
static inline __attribute__((always_inline)) void add_values512(const float *p, const float *v,
                                                                int64_t stride, int64_t n,
                                                                const int64_t D, float *acc) {
    __m512 a[16];
    for (int64_t c = 0; c < D / 16; c++) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t i = 0; i < n; i++) {
        const __m512 w = _mm512_set1_ps(p[i]);
        for (int64_t c = 0; c < D / 16; c++)
            a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + i * stride + 16 * c), a[c]);
    }
    for (int64_t c = 0; c < D / 16; c++) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

/* The value pass of G query heads of one KV head at once (G a constant where inlined): acc
   [G, D] (lane order for a bfloat16 cache) += p_g[i] * value i for n values read where they lie
   (heads of D bfloat16 or float32 values, `stride` elements apart from element `first`; a
   bfloat16 value widened in registers), p_g = p + g * p_stride. Each query head's sums are in
   the order add_values512 makes them; the G heads' G * D / 16 chains of multiply-adds are in
   flight together, and each value is loaded once for all of them. */
static inline __attribute__((always_inline)) void add_values512_heads(
    const float *p, int64_t p_stride, const void *cache, const int bf16, int64_t first,
    int64_t stride, int64_t n, const int64_t D, const int64_t G, float *acc) {
    __m512 a[16];
    for (int64_t j = 0; j < G * (D / 16); j++) a[j] = _mm512_loadu_ps(acc + 16 * j);
    for (int64_t i = 0; i < n; i++) {
        __m512 v[8];
        load_head512(cache, bf16, first + i * stride, D, v);
        for (int64_t g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(p[g * p_stride + i]);
            for (int64_t c = 0; c < D / 16; c++)
                a[g * (D / 16) + c] = _mm512_fmadd_ps(w, v[c], a[g * (D / 16) + c]);
        }
    }
    for (int64_t j = 0; j < G * (D / 16); j++) _mm512_storeu_ps(acc + 16 * j, a[j]);
}

/* The key pass of G query heads of one KV head at once (G a constant where inlined): the scaled
   scores of n keys read where they lie (heads of D bfloat16 or float32 values, `stride` elements
   apart from element `first`; a bfloat16 key widened in registers) against the G queries at qs
   [G, D] (lane order for a bfloat16 cache), query head g's into scores + g * s_stride. Each
   key's score is the sums score_keys512 makes (the same partial sums, folded and reduced eight
   keys at a time, the last eight padded); each key is loaded once for all G heads. */
static inline __attribute__((always_inline)) void score_keys512_heads(
    const float *qs, const void *cache, const int bf16, int64_t first, int64_t stride, int64_t n,
    const int64_t D, const int64_t G, float scale, float *scores, int64_t s_stride) {
    __m512 qv[16];
    for (int64_t j = 0; j < G * (D / 16); j++) qv[j] = _mm512_loadu_ps(qs + 16 * j);
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (int64_t u = 0; u < n; u += 8) {
        __m256 f[4][8];
        for (int64_t j = 0; j < 8; j++) {
            if (u + j >= n) {
                for (int64_t g = 0; g < G; g++) f[g][j] = _mm256_setzero_ps();
                continue;
            }
            __m512 k[8];
            load_head512(cache, bf16, first + (u + j) * stride, D, k);
            for (int64_t g = 0; g < G; g++) {
                const __m512 *q = qv + g * (D / 16);
                __m512 a = _mm512_mul_ps(q[0], k[0]);
                for (int64_t c = 1; c < D / 16; c++) a = _mm512_fmadd_ps(q[c], k[c], a);
                f[g][j] = fold16(a);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            const __m256 sc = _mm256_mul_ps(
                sum8_lanes(f[g][0], f[g][1], f[g][2], f[g][3], f[g][4], f[g][5], f[g][6], f[g][7]),
                scale8);
            store_scores8(scores + g * s_stride + u, sc, n - u);
        }
    }
}

/* score_keys512_heads with G a constant (2, 3 or 4: values_fused). */
static inline __attribute__((always_inline)) void score_keys512_any(
    const float *qs, const void *cache, const int bf16, int64_t first, int64_t stride, int64_t n,
    const int64_t D, int64_t G, float scale, float *scores, int64_t s_stride) {
    if (G == 2)
        score_keys512_heads(qs, cache, bf16, first, stride, n, D, 2, scale, scores, s_stride);
    else if (G == 3)
        score_keys512_heads(qs, cache, bf16, first, stride, n, D, 3, scale, scores, s_stride);
    else
        score_keys512_heads(qs, cache, bf16, first, stride, n, D, 4, scale, scores, s_stride);
}

/* Whether score_keys512_heads and add_values512_heads take G heads of D values: their queries
   or sums fit the registers. */
static inline int values_fused(int64_t G, int64_t D) {
    return G >= 2 && G <= 4 && D <= 128 && G * (D / 16) <= 16;
}

/* add_values512_heads with G a constant (2, 3 or 4: values_fused). */
static inline __attribute__((always_inline)) void add_values512_any(
    const float *p, int64_t p_stride, const void *cache, const int bf16, int64_t first,
    int64_t stride, int64_t n, const int64_t D, int64_t G, float *acc) {
    if (G == 2)
        add_values512_heads(p, p_stride, cache, bf16, first, stride, n, D, 2, acc);
    else if (G == 3)
        add_values512_heads(p, p_stride, cache, bf16, first, stride, n, D, 3, acc);
    else
        add_values512_heads(p, p_stride, cache, bf16, first, stride, n, D, 4, acc);
}

/* Scratch floats attend512 needs for R rows of G query heads and contexts up to Lmax. */
static inline int64_t scratch512(int64_t R, int64_t G, int64_t Lmax, int64_t D, int64_t BS) {
    return R * G * (Lmax > 0 ? Lmax : 1) + 2 * R * G * D + BS * D;
}

/* KV head h for R rows that read the same keys (one block table; R = 1: a row alone), each to
   its own lens[r] from `start`: out [(r * H + h * G + g) * D] gets row r's query head h * G + g
   (query + r * ldq + (h * G + g) * D). scratch: scratch512 floats. */
static inline __attribute__((always_inline)) void attend512(
    const float *query, int64_t ldq, const void *keys, const void *values, const int bf16,
    const int64_t *table, const int64_t *lens, int64_t R, float *out, int64_t H, float *scratch,
    int64_t start, int64_t Lmax, int64_t G, int64_t KVH, int64_t BS, int64_t h, const int64_t D,
    float scale) {
    const int64_t slot_stride = KVH * D, end = start + Lmax, nq = R * G;
    float *scores = scratch, *qs = scores + nq * (Lmax > 0 ? Lmax : 1), *acc = qs + nq * D,
          *wide = acc + nq * D;
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *q = query + r * ldq + (h * G + g) * D;
            float *dst = qs + (r * G + g) * D;
            if (bf16)
                to_lane_order(q, D, dst);
            else
                for (int64_t d = 0; d < D; d++) dst[d] = q[d];
        }
    for (int64_t pass = 0; pass < 2; pass++) { /* the keys' scores, then the values' sums */
        const void *cache = pass == 0 ? keys : values;
        if (pass == 1) {
            for (int64_t r = 0; r < R; r++)
                softmax_rows(scores + r * G * Lmax, G, Lmax, lens[r] - start);
            for (int64_t i = 0; i < nq * D; i++) acc[i] = 0.0f;
        }
        for (int64_t t = start; t < end;) {
            const int64_t block_end = t - t % BS + BS;
            const int64_t block_stop = block_end < end ? block_end : end;
            const int64_t slot = slot_at(table, t, BS, KVH, h, D);
            if (block_end < end) /* the next block's heads, while this one is worked on */
                prefetch_heads(cache, bf16, slot_at(table, block_end, BS, KVH, h, D), slot_stride,
                               (end < block_end + BS ? end : block_end + BS) - block_end, D);
            if (values_fused(G, D)) { /* every query head of h in one pass */
                for (int64_t r = 0; r < R; r++) {
                    if (t >= lens[r]) continue;
                    const int64_t n = (block_end < lens[r] ? block_end : lens[r]) - t;
                    float *s = scores + r * G * Lmax + (t - start);
                    if (pass == 0)
                        score_keys512_any(qs + r * G * D, cache, bf16, slot, slot_stride, n, D, G,
                                          scale, s, Lmax);
                    else
                        add_values512_any(s, Lmax, cache, bf16, slot, slot_stride, n, D, G,
                                          acc + r * G * D);
                }
                t = block_end;
                continue;
            }
            const float *k;
            int64_t stride;
            if (bf16) {
                widen_heads((const uint16_t *)cache + slot, slot_stride, block_stop - t, D, wide);
                k = wide, stride = D;
            } else {
                k = (const float *)cache + slot, stride = slot_stride;
            }
            for (int64_t r = 0; r < R; r++) {
                if (t >= lens[r]) continue;
                const int64_t n = (block_end < lens[r] ? block_end : lens[r]) - t;
                for (int64_t g = 0; g < G; g++) {
                    float *s = scores + (r * G + g) * Lmax + (t - start);
                    if (pass == 0)
                        score_keys512(qs + (r * G + g) * D, k, stride, n, D, scale, s);
                    else
                        add_values512(s, k, stride, n, D, acc + (r * G + g) * D);
                }
            }
            t = block_end;
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *a = acc + (r * G + g) * D;
            float *o = out + (r * H + h * G + g) * D;
            if (bf16)
                from_lane_order(a, D, o);
            else
                for (int64_t d = 0; d < D; d++) o[d] = a[d];
        }
}

/* attend512 with D a constant for the common head sizes. */
static inline __attribute__((always_inline)) void attend512_any(
    const float *query, int64_t ldq, const void *keys, const void *values, const int bf16,
    const int64_t *table, const int64_t *lens, int64_t R, float *out, int64_t H, float *scratch,
    int64_t start, int64_t Lmax, int64_t G, int64_t KVH, int64_t BS, int64_t h, int64_t D,
    float scale) {
#define ATTEND512(DD)                                                                          \
    attend512(query, ldq, keys, values, bf16, table, lens, R, out, H, scratch, start, Lmax, G, \
              KVH, BS, h, DD, scale)
    BY_HEAD_SIZE(ATTEND512, D);
#undef ATTEND512
}
#endif

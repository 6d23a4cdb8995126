/* Matmuls of a few rows (decode) on quantized weights: each weight value is an int8 q with, per
   block of B inputs (16 or 32) and output column, a float32 scale and offset: w = scale * q +
   offset. That one layout holds GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K (a 32-input
   sub-block's d * sc and -dmin * m) and Q6_K (16-input sub-blocks) exactly
   (kernels/quant_formats.py), at 1.25 (B = 32) or 1.5 (B = 16) bytes a weight against float32's
   4: a decode step of few rows is bound by reading the weights.

   Panels of 16 output columns like small_batch_gemm.c: panel q is K / B blocks, each
   int8 q[B][16] (input-major), float scale[16], float offset[16] (quant_pack). The kernel
   dequantizes each 16 weights in registers and runs small_batch_gemm.c's sums on them: the
   same floats as that kernel on the dequantized float32 weight, batch-invariant as it is.
   Needs AVX2 and FMA: built without them, quant_gemm_max_rows() is 0 and the kernel is not
   used. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "work_pool.h"

#define PW 16 /* output columns per panel: two AVX2 vectors */

/* the bytes of one block of a panel: B x 16 int8, 16 scales, 16 offsets */
static inline int64_t block_bytes(int64_t B) { return B * PW + 2 * PW * (int64_t)sizeof(float); }

/* q [N, K] int8, scale and offset [N, K / B] (offset NULL: zeros) -> panels, zero past N */
void quant_pack(const int8_t *q, const float *scale, const float *offset, uint8_t *p, int64_t N,
                int64_t K, int64_t B) {
    const int64_t panels = (N + PW - 1) / PW, blocks = K / B, bb = block_bytes(B);
#pragma omp parallel for schedule(static)
    for (int64_t pq = 0; pq < panels; pq++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *blk = p + (pq * blocks + b) * bb;
            int8_t *qs = (int8_t *)blk;
            float so[2 * PW];
            for (int64_t j = 0; j < PW; j++) {
                const int64_t n = pq * PW + j;
                for (int64_t k = 0; k < B; k++) qs[k * PW + j] = n < N ? q[n * K + b * B + k] : 0;
                so[j] = n < N ? scale[n * blocks + b] : 0.0f;
                so[PW + j] = n < N && offset ? offset[n * blocks + b] : 0.0f;
            }
            __builtin_memcpy(blk + B * PW, so, sizeof so);
        }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 16 floats, the width of a panel: one AVX-512 register, or two AVX2 ones. Lane by lane the
   same operations either way (the same floats as small_batch_gemm.c's pairs of AVX2 vectors);
   with AVX-512 a panel's 16 weights dequantize in four instructions instead of eight. */
#ifdef __AVX512F__
typedef struct { __m512 v; } vec16;
static inline vec16 v16_zero(void) { return (vec16){_mm512_setzero_ps()}; }
static inline vec16 v16_load(const float *p) { return (vec16){_mm512_loadu_ps(p)}; }
static inline void v16_store(float *p, vec16 a) { _mm512_storeu_ps(p, a.v); }
static inline vec16 v16_add(vec16 a, vec16 b) { return (vec16){_mm512_add_ps(a.v, b.v)}; }
static inline vec16 v16_fma(const float *x, vec16 w, vec16 acc) {
    return (vec16){_mm512_fmadd_ps(_mm512_set1_ps(*x), w.v, acc.v)};
}
/* scale * q + offset: two roundings, as gguf dequantizes (the empty asm keeps the compiler
   from fusing them into one multiply-add, which GCC does to intrinsics too) */
static inline vec16 v16_dequantize(const int8_t *q, vec16 s, vec16 o) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    __m512 product = _mm512_mul_ps(s.v, f);
    __asm__("" : "+v"(product));
    return (vec16){_mm512_add_ps(product, o.v)};
}
#else
typedef struct { __m256 lo, hi; } vec16;
static inline vec16 v16_zero(void) { return (vec16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vec16 v16_load(const float *p) {
    return (vec16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline void v16_store(float *p, vec16 a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
static inline vec16 v16_add(vec16 a, vec16 b) {
    return (vec16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
static inline vec16 v16_fma(const float *x, vec16 w, vec16 acc) {
    const __m256 b = _mm256_broadcast_ss(x);
    return (vec16){_mm256_fmadd_ps(b, w.lo, acc.lo), _mm256_fmadd_ps(b, w.hi, acc.hi)};
}
static inline __m256 dequantize8(const int8_t *q, __m256 s, __m256 o) {
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
    __m256 product = _mm256_mul_ps(s, f);
    __asm__("" : "+x"(product)); /* two roundings: see the AVX-512 version */
    return _mm256_add_ps(product, o);
}
static inline vec16 v16_dequantize(const int8_t *q, vec16 s, vec16 o) {
    return (vec16){dequantize8(q, s.lo, o.lo), dequantize8(q + 8, s.hi, o.hi)};
}
#endif

/* Rows per call, as in small_batch_gemm.c: a row's sums take two AVX2 vector registers. */
#ifdef __AVX512VL__
#define MAX_ROWS 8
#else
#define MAX_ROWS 6
#endif

int quant_gemm_max_rows(void) { return MAX_ROWS; }

/* Bytes ahead that the group reading the weights from memory asks for, a line (4 k-rows of a
   panel) at a time; later groups ask for the next panel's lines instead, as in
   small_batch_gemm.c. Into L2: asking for L1 (as small_batch_gemm.c does), a whole block's
   lines at its start, the kernel read the weights at 10 GB/s, one thread of the 2-core EPYC,
   SmolLM2's matrices at one row; into L2 a line every 4 k-rows, 15 GB/s (16.8 -> 11.2 ms;
   without prefetching 14.8 ms; 1 KB or 4 KB ahead measured slower). */
#define PREFETCH_AHEAD 2048

/* Where a group of rows takes the panel's weights from: */
enum source {
    DEQUANTIZE,          /* the int8 values, dequantized in registers */
    DEQUANTIZE_AND_KEEP, /* the same, also stored as float32 for the next groups */
    KEPT                 /* the float32 values the first group stored */
};

/* The panels a call of R rows takes at once: a row's sum over one panel is a chain of
   dependent multiply-adds, and one or two rows over one panel left the FMA units waiting on
   the chain's latency (hot weights: 20 us for one row times 512 x 576, 5 us over four panels
   at once). Several panels' chains interleave, each output still the same chain. Measured cold
   (SmolLM2's matrices, one thread, the 2-core EPYC), more panels at once than this was slower
   from three rows (four panels for two rows with AVX-512, 13.7 ms; two, 16.4 ms; three rows
   over two panels 18.2 ms, over one 14.6); AVX2's 16 registers hold two panels' sums and
   weights for two rows (four panels: 16.4 ms, two: 13.3 ms). */
#ifdef __AVX512F__
#define PANELS_FOR(R) ((R) <= 2 ? 4 : 1)
#else
#define PANELS_FOR(R) ((R) == 1 ? 4 : (R) == 2 ? 2 : 1)
#endif

/* Tile i (rows x panels, row i % R of panel i / R): its multiply-add, and its store (a whole
   panel's sums straight to y with the bias added as a vector, as small_batch_gemm.c does; a
   partial one through t). */
#define TILE_FMA(i)                                                                      \
    if (R * P > i) a##i = v16_fma(xb + (i % R) * ldx + k, w[i / R], a##i);
#define TILE_STORE(i)                                                                    \
    if (R * P > i) {                                                                     \
        const int r = i % R, pp = i / R;                                                 \
        const int64_t ncols = pp == P - 1 ? ncols_last : PW;                             \
        const float *bp = bias ? bias + pp * PW : 0;                                     \
        float *yp = y + r * ldy + pp * PW;                                               \
        if (ncols == PW) {                                                               \
            v16_store(yp, bp ? v16_add(a##i, v16_load(bp)) : a##i);                      \
        } else {                                                                         \
            v16_store(t, a##i);                                                          \
            for (int64_t j = 0; j < ncols; j++) yp[j] = bp ? t[j] + bp[j] : t[j];        \
        }                                                                                \
    }

/* R rows times P consecutive panels of blocks of B inputs (R, P, B and the source constants
   where it is inlined); the last panel has ncols_last columns (the others 16). Every row's
   sums over a panel are small_batch_gemm.c's multiply-add chain, over the weights dequantized
   as scale * q + offset: the same floats as that kernel on the dequantized float32 weight.
   The weights `ahead` bytes further on are prefetched (PREFETCH_AHEAD). */
static inline __attribute__((always_inline)) void panel_tile(
    const int R, const int P, const enum source source, const int64_t B, const float *x,
    int64_t ldx, int64_t blocks, const uint8_t *p, float *kept, int64_t ahead, float *y,
    int64_t ldy, int64_t ncols_last, const float *bias) {
    const int64_t bb = block_bytes(B), panel_bytes = blocks * bb;
    vec16 a0 = v16_zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t b = 0; b < blocks; b++) {
        vec16 s[4], o[4], w[4];
        for (int pp = 0; pp < P; pp++) {
            const uint8_t *blk = p + pp * panel_bytes + b * bb;
            _mm_prefetch((const char *)(blk + ahead + B * PW), _MM_HINT_T1);
            _mm_prefetch((const char *)(blk + ahead + B * PW + 64), _MM_HINT_T1);
            s[pp] = v16_load((const float *)(blk + B * PW));
            o[pp] = v16_load((const float *)(blk + B * PW) + PW);
        }
        const float *xb = x + b * B;
        float *kb = kept + b * B * PW;
        for (int64_t k = 0; k < B; k++) {
            for (int pp = 0; pp < P; pp++) {
                const int8_t *q = (const int8_t *)(p + pp * panel_bytes + b * bb) + k * PW;
                if (source == KEPT) {
                    if ((k & 3) == 0) _mm_prefetch((const char *)q + ahead, _MM_HINT_T1);
                    w[pp] = v16_load(kb + k * PW);
                } else {
                    if ((k & 3) == 0) _mm_prefetch((const char *)q + ahead, _MM_HINT_T1);
                    w[pp] = v16_dequantize(q, s[pp], o[pp]);
                    if (source == DEQUANTIZE_AND_KEEP) v16_store(kb + k * PW, w[pp]);
                }
            }
            TILE_FMA(0) TILE_FMA(1) TILE_FMA(2) TILE_FMA(3)
            TILE_FMA(4) TILE_FMA(5) TILE_FMA(6) TILE_FMA(7)
        }
    }
    float t[PW];
    TILE_STORE(0) TILE_STORE(1) TILE_STORE(2) TILE_STORE(3)
    TILE_STORE(4) TILE_STORE(5) TILE_STORE(6) TILE_STORE(7)
}

#define TILE(rows, panels, source)                                                       \
    panel_tile(rows, panels, source, B, x, ldx, blocks, p, kept, ahead, y, ldy, ncols_last, bias)

/* M <= MAX_ROWS rows times one panel, or PANELS_FOR(M) panels when `many` (DEQUANTIZE, one
   or two rows).
   Groups that keep or read kept weights have at least three rows (more than MAX_ROWS rows
   split into groups of at least MAX_ROWS / 2). One instance per case taken: each is a
   separate loop. */
static void panel_group(int64_t M, int many, int64_t B, enum source source, const float *x,
                        int64_t ldx, int64_t blocks, const uint8_t *p, float *kept,
                        int64_t ahead, float *y, int64_t ldy, int64_t ncols_last,
                        const float *bias) {
    if (source == DEQUANTIZE) {
        switch (M) {
            case 1: many ? TILE(1, PANELS_FOR(1), DEQUANTIZE) : TILE(1, 1, DEQUANTIZE); break;
            case 2: many ? TILE(2, PANELS_FOR(2), DEQUANTIZE) : TILE(2, 1, DEQUANTIZE); break;
            case 3: TILE(3, 1, DEQUANTIZE); break;
            case 4: TILE(4, 1, DEQUANTIZE); break;
            case 5: TILE(5, 1, DEQUANTIZE); break;
            case 6: TILE(6, 1, DEQUANTIZE); break;
#if MAX_ROWS > 6
            case 7: TILE(7, 1, DEQUANTIZE); break;
            case 8: TILE(8, 1, DEQUANTIZE); break;
#endif
        }
        return;
    }
#define KEEPING_CASE(rows)                                                               \
    case rows:                                                                           \
        if (source == DEQUANTIZE_AND_KEEP)                                               \
            TILE(rows, 1, DEQUANTIZE_AND_KEEP);                                          \
        else                                                                             \
            TILE(rows, 1, KEPT);                                                         \
        break;
    switch (M) {
        KEEPING_CASE(3) KEEPING_CASE(4) KEEPING_CASE(5) KEEPING_CASE(6)
#if MAX_ROWS > 6
        KEEPING_CASE(7) KEEPING_CASE(8)
#endif
    }
#undef KEEPING_CASE
}

struct quant_task {
    const float *x, *bias;
    const uint8_t *p;
    float *y;
    int64_t ldx, M, K, N, B, step; /* step: the panels of a work item */
};

/* work items [i0, i1) (items of `step` panels) of one matmul, every row. Rows that fit one
   group take PANELS_FOR(rows) panels at a time (an item: so that a thread's chunk never splits
   them; one at a time for the matrix's last few). More rows go in groups of nearly equal size
   as in small_batch_gemm.c, over one panel at a time: the first group dequantizes the panel
   into `kept` (float32, [K, 16]: it stays in L1 or L2) and the others read it there; without
   the memory for it every group dequantizes (the same floats). */
static void quant_panels(void *arg, int64_t i0, int64_t i1) {
    const struct quant_task *t = arg;
    const int64_t groups = (t->M + MAX_ROWS - 1) / MAX_ROWS;
    const int64_t base = t->M / groups, wider = t->M % groups;
    const int64_t blocks = t->K / t->B, panel_bytes = blocks * block_bytes(t->B);
    const int64_t panels = (t->N + PW - 1) / PW;
    const int64_t q1 = i1 * t->step < panels ? i1 * t->step : panels;
    float *kept = groups > 1 ? malloc(sizeof(float) * (size_t)(t->K * PW)) : NULL;
    for (int64_t q = i0 * t->step; q < q1;) {
        const int many = t->step > 1 && q + t->step <= q1;
        const int64_t last = many ? q + t->step - 1 : q;
        const int64_t ncols_last = t->N - last * PW < PW ? t->N - last * PW : PW;
        const uint8_t *pq = t->p + q * panel_bytes;
        const float *bq = t->bias ? t->bias + q * PW : 0;
        for (int64_t g = 0, r0 = 0; g < groups; g++) {
            const int64_t rows = base + (g < wider);
            const enum source source =
                kept == NULL ? DEQUANTIZE : g == 0 ? DEQUANTIZE_AND_KEEP : KEPT;
            panel_group(rows, many, t->B, source, t->x + r0 * t->ldx, t->ldx, blocks, pq, kept,
                        g == 0 ? PREFETCH_AHEAD : panel_bytes, t->y + r0 * t->N + q * PW, t->N,
                        ncols_last, bq);
            r0 += rows;
        }
        q = last + 1;
    }
    free(kept);
}

/* y [M, N] = x [M, K] (row stride ldx) @ w^T (+ bias), w in quant_pack's panels of blocks of
   B inputs (16 or 32; K a multiple of it). Returns 0; -1 for bad sizes. The work items are
   split across the pool's threads as in small_batch_gemm.c. */
#define PANEL_WORK 32768
int quant_linear(const float *x, int64_t ldx, const uint8_t *p, const float *bias, float *y,
                 int64_t M, int64_t K, int64_t N, int64_t B) {
    if (M < 1 || K < 1 || (B != 16 && B != 32) || K % B != 0) return -1;
    const int64_t step = M <= MAX_ROWS ? PANELS_FOR(M) : 1;
    const struct quant_task task = {x, bias, p, y, ldx, M, K, N, B, step};
    const int64_t per_item = M * K * PW * step, min_items = PANEL_WORK / per_item;
    const int64_t items = ((N + PW - 1) / PW + step - 1) / step;
    switchboard_parallel_for(items, min_items, quant_panels, (void *)&task);
    return 0;
}

#else /* no AVX2 and FMA: nothing to run; quant_gemm_max_rows() says so */
int quant_gemm_max_rows(void) { return 0; }

int quant_linear(const float *x, int64_t ldx, const uint8_t *p, const float *bias, float *y,
                 int64_t M, int64_t K, int64_t N, int64_t B) {
    (void)x, (void)ldx, (void)p, (void)bias, (void)y, (void)M, (void)K, (void)N, (void)B;
    return -1;
}
#endif

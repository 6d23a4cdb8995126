/* Matmuls of a few rows (decode) on quantized weights with integer dot products, as llama.cpp
   computes them: each row of x is quantized to int8 per block of B inputs (the weight's block:
   x ~ d * xq, d = the block's largest magnitude / 127, xq rounded to nearest even), and per
   block and output column the integer sum of q * xq is exact, so
       y = sum over blocks of d * (scale * sum(q * xq) + offset * sum(xq))
   for weights w = scale * q + offset (quant_gemm.c's int8 q with a float32 scale and offset per
   block of 16 or 32 inputs: every GGUF block format it takes). The result differs from the
   float32 product on the dequantized weight by the rounding of x to 8 bits (about 0.4 % of a
   block's largest input), not bit for bit; what a model's greedy output keeps is tested.

   Panels of 16 output columns; per block the values as uint8 u = q + 128, four consecutive
   inputs of a column together ([B / 4][16][4]: one 64-byte line per 4 inputs of a panel),
   then float scale[16] and offset[16] (quant_dot_pack): the same bytes as quant_gemm.c's.
   Variants, compiled where the build's CPU flags (-march=native) have their instructions and
   chosen at run time (quant_dot_select):
     VNNI512  AVX-512 VNNI: _mm512_dpbusd_epi32 sums u * xq over 4 inputs a lane; the block's
              sum starts at -128 * sum(xq), which makes it sum(q * xq);
     AVX2     q = u ^ 0x80; _mm256_maddubs_epi16(|q|, sign(xq, q)) (pairs at most 2 * 128 * 127:
              no saturation) and _mm256_madd_epi16 with ones sum 4 inputs a lane.
   The variants give the same integer sums, hence the same floats (the same float operations
   in the same order per lane). A row's result does not depend on the rows beside it.

   Weights whose q span at most 16 values (Q4_0, Q4_1, Q4_K) pack as 4 bits instead
   (quant_dot4_pack: u = q - qmin in 0..15, the offset made offset + qmin * scale, exact for
   qmin 0 and -8): per block of a panel [B / 8][16][4] bytes, input k in the low half of a byte
   and input k + B / 2 in the high half, then the scales and offsets: 0.75 bytes a weight
   instead of 1.25, for the step at one row is bound by reading the weights. The sums then
   start at 0, and |u| <= 15 needs no sign trick with AVX2.

   The factors' layout (kernels.h): scales and offsets as float16 (B | QUANT_HALF_SCALES) where
   every one of a matrix is a float16 exactly, as GGUF's Q8_0, Q4_0 and Q4_1 hold them, and no
   offsets (B | QUANT_NO_OFFSETS) where all are zero (Q8_0): the pack says whether the layout
   held them (it counts the factors it did not hold exactly), and the kernel widens them back to
   the same float32 values (an offset of zero adds nothing), so the products are bit for bit
   those of float32 factors on 0.625 bytes a weight (4 bits) or 1.0625 (Q8_0) instead of 0.75
   or 1.25. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "work_pool.h"

#define PW 16 /* output columns per panel */

enum variant { NONE = 0, AVX2 = 1, VNNI512 = 2 };

/* the factors' layout: bits of B above the block size */
#define HALF 1       /* float16 */
#define NO_OFFSETS 2 /* scales only */
static inline int layout_of(int64_t B) {
    return (B & QUANT_HALF_SCALES ? HALF : 0) | (B & QUANT_NO_OFFSETS ? NO_OFFSETS : 0);
}
static inline int64_t block_of(int64_t B) {
    return B & ~(int64_t)(QUANT_HALF_SCALES | QUANT_NO_OFFSETS);
}

/* the bytes of a block's factors, and of the whole block: the values (4 bits each when
   `nibbles`), the scales and the offsets, as `layout` says */
static inline int64_t factor_bytes(int layout) {
    return (layout & NO_OFFSETS ? 1 : 2) * PW * (layout & HALF ? 2 : (int64_t)sizeof(float));
}
static inline int64_t block_bytes(int64_t B, int nibbles, int layout) {
    return (nibbles ? B * PW / 2 : B * PW) + factor_bytes(layout);
}

/* float16 bits of f, and whether they hold f exactly (finite, normal or subnormal) */
static int to_half(float f, uint16_t *h) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const int32_t e = (int32_t)((u >> 23) & 0xff) - 127;
    uint32_t m = u & 0x7fffffu;
    if ((u & 0x7fffffffu) == 0) return *h = sign, 1;
    if (e > 15 || e < -24 || e == 128) return *h = 0, 0;
    if (e >= -14) { /* normal: 10 bits of mantissa */
        *h = (uint16_t)(sign | (uint32_t)(e + 15) << 10 | m >> 13);
        return (m & 0x1fffu) == 0;
    }
    m |= 0x800000u; /* subnormal: value = m * 2^(e - 23), in units of 2^-24 */
    const int shift = -e - 1;
    *h = (uint16_t)(sign | m >> shift);
    return (m & ((1u << shift) - 1)) == 0;
}

static inline float from_half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0) { /* zero or subnormal: m * 2^-24 */
        float f = (float)m * 0x1p-24f;
        __builtin_memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | (e + 112) << 23 | m << 13;
    }
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

/* the scales and offsets of one block of a panel, so[0..2 PW), at `at` as `layout` says; how
   many it does not hold exactly (offsets other than zero without offsets, values float16 does
   not hold) */
static int64_t store_factors(uint8_t *at, const float *so, int layout) {
    const int count = layout & NO_OFFSETS ? PW : 2 * PW;
    int64_t inexact = 0;
    if (layout & NO_OFFSETS)
        for (int i = PW; i < 2 * PW; i++) inexact += so[i] != 0.0f;
    if (!(layout & HALF)) {
        __builtin_memcpy(at, so, count * sizeof(float));
        return inexact;
    }
    uint16_t h[2 * PW];
    for (int i = 0; i < count; i++) inexact += !to_half(so[i], h + i);
    __builtin_memcpy(at, h, count * sizeof(uint16_t));
    return inexact;
}

/* q [N, K] int8, scale and offset [N, K / B] (offset NULL: zeros) -> panels, zero past N (a
   zero weight: u = 128, scale and offset 0); B with QUANT_HALF_SCALES / QUANT_NO_OFFSETS: the
   factors in that layout. Returns how many factors the layout does not hold exactly (0: the
   panels are good). */
int64_t quant_dot_pack(const int8_t *q, const float *scale, const float *offset, uint8_t *p,
                       int64_t N, int64_t K, int64_t B) {
    const int layout = layout_of(B);
    B = block_of(B);
    const int64_t panels = (N + PW - 1) / PW, blocks = K / B, bb = block_bytes(B, 0, layout);
    int64_t inexact = 0;
#pragma omp parallel for schedule(static) reduction(+ : inexact)
    for (int64_t pq = 0; pq < panels; pq++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *blk = p + (pq * blocks + b) * bb;
            float so[2 * PW];
            for (int64_t j = 0; j < PW; j++) {
                const int64_t n = pq * PW + j;
                for (int64_t k = 0; k < B; k++) {
                    const int8_t v = n < N ? q[n * K + b * B + k] : 0;
                    blk[(k / 4) * 4 * PW + j * 4 + k % 4] = (uint8_t)v ^ 0x80u;
                }
                so[j] = n < N ? scale[n * blocks + b] : 0.0f;
                so[PW + j] = n < N && offset ? offset[n * blocks + b] : 0.0f;
            }
            inexact += store_factors(blk + B * PW, so, layout);
        }
    return inexact;
}

/* the same as 4 bits: q - qmin in 0..15 (the caller checks), offset + qmin * scale */
int64_t quant_dot4_pack(const int8_t *q, const float *scale, const float *offset, uint8_t *p,
                        int64_t N, int64_t K, int64_t B, int64_t qmin) {
    const int layout = layout_of(B);
    B = block_of(B);
    const int64_t panels = (N + PW - 1) / PW, blocks = K / B, bb = block_bytes(B, 1, layout);
    int64_t inexact = 0;
#pragma omp parallel for schedule(static) reduction(+ : inexact)
    for (int64_t pq = 0; pq < panels; pq++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *blk = p + (pq * blocks + b) * bb;
            float so[2 * PW];
            for (int64_t j = 0; j < PW; j++) {
                const int64_t n = pq * PW + j;
                for (int64_t k = 0; k < B / 2; k++) {
                    const int64_t at = n * K + b * B + k;
                    const uint8_t lo = n < N ? (uint8_t)(q[at] - qmin) : 0;
                    const uint8_t hi = n < N ? (uint8_t)(q[at + B / 2] - qmin) : 0;
                    blk[(k / 4) * 4 * PW + j * 4 + k % 4] = (uint8_t)(lo | hi << 4);
                }
                const float s = n < N ? scale[n * blocks + b] : 0.0f;
                so[j] = s;
                so[PW + j] = (n < N && offset ? offset[n * blocks + b] : 0.0f) + (float)qmin * s;
            }
            inexact += store_factors(blk + B * PW / 2, so, layout);
        }
    return inexact;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_VNNI512 1
#else
#define HAVE_VNNI512 0
#endif

static const int compiled = (1 << AVX2) | (HAVE_VNNI512 << VNNI512);
static int selected = NONE;

/* Rows per group over one panel: every (row, panel) pair holds an integer and a float sum in
   registers (AVX-512: one register each; AVX2: two each, of its 16) */
#define MAX_ROWS_512 8
#define MAX_ROWS_256 2
static inline int rows_of(int v) { return v == VNNI512 ? MAX_ROWS_512 : MAX_ROWS_256; }
/* panels one group takes at once: independent chains for few rows */
static inline int panels_for(int v, int64_t R) {
    if (v == VNNI512) return R <= 2 ? 4 : R <= 4 ? 2 : 1;
    return R == 1 ? 2 : 1;
}

int quant_dot_variants(void) { return compiled; }

int quant_dot_select(int v) {
    if (v <= NONE || v > VNNI512 || !(compiled & (1 << v))) return 0;
    selected = v;
    return rows_of(v);
}

int quant_dot_max_rows(void) { return selected == NONE ? 0 : rows_of(selected); }

/* The rows quantized per block: the int8 values as groups of 4 consecutive inputs, the M rows'
   groups of one line side by side ([K / 4][M] int32: a tile reads its rows' inputs at constant
   offsets from one pointer; with a row's values together it kept a pointer per row, which ran
   short of registers at 8 rows), and per block d, d * sum(xq) and -128 * sum(xq) */
struct qrows {
    const int32_t *q4;
    const float *d, *ds;
    const int32_t *corr;
    int64_t M, blocks; /* the rows, and a row's blocks */
};

/* 8 floats of x * id rounded to int32 (the current rounding mode: to nearest even) */
static inline __m256i round8(const float *x, __m256 id) {
    return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), id));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* One row's block of B (16 or 32) values: its 4-input groups at q4, stride apart (struct
   qrows), d, and the sums; B a multiple of 8. */
static void quantize_block(const float *x, int64_t B, int32_t *q4, int64_t stride, float *d,
                           float *ds, int32_t *corr) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int64_t k = 0; k < B; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    const float m = hmax8(amax), dv = m / 127.0f, iv = dv != 0.0f ? 1.0f / dv : 0.0f;
    const __m256 id = _mm256_set1_ps(iv);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t k = 0; k < B; k += 16) {
        const __m256i i0 = round8(x + k, id), i1 = round8(x + k + 8, id);
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(i0, i1));
        /* int32 -> int8 (|values| <= 127: no saturation); packs interleave the 128-bit lanes */
        const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xd8);
        const __m128i w8 = _mm_packs_epi16(_mm256_castsi256_si128(w16),
                                           _mm256_extracti128_si256(w16, 1));
        if (stride == 1) {
            _mm_storeu_si128((__m128i *)(q4 + k / 4), w8);
        } else {
            q4[(k / 4) * stride] = _mm_extract_epi32(w8, 0);
            q4[(k / 4 + 1) * stride] = _mm_extract_epi32(w8, 1);
            q4[(k / 4 + 2) * stride] = _mm_extract_epi32(w8, 2);
            q4[(k / 4 + 3) * stride] = _mm_extract_epi32(w8, 3);
        }
    }
    const int32_t s = hsum8_epi32(sum);
    *d = dv;
    *ds = dv * (float)s;
    *corr = -128 * s;
}

/* What both variants do over a block of a panel: fetch the line `ahead` bytes after the one
   `off` bytes into `panel`, one of a tile's P panels. The P panels are read side by side, so
   past its end a panel's fetch goes on in the same panel of the next tile (the panel right after
   it is being read already): fetched straight on, the last `ahead` bytes of every panel's
   fetches were wasted and the next tile's panels but its first started cold (the matmuls of a
   1-row SmolLM2 step took ~25 % longer on one thread). A fetch past the matrix or the thread's
   panels is a wasted line, not a fault. (4 bits: the lines of the low nibbles hold the high
   ones too.) */
static inline __attribute__((always_inline)) void prefetch_line(const uint8_t *panel, int64_t off,
                                                                int64_t ahead, int P,
                                                                int64_t panel_bytes) {
    const int64_t at = off + ahead >= panel_bytes ? off + ahead + (P - 1) * panel_bytes
                                                  : off + ahead;
    _mm_prefetch((const char *)panel + at, _MM_HINT_T1);
}

/* the first `ahead` bytes of `panels` panels, which no earlier fetch of this thread covered:
   the start of a thread's chunk of panels */
static void prefetch_start(const uint8_t *p, int64_t panels, int64_t panel_bytes, int64_t ahead) {
    const int64_t warm = ahead < panel_bytes ? ahead : panel_bytes;
    for (int64_t pq = 0; pq < panels; pq++)
        for (int64_t off = 0; off < warm; off += 64)
            _mm_prefetch((const char *)p + pq * panel_bytes + off, _MM_HINT_T1);
}

/* and the quantized inputs of line k4 of block b from row r0 on: row r0 + r's 4 at [r] */
static inline __attribute__((always_inline)) const int32_t *line_of(const struct qrows *x,
                                                                    int64_t r0, int64_t b,
                                                                    int64_t B, int64_t k4) {
    return x->q4 + (b * (B / 4) + k4) * x->M + r0;
}

/* Tile of R rows times P panels (constants where inlined), variant V; the last panel has
   ncols_last columns. acc: float sums, one per (row, panel) pair. */
#define PREFETCH_AHEAD 2048

static inline __attribute__((always_inline)) void store_tile(const int R, const int P,
                                                             const float *acc, float *y,
                                                             int64_t ldy, int64_t ncols_last,
                                                             const float *bias) {
    for (int r = 0; r < R; r++)
        for (int pp = 0; pp < P; pp++) {
            const int64_t ncols = pp == P - 1 ? ncols_last : PW;
            const float *a = acc + (r * P + pp) * PW, *bp = bias ? bias + pp * PW : 0;
            float *yp = y + r * ldy + pp * PW;
            for (int64_t j = 0; j < ncols; j++) yp[j] = bp ? a[j] + bp[j] : a[j];
        }
}

#if HAVE_VNNI512
static inline __attribute__((always_inline)) void tile_vnni(
    const int R, const int P, const int nibbles, const int layout, const int64_t B,
    const struct qrows *x,
    int64_t r0, const uint8_t *p, int64_t panel_bytes, int64_t ahead, float *y, int64_t ldy,
    int64_t ncols_last, const float *bias) {
    const int64_t bb = block_bytes(B, nibbles, layout), values = nibbles ? B * PW / 2 : B * PW;
    const int half = layout & HALF, offsets = !(layout & NO_OFFSETS);
    __m512 acc[8 * 4];
    for (int i = 0; i < R * P; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < x->blocks; b++) {
        __m512i sums[8 * 4];
        for (int r = 0; r < R; r++) {
            const __m512i c = _mm512_set1_epi32(nibbles ? 0 : x->corr[(r0 + r) * x->blocks + b]);
            for (int pp = 0; pp < P; pp++) sums[r * P + pp] = c;
        }
        /* lines k4 and k4 + B / 8 (4 bits: one line's low and high nibbles, loaded once). With
           fewer (row, panel) pairs than a dot product's latency in cycles, each pair's sums run
           as two chains, added at the end (the dot products of one chain wait on each other);
           with more, one chain a pair: the second chains' registers spilled, and their adds
           and zeroing cost ~15 % at 8 rows and ~30 % at 4. Integer sums are exact either way,
           so the same integers. */
        const int split = R * P < 6;
        __m512i more[8 * 4];
        if (split)
            for (int i = 0; i < R * P; i++) more[i] = _mm512_setzero_si512();
        for (int64_t k4 = 0; k4 < B / 8; k4++) {
            __m512i w[4], w2[4];
            for (int pp = 0; pp < P; pp++) {
                const uint8_t *panel = p + pp * panel_bytes;
                const int64_t off = b * bb + k4 * 4 * PW, off2 = off + B / 8 * 4 * PW;
                prefetch_line(panel, off, ahead, P, panel_bytes);
                if (nibbles) {
                    const __m512i v = _mm512_loadu_si512((const void *)(panel + off));
                    const __m512i low = _mm512_set1_epi8(0x0f);
                    w[pp] = _mm512_and_si512(v, low);
                    w2[pp] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                } else {
                    prefetch_line(panel, off2, ahead, P, panel_bytes);
                    w[pp] = _mm512_loadu_si512((const void *)(panel + off));
                    w2[pp] = _mm512_loadu_si512((const void *)(panel + off2));
                }
            }
            const int32_t *line = line_of(x, r0, b, B, k4);
            const int32_t *line2 = line_of(x, r0, b, B, k4 + B / 8);
            for (int r = 0; r < R; r++) {
                const __m512i xa = _mm512_set1_epi32(line[r]);
                const __m512i xb = _mm512_set1_epi32(line2[r]);
                for (int pp = 0; pp < P; pp++) {
                    sums[r * P + pp] = _mm512_dpbusd_epi32(sums[r * P + pp], w[pp], xa);
                    if (split)
                        more[r * P + pp] = _mm512_dpbusd_epi32(more[r * P + pp], w2[pp], xb);
                    else
                        sums[r * P + pp] = _mm512_dpbusd_epi32(sums[r * P + pp], w2[pp], xb);
                }
            }
        }
        if (split)
            for (int i = 0; i < R * P; i++) sums[i] = _mm512_add_epi32(sums[i], more[i]);
        for (int pp = 0; pp < P; pp++) {
            const uint8_t *panel = p + pp * panel_bytes, *so = panel + b * bb + values;
            prefetch_line(panel, b * bb + values, ahead, P, panel_bytes);
            if (factor_bytes(layout) > 64)
                prefetch_line(panel, b * bb + values + 64, ahead, P, panel_bytes);
            const __m512 s = half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)so))
                                  : _mm512_loadu_ps((const float *)so);
            const __m256i *o16 = (const __m256i *)(so + 32);
            const __m512 o = !offsets ? _mm512_setzero_ps()
                             : half   ? _mm512_cvtph_ps(_mm256_loadu_si256(o16))
                                      : _mm512_loadu_ps((const float *)so + PW);
            for (int r = 0; r < R; r++) {
                const int64_t i = (r0 + r) * x->blocks + b;
                const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(x->d[i]));
                __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r * P + pp]), sd,
                                           acc[r * P + pp]);
                acc[r * P + pp] = offsets ? _mm512_fmadd_ps(o, _mm512_set1_ps(x->ds[i]), a) : a;
            }
        }
    }
    float out[8 * 4 * PW];
    for (int i = 0; i < R * P; i++) _mm512_storeu_ps(out + i * PW, acc[i]);
    store_tile(R, P, out, y, ldy, ncols_last, bias);
}
#endif

/* A block's `count` float16 factors as float32 */
static inline void widen_factors(const uint8_t *at, float *so, int count) {
#if defined(__F16C__)
    for (int i = 0; i < count; i += 8)
        _mm256_storeu_ps(so + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 2 * i))));
#else
    for (int i = 0; i < count; i++) {
        uint16_t h;
        __builtin_memcpy(&h, at + 2 * i, 2);
        so[i] = from_half(h);
    }
#endif
}

/* The AVX2 variant: a panel's 4 inputs are two vectors of 8 columns. */
static inline __m256i line256(const int nibbles, const uint8_t *blk, int64_t k4, int64_t B,
                              int h) {
    if (!nibbles) return _mm256_loadu_si256((const __m256i *)(blk + k4 * 4 * PW + 32 * h));
    const int64_t half = B / 8;
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + (k4 % half) * 4 * PW + 32 * h));
    const __m256i low = _mm256_set1_epi8(0x0f);
    return k4 < half ? _mm256_and_si256(v, low) : _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
}

static inline __attribute__((always_inline)) void tile_avx2(
    const int R, const int P, const int nibbles, const int layout, const int64_t B,
    const struct qrows *x,
    int64_t r0, const uint8_t *p, int64_t panel_bytes, int64_t ahead, float *y, int64_t ldy,
    int64_t ncols_last, const float *bias) {
    const int64_t bb = block_bytes(B, nibbles, layout), values = nibbles ? B * PW / 2 : B * PW;
    const int half = layout & HALF, offsets = !(layout & NO_OFFSETS);
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[2 * 2 * 2];
    for (int i = 0; i < 2 * R * P; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x->blocks; b++) {
        __m256i sums[2 * 2 * 2];
        for (int i = 0; i < 2 * R * P; i++) sums[i] = _mm256_setzero_si256();
        for (int64_t k4 = 0; k4 < B / 4; k4++) {
            __m256i wq[2 * 2], wa[2 * 2];
            for (int pp = 0; pp < P; pp++) {
                const uint8_t *blk = p + pp * panel_bytes + b * bb;
                if (!nibbles || k4 < B / 8)
                    prefetch_line(p + pp * panel_bytes, b * bb + k4 * 4 * PW, ahead, P,
                                  panel_bytes);
                for (int h = 0; h < 2; h++) {
                    /* 4 bits: u itself (at most 15); else q = u ^ 0x80 and |q| */
                    wq[2 * pp + h] = line256(nibbles, blk, k4, B, h);
                    if (!nibbles) {
                        wq[2 * pp + h] = _mm256_xor_si256(wq[2 * pp + h], flip);
                        wa[2 * pp + h] = _mm256_abs_epi8(wq[2 * pp + h]);
                    }
                }
            }
            const int32_t *line = line_of(x, r0, b, B, k4);
            for (int r = 0; r < R; r++) {
                const __m256i xb = _mm256_set1_epi32(line[r]);
                for (int i = 0; i < 2 * P; i++) {
                    const __m256i pairs =
                        nibbles ? _mm256_maddubs_epi16(wq[i], xb)
                                : _mm256_maddubs_epi16(wa[i], _mm256_sign_epi8(xb, wq[i]));
                    sums[2 * r * P + i] =
                        _mm256_add_epi32(sums[2 * r * P + i], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        for (int pp = 0; pp < P; pp++) {
            const uint8_t *at = p + pp * panel_bytes + b * bb + values;
            prefetch_line(p + pp * panel_bytes, b * bb + values, ahead, P, panel_bytes);
            if (factor_bytes(layout) > 64)
                prefetch_line(p + pp * panel_bytes, b * bb + values + 64, ahead, P, panel_bytes);
            float widened[2 * PW];
            const float *so = half ? widened : (const float *)at;
            if (half) widen_factors(at, widened, offsets ? 2 * PW : PW);
            for (int r = 0; r < R; r++) {
                const int64_t i = (r0 + r) * x->blocks + b;
                const __m256 d = _mm256_set1_ps(x->d[i]), ds = _mm256_set1_ps(x->ds[i]);
                for (int h = 0; h < 2; h++) {
                    const int t = 2 * (r * P + pp) + h;
                    const __m256 sd = _mm256_mul_ps(_mm256_loadu_ps(so + 8 * h), d);
                    const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), sd, acc[t]);
                    acc[t] = offsets ? _mm256_fmadd_ps(_mm256_loadu_ps(so + PW + 8 * h), ds, a) : a;
                }
            }
        }
    }
    float out[2 * 2 * 2 * 8];
    for (int i = 0; i < 2 * R * P; i++) _mm256_storeu_ps(out + i * 8, acc[i]);
    store_tile(R, P, out, y, ldy, ncols_last, bias);
}

#define TILE_ARGS NIBBLES, layout, B, x, r0, p, panel_bytes, ahead, y, ldy, ncols_last, bias

/* M rows (at most the variant's) times one panel, or panels_for(v, M) when `many`; values of
   8 bits, or 4 when NIBBLES (a constant: one instance of each) */
static inline __attribute__((always_inline)) void panel_group_of(
    const int NIBBLES, int layout, int v, int64_t M, int many, int64_t B, const struct qrows *x,
    int64_t r0,
    const uint8_t *p, int64_t panel_bytes, int64_t ahead, float *y, int64_t ldy,
    int64_t ncols_last, const float *bias) {
#if HAVE_VNNI512
    if (v == VNNI512) {
        switch (M) {
            case 1: many ? tile_vnni(1, 4, TILE_ARGS) : tile_vnni(1, 1, TILE_ARGS); break;
            case 2: many ? tile_vnni(2, 4, TILE_ARGS) : tile_vnni(2, 1, TILE_ARGS); break;
            case 3: many ? tile_vnni(3, 2, TILE_ARGS) : tile_vnni(3, 1, TILE_ARGS); break;
            case 4: many ? tile_vnni(4, 2, TILE_ARGS) : tile_vnni(4, 1, TILE_ARGS); break;
            case 5: tile_vnni(5, 1, TILE_ARGS); break;
            case 6: tile_vnni(6, 1, TILE_ARGS); break;
            case 7: tile_vnni(7, 1, TILE_ARGS); break;
            case 8: tile_vnni(8, 1, TILE_ARGS); break;
        }
        return;
    }
#endif
    (void)v;
    switch (M) {
        case 1: many ? tile_avx2(1, 2, TILE_ARGS) : tile_avx2(1, 1, TILE_ARGS); break;
        case 2: tile_avx2(2, 1, TILE_ARGS); break;
    }
}

static void panel_group8(int layout, int v, int64_t M, int many, int64_t B, const struct qrows *x,
                         int64_t r0, const uint8_t *p, int64_t panel_bytes, int64_t ahead,
                         float *y, int64_t ldy, int64_t ncols_last, const float *bias) {
    panel_group_of(0, layout, v, M, many, B, x, r0, p, panel_bytes, ahead, y, ldy, ncols_last,
                   bias);
}

static void panel_group4(int layout, int v, int64_t M, int many, int64_t B, const struct qrows *x,
                         int64_t r0, const uint8_t *p, int64_t panel_bytes, int64_t ahead,
                         float *y, int64_t ldy, int64_t ncols_last, const float *bias) {
    panel_group_of(1, layout, v, M, many, B, x, r0, p, panel_bytes, ahead, y, ldy, ncols_last,
                   bias);
}

struct dot_task {
    struct qrows x;
    const float *bias;
    const uint8_t *p;
    float *y;
    int64_t M, N, B, step; /* step: the panels of a work item */
    int v, nibbles, layout;
};

/* work items [i0, i1) of `step` panels each, every row, in groups of the variant's rows (the
   later groups read the panel from cache) */
static void dot_panels(void *arg, int64_t i0, int64_t i1) {
    const struct dot_task *t = arg;
    const int64_t most = rows_of(t->v), groups = (t->M + most - 1) / most;
    const int64_t base = t->M / groups, wider = t->M % groups;
    const int64_t panel_bytes = t->x.blocks * block_bytes(t->B, t->nibbles, t->layout);
    const int64_t panels = (t->N + PW - 1) / PW;
    const int64_t q1 = i1 * t->step < panels ? i1 * t->step : panels;
    const int64_t first = q1 - i0 * t->step < t->step ? q1 - i0 * t->step : t->step;
    prefetch_start(t->p + i0 * t->step * panel_bytes, first, panel_bytes, PREFETCH_AHEAD);
    for (int64_t q = i0 * t->step; q < q1;) {
        const int many = t->step > 1 && q + t->step <= q1;
        const int64_t last = many ? q + t->step - 1 : q;
        const int64_t ncols_last = t->N - last * PW < PW ? t->N - last * PW : PW;
        const float *bq = t->bias ? t->bias + q * PW : 0;
        for (int64_t g = 0, r0 = 0; g < groups; g++) {
            const int64_t rows = base + (g < wider);
            (t->nibbles ? panel_group4 : panel_group8)(
                t->layout, t->v, rows, many, t->B, &t->x, r0, t->p + q * panel_bytes, panel_bytes,
                g == 0 ? PREFETCH_AHEAD : panel_bytes, t->y + r0 * t->N + q * PW, t->N,
                ncols_last, bq);
            r0 += rows;
        }
        q = last + 1;
    }
}

/* y [M, N] = x [M, K] (row stride ldx) @ w^T (+ bias), w in quant_dot_pack's panels (or
   quant_dot4_pack's when `nibbles`) of blocks of B inputs (16 or 32; K a multiple of it), x
   quantized per block, with the selected variant. Returns 0; -1 for bad sizes or no variant;
   -2 out of memory. */
#define PANEL_WORK 32768
static int dot_linear(const float *x, int64_t ldx, const uint8_t *p, const float *bias, float *y,
                      int64_t M, int64_t K, int64_t N, int64_t B, int nibbles) {
    const int v = selected, layout = layout_of(B);
    B = block_of(B);
    if (M < 1 || K < 1 || (B != 16 && B != 32) || K % B != 0 || v == NONE) return -1;
    const int64_t blocks = K / B;
    /* the quantized rows, kept from call to call (fresh pages each call would be faulted in
       every time); one per calling thread */
    static __thread void *scratch = NULL;
    static __thread size_t capacity = 0;
    const size_t floats = (size_t)(M * blocks), needed = 3 * floats * 4 + (size_t)(M * K);
    if (needed > capacity) {
        free(scratch);
        scratch = malloc(needed);
        capacity = scratch == NULL ? 0 : needed;
        if (scratch == NULL) return -2;
    }
    float *d = scratch, *ds = d + floats;
    int32_t *corr = (int32_t *)(ds + floats);
    int32_t *q4 = corr + floats;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t i = r * blocks + b;
            quantize_block(x + r * ldx + b * B, B, q4 + b * (B / 4) * M + r, M, d + i, ds + i,
                           corr + i);
        }
    const int64_t step = M <= rows_of(v) ? panels_for(v, M) : 1;
    const struct dot_task task = {{q4, d, ds, corr, M, blocks}, bias, p, y, M, N, B, step, v,
                                  nibbles, layout};
    const int64_t per_item = M * K * PW * step, min_items = PANEL_WORK / per_item;
    const int64_t items = ((N + PW - 1) / PW + step - 1) / step;
    switchboard_parallel_for(items, min_items, dot_panels, (void *)&task);
    return 0;
}

int quant_dot_linear(const float *x, int64_t ldx, const uint8_t *p, const float *bias, float *y,
                     int64_t M, int64_t K, int64_t N, int64_t B) {
    return dot_linear(x, ldx, p, bias, y, M, K, N, B, 0);
}

int quant_dot4_linear(const float *x, int64_t ldx, const uint8_t *p, const float *bias,
                      float *y, int64_t M, int64_t K, int64_t N, int64_t B) {
    return dot_linear(x, ldx, p, bias, y, M, K, N, B, 1);
}

#else /* no AVX2 and FMA: nothing to run; quant_dot_variants() says so */
int quant_dot_variants(void) { return 0; }
int quant_dot_select(int v) { (void)v; return 0; }
int quant_dot_max_rows(void) { return 0; }

int quant_dot_linear(const float *x, int64_t ldx, const uint8_t *p, const float *bias, float *y,
                     int64_t M, int64_t K, int64_t N, int64_t B) {
    (void)x, (void)ldx, (void)p, (void)bias, (void)y, (void)M, (void)K, (void)N, (void)B;
    return -1;
}

int quant_dot4_linear(const float *x, int64_t ldx, const uint8_t *p, const float *bias,
                      float *y, int64_t M, int64_t K, int64_t N, int64_t B) {
    return quant_dot_linear(x, ldx, p, bias, y, M, K, N, B);
}
#endif

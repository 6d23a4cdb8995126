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
              no saturation) and _mm256_madd_epi16 with ones sum 4 inputs a lane;
     AMX8     AMX-INT8 tiles for groups of 12 to 16 rows, VNNI512 for fewer (quant_dot_amx.h),
              where Linux grants the process the tiles.
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
   or 1.25.

   quant_dot_pack.c packs the panels, quant_dot_tiles.h holds each variant's tile (R rows times
   P panels), this file quantizes the rows and splits a matmul into tiles over the work pool. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "quant_dot.h"
#include "work_pool.h"

enum variant { NONE = 0, AVX2 = 1, VNNI512 = 2, AMX8 = 3 };

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_VNNI512 1
#else
#define HAVE_VNNI512 0
#endif

#if HAVE_VNNI512 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define HAVE_AMX8 1
#else
#define HAVE_AMX8 0
#endif

static const int compiled = (1 << AVX2) | (HAVE_VNNI512 << VNNI512) | (HAVE_AMX8 << AMX8);
static int selected = NONE;

/* Rows per group over one panel: every (row, panel) pair holds an integer sum in registers
   (AVX-512: one register, and its float sum another; AVX2: two, of its 16, the float sums in
   memory). 9 on AVX-512: a decode with 8 proposed tokens in one pass over the weights (as groups
   of 5 and 4 its matmuls took ~12 % longer). AVX2: 6 rows of 4-bit values (12 registers of
   sums, 2 of the line's weights), 4 of 8-bit ones (their lines take 4: q and |q|); at 9 to 64
   rows 4-bit matmuls took ~5 % longer as groups of 4, 8-bit ones ~5 % longer as groups of 6 */
#define MAX_ROWS_512 9
#define MAX_ROWS_256 6
#define MAX_ROWS_256_8BIT 4
#define MAX_ROWS_AMX8 16 /* a tile's rows (the VNNI-512 tile's for rows left over) */
static inline int rows_of(int v, int nibbles) {
    return v == AMX8      ? MAX_ROWS_AMX8
           : v == VNNI512 ? MAX_ROWS_512
           : nibbles      ? MAX_ROWS_256
                          : MAX_ROWS_256_8BIT;
}
/* panels one group takes at once: independent chains for few rows */
static inline int panels_for(int v, int64_t R) {
    if (v == VNNI512) return R <= 2 ? 4 : R <= 4 ? 2 : 1;
    return R == 1 ? 2 : 1;
}

/* the AMX variant only where Linux granted the tiles (bf16_amx.c asks once) */
int quant_dot_variants(void) { return compiled & ~(bf16_amx_ready() ? 0 : 1 << AMX8); }

int quant_dot_select(int v) {
    if (v <= NONE || v > AMX8 || !(quant_dot_variants() & (1 << v))) return 0;
    selected = v;
    return rows_of(v, 1);
}

int quant_dot_max_rows(void) { return selected == NONE ? 0 : rows_of(selected, 1); }

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

#include "quant_dot_tiles.h"

#define TILE_ARGS NIBBLES, layout, B, x, r0, p, panel_bytes, ahead, y, ldy, ncols_last, bias
#define GROUP_PARAMS                                                                           \
    int64_t M, int many, const struct qrows *x, int64_t r0, const uint8_t *p,                 \
        int64_t panel_bytes, int64_t ahead, float *y, int64_t ldy, int64_t ncols_last,        \
        const float *bias

#if HAVE_VNNI512
/* M rows (at most the variant's) times one panel, or panels_for(v, M) when `many`; values of
   8 bits, or 4 when NIBBLES (a constant: one instance of each) */
static inline __attribute__((always_inline)) void vnni_group(const int NIBBLES, int layout,
                                                             int64_t B, GROUP_PARAMS) {
    switch (M) {
        case 1: many ? tile_vnni(1, 4, TILE_ARGS) : tile_vnni(1, 1, TILE_ARGS); break;
        case 2: many ? tile_vnni(2, 4, TILE_ARGS) : tile_vnni(2, 1, TILE_ARGS); break;
        case 3: many ? tile_vnni(3, 2, TILE_ARGS) : tile_vnni(3, 1, TILE_ARGS); break;
        case 4: many ? tile_vnni(4, 2, TILE_ARGS) : tile_vnni(4, 1, TILE_ARGS); break;
        case 5: tile_vnni(5, 1, TILE_ARGS); break;
        case 6: tile_vnni(6, 1, TILE_ARGS); break;
        case 7: tile_vnni(7, 1, TILE_ARGS); break;
        case 8: tile_vnni(8, 1, TILE_ARGS); break;
        case 9: tile_vnni(9, 1, TILE_ARGS); break;
    }
}
#endif

/* The same with the AVX2 tiles; an instance per (block size, factor layout) pair it is called
   with as constants (AVX2_GROUP) */
static inline __attribute__((always_inline)) void avx2_group(const int NIBBLES, const int layout,
                                                             const int64_t B, GROUP_PARAMS) {
    switch (M) {
        case 1: many ? tile_avx2(1, 2, TILE_ARGS) : tile_avx2(1, 1, TILE_ARGS); break;
        case 2: tile_avx2(2, 1, TILE_ARGS); break;
        case 3: tile_avx2(3, 1, TILE_ARGS); break;
        case 4: tile_avx2(4, 1, TILE_ARGS); break;
        /* 8-bit values come in groups of at most MAX_ROWS_256_8BIT: no such tiles for them */
        case 5: if (NIBBLES) tile_avx2(5, 1, TILE_ARGS); break;
        case 6: if (NIBBLES) tile_avx2(6, 1, TILE_ARGS); break;
    }
}

/* The AVX2 tiles of the block sizes and factor layouts GGUF's formats pack as (quant_dot.h),
   each an instance with both constants: the loops over a block's lines then unroll, the sums
   stay in registers and the factors' branches go (with both variables the sums lived on the
   stack, and the one-row 4-bit matmuls of the default model's shapes took 1.15-1.2x as long, C
   harness on the AVX2 AMD EPYC); any other pair takes the instance with both variables. The
   VNNI-512 tiles keep them variables (one instance: the build on AVX-512 CPUs stays short; not
   measured there). */
#define AVX2_GROUP(NIBBLES, LAYOUT, BLOCK)                                                     \
    avx2_group(NIBBLES, LAYOUT, BLOCK, M, many, x, r0, p, panel_bytes, ahead, y, ldy,         \
               ncols_last, bias)
#define KIND(NIBBLES, BLOCK, LAYOUT) ((NIBBLES) << 16 | (LAYOUT) << 8 | (BLOCK))

/* M rows of values of 8 bits, or 4 when `nibbles`, on variant v (see vnni_group) */
static void panel_group(int nibbles, int layout, int v, int64_t B, GROUP_PARAMS) {
#if HAVE_VNNI512
    if (v == VNNI512) {
        if (nibbles)
            vnni_group(1, layout, B, M, many, x, r0, p, panel_bytes, ahead, y, ldy, ncols_last,
                       bias);
        else
            vnni_group(0, layout, B, M, many, x, r0, p, panel_bytes, ahead, y, ldy, ncols_last,
                       bias);
        return;
    }
#endif
    (void)v;
    switch (KIND(nibbles, B, layout)) {
        case KIND(1, 32, HALF): AVX2_GROUP(1, HALF, 32); break; /* Q4_0, Q4_1 */
        case KIND(1, 32, 0): AVX2_GROUP(1, 0, 32); break;       /* Q4_K */
        case KIND(0, 32, HALF | NO_OFFSETS): /* Q8_0, Q5_0 */
            AVX2_GROUP(0, HALF | NO_OFFSETS, 32);
            break;
        case KIND(0, 32, HALF): AVX2_GROUP(0, HALF, 32); break;             /* Q5_1 */
        case KIND(0, 32, NO_OFFSETS): AVX2_GROUP(0, NO_OFFSETS, 32); break; /* int8 */
        case KIND(0, 16, NO_OFFSETS): AVX2_GROUP(0, NO_OFFSETS, 16); break; /* Q6_K */
        default:
            if (nibbles)
                AVX2_GROUP(1, layout, B);
            else
                AVX2_GROUP(0, layout, B);
            break;
    }
}

#if HAVE_AMX8
#include "quant_dot_amx.h"
#endif

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
    const int64_t most = rows_of(t->v, t->nibbles), groups = (t->M + most - 1) / most;
    const int64_t base = t->M / groups, wider = t->M % groups;
    const int64_t panel_bytes = t->x.blocks * block_bytes(t->B, t->nibbles, t->layout);
    const int64_t panels = (t->N + PW - 1) / PW;
    const int64_t q1 = i1 * t->step < panels ? i1 * t->step : panels;
    const int64_t first = q1 - i0 * t->step < t->step ? q1 - i0 * t->step : t->step;
    prefetch_start(t->p + i0 * t->step * panel_bytes, first, panel_bytes, PREFETCH_AHEAD,
                   fetch_of(t->v));
    for (int64_t q = i0 * t->step; q < q1;) {
        const int many = t->step > 1 && q + t->step <= q1;
        const int64_t last = many ? q + t->step - 1 : q;
        const int64_t ncols_last = t->N - last * PW < PW ? t->N - last * PW : PW;
        const float *bq = t->bias ? t->bias + q * PW : 0;
        for (int64_t g = 0, r0 = 0; g < groups; g++) {
            const int64_t rows = base + (g < wider);
            panel_group(t->nibbles, t->layout, t->v, t->B, rows, many, &t->x, r0,
                        t->p + q * panel_bytes, panel_bytes, g == 0 ? PREFETCH_AHEAD : panel_bytes,
                        t->y + r0 * t->N + q * PW, t->N, ncols_last, bq);
            r0 += rows;
        }
        q = last + 1;
    }
}

#define PANEL_WORK 32768

/* The quantized rows' scratch, kept from call to call (fresh pages each call would be faulted
   in every time); one per calling thread; NULL out of memory */
static void *rows_scratch(size_t needed) {
    static __thread void *scratch = NULL;
    static __thread size_t capacity = 0;
    if (needed > capacity) {
        free(scratch);
        scratch = malloc(needed);
        capacity = scratch == NULL ? 0 : needed;
    }
    return scratch;
}

#if HAVE_AMX8
/* dot_linear on the tiles for rows 0 .. m_amx, the VNNI-512 tile for the rest */
static int amx_linear(const float *x, int64_t ldx, const uint8_t *p, const float *bias, float *y,
                      int64_t M, int64_t K, int64_t N, int64_t B, int nibbles, int layout,
                      int64_t m_amx) {
    const int64_t blocks = K / B, padded = (m_amx + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    const int64_t rest = M - m_amx;
    const size_t floats = (size_t)(M * blocks);
    float *d = rows_scratch(3 * floats * 4 + (size_t)(padded * K) + (size_t)(rest * K));
    if (d == NULL) return -2;
    float *ds = d + floats;
    int32_t *corr = (int32_t *)(ds + floats);
    int8_t *qa = (int8_t *)(corr + floats), *q_rest = qa + padded * K;
    memset(qa + m_amx * K, 0, (size_t)((padded - m_amx) * K)); /* a last tile's rows past M */
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t i = r * blocks + b;
            int32_t *q4 = r < m_amx ? (int32_t *)(qa + r * K + b * B)
                                    : (int32_t *)q_rest + b * (B / 4) * rest + (r - m_amx);
            quantize_block(x + r * ldx + b * B, B, q4, r < m_amx ? 1 : rest, d + i, ds + i,
                           corr + i);
        }
    const struct qrows rest_rows = {(const int32_t *)q_rest, d + m_amx * blocks,
                                    ds + m_amx * blocks, corr + m_amx * blocks, rest, blocks};
    struct amx_task task = {qa, d, ds, corr, rest_rows, bias, p, y, M, m_amx, K, N, B,
                            blocks, nibbles, layout, 0};
    const int64_t items = (N + PW - 1) / PW;
    switchboard_parallel_for(items, PANEL_WORK / (M * K * PW), amx_panels, &task);
    return atomic_load(&task.failed) ? -2 : 0;
}
#endif

/* y [M, N] = x [M, K] (row stride ldx) @ w^T (+ bias), w in quant_dot_pack's panels (or
   quant_dot4_pack's when `nibbles`) of blocks of B inputs (16 or 32; K a multiple of it), x
   quantized per block, with the selected variant. Returns 0; -1 for bad sizes or no variant;
   -2 out of memory. */
static int dot_linear(const float *x, int64_t ldx, const uint8_t *p, const float *bias, float *y,
                      int64_t M, int64_t K, int64_t N, int64_t B, int nibbles) {
    int v = selected;
    const int layout = layout_of(B);
    B = block_of(B);
    if (M < 1 || K < 1 || (B != 16 && B != 32) || K % B != 0 || v == NONE) return -1;
#if HAVE_AMX8
    if (v == AMX8 && amx_rows(M) > 0) return amx_linear(x, ldx, p, bias, y, M, K, N, B, nibbles,
                                                         layout, amx_rows(M));
#endif
    if (v == AMX8) v = VNNI512; /* too few rows for a tile */
    const int64_t blocks = K / B;
    const size_t floats = (size_t)(M * blocks);
    float *d = rows_scratch(3 * floats * 4 + (size_t)(M * K));
    if (d == NULL) return -2;
    float *ds = d + floats;
    int32_t *corr = (int32_t *)(ds + floats);
    int32_t *q4 = corr + floats;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t i = r * blocks + b;
            quantize_block(x + r * ldx + b * B, B, q4 + b * (B / 4) * M + r, M, d + i, ds + i,
                           corr + i);
        }
    const int64_t step = M <= rows_of(v, nibbles) ? panels_for(v, M) : 1;
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

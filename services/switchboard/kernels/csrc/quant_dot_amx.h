/* quant_dot.c's AMX-INT8 variant: the integer sums of 16 rows by a panel's 16 columns over a
   block on the tiles, one TDPBSUD (signed int8 rows times the panel's unsigned bytes) a block.

   A panel's block is already the layout a tile multiply reads as its second operand: a line
   of 16 columns' 4 consecutive inputs is one tile row of 64 bytes, so the block's B / 4 lines
   (8 bits) are one B tile; 4-bit blocks are unpacked to those lines once per panel. The rows,
   quantized as for the other variants (the same d, sums and values), are laid out row by row
   for the A tile (16 rows of the block's B inputs, zero rows past M). Each block's tile of sums
   is stored and folded into the float sums with the same operations, in the same order, as the
   VNNI-512 tile: the same integers (exact) and so the same floats, bit for bit. A group of rows
   is a tile of 16 whatever the rows beside them, and rows left over in too small a group for a
   tile (fewer than AMX_MIN_ROWS) take the VNNI-512 tile: a row's floats are the same either
   way, so the variant is batch-invariant too.

   Linux hands out the tiles' register state only to a process that asks for it
   (bf16_amx_ready, shared with bf16_amx.c); each thread loads the tile configuration before
   its loop and releases the tiles after (oneDNN uses them on the same threads). Included by
   quant_dot.c alone, after quant_dot_tiles.h, where HAVE_AMX8. */
#ifndef SWITCHBOARD_QUANT_DOT_AMX_H
#define SWITCHBOARD_QUANT_DOT_AMX_H
#include <stdatomic.h>
#include <string.h>

#include "amx_tiles.h"

#define AMX_ROWS 16
/* A last group of fewer rows than this takes the VNNI-512 tile: a block's tile work (two tile
   loads, the multiply, storing 1 KB of sums) costs the same for one row as for 16, and below
   12 rows the VNNI-512 tile was the faster (SmolLM2's matrices, 2 threads, its time over the
   tiles' in two runs: 4 / 8 / 9 rows 0.47-0.70 / 0.58-0.76 / 0.66-0.79x, 12 rows 0.83-1.05x,
   16 rows 1.01-1.23x). */
#define AMX_MIN_ROWS 12

struct amx_task {
    const int8_t *qa; /* [rows rounded up to 16][K] */
    const float *d, *ds;
    const int32_t *corr; /* per (row, block); a tile's rows past M are never folded */
    struct qrows rest;   /* rows past m_amx in quant_dot.c's layout, for the VNNI-512 tile */
    const float *bias;
    const uint8_t *p;
    float *y;
    int64_t M, m_amx, K, N, B, blocks;
    int nibbles, layout;
    _Atomic int failed; /* a thread found no memory for its unpacked panel */
};

static void amx_load_config(int64_t B) {
    struct amx_tile_config c = amx_tile_config_empty();
    for (int first = 0; first < 6; first += 3) { /* two sets: tiles 0-2 and 3-5 */
        c.rows[first] = AMX_ROWS, c.colsb[first] = 64;            /* sums: 16 rows x 16 int32 */
        c.rows[first + 1] = AMX_ROWS, c.colsb[first + 1] = (uint16_t)B; /* rows: 16 x B int8 */
        c.rows[first + 2] = (uint8_t)(B / 4), c.colsb[first + 2] = 4 * PW; /* B / 4 lines */
    }
    amx_tile_config_load(&c);
}

/* A 4-bit panel's blocks as 8-bit lines: block b's lines at out + b * B * PW, its B / 8 lines'
   low nibbles (inputs 0 .. B / 2) first, then their high ones. */
static void unpack_panel4(const uint8_t *panel, int64_t blocks, int64_t B, int64_t bb,
                          uint8_t *out) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *src = panel + b * bb;
        uint8_t *dst = out + b * B * PW;
        for (int64_t k4 = 0; k4 < B / 8; k4++) {
            const __m512i v = _mm512_loadu_si512((const void *)(src + k4 * 4 * PW));
            _mm512_storeu_si512((void *)(dst + k4 * 4 * PW), _mm512_and_si512(v, low));
            _mm512_storeu_si512((void *)(dst + (B / 8 + k4) * 4 * PW),
                                _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
    }
}

/* Block `blk`'s tile of sums into tile c (rows in tile a, the panel's lines in tile bt) */
#define AMX_BLOCK(c, a, bt, blk)                                                   \
    do {                                                                           \
        _tile_zero(c);                                                             \
        _tile_loadd(a, t->qa + r0 * t->K + (blk) * B, t->K);                       \
        _tile_loadd(bt, values + (blk) * vstride, 4 * PW);                         \
        _tile_dpbsud(c, a, bt);                                                    \
    } while (0)

/* Block b's integer sums (rows r0 .. r0 + 16) folded into acc as the VNNI-512 tile does */
static inline __attribute__((always_inline)) void amx_fold(const int R,
                                                          const struct amx_task *t, int64_t r0,
                                                          int64_t b, const int32_t *sums,
                                                          const uint8_t *so, __m512 *acc) {
    const int half = t->layout & HALF, offsets = !(t->layout & NO_OFFSETS);
    __m512 s, o;
    block_factors(so, half, offsets, &s, &o);
    for (int r = 0; r < R; r++) {
        const int64_t i = (r0 + r) * t->blocks + b;
        __m512i v = _mm512_load_si512((const void *)(sums + r * PW));
        if (!t->nibbles) v = _mm512_add_epi32(v, _mm512_set1_epi32(t->corr[i]));
        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(t->d[i]));
        const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), sd, acc[r]);
        acc[r] = offsets ? _mm512_fmadd_ps(o, _mm512_set1_ps(t->ds[i]), a) : a;
    }
}

/* Rows r0 .. r0 + R (a constant where inlined; the tile's rows past them are zero) times one
   panel: its blocks' values at `values` (8-bit lines, block b at values + b * vstride) and
   factors at panel + b * bb + factors. Two tiles of sums take turns: the next block's multiply
   runs while this one's sums are folded. */
static inline __attribute__((always_inline)) void amx_group(
    const int R, const struct amx_task *t, int64_t r0, const uint8_t *panel, const uint8_t *values,
    int64_t vstride, int64_t bb, int64_t factors, float *y, int64_t ncols_last,
    const float *bias) {
    const int64_t B = t->B, blocks = t->blocks;
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    int32_t sums[AMX_ROWS * PW] __attribute__((aligned(64)));
    AMX_BLOCK(0, 1, 2, 0);
    for (int64_t b = 0; b < blocks; b += 2) {
        if (b + 1 < blocks) AMX_BLOCK(3, 4, 5, b + 1);
        _tile_stored(0, sums, 4 * PW);
        amx_fold(R, t, r0, b, sums, panel + b * bb + factors, acc);
        if (b + 1 < blocks) {
            if (b + 2 < blocks) AMX_BLOCK(0, 1, 2, b + 2);
            _tile_stored(3, sums, 4 * PW);
            amx_fold(R, t, r0, b + 1, sums, panel + (b + 1) * bb + factors, acc);
        }
    }
    float out[AMX_ROWS * PW];
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * PW, acc[r]);
    store_tile(R, 1, out, y, t->N, ncols_last, bias);
}
#undef AMX_BLOCK

/* amx_group with R a constant: AMX_MIN_ROWS .. 16 */
_Static_assert(AMX_MIN_ROWS == 12, "amx_group_of instantiates groups of 12 to 16 rows");
static void amx_group_of(int64_t R, const struct amx_task *t, int64_t r0, const uint8_t *panel,
                         const uint8_t *values, int64_t vstride, int64_t bb, int64_t factors,
                         float *y, int64_t ncols_last, const float *bias) {
#define GROUP(n) \
    case n: amx_group(n, t, r0, panel, values, vstride, bb, factors, y, ncols_last, bias); break
    switch (R) {
        GROUP(12); GROUP(13); GROUP(14); GROUP(15); GROUP(16);
    }
#undef GROUP
}

/* panels [i0, i1): every row, the tiles' groups then the rest on the VNNI-512 tile */
static void amx_panels(void *arg, int64_t i0, int64_t i1) {
    struct amx_task *t = arg;
    const int64_t bb = block_bytes(t->B, t->nibbles, t->layout);
    const int64_t panel_bytes = t->blocks * bb, factors = t->nibbles ? t->B * PW / 2 : t->B * PW;
    static __thread uint8_t *unpacked = NULL;
    static __thread size_t capacity = 0;
    const size_t needed = (size_t)(t->K * PW);
    if (t->nibbles && needed > capacity) {
        free(unpacked);
        unpacked = malloc(needed);
        capacity = unpacked == NULL ? 0 : needed;
        if (unpacked == NULL) {
            atomic_store(&t->failed, 1);
            return;
        }
    }
    const int64_t rest = t->M - t->m_amx, most = MAX_ROWS_512;
    const int64_t groups = (rest + most - 1) / most;
    amx_load_config(t->B);
    for (int64_t q = i0; q < i1; q++) {
        const uint8_t *panel = t->p + q * panel_bytes;
        const int64_t ncols_last = t->N - q * PW < PW ? t->N - q * PW : PW;
        const float *bq = t->bias ? t->bias + q * PW : 0;
        const uint8_t *values = panel;
        int64_t vstride = bb;
        if (t->nibbles) {
            unpack_panel4(panel, t->blocks, t->B, bb, unpacked);
            values = unpacked, vstride = t->B * PW;
        }
        for (int64_t r0 = 0; r0 < t->m_amx; r0 += AMX_ROWS) {
            const int64_t R = t->m_amx - r0 < AMX_ROWS ? t->m_amx - r0 : AMX_ROWS;
            amx_group_of(R, t, r0, panel, values, vstride, bb, factors, t->y + r0 * t->N + q * PW,
                      ncols_last, bq);
        }
        for (int64_t g = 0, r0 = 0; g < groups; g++) {
            const int64_t rows = rest / groups + (g < rest % groups);
            panel_group(t->nibbles, t->layout, VNNI512, t->B, rows, 0, &t->rest, r0, panel,
                        panel_bytes, panel_bytes, t->y + (t->m_amx + r0) * t->N + q * PW, t->N,
                        ncols_last, bq);
            r0 += rows;
        }
    }
    _tile_release();
}

/* The rows the tiles take: whole groups of 16, and a last group of at least AMX_MIN_ROWS */
static inline int64_t amx_rows(int64_t M) {
    return M % AMX_ROWS >= AMX_MIN_ROWS ? M : M - M % AMX_ROWS;
}

#endif

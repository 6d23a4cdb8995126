/* bfloat16 matmuls on AMX tiles (TDPBF16PS): bf16_gemm.c's AMX variant.

   bf16_pack's panels are already the layout a tile multiply reads as its second operand: a
   k-pair of a panel is one 64-byte line of 16 columns' input pairs, so 16 consecutive k-pairs
   of a panel (1 KB) are one B tile, [16 pairs][16 columns]. The rows, rounded to bfloat16 pairs
   (bf16_gemm.c's DPBF16 layout, padded with zero rows to a multiple of 16), give the A tiles:
   16 rows by 16 pairs. One TDPBF16PS adds 16 rows x 16 columns x 32 products into a float32
   tile; four such sums (four panels) stay in tiles over the whole of K while A is loaded once
   per 16 pairs for the four.

   A row's sums are the same operations whatever rows share the call (a tile row depends on its
   A row alone), so the variant is batch-invariant; it runs for any number of rows, one included,
   so that a row never switches variant with the rows beside it. The instruction adds each pair's
   even product first (the AVX-512 variants, VDPBF16PS's order, add the odd one first): the
   variants agree to float32 rounding.

   Linux hands out the tiles' register state only to a process that asks for it
   (arch_prctl ARCH_REQ_XCOMP_PERM); bf16_amx_ready asks once, and the variant exists only where
   that was granted. Each thread loads the tile configuration before its loop and releases the
   tiles after. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "work_pool.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define PW 16         /* output columns per panel */
#define TILE_PAIRS 16 /* k-pairs per tile: 32 bfloat16 inputs */
#define TILE_ROWS 16
#define PANELS_AT_ONCE 4

int bf16_amx_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

/* palette 1; tiles 0-3 the sums of four panels and 4 the rows (up to 16 of them), 5 and 6 the
   panels' weights (alternating, so a load need not wait for the multiply reading the other) */
struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void load_config(int rows) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 7; t++) {
        c.rows[t] = t < 5 ? (uint8_t)rows : TILE_ROWS;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

struct amx_task {
    const uint32_t *xp, *p;
    const float *bias;
    float *y;
    int64_t M, KP, N;
};

/* B tile of panel pq's k-pairs kc .. kc + 15 into `tile`; where fewer than 16 remain in K, the
   rest (zero) come from `tail`, a copy, so that no line past the panel is read */
#define LOAD_B(tile, pq, kc)                                                              \
    do {                                                                                  \
        if ((kc) + TILE_PAIRS <= KP) {                                                    \
            _tile_loadd(tile, (pq) + (kc) * PW, 64);                                      \
        } else {                                                                          \
            memset(tail, 0, sizeof tail);                                                 \
            memcpy(tail, (pq) + (kc) * PW, (size_t)(KP - (kc)) * 64);                     \
            _tile_loadd(tile, tail, 64);                                                  \
        }                                                                                 \
    } while (0)

/* the sums of n (1..4) panels from panel q on, rows r0 .. r0 + 15 of the padded rows */
static void four_panels(const struct amx_task *t, int64_t q, int n, int64_t r0) {
    const int64_t KP = t->KP, KPA = (KP + TILE_PAIRS - 1) / TILE_PAIRS * TILE_PAIRS;
    const uint32_t *x = t->xp + r0 * KPA;
    const uint32_t *p0 = t->p + q * KP * PW, *p1 = p0 + KP * PW, *p2 = p1 + KP * PW,
                   *p3 = p2 + KP * PW;
    uint32_t tail[TILE_PAIRS * PW];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < KP; kc += TILE_PAIRS) {
        _tile_loadd(4, x + kc, KPA * 4);
        LOAD_B(5, p0, kc);
        _tile_dpbf16ps(0, 4, 5);
        if (n > 1) {
            LOAD_B(6, p1, kc);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (n > 2) {
            LOAD_B(5, p2, kc);
            _tile_dpbf16ps(2, 4, 5);
        }
        if (n > 3) {
            LOAD_B(6, p3, kc);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    float sums[PANELS_AT_ONCE][TILE_ROWS][PW]; /* rows past the tiles' are not written */
    _tile_stored(0, sums[0], PW * 4);
    if (n > 1) _tile_stored(1, sums[1], PW * 4);
    if (n > 2) _tile_stored(2, sums[2], PW * 4);
    if (n > 3) _tile_stored(3, sums[3], PW * 4);
    const int64_t rows = t->M - r0 < TILE_ROWS ? t->M - r0 : TILE_ROWS;
    for (int i = 0; i < n; i++) {
        const int64_t col = (q + i) * PW;
        const int64_t ncols = t->N - col < PW ? t->N - col : PW;
        const float *b = t->bias ? t->bias + col : 0;
        for (int64_t r = 0; r < rows; r++) {
            float *yr = t->y + (r0 + r) * t->N + col;
            for (int64_t j = 0; j < ncols; j++) yr[j] = b ? sums[i][r][j] + b[j] : sums[i][r][j];
        }
    }
}

/* work items [i0, i1): groups of four panels, every row group over each while it is cached */
static void amx_items(void *arg, int64_t i0, int64_t i1) {
    const struct amx_task *t = arg;
    const int64_t panels = (t->N + PW - 1) / PW;
    /* fewer than 16 rows: tiles of that many (a shorter multiply), the same sums a row */
    load_config(t->M < TILE_ROWS ? (int)t->M : TILE_ROWS);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t q = i * PANELS_AT_ONCE;
        const int n = panels - q < PANELS_AT_ONCE ? (int)(panels - q) : PANELS_AT_ONCE;
        for (int64_t r0 = 0; r0 < t->M; r0 += TILE_ROWS) four_panels(t, q, n, r0);
    }
    _tile_release();
}

/* y [M, N] = rows xp (bfloat16 pairs, KP of them a row, stored at a stride of KP rounded up to
   16 and zero past KP and past row M up to a multiple of 16) @ panels p (+ bias) */
#define AMX_ITEM_WORK 32768
void bf16_amx_linear(const uint32_t *xp, const uint32_t *p, const float *bias, float *y,
                     int64_t M, int64_t KP, int64_t N) {
    const struct amx_task task = {xp, p, bias, y, M, KP, N};
    const int64_t items = ((N + PW - 1) / PW + PANELS_AT_ONCE - 1) / PANELS_AT_ONCE;
    const int64_t per_item = M * 2 * KP * PW * PANELS_AT_ONCE;
    switchboard_parallel_for(items, AMX_ITEM_WORK / per_item, amx_items, (void *)&task);
}

#else /* no AMX in this build (or not Linux): the variant is never offered */
int bf16_amx_ready(void) { return 0; }

void bf16_amx_linear(const uint32_t *xp, const uint32_t *p, const float *bias, float *y,
                     int64_t M, int64_t KP, int64_t N) {
    (void)xp, (void)p, (void)bias, (void)y, (void)M, (void)KP, (void)N;
}
#endif

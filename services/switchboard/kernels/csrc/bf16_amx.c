/* bfloat16 matmuls on AMX tiles (TDPBF16PS): bf16_gemm.c's AMX variant.

   bf16_pack's panels are already the layout a tile multiply reads as its second operand: a
   k-pair of a panel is one 64-byte line of 16 columns' input pairs, so 16 consecutive k-pairs
   of a panel (1 KB) are one B tile, [16 pairs][16 columns]. The rows, rounded to bfloat16 pairs
   (padded with zero rows to a multiple of 16), give the A tiles: 16 rows by 16 pairs, which
   bf16_linear lays out one after another, each a contiguous kilobyte (with the rows at their
   own stride a tile's 16 lines were KPA * 4 bytes apart, 4 KB for 2,048 inputs, all in one L1
   set: matmuls of 64 to 128 rows took 1.1-1.3x as long). One TDPBF16PS adds 16 rows x 16
   columns x 32 products into a float32 tile; four such sums (four panels) stay in tiles over
   the whole of K while A is loaded once per 16 pairs for the four, or with more than 16 rows
   two groups of rows by two panels, every group of rows over two panels while they are in L2
   (and the next two panels read from memory meanwhile).
   Measured on a 2-core Xeon with AMX against oneDNN's bfloat16 matmul (its tiles too, the plain
   weight each call) on tiny-llama's, llama-100m's and SmolLM2's matrices: 1.2-3x as fast at 1
   to 32 rows, about even at 64, 0.65-0.9x at 128; against this kernel's dpbf16 variant 2-4x as
   fast from 16 rows, 0.75-0.95x at one row (K in blocks held in L1 measured no faster).

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_tiles.h"

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

/* tiles 0-3 sums, 4 and 7 rows (up to 16 each), 5 and 6 the panels' weights: with one group
   of rows, the sums of four panels (a row tile loaded once for four multiplies), with two, two
   groups by two panels (four loads for four multiplies, not five) */
static void load_config(int rows) {
    struct amx_tile_config c = amx_tile_config_empty();
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t == 5 || t == 6 ? TILE_ROWS : (uint8_t)rows;
        c.colsb[t] = 64;
    }
    amx_tile_config_load(&c);
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

/* Prefetch distance in k-pairs: each panel's lines 2 KB ahead of its tile loads, as the
   AVX-512 variants ask for theirs (the tile loads alone left a one-row step, which reads the
   weights from memory, 10-40 % slower; measured 1 and 2 KB ahead alike, 3 KB no better) */
#define PF_PAIRS 32

/* rows r0 .. r0 + 15 (those below M) of panel q's sums, `sums`, into y with the bias */
static void put_sums(const struct amx_task *t, float sums[TILE_ROWS][PW], int64_t q, int64_t r0) {
    const int64_t rows = t->M - r0 < TILE_ROWS ? t->M - r0 : TILE_ROWS;
    const int64_t col = q * PW, ncols = t->N - col < PW ? t->N - col : PW;
    const float *b = t->bias ? t->bias + col : 0;
    for (int64_t r = 0; r < rows; r++) {
        float *yr = t->y + (r0 + r) * t->N + col;
        for (int64_t j = 0; j < ncols; j++) yr[j] = b ? sums[r][j] + b[j] : sums[r][j];
    }
}

/* bias (may be NULL) added to rows r0 .. r0 + 15 of panel q's 16 columns in y */
static void add_bias(const struct amx_task *t, int64_t q, int64_t r0) {
    if (!t->bias) return;
    const __m512 b = _mm512_loadu_ps(t->bias + q * PW);
    for (int64_t r = r0; r < r0 + TILE_ROWS; r++) {
        float *yr = t->y + r * t->N + q * PW;
        _mm512_storeu_ps(yr, _mm512_add_ps(_mm512_loadu_ps(yr), b));
    }
}

/* tile `tile`'s sums: panel q, rows from r0 (rows past the tiles' configured ones unused);
   a whole tile's straight into y */
#define STORE(tile, q, r0)                                                                \
    do {                                                                                  \
        if ((r0) + TILE_ROWS <= t->M && ((q) + 1) * PW <= t->N) {                         \
            _tile_stored(tile, t->y + (r0) * t->N + (q) * PW, t->N * 4);                  \
            add_bias(t, q, r0);                                                           \
        } else {                                                                          \
            float sums_[TILE_ROWS][PW];                                                   \
            _tile_stored(tile, sums_, PW * 4);                                            \
            put_sums(t, sums_, q, r0);                                                    \
        }                                                                                 \
    } while (0)

#define PREFETCH_PANEL(pq, kc)                                                            \
    for (int l = 0; l < 16; l++)                                                          \
        _mm_prefetch((const char *)((pq) + ((kc) + PF_PAIRS) * PW) + 64 * l, _MM_HINT_T0)

/* the sums of n (1..4) panels from panel q on, rows 0 .. 15 (M at most 16) */
static void four_panels(const struct amx_task *t, int64_t q, int n) {
    const int64_t KP = t->KP;
    const uint32_t *x = t->xp;
    const uint32_t *p0 = t->p + q * KP * PW, *p1 = p0 + KP * PW, *p2 = p1 + KP * PW,
                   *p3 = p2 + KP * PW;
    uint32_t tail[TILE_PAIRS * PW];
    _tile_zero(0);
    if (n > 1) _tile_zero(1);
    if (n > 2) _tile_zero(2);
    if (n > 3) _tile_zero(3);
    for (int64_t kc = 0; kc < KP; kc += TILE_PAIRS) {
        if (kc + PF_PAIRS < KP) {
            PREFETCH_PANEL(p0, kc);
            if (n > 1) PREFETCH_PANEL(p1, kc);
            if (n > 2) PREFETCH_PANEL(p2, kc);
            if (n > 3) PREFETCH_PANEL(p3, kc);
        }
        _tile_loadd(4, x + kc * TILE_ROWS, 64);
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
    STORE(0, q, 0);
    if (n > 1) STORE(1, q + 1, 0);
    if (n > 2) STORE(2, q + 2, 0);
    if (n > 3) STORE(3, q + 3, 0);
}

/* lines [lo, hi) of panel pq (a k-pair a 64-byte line) asked for into L2 */
static inline void prefetch_lines(const uint32_t *pq, int64_t lo, int64_t hi) {
    for (int64_t l = lo; l < hi; l++) _mm_prefetch((const char *)(pq + l * PW), _MM_HINT_T1);
}

/* One pass over K: panel q (pa) and q + 1 (pb, where not NULL) by the rows of group r0 and, where
   two, of group r0 + 16; meanwhile the k-pairs [nlo, nhi) of the next panels na and nb (where not
   NULL) are asked for into L2, spread evenly over the pass's steps. */
static void pass(const struct amx_task *t, int64_t q, const uint32_t *pa, const uint32_t *pb,
                 int64_t r0, int two, const uint32_t *na, const uint32_t *nb, int64_t nlo,
                 int64_t nhi) {
    const int64_t KP = t->KP, KPA = (KP + TILE_PAIRS - 1) / TILE_PAIRS * TILE_PAIRS;
    const uint32_t *x0 = t->xp + r0 * KPA, *x1 = x0 + TILE_ROWS * KPA;
    const int64_t steps = KPA / TILE_PAIRS, span = nhi - nlo;
    uint32_t tail[TILE_PAIRS * PW];
    _tile_zero(0);
    if (two) _tile_zero(2);
    if (pb) {
        _tile_zero(1);
        if (two) _tile_zero(3);
    }
    int64_t step = 0;
    for (int64_t kc = 0; kc < KP; kc += TILE_PAIRS, step++) {
        if (kc + PF_PAIRS < KP) {
            PREFETCH_PANEL(pa, kc);
            if (pb) PREFETCH_PANEL(pb, kc);
        }
        if (na) {
            const int64_t lo = nlo + step * span / steps, hi = nlo + (step + 1) * span / steps;
            prefetch_lines(na, lo, hi);
            if (nb) prefetch_lines(nb, lo, hi);
        }
        _tile_loadd(4, x0 + kc * TILE_ROWS, 64);
        if (two) _tile_loadd(7, x1 + kc * TILE_ROWS, 64);
        LOAD_B(5, pa, kc);
        _tile_dpbf16ps(0, 4, 5);
        if (two) _tile_dpbf16ps(2, 7, 5);
        if (pb) {
            LOAD_B(6, pb, kc);
            _tile_dpbf16ps(1, 4, 6);
            if (two) _tile_dpbf16ps(3, 7, 6);
        }
    }
    STORE(0, q, r0);
    if (two) STORE(2, q, r0 + TILE_ROWS);
    if (pb) {
        STORE(1, q + 1, r0);
        if (two) STORE(3, q + 1, r0 + TILE_ROWS);
    }
}

/* Panel q (and q + 1 where pair) by every group of rows, two groups a pass, all the passes
   while the panels are in L2. Where there are two passes or more, each pass also asks for its
   share of the next panels (nq, and nq + 1 where npair; none where nq < 0): the first pass read
   its panels from memory and the rest from L2, and nothing was read from memory meanwhile
   (bench/amx_matmul_ab.sh, two threads, weights past the CPU's caches: llama-100m's layer
   matrices at 64 rows 0.89-0.95x the time, at 128 rows 0.94-1.02x, SmolLM2's 0.89x / 0.93x,
   the language-model heads 0.79-0.91x; one pass, up to 32 rows: nothing to gain, left so). */
static void panel_pair(const struct amx_task *t, int64_t q, int pair, int64_t nq, int npair) {
    const int64_t KP = t->KP, passes = (t->M + 2 * TILE_ROWS - 1) / (2 * TILE_ROWS);
    const uint32_t *pa = t->p + q * KP * PW, *pb = pair ? pa + KP * PW : 0;
    const uint32_t *na = nq >= 0 && passes > 1 ? t->p + nq * KP * PW : 0;
    const uint32_t *nb = na && npair ? na + KP * PW : 0;
    int64_t r = 0;
    for (int64_t r0 = 0; r0 < t->M; r0 += 2 * TILE_ROWS, r++)
        pass(t, q, pa, pb, r0, r0 + TILE_ROWS < t->M, na, nb, r * KP / passes,
             (r + 1) * KP / passes);
}

/* work items [i0, i1): groups of four panels. One group of rows: four panels a pass (a row
   tile loaded once for four multiplies); more: two panels at a time by every group of rows */
static void amx_items(void *arg, int64_t i0, int64_t i1) {
    const struct amx_task *t = arg;
    const int64_t panels = (t->N + PW - 1) / PW;
    /* fewer than 16 rows: tiles of that many (a shorter multiply), the same sums a row */
    load_config(t->M < TILE_ROWS ? (int)t->M : TILE_ROWS);
    if (t->M <= TILE_ROWS) {
        for (int64_t i = i0; i < i1; i++) {
            const int64_t q = i * PANELS_AT_ONCE;
            const int n = panels - q < PANELS_AT_ONCE ? (int)(panels - q) : PANELS_AT_ONCE;
            four_panels(t, q, n);
        }
    } else {
        /* the next panels past this chunk's too: a thread's next chunk is most often the
           one after it (work_pool.c's runs); measured 0.96-1.0x the time of stopping at the
           chunk's end */
        const int64_t end = i1 * PANELS_AT_ONCE < panels ? i1 * PANELS_AT_ONCE : panels;
        for (int64_t q = i0 * PANELS_AT_ONCE; q < end; q += 2) {
            const int64_t nq = q + 2 < panels ? q + 2 : -1;
            panel_pair(t, q, q + 1 < end, nq, nq >= 0 && nq + 1 < panels);
        }
    }
    _tile_release();
}

/* y [M, N] = rows xp (bfloat16 pairs, KP of them a row, in tiles: rows 16g .. 16g + 15 by
   pairs kc .. kc + 15 one kilobyte at xp + 16g * KPA + 16kc, KPA = KP rounded up to 16, zero
   past KP and past row M up to a multiple of 16) @ panels p (+ bias) */
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

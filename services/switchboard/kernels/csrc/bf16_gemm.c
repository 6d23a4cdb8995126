/* Matmuls of a few rows (decode) on bfloat16 weights: half the bytes of float32, so a decode
   step bound by reading the weights takes about half the time. float32 x in and y out; the
   rows are rounded to bfloat16 (round to nearest even) as torch's bfloat16 matmul takes them,
   and every product of two bfloat16 values is exact in float32, summed in float32.

   Panels of 16 output columns like small_batch_gemm.c, each input pair interleaved: panel q is
   [ceil(K / 2)][16][2] bfloat16 (bf16_pack), so one k-pair of a panel is one 64-byte line,
   one AVX-512 register. Four variants, each compiled where the build's CPU flags (the
   machine's, -march=native) have its instructions, chosen at run time (bf16_gemm_select):
     AMX     AMX-BF16 tiles (bf16_amx.c), where the kernel may use them;
     DPBF16  AVX-512 BF16: _mm512_dpbf16_ps multiplies and sums a pair of inputs per lane;
     AVX512  AVX-512F: each lane's pair widened to two float32 by a shift and a mask, two FMAs;
     AVX2    the same on two AVX2 halves.
   The shift variants add the odd input's product first, as VDPBF16PS is specified to; a
   product of two bfloat16 values is exact, so an FMA rounds as the instruction's add does.
   Within a variant a row's result does not depend on the rows beside it (batch-invariant). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "work_pool.h"

#define PW 16 /* output columns per panel */

enum variant { NONE = 0, AVX2 = 1, AVX512 = 2, DPBF16 = 3, AMX = 4 };

static inline int64_t pairs_of(int64_t K) { return (K + 1) / 2; }

static inline uint32_t bf16_bits(float f) { return bf16_from_f32(f); }

/* w [N, K] bfloat16 row-major -> panels [ceil(N / 16), ceil(K / 2), 16] of pairs (input 2k in
   the low half, 2k + 1 in the high half), zero past N and K */
void bf16_pack(const uint16_t *w, uint32_t *p, int64_t N, int64_t K) {
    const int64_t panels = (N + PW - 1) / PW, KP = pairs_of(K);
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < panels; q++)
        for (int64_t kp = 0; kp < KP; kp++)
            for (int64_t j = 0; j < PW; j++) {
                const int64_t n = q * PW + j, k = 2 * kp;
                const uint32_t lo = n < N ? w[n * K + k] : 0;
                const uint32_t hi = n < N && k + 1 < K ? w[n * K + k + 1] : 0;
                p[(q * KP + kp) * PW + j] = lo | hi << 16;
            }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static const int compiled = (1 << AVX2)
#ifdef __AVX512F__
                            | (1 << AVX512)
#endif
#ifdef __AVX512BF16__
                            | (1 << DPBF16)
#endif
    ;

/* Rows per group (over one cached panel) and panels one or two rows take at once (several
   independent multiply-add chains: one row over one panel waits on one chain's latency).
   AVX-512: 8 rows' sums and the weights fit its 32 registers; AVX2's 16 hold 4 rows' (two
   halves each) and a panel's four widened weight vectors. */
#define MAX_ROWS_512 8
#define MAX_ROWS_256 4
#define MAX_ROWS_AMX 16 /* a tile's rows */
static inline int rows_of(int v) {
    return v == AVX2 ? MAX_ROWS_256 : v == AMX ? MAX_ROWS_AMX : MAX_ROWS_512;
}
static inline int panels_for(int v, int64_t R) {
    if (v == AVX2) return R == 1 ? 2 : 1;
    return R <= 2 ? 4 : 1;
}

static int selected = NONE;

int bf16_gemm_variants(void) { return compiled | (bf16_amx_ready() ? 1 << AMX : 0); }

int bf16_gemm_select(int v) {
    if (v <= NONE || v > AMX || !(bf16_gemm_variants() & (1 << v))) return 0;
    selected = v;
    return rows_of(v);
}

int bf16_gemm_max_rows(void) { return selected == NONE ? 0 : rows_of(selected); }

/* Prefetch distance of the group that reads a panel from memory (a line a k-pair), as
   small_batch_gemm.c: 2 KB ahead; the later groups ask for the next panel instead. */
#define PREFETCH_AHEAD 2048

/* Tile i = row i % R of panel i / R; its sums' store (a whole panel straight to y, the bias
   added as a vector; a partial one through t). */
#define STORE_512(i)                                                                     \
    if (R * P > i) {                                                                     \
        const int r = i % R, pp = i / R;                                                 \
        const int64_t ncols = pp == P - 1 ? ncols_last : PW;                             \
        const float *bp = bias ? bias + pp * PW : 0;                                     \
        float *yp = y + r * ldy + pp * PW;                                               \
        if (ncols == PW) {                                                               \
            _mm512_storeu_ps(yp, bp ? _mm512_add_ps(a##i, _mm512_loadu_ps(bp)) : a##i);  \
        } else {                                                                         \
            _mm512_storeu_ps(t, a##i);                                                   \
            for (int64_t j = 0; j < ncols; j++) yp[j] = bp ? t[j] + bp[j] : t[j];        \
        }                                                                                \
    }

#ifdef __AVX512F__
#ifdef __AVX512BF16__
#define DP_STEP(i)                                                                       \
    if (R * P > i)                                                                       \
        a##i = _mm512_dpbf16_ps(a##i, (__m512bh)_mm512_set1_epi32((int)xp[(i % R) * KP + kp]), \
                                (__m512bh)w[i / R]);
#else
#define DP_STEP(i)
#endif
#define SHIFT_STEP(i)                                                                    \
    if (R * P > i) {                                                                     \
        const float *xr = xf + (i % R) * 2 * KP + 2 * kp;                                \
        a##i = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), wo[i / R], a##i);                  \
        a##i = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), we[i / R], a##i);                  \
    }

/* R rows times P consecutive panels (R, P, V constants where inlined), AVX-512. xp: the rows
   as bfloat16 pairs (DPBF16), xf: as float32 values rounded to bfloat16 (AVX512); rows at a
   stride of KP pairs. */
static inline __attribute__((always_inline)) void tile512(
    const int R, const int P, const int V, const uint32_t *xp, const float *xf, int64_t KP,
    const uint32_t *p, int64_t ahead, int hint_l1, float *y, int64_t ldy, int64_t ncols_last,
    const float *bias) {
    const int64_t panel = KP * PW;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int64_t kp = 0; kp < KP; kp++) {
        __m512i w[4];
        __m512 we[4], wo[4];
        for (int pp = 0; pp < P; pp++) {
            const uint32_t *wp = p + pp * panel + kp * PW;
            if (hint_l1)
                _mm_prefetch((const char *)wp + ahead, _MM_HINT_T0);
            else
                _mm_prefetch((const char *)wp + ahead, _MM_HINT_T1);
            w[pp] = _mm512_loadu_si512((const void *)wp);
            if (V != DPBF16) {
                we[pp] = _mm512_castsi512_ps(_mm512_slli_epi32(w[pp], 16));
                wo[pp] = _mm512_castsi512_ps(_mm512_and_si512(w[pp], high));
            }
        }
        if (V == DPBF16) {
            DP_STEP(0) DP_STEP(1) DP_STEP(2) DP_STEP(3)
            DP_STEP(4) DP_STEP(5) DP_STEP(6) DP_STEP(7)
        } else {
            SHIFT_STEP(0) SHIFT_STEP(1) SHIFT_STEP(2) SHIFT_STEP(3)
            SHIFT_STEP(4) SHIFT_STEP(5) SHIFT_STEP(6) SHIFT_STEP(7)
        }
    }
    (void)xp, (void)xf;
    float t[PW];
    STORE_512(0) STORE_512(1) STORE_512(2) STORE_512(3)
    STORE_512(4) STORE_512(5) STORE_512(6) STORE_512(7)
}
#endif

#define SHIFT_STEP_256(i)                                                                \
    if (R * P > i) {                                                                     \
        const float *xr = xf + (i % R) * 2 * KP + 2 * kp;                                \
        const __m256 odd = _mm256_broadcast_ss(xr + 1), even = _mm256_broadcast_ss(xr);  \
        lo##i = _mm256_fmadd_ps(odd, wo[i / R][0], lo##i);                               \
        hi##i = _mm256_fmadd_ps(odd, wo[i / R][1], hi##i);                               \
        lo##i = _mm256_fmadd_ps(even, we[i / R][0], lo##i);                              \
        hi##i = _mm256_fmadd_ps(even, we[i / R][1], hi##i);                              \
    }
#define STORE_256(i)                                                                     \
    if (R * P > i) {                                                                     \
        const int r = i % R, pp = i / R;                                                 \
        const int64_t ncols = pp == P - 1 ? ncols_last : PW;                             \
        const float *bp = bias ? bias + pp * PW : 0;                                     \
        float *yp = y + r * ldy + pp * PW;                                               \
        _mm256_storeu_ps(t, lo##i);                                                      \
        _mm256_storeu_ps(t + 8, hi##i);                                                  \
        for (int64_t j = 0; j < ncols; j++) yp[j] = bp ? t[j] + bp[j] : t[j];            \
    }

/* tile512's AVX2 twin (the AVX2 variant): a panel's k-pair is two vectors of 8 lanes. */
static inline __attribute__((always_inline)) void tile256(
    const int R, const int P, const float *xf, int64_t KP, const uint32_t *p, int64_t ahead,
    int hint_l1, float *y, int64_t ldy, int64_t ncols_last, const float *bias) {
    const int64_t panel = KP * PW;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0,
           lo3 = lo0, hi3 = lo0;
    for (int64_t kp = 0; kp < KP; kp++) {
        __m256 we[2][2], wo[2][2];
        for (int pp = 0; pp < P; pp++) {
            const uint32_t *wp = p + pp * panel + kp * PW;
            if (hint_l1)
                _mm_prefetch((const char *)wp + ahead, _MM_HINT_T0);
            else
                _mm_prefetch((const char *)wp + ahead, _MM_HINT_T1);
            for (int h = 0; h < 2; h++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wp + 8 * h));
                we[pp][h] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
                wo[pp][h] = _mm256_castsi256_ps(_mm256_and_si256(w, high));
            }
        }
        SHIFT_STEP_256(0) SHIFT_STEP_256(1) SHIFT_STEP_256(2) SHIFT_STEP_256(3)
    }
    float t[PW];
    STORE_256(0) STORE_256(1) STORE_256(2) STORE_256(3)
}

#define T512(rows, panels, v) tile512(rows, panels, v, xp, xf, KP, p, ahead, l1, y, ldy, nl, bias)
#define T256(rows, panels) tile256(rows, panels, xf, KP, p, ahead, l1, y, ldy, nl, bias)

/* M rows (at most the variant's rows) times one panel, or panels_for(M) panels when `many`.
   One instance per case: each is its own loop with its sums in registers. */
static void panel_group(int v, int64_t M, int many, const uint32_t *xp, const float *xf,
                        int64_t KP, const uint32_t *p, int64_t ahead, int l1, float *y,
                        int64_t ldy, int64_t nl, const float *bias) {
    (void)xp;
#ifdef __AVX512F__
#ifdef __AVX512BF16__
    if (v == DPBF16) {
        switch (M) {
            case 1: many ? T512(1, 4, DPBF16) : T512(1, 1, DPBF16); break;
            case 2: many ? T512(2, 4, DPBF16) : T512(2, 1, DPBF16); break;
            case 3: T512(3, 1, DPBF16); break;
            case 4: T512(4, 1, DPBF16); break;
            case 5: T512(5, 1, DPBF16); break;
            case 6: T512(6, 1, DPBF16); break;
            case 7: T512(7, 1, DPBF16); break;
            case 8: T512(8, 1, DPBF16); break;
        }
        return;
    }
#endif
    if (v == AVX512) {
        switch (M) {
            case 1: many ? T512(1, 4, AVX512) : T512(1, 1, AVX512); break;
            case 2: many ? T512(2, 4, AVX512) : T512(2, 1, AVX512); break;
            case 3: T512(3, 1, AVX512); break;
            case 4: T512(4, 1, AVX512); break;
            case 5: T512(5, 1, AVX512); break;
            case 6: T512(6, 1, AVX512); break;
            case 7: T512(7, 1, AVX512); break;
            case 8: T512(8, 1, AVX512); break;
        }
        return;
    }
#endif
    switch (M) {
        case 1: many ? T256(1, 2) : T256(1, 1); break;
        case 2: T256(2, 1); break;
        case 3: T256(3, 1); break;
        case 4: T256(4, 1); break;
    }
}

struct bf16_task {
    const uint32_t *xp, *p;
    const float *xf, *bias;
    float *y;
    int64_t M, KP, N, step;
    int v;
};

/* work items [i0, i1) (of `step` panels) of one matmul, every row; more rows than a group
   takes go in groups of nearly equal size over each panel while it is in the core's cache,
   as small_batch_gemm.c does. */
static void bf16_panels(void *arg, int64_t i0, int64_t i1) {
    const struct bf16_task *t = arg;
    const int64_t max_rows = rows_of(t->v), KP = t->KP;
    const int64_t groups = (t->M + max_rows - 1) / max_rows;
    const int64_t base = t->M / groups, wider = t->M % groups;
    const int64_t panels = (t->N + PW - 1) / PW, panel_bytes = KP * PW * 4;
    const int64_t q1 = i1 * t->step < panels ? i1 * t->step : panels;
    for (int64_t q = i0 * t->step; q < q1;) {
        const int many = t->step > 1 && q + t->step <= q1;
        const int64_t last = many ? q + t->step - 1 : q;
        const int64_t nl = t->N - last * PW < PW ? t->N - last * PW : PW;
        const uint32_t *pq = t->p + q * KP * PW;
        const float *bq = t->bias ? t->bias + q * PW : 0;
        for (int64_t g = 0, r0 = 0; g < groups; g++) {
            const int64_t rows = base + (g < wider);
            panel_group(t->v, rows, many, t->xp + r0 * KP, t->xf + r0 * 2 * KP, KP, pq,
                        g == 0 ? PREFETCH_AHEAD : panel_bytes, g == 0, t->y + r0 * t->N + q * PW,
                        t->N, nl, bq);
            r0 += rows;
        }
        q = last + 1;
    }
}

/* rows [r0, r1) of x rounded to bfloat16 into the layout the variant reads (bf16_linear) */
struct convert_task {
    const float *x;
    int64_t ldx;
    uint32_t *xp;
    float *xf;
    int64_t K, KP, KPA;
    int v;
};

#define CONVERT_WORK 16384 /* floats a chunk at least */
static void convert_rows(void *arg, int64_t r0, int64_t r1) {
    const struct convert_task *t = arg;
    const float *x = t->x;
    const int64_t ldx = t->ldx, K = t->K, KP = t->KP, KPA = t->KPA;
    const int v = t->v;
    uint32_t *xp = t->xp;
    float *xf = t->xf;
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * ldx;
        if (v == DPBF16 || v == AMX) {
            /* pair kp of row r at o + kp (DPBF16), o + kp / 16 * 256 + kp % 16 (AMX) */
            uint32_t *o = v == AMX ? xp + r / 16 * 16 * KPA + r % 16 * 16 : xp + r * KPA;
#define PAIR_AT(kp) (v == AMX ? (kp) / 16 * 256 + (kp) % 16 : (kp))
            int64_t kp = 0;
#ifdef __AVX512BF16__
            /* 16 pairs an instruction, rounded to nearest even as bf16_bits does (the two
               differ only for subnormal inputs, which VCVTNE2PS2BF16 reads as zero, as the
               multiplies read subnormal bfloat16 anyway) */
            for (; 2 * kp + 32 <= K; kp += 16) {
                const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 2 * kp + 16),
                                                           _mm512_loadu_ps(xr + 2 * kp));
                _mm512_storeu_si512((void *)(o + PAIR_AT(kp)), (__m512i)pairs);
            }
#endif
            for (; kp < KP; kp++) {
                const uint32_t lo = bf16_bits(xr[2 * kp]);
                const uint32_t hi = 2 * kp + 1 < K ? bf16_bits(xr[2 * kp + 1]) : 0;
                o[PAIR_AT(kp)] = lo | hi << 16;
            }
            for (int64_t kp = KP; kp < KPA; kp++) o[PAIR_AT(kp)] = 0;
#undef PAIR_AT
        } else {
            float *o = xf + r * 2 * KP;
            for (int64_t k = 0; k < 2 * KP; k++) {
                const uint32_t bits = k < K ? bf16_bits(xr[k]) << 16 : 0;
                memcpy(o + k, &bits, sizeof bits);
            }
        }
    }
}

/* y [M, N] = bf16(x) [M, K] (row stride ldx) @ w^T (+ bias), w in bf16_pack's panels, with
   the selected variant. Returns 0; -1 for bad sizes or no variant; -2 out of memory. */
#define PANEL_WORK 32768
int bf16_linear(const float *x, int64_t ldx, const uint32_t *p, const float *bias, float *y,
                int64_t M, int64_t K, int64_t N) {
    const int v = selected;
    if (M < 1 || K < 1 || v == NONE) return -1;
    const int64_t KP = pairs_of(K);
    /* AMX reads the rows as whole tiles: 16 pairs by 16 rows, zero past K and M */
    const int64_t KPA = v == AMX ? (KP + 15) / 16 * 16 : KP, MA = v == AMX ? (M + 15) / 16 * 16 : M;
    /* the rows rounded to bfloat16, kept from call to call (a fresh allocation of this size
       each call would be fresh pages, faulted in every time); one per calling thread */
    static __thread void *scratch = NULL;
    static __thread size_t capacity = 0;
    const size_t needed = (size_t)(v == AMX ? MA * KPA : M * 2 * KP) * sizeof(float);
    if (needed > capacity) {
        free(scratch);
        scratch = malloc(needed);
        capacity = scratch == NULL ? 0 : needed;
        if (scratch == NULL) return -2;
    }
    uint32_t *xp = scratch;
    float *xf = scratch;
    /* AMX: the rows in tiles, each 16 rows by 16 pairs one contiguous kilobyte (rows from 16g,
       pairs from kc at xp + 16g * KPA + 16kc: bf16_amx.c), which a tile load reads as 16
       consecutive lines; the last group's rows past M are zero. */
    if (v == AMX && MA > M) memset(xp + (M / 16) * 16 * KPA, 0, (size_t)(16 * KPA) * 4);
    /* the rows' conversion over the pool's threads too: alone on the calling thread it was
       ~2 % of a served bfloat16 worker's time at 64 rows, the other thread idle meanwhile */
    const struct convert_task convert = {x, ldx, xp, xf, K, KP, KPA, v};
    switchboard_parallel_for(M, CONVERT_WORK / (2 * KP), convert_rows, (void *)&convert);
    if (v == AMX) {
        bf16_amx_linear(xp, p, bias, y, M, KP, N);
        return 0;
    }
    const int64_t step = M <= rows_of(v) ? panels_for(v, M) : 1;
    const struct bf16_task task = {xp, p, xf, bias, y, M, KP, N, step, v};
    const int64_t per_item = M * 2 * KP * PW * step, min_items = PANEL_WORK / per_item;
    const int64_t items = ((N + PW - 1) / PW + step - 1) / step;
    switchboard_parallel_for(items, min_items, bf16_panels, (void *)&task);
    return 0;
}

#else /* no AVX2 and FMA: nothing to run; bf16_gemm_variants() says so */
int bf16_gemm_variants(void) { return 0; }
int bf16_gemm_select(int v) { (void)v; return 0; }
int bf16_gemm_max_rows(void) { return 0; }

int bf16_linear(const float *x, int64_t ldx, const uint32_t *p, const float *bias, float *y,
                int64_t M, int64_t K, int64_t N) {
    (void)x, (void)ldx, (void)p, (void)bias, (void)y, (void)M, (void)K, (void)N;
    return -1;
}
#endif

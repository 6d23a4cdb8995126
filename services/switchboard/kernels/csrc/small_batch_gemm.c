/* Matmuls of a few rows (decode at low concurrency) at the memory's speed: each weight streamed
   once, in panels of 16 output columns laid out for it ([ceil(out / 16), in, 16], made once by
   small_batch_pack), the rows' sums kept in registers. Every output is one fused multiply-add
   chain over the inputs in order, so a row's result does not depend on which rows share the
   call (batch-invariant). Needs AVX2 and FMA: built without them, small_batch_max_rows() is 0
   and the kernel is not used. */
#include <stdint.h>

#include "kernels.h"
#include "work_pool.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define PW 16 /* output columns per panel: two AVX2 vectors, one AVX-512 vector */
/* Rows per call. With AVX-512 (small_batch_gemm_512.h): twelve rows times two panels, 24 sums
   in its 32 registers. With AVX2 the sums take two vector registers per row, and the 16
   registers hold six rows (twelve sums, the panel's two vectors and a broadcast): with four,
   eight independent sums were too few to cover the multiply-add's latency on two FMA pipes,
   and each panel was read from L2 once per four rows. Six rows measured 1.3-1.6x faster at
   16-64 rows on a Zen 3 EPYC (warm, one thread). */
#ifdef __AVX512F__
#define MAX_ROWS 12
#else
#define MAX_ROWS 6
#endif

int small_batch_max_rows(void) { return MAX_ROWS; }

/* The weights of a decode step come from memory (they are larger than the caches), and the
   hardware's prefetcher alone left the kernel waiting on them: a software prefetch 2 KB ahead
   made cold-weight products 20-45 % faster at 8 rows and 10-20 % at 32 on the 2-core EPYC
   (LM-head and MLP shapes, 1 and 2 threads); 1 and 4 KB ahead measured about the same. */
#define PREFETCH_AHEAD 32

/* weight [N, K] row-major -> panels [ceil(N / 16), K, 16], zero-padded past N */
void small_batch_pack(const float *w, float *p, int64_t N, int64_t K) {
    const int64_t panels = (N + PW - 1) / PW;
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < panels; q++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < PW; j++) {
                const int64_t n = q * PW + j;
                p[(q * K + k) * PW + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

#ifdef __AVX512F__
#include "small_batch_gemm_512.h"
#else
/* R rows times one panel, R a constant where it is inlined. The sums are named variables:
   GCC kept an array of them on the stack, storing eight vectors on every step of k. */
#define ROW_FMA(r)                                                                       \
    if (R > r) {                                                                         \
        const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);                           \
        lo##r = _mm256_fmadd_ps(b, w0, lo##r);                                           \
        hi##r = _mm256_fmadd_ps(b, w1, hi##r);                                           \
    }
/* A whole panel's sums go straight to y (the bias added as a vector: the same float sums); the
   last, partial panel through t. Through t for every panel, the copy compiled into `rep movs`,
   whose start-up cost on 64 bytes was about a tenth of the kernel's time in a decode step of 32
   rows. */
#define ROW_STORE(r)                                                                     \
    if (R > r) {                                                                         \
        if (ncols == PW) {                                                               \
            if (bias) {                                                                  \
                lo##r = _mm256_add_ps(lo##r, _mm256_loadu_ps(bias));                     \
                hi##r = _mm256_add_ps(hi##r, _mm256_loadu_ps(bias + 8));                 \
            }                                                                            \
            _mm256_storeu_ps(y + r * ldy, lo##r);                                        \
            _mm256_storeu_ps(y + r * ldy + 8, hi##r);                                    \
        } else {                                                                         \
            _mm256_storeu_ps(t, lo##r);                                                  \
            _mm256_storeu_ps(t + 8, hi##r);                                              \
            for (int64_t j = 0; j < ncols; j++)                                          \
                y[r * ldy + j] = bias ? t[j] + bias[j] : t[j];                           \
        }                                                                                \
    }
/* how panel_rows asks for the lines ahead (linear_panels says which): for later groups to
   read again, the next panel into L2, or for this group alone (non-temporally) */
enum { FETCH_KEEP, FETCH_NEXT, FETCH_ONCE };
static inline __attribute__((always_inline)) void panel_rows(
    const int R, const float *x, int64_t ldx, const float *p, const float *ahead,
    const int fetch, int64_t K, float *y, int64_t ldy, int64_t ncols,
    const float *bias) {
    __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0,
           lo3 = lo0, hi3 = lo0, lo4 = lo0, hi4 = lo0, lo5 = lo0, hi5 = lo0;
    for (int64_t k = 0; k < K; k++) {
        /* One line (a k-row of a panel) a step: see linear_panels for which. A hint never
           faults past the last panel. */
        if (fetch == FETCH_NEXT)
            _mm_prefetch((const char *)(ahead + k * PW), _MM_HINT_T1);
        else if (fetch == FETCH_ONCE)
            _mm_prefetch((const char *)(ahead + k * PW), _MM_HINT_NTA);
        else
            _mm_prefetch((const char *)(ahead + k * PW), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(p + k * PW), w1 = _mm256_loadu_ps(p + k * PW + 8);
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
    }
    float t[PW];
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
}

/* At most MAX_ROWS rows times one panel (the AVX2 code). */
static inline void panel_group(int64_t M, const float *x, int64_t ldx, const float *pq,
                               const float *ahead, int fetch, int64_t K, float *yq,
                               int64_t N, int64_t ncols, const float *bq) {
    switch (M) {
        case 1: panel_rows(1, x, ldx, pq, ahead, fetch, K, yq, N, ncols, bq); break;
        case 2: panel_rows(2, x, ldx, pq, ahead, fetch, K, yq, N, ncols, bq); break;
        case 3: panel_rows(3, x, ldx, pq, ahead, fetch, K, yq, N, ncols, bq); break;
        case 4: panel_rows(4, x, ldx, pq, ahead, fetch, K, yq, N, ncols, bq); break;
        case 5: panel_rows(5, x, ldx, pq, ahead, fetch, K, yq, N, ncols, bq); break;
        case 6: panel_rows(6, x, ldx, pq, ahead, fetch, K, yq, N, ncols, bq); break;
    }
}

struct linear_task {
    const float *x, *p, *bias;
    float *y;
    int64_t ldx, M, K, N;
};

/* panels [q0, q1) of one matmul, every row. The rows go in as few groups as MAX_ROWS allows,
   of nearly equal size (8 rows as 4 + 4, not 6 + 2: a group of few rows does few multiply-adds
   per load of the panel).
   The first group reads the panel from memory, asking for its lines PREFETCH_AHEAD k-rows ahead
   (into the next panel near its end: the panels are contiguous). The later groups read it from
   the caches, and meanwhile ask for the next panel into L2, so that memory works while they
   compute (a step's weights are larger than the caches: otherwise every first group waited on
   memory and every later one left it idle). Where one group takes all the rows, nothing reads
   the panel again, and its lines are asked for non-temporally (PREFETCHNTA), so that the
   step's weights do not push the rest of the step out of L2 and L3: one user of the default
   model in float32 on the AVX2-only EPYC, ITL p50 23.9 -> 22.9 ms (lower in 5 of 6 rounds). */
static void linear_panels(void *arg, int64_t q0, int64_t q1) {
    const struct linear_task *t = arg;
    const int64_t groups = (t->M + MAX_ROWS - 1) / MAX_ROWS;
    const int64_t base = t->M / groups, wider = t->M % groups; /* `wider` groups of base + 1 */
    for (int64_t q = q0; q < q1; q++) {
        const int64_t ncols = t->N - q * PW < PW ? t->N - q * PW : PW;
        const float *pq = t->p + q * t->K * PW, *bq = t->bias ? t->bias + q * PW : 0;
        for (int64_t g = 0, r0 = 0; g < groups; g++) {
            const int64_t rows = base + (g < wider);
            const float *ahead = g == 0 ? pq + PREFETCH_AHEAD * PW : pq + t->K * PW;
            const int fetch = g > 0 ? FETCH_NEXT : groups == 1 ? FETCH_ONCE : FETCH_KEEP;
            panel_group(rows, t->x + r0 * t->ldx, t->ldx, pq, ahead, fetch, t->K,
                        t->y + r0 * t->N + q * PW, t->N, ncols, bq);
            r0 += rows;
        }
    }
}

#endif

/* y [M, N] = x [M, K] (row stride ldx) @ weight^T (+ bias); M >= 1, else -1. More rows than
   MAX_ROWS are taken MAX_ROWS at a time, each group over the same panel while it is still in
   the core's cache (the weight is read from memory once). The panels are split across the
   pool's threads, a chunk being at least PANEL_WORK multiply-adds. */
#define PANEL_WORK 32768
int small_batch_linear(const float *x, int64_t ldx, const float *p, const float *bias, float *y,
                       int64_t M, int64_t K, int64_t N) {
    if (M < 1) return -1;
    const struct linear_task task = {x, p, bias, y, ldx, M, K, N};
    const int64_t per_panel = M * K * PW, min_panels = PANEL_WORK / (per_panel ? per_panel : 1);
    switchboard_parallel_for((N + PW - 1) / PW, min_panels, linear_panels, (void *)&task);
    return 0;
}

#else /* no AVX2 and FMA: nothing to run; small_batch_max_rows() says so */
int small_batch_max_rows(void) { return 0; }

void small_batch_pack(const float *w, float *p, int64_t N, int64_t K) {
    (void)w, (void)p, (void)N, (void)K;
}

int small_batch_linear(const float *x, int64_t ldx, const float *p, const float *bias, float *y,
                       int64_t M, int64_t K, int64_t N) {
    (void)x, (void)ldx, (void)p, (void)bias, (void)y, (void)M, (void)K, (void)N;
    return -1;
}
#endif

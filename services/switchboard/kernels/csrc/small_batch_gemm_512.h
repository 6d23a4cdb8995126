/* small_batch_gemm.c's matmul where the compiler targets AVX-512F: the panels' 16 columns are
   one 512-bit vector, and a call takes up to twelve rows times two neighbouring panels (24 sums
   in registers). The AVX2 code's two 256-bit vectors a panel ran at half the multiply-add rate
   of a core whose 512-bit units are two (an Intel Xeon's): 116-150 GFLOP/s on two threads at
   32-64 rows, where oneDNN's kernels reached 200-250. Every output is the same fused
   multiply-add chain over the inputs in order as the AVX2 code's, so the floats are the same
   bit for bit, and still independent of the rows beside it. Included by small_batch_gemm.c
   only; PW, MAX_ROWS and PREFETCH_AHEAD are its. */

/* One row's sums over two panels (b: the second; unused where P is 1). */
#define ROW_FMA512(r)                                                                    \
    if (R > r) {                                                                         \
        const __m512 v = _mm512_set1_ps(x[r * ldx + k]);                                 \
        a##r = _mm512_fmadd_ps(v, w0, a##r);                                             \
        if (P > 1) b##r = _mm512_fmadd_ps(v, w1, b##r);                                  \
    }
/* The first panel of a pair is always whole (the second exists); the last panel of the
   matmul may be partial: masked loads of its bias and stores of its sums. */
#define ROW_STORE512(r)                                                                  \
    if (R > r) {                                                                         \
        float *yr = y + r * ldy;                                                         \
        if (P > 1) {                                                                     \
            if (bias) a##r = _mm512_add_ps(a##r, _mm512_loadu_ps(bias));                 \
            _mm512_storeu_ps(yr, a##r);                                                  \
            if (bias) b##r = _mm512_add_ps(b##r, _mm512_maskz_loadu_ps(last, bias + PW)); \
            _mm512_mask_storeu_ps(yr + PW, last, b##r);                                  \
        } else {                                                                         \
            if (bias) a##r = _mm512_add_ps(a##r, _mm512_maskz_loadu_ps(last, bias));     \
            _mm512_mask_storeu_ps(yr, last, a##r);                                       \
        }                                                                                \
    }

/* R rows (1..12) times P panels (1 or 2) starting at p (the second at p + K * PW), R and P
   constants where it is inlined. `last` masks the columns of the pair's last panel. The first
   group of rows over a pair reads it from memory and asks for both streams' lines
   PREFETCH_AHEAD k-rows ahead; a later group reads it from the caches and asks for the next
   pair (`next`, 2 lines a step of k) into L2, so that memory works while it computes. */
static inline __attribute__((always_inline)) void panels_rows512(
    const int R, const int P, const float *x, int64_t ldx, const float *p, const float *next,
    int64_t K, float *y, int64_t ldy, __mmask16 last, const float *bias) {
    const __m512 z = _mm512_setzero_ps();
    __m512 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z, a8 = z, a9 = z,
           a10 = z, a11 = z, b0 = z, b1 = z, b2 = z, b3 = z, b4 = z, b5 = z, b6 = z, b7 = z,
           b8 = z, b9 = z, b10 = z, b11 = z;
    const float *q = p + K * PW;
    for (int64_t k = 0; k < K; k++) {
        if (next) {
            _mm_prefetch((const char *)(next + 2 * k * PW), _MM_HINT_T1);
            _mm_prefetch((const char *)(next + (2 * k + 1) * PW), _MM_HINT_T1);
        } else {
            _mm_prefetch((const char *)(p + (k + PREFETCH_AHEAD) * PW), _MM_HINT_T0);
            if (P > 1) _mm_prefetch((const char *)(q + (k + PREFETCH_AHEAD) * PW), _MM_HINT_T0);
        }
        const __m512 w0 = _mm512_loadu_ps(p + k * PW);
        const __m512 w1 = P > 1 ? _mm512_loadu_ps(q + k * PW) : w0;
        ROW_FMA512(0) ROW_FMA512(1) ROW_FMA512(2) ROW_FMA512(3) ROW_FMA512(4) ROW_FMA512(5)
        ROW_FMA512(6) ROW_FMA512(7) ROW_FMA512(8) ROW_FMA512(9) ROW_FMA512(10) ROW_FMA512(11)
    }
    ROW_STORE512(0) ROW_STORE512(1) ROW_STORE512(2) ROW_STORE512(3) ROW_STORE512(4)
    ROW_STORE512(5) ROW_STORE512(6) ROW_STORE512(7) ROW_STORE512(8) ROW_STORE512(9)
    ROW_STORE512(10) ROW_STORE512(11)
}

#define ROWS_CASE512(n)                                                                  \
    case n:                                                                              \
        if (P2) panels_rows512(n, 2, x, ldx, p, next, K, y, ldy, last, bias);            \
        else panels_rows512(n, 1, x, ldx, p, next, K, y, ldy, last, bias);               \
        break;
/* At most MAX_ROWS rows times one or two panels (P2). */
static inline void panel_group512(int64_t M, int P2, const float *x, int64_t ldx,
                                  const float *p, const float *next, int64_t K, float *y,
                                  int64_t ldy, __mmask16 last, const float *bias) {
    switch (M) {
        ROWS_CASE512(1) ROWS_CASE512(2) ROWS_CASE512(3) ROWS_CASE512(4) ROWS_CASE512(5)
        ROWS_CASE512(6) ROWS_CASE512(7) ROWS_CASE512(8) ROWS_CASE512(9) ROWS_CASE512(10)
        ROWS_CASE512(11) ROWS_CASE512(12)
    }
}

struct linear_task {
    const float *x, *p, *bias;
    float *y;
    int64_t ldx, M, K, N;
};

/* Panels [q0, q1) of one matmul, every row: the panels in pairs (a lone last one alone), the
   rows in as few groups as MAX_ROWS allows, of nearly equal size. */
static void linear_panels(void *arg, int64_t q0, int64_t q1) {
    const struct linear_task *t = arg;
    const int64_t groups = (t->M + MAX_ROWS - 1) / MAX_ROWS;
    const int64_t base = t->M / groups, wider = t->M % groups; /* `wider` groups of base + 1 */
    for (int64_t q = q0; q < q1; q += 2) {
        const int P2 = q + 1 < q1;
        const int64_t end = (q + 1 + P2) * PW, cols = (t->N < end ? t->N : end) - (q + P2) * PW;
        const __mmask16 last = (__mmask16)((1u << cols) - 1);
        const float *pq = t->p + q * t->K * PW, *bq = t->bias ? t->bias + q * PW : 0;
        const float *next = pq + (1 + P2) * t->K * PW;
        for (int64_t g = 0, r0 = 0; g < groups; g++) {
            const int64_t rows = base + (g < wider);
            panel_group512(rows, P2, t->x + r0 * t->ldx, t->ldx, pq, g > 0 ? next : 0, t->K,
                           t->y + r0 * t->N + q * PW, t->N, last, bq);
            r0 += rows;
        }
    }
}

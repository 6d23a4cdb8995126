/* The LoRA delta of a projection for a batch of rows over several adapters: the grouped
   shrink/expand of punica / S-LoRA. For every row r whose slot s = row_slot[r] is not -1,

       y[r] += (x[r] . A_s^T) . B_s

   with A_s [parts * max_rank, K] and B_s [parts * max_rank, N] the slot's stacked matrices
   (models/lora/stacks.py; the scaling folded into B). A fused projection (q/k/v, gate/up) has
   one part per module: part p's rank rows [p * max_rank, p * max_rank + rank) write only the
   output columns [cols[p], cols[p + 1]) (its B is zero elsewhere), so only those are computed;
   rows past the slot's own rank (zero) are skipped.

   The rows are grouped by slot and taken up to ROWS at a time, so each row of A and of B is
   read once for them; the groups run on the work pool. A row's floats do not depend on the rows
   beside it: each shrink output is the same LANES-lane sum over K, each output column the same
   sum over the rank (then added to it), whichever rows share the group. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "work_pool.h"

#define ROWS 4 /* rows of one slot per group */

/* Vectors of LANES floats. Written with intrinsics: the shrink's loop left to the vectoriser gave
   a row other floats in a group of one than in a group of four. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(x) _mm512_set1_ps(x)
#define VADD(a, b) _mm512_add_ps(a, b)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(x) _mm256_set1_ps(x)
#define VADD(a, b) _mm256_add_ps(a, b)
#else
#define LANES 1
typedef float vec;
#define VZERO() 0.0f
#define VLOAD(p) (*(p))
#define VFMA(a, b, c) fmaf(a, b, c)
#define VSTORE(p, v) (*(p) = (v))
#define VSET1(x) (x)
#define VADD(a, b) ((a) + (b))
#endif

struct lora_task {
    const float *x, *a, *b;
    float *y;
    int64_t ldx, ldy, K, N, max_rank, parts;
    const int64_t *slot_rank, *cols;
    const int64_t *order;  /* the rows, grouped by slot */
    const int64_t *groups; /* group g: rows order[groups[g]] .. order[groups[g + 1] - 1] */
    const int64_t *group_slot;
};

/* shrink[j][i] = x[rows[i]] . a[j] for the n rows (n a constant where inlined) */
static inline __attribute__((always_inline)) void shrink_rows(const int n, const float *const *x,
                                                              const float *a, int64_t K,
                                                              int64_t rank, float (*shrink)[ROWS]) {
    for (int64_t j = 0; j < rank; j++) {
        const float *w = a + j * K;
        vec acc0 = VZERO(), acc1 = VZERO(), acc2 = VZERO(), acc3 = VZERO();
        int64_t k = 0;
        for (; k + LANES <= K; k += LANES) {
            const vec v = VLOAD(w + k);
            acc0 = VFMA(VLOAD(x[0] + k), v, acc0);
            if (n > 1) acc1 = VFMA(VLOAD(x[1] + k), v, acc1);
            if (n > 2) acc2 = VFMA(VLOAD(x[2] + k), v, acc2);
            if (n > 3) acc3 = VFMA(VLOAD(x[3] + k), v, acc3);
        }
        float lanes[ROWS][LANES];
        VSTORE(lanes[0], acc0);
        if (n > 1) VSTORE(lanes[1], acc1);
        if (n > 2) VSTORE(lanes[2], acc2);
        if (n > 3) VSTORE(lanes[3], acc3);
        for (int i = 0; i < n; i++) {
            float sum = 0.0f;
            for (int l = 0; l < LANES; l++) sum += lanes[i][l];
            for (int64_t t = k; t < K; t++) sum = fmaf(x[i][t], w[t], sum);
            shrink[j][i] = sum;
        }
    }
}

/* y[rows[i]][c0 .. c1) += sum over j of shrink[j][i] * b[j][c0 .. c1): per output the sum over
   the rank in registers from zero, then added to y once (a vector, or the same operations one
   column at a time for the last few) */
#define EXPAND_ROW(i)                                                                    \
    if (n > i) {                                                                         \
        const vec s = VSET1(shrink[j][i]);                                               \
        lo##i = VFMA(s, w0, lo##i);                                                      \
        hi##i = VFMA(s, w1, hi##i);                                                      \
    }
#define EXPAND_STORE(i)                                                                  \
    if (n > i) {                                                                         \
        VSTORE(y[i] + c, VADD(VLOAD(y[i] + c), lo##i));                                  \
        VSTORE(y[i] + c + LANES, VADD(VLOAD(y[i] + c + LANES), hi##i));                  \
    }
static inline __attribute__((always_inline)) void expand_rows(const int n, float *const *y,
                                                              const float *b, int64_t N,
                                                              int64_t rank, float (*shrink)[ROWS],
                                                              int64_t c0, int64_t c1) {
    int64_t c = c0;
    for (; c + 2 * LANES <= c1; c += 2 * LANES) {
        vec lo0 = VZERO(), hi0 = VZERO(), lo1 = VZERO(), hi1 = VZERO(), lo2 = VZERO(),
            hi2 = VZERO(), lo3 = VZERO(), hi3 = VZERO();
        for (int64_t j = 0; j < rank; j++) {
            const vec w0 = VLOAD(b + j * N + c), w1 = VLOAD(b + j * N + c + LANES);
            EXPAND_ROW(0)
            EXPAND_ROW(1)
            EXPAND_ROW(2)
            EXPAND_ROW(3)
        }
        EXPAND_STORE(0)
        EXPAND_STORE(1)
        EXPAND_STORE(2)
        EXPAND_STORE(3)
    }
    for (; c < c1; c++)
        for (int i = 0; i < n; i++) {
            float sum = 0.0f;
            for (int64_t j = 0; j < rank; j++) sum = fmaf(shrink[j][i], b[j * N + c], sum);
            y[i][c] += sum;
        }
}
#undef EXPAND_ROW
#undef EXPAND_STORE

static inline __attribute__((always_inline)) void group_delta(const int n,
                                                              const struct lora_task *t,
                                                              const int64_t *rows, int64_t slot) {
    const float *x[ROWS];
    float *y[ROWS];
    for (int i = 0; i < n; i++) {
        x[i] = t->x + rows[i] * t->ldx;
        y[i] = t->y + rows[i] * t->ldy;
    }
    const int64_t R = t->parts * t->max_rank;
    const int64_t rank = t->slot_rank[slot] < t->max_rank ? t->slot_rank[slot] : t->max_rank;
    const float *a = t->a + slot * R * t->K, *b = t->b + slot * R * t->N;
    float shrink[LORA_MAX_RANK][ROWS];
    for (int64_t p = 0; p < t->parts; p++) {
        const int64_t first = p * t->max_rank;
        shrink_rows(n, x, a + first * t->K, t->K, rank, shrink);
        expand_rows(n, y, b + first * t->N, t->N, rank, shrink, t->cols[p], t->cols[p + 1]);
    }
}

static void lora_groups(void *ctx, int64_t begin, int64_t end) {
    const struct lora_task *t = ctx;
    for (int64_t g = begin; g < end; g++) {
        const int64_t *rows = t->order + t->groups[g];
        const int64_t slot = t->group_slot[g];
        switch (t->groups[g + 1] - t->groups[g]) {
        case 1: group_delta(1, t, rows, slot); break;
        case 2: group_delta(2, t, rows, slot); break;
        case 3: group_delta(3, t, rows, slot); break;
        default: group_delta(4, t, rows, slot); break;
        }
    }
}

int lora_delta_f32(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t M, int64_t K,
                   int64_t N, const float *a, const float *b, const int64_t *row_slot,
                   int64_t slots, const int64_t *slot_rank, int64_t max_rank, int64_t parts,
                   const int64_t *cols) {
    if (max_rank > LORA_MAX_RANK) return -4;
    if (M <= 0 || max_rank <= 0) return 0;
    for (int64_t r = 0; r < M; r++)
        if (row_slot[r] < -1 || row_slot[r] >= slots) return -3;
    /* scratch: order [M], groups [M + 1], group_slot [M], the rows of a slot per slot [slots] */
    int64_t *scratch = malloc(sizeof(int64_t) * (size_t)(3 * M + 1 + slots + 1));
    if (scratch == NULL) return -1;
    int64_t *order = scratch, *groups = order + M, *group_slot = groups + M + 1;
    int64_t *start = group_slot + M; /* [slots + 1]: where each slot's rows begin in order */
    memset(start, 0, sizeof(int64_t) * (size_t)(slots + 1));
    for (int64_t r = 0; r < M; r++)
        if (row_slot[r] >= 0) start[row_slot[r] + 1]++;
    for (int64_t s = 0; s < slots; s++) start[s + 1] += start[s];
    const int64_t adapted = start[slots];
    int64_t count = 0;
    for (int64_t s = 0; s < slots; s++) { /* a counting sort: each slot's rows in row order */
        int64_t next = start[s];
        for (int64_t r = 0; r < M && next < start[s + 1]; r++)
            if (row_slot[r] == s) order[next++] = r;
        for (int64_t i = start[s]; i < start[s + 1]; i += ROWS) {
            groups[count] = i;
            group_slot[count++] = s;
        }
    }
    groups[count] = adapted;
    struct lora_task task = {.x = x, .a = a, .b = b, .y = y, .ldx = ldx, .ldy = ldy, .K = K,
                             .N = N, .max_rank = max_rank, .parts = parts, .slot_rank = slot_rank,
                             .cols = cols, .order = order, .groups = groups,
                             .group_slot = group_slot};
    switchboard_parallel_for(count, 1, lora_groups, &task);
    free(scratch);
    return 0;
}

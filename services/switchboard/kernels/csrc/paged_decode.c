/* Decode attention on CPU that reads the paged KV cache in place.

   The torch path gathers every request's whole context out of the cache into a new tensor, per
   layer per step, before attending; this walks each request's block table instead and reads
   every key and value once, where it lies: one task per request (per request and KV head when
   requests are fewer than threads) computes the scores of its query heads, a float32 softmax
   (max subtracted) and the weighted sum of the values. Rows that read the same keys (a decode
   with its speculative proposals, a prompt chunk: one block table, each row's context ending
   at its own position) go in groups, which read each block once for up to 16 rows while it is
   in cache; each row's floats are what it gets alone. A row whose context spans more than 256
   positions is attended in parts (paged_decode_avx2.h), merged after: with fewer rows than
   the threads need, the parts are tasks of their own, so one request's few KV heads no longer
   leave a thread waiting. The tasks run on the work pool. Where
   the compiler targets AVX-512, paged_decode_512.h takes the head sizes it can (a bfloat16 block
   widened once for all the rows and query heads that read it), paged_decode_avx2.h the rest
   where it targets AVX2, the scalar code below any other CPU. */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vector_exp.h"
#include "work_pool.h"

/* CALL(D) with D a constant for the common head sizes (32, 64, 128), so that a vector kernel's
   loops over a head unroll into registers; other sizes pass D as it is. */
#define BY_HEAD_SIZE(CALL, D) \
    do {                      \
        if ((D) == 32)        \
            CALL(32);         \
        else if ((D) == 64)   \
            CALL(64);         \
        else if ((D) == 128)  \
            CALL(128);        \
        else                  \
            CALL(D);          \
    } while (0)

/* The end of token t's block (or len), and where KV head h0 of token t lies in the cache. */
static inline int64_t block_stop(int64_t t, int64_t BS, int64_t len) {
    const int64_t end = t - t % BS + BS;
    return end < len ? end : len;
}

static inline int64_t slot_at(const int64_t *table, int64_t t, int64_t BS, int64_t KVH,
                              int64_t h0, int64_t D) {
    return ((table[t / BS] * BS + t % BS) * KVH + h0) * D;
}

/* Element i of a cache of float32 (bf16 == 0) or bfloat16 values (bf16 a constant where
   inlined): a bfloat16 is a float32's high half, widened by a shift. */
static inline float load1(const void *cache, int64_t i, const int bf16) {
    if (!bf16) return ((const float *)cache)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)cache)[i] << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

/* Each of the nq rows of L scores (stride apart) in place: a float32 softmax, its max
   subtracted. */
static inline void softmax_rows(float *scores, int64_t nq, int64_t stride, int64_t L) {
    for (int64_t j = 0; j < nq; j++) {
        float *s = scores + j * stride;
        float max = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : max)
        for (int64_t i = 0; i < L; i++) max = s[i] > max ? s[i] : max;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < L; i++) {
            s[i] = exp_f32(s[i] - max);
            sum += s[i];
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma omp simd
        for (int64_t i = 0; i < L; i++) s[i] *= inv;
    }
}

/* One task: request b's query heads of KV heads h0 .. h0 + nkv - 1 (query head j = h * G + g
   reads KV head h). scores [nq, L] and acc [nq, D] are the task's scratch. Inlined with D a
   constant for the common head sizes (32, 64, 128), so the dot products and sums unroll into
   registers.
   Blocks are walked one at a time: the block table is read and divided once per block, then
   the block's slots follow each other in memory. */
static inline __attribute__((always_inline)) void attend(
    const float *q, const void *keys, const void *values, const int bf16, const int64_t *table,
    float *o, float *scores, float *acc, int64_t start, int64_t len, int64_t nkv, int64_t G,
    int64_t KVH, int64_t BS, int64_t h0, const int64_t D, float scale) {
    const int64_t L = len - start, nq = nkv * G, slot_stride = KVH * D;
    for (int64_t t = start; t < len;) {
        const int64_t stop = block_stop(t, BS, len);
        int64_t slot = slot_at(table, t, BS, KVH, h0, D);
        for (; t < stop; t++, slot += slot_stride) {
            for (int64_t h = 0; h < nkv; h++) {
                const int64_t kh = slot + h * D;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t j = h * G + g;
                    const float *qj = q + j * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qj[d] * load1(keys, kh + d, bf16);
                    scores[j * L + (t - start)] = dot * scale;
                }
            }
        }
    }
    softmax_rows(scores, nq, L, L);
    for (int64_t i = 0; i < nq * D; i++) acc[i] = 0.0f;
    for (int64_t t = start; t < len;) {
        const int64_t stop = block_stop(t, BS, len);
        int64_t slot = slot_at(table, t, BS, KVH, h0, D);
        for (; t < stop; t++, slot += slot_stride) {
            for (int64_t h = 0; h < nkv; h++) {
                const int64_t vh = slot + h * D;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t j = h * G + g;
                    const float p = scores[j * L + (t - start)];
                    float *a = acc + j * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] += p * load1(values, vh + d, bf16);
                }
            }
        }
    }
    for (int64_t i = 0; i < nq * D; i++) o[i] = acc[i];
}

#if defined(__AVX2__) && defined(__FMA__)
#include "paged_decode_avx2.h"
#else
static inline int rows_grouped(int64_t D) { (void)D; return 0; }
#endif

#if defined(HAVE_ATTEND_VEC) && defined(__AVX512F__)
#define HAVE_ATTEND_512 1
#include "paged_decode_512.h"
#endif

/* One task's attention (bf16 a constant where inlined): the vector version for the head
   sizes it takes, D a constant for the common ones. */
static inline __attribute__((always_inline)) void attend_any(
    const float *q, const void *kv, const void *values, const int bf16, const int64_t *table,
    float *o, float *scores, float *acc, int64_t start, int64_t len, int64_t nkv, int64_t G,
    int64_t KVH, int64_t BS, int64_t h0, int64_t D, float scale) {
#ifdef HAVE_ATTEND_VEC
    if (D == 32)
        attend_vec(q, kv, values, bf16, table, o, scores, start, len, nkv, G, KVH, BS, h0, 32,
                   scale);
    else if (D == 64)
        attend_vec(q, kv, values, bf16, table, o, scores, start, len, nkv, G, KVH, BS, h0, 64,
                   scale);
    else if (D == 128)
        attend_vec(q, kv, values, bf16, table, o, scores, start, len, nkv, G, KVH, BS, h0, 128,
                   scale);
    else if (D % 8 == 0 && D <= 128)
        attend_vec(q, kv, values, bf16, table, o, scores, start, len, nkv, G, KVH, BS, h0, D,
                   scale);
    else
#endif
        attend(q, kv, values, bf16, table, o, scores, acc, start, len, nkv, G, KVH, BS, h0, D,
               scale);
}

/* query [B, H, D] (rows at stride ldq); kv [2, NB, BS, KVH, D] (keys, then values);
   block_table [B, MB]; context_lens [B]; out [B, H, D]. window > 0: a query at position
   len - 1 sees keys at positions > len - 1 - window. Returns 0, or -1 when scratch memory could
   not be allocated.
   A task is one request and a run of its KV heads: all of them when there are requests enough
   to keep every thread busy (each key/value slot is then read as one contiguous run, which the
   prefetcher streams), one head each otherwise. Consecutive rows with the same block table and
   window start (a decode with its proposed tokens, a prompt chunk) are a group instead: a task
   is up to GROUP_ROWS of its rows and one KV head, which reads each key once for its rows
   (attend_rows_vec) where a task per row read the context once per row. A row's floats are the
   same either way. */
/* The most rows of a group a task takes, and the most scores (rows x G x context floats): a
   task of a long context takes fewer rows */
#define GROUP_ROWS 16
#define GROUP_SCORES (1 << 20)
#define UNIT_FIELDS 4 /* a task of a grouped step: first row, rows, first KV head, KV heads */

struct decode_task {
    const float *query;
    const void *kv, *values; /* float32 or bfloat16 (bf16) */
    int bf16;
    const int64_t *block_table, *context_lens;
    float *out;
    int64_t ldq, H, KVH, D, G, BS, MB, window, heads_per_task, tasks_per_row;
    float scale;
    const int64_t *units; /* NULL: task i is row i / tasks_per_row, heads_per_task of its heads */
    /* With rows of several parts (paged_decode_avx2.h), instead of units: task i is row
       part_units[4i], its KV heads from part_units[4i + 2] (part_units[4i + 1] of them), part
       part_units[4i + 3] (-1: a row of one part, attended whole); a part's floats go to
       partials + (row_parts[b] + j * P) * PART_FLOATS(D) for query head j (P: the row's
       parts), merged after. */
    const int64_t *part_units, *row_parts;
    float *partials;
    _Atomic int failed;
};

static inline int64_t window_start(int64_t len, int64_t window) {
    return (window > 0 && len > window) ? len - window : 0;
}

static void decode_tasks(void *arg, int64_t first, int64_t stop) {
    struct decode_task *t = arg;
    const float *query = t->query;
    const void *kv = t->kv, *values = t->values;
    const int bf16 = t->bf16;
    const int64_t *block_table = t->block_table, *context_lens = t->context_lens;
    float *out = t->out;
    const int64_t ldq = t->ldq, H = t->H, KVH = t->KVH, D = t->D, G = t->G, BS = t->BS;
    const int64_t MB = t->MB, window = t->window;
    const int64_t tasks_per_row = t->tasks_per_row;
    const float scale = t->scale;
    for (int64_t task = first; task < stop; task++) {
        int64_t b, rows, h0, heads;
#ifdef HAVE_ATTEND_VEC
        if (t->part_units != NULL && t->part_units[4 * task + 3] >= 0) {
            const int64_t *unit = t->part_units + 4 * task;
            b = unit[0], heads = unit[1], h0 = unit[2];
            const int64_t len = context_lens[b], start = window_start(len, window);
            const int64_t C = part_span(BS), P = parts_of(start, len, C);
            float *scores = malloc(sizeof(float) * (size_t)(G * C));
            if (scores == NULL) {
                atomic_store(&t->failed, 1);
                continue;
            }
            float *parts = t->partials + (t->row_parts[b] + h0 * G * P) * PART_FLOATS(D);
            const float *q = query + b * ldq + h0 * G * D;
            const int64_t *table = block_table + b * MB;
            if (bf16)
                attend_heads_part(q, kv, values, 1, table, parts, scores, start, len, unit[3], P,
                                  h0, heads, G, KVH, BS, D, scale);
            else
                attend_heads_part(q, kv, values, 0, table, parts, scores, start, len, unit[3], P,
                                  h0, heads, G, KVH, BS, D, scale);
            free(scores);
            continue;
        }
#endif
        if (t->part_units != NULL) {
            const int64_t *unit = t->part_units + 4 * task;
            b = unit[0], rows = 1, heads = unit[1], h0 = unit[2];
        } else if (t->units != NULL) {
            const int64_t *unit = t->units + task * UNIT_FIELDS;
            b = unit[0], rows = unit[1], h0 = unit[2], heads = unit[3];
        } else {
            b = task / tasks_per_row, rows = 1;
            h0 = (task % tasks_per_row) * t->heads_per_task, heads = t->heads_per_task;
        }
        const int64_t *table = block_table + b * MB;
        const int64_t start = window_start(context_lens[b], window);
        int64_t L = 0;
        for (int64_t r = 0; r < rows; r++)
            L = context_lens[b + r] - start > L ? context_lens[b + r] - start : L;
#ifdef HAVE_ATTEND_512
        if (takes512(D, bf16)) { /* one task's rows (one, or a group's), head by head */
            float *scratch = malloc(sizeof(float) * (size_t)scratch512(rows, G, L, D, BS));
            if (scratch == NULL) {
                atomic_store(&t->failed, 1);
                continue;
            }
            for (int64_t h = h0; h < h0 + heads; h++) {
                if (bf16)
                    attend512_any(query + b * ldq, ldq, kv, values, 1, table, context_lens + b,
                                  rows, out + b * H * D, H, scratch, start, L, G, KVH, BS, h, D,
                                  scale);
                else
                    attend512_any(query + b * ldq, ldq, kv, values, 0, table, context_lens + b,
                                  rows, out + b * H * D, H, scratch, start, L, G, KVH, BS, h, D,
                                  scale);
            }
            free(scratch);
            continue;
        }
#endif
        const int64_t nq = rows == 1 ? heads * G : rows * G;
#ifdef HAVE_ATTEND_VEC
        const int64_t P = parts_of(start, start + L, part_span(BS));
        const int64_t part_floats = rows_grouped(D) && P > 1 ? nq * P * PART_FLOATS(D) : 0;
#else
        const int64_t part_floats = 0; /* no parts without the vector code */
#endif
        float *scores =
            malloc(sizeof(float) * (size_t)(nq * (L > 0 ? L : 1) + nq * D + part_floats));
        if (scores == NULL) {
            atomic_store(&t->failed, 1);
            continue;
        }
        float *acc = scores + nq * L, *parts = acc + nq * D;
        (void)parts; /* the vector code's, past acc */
        if (rows > 1) { /* a group's rows, each of its KV heads (only where rows_grouped) */
#ifdef HAVE_ATTEND_VEC
            const float *q = query + b * ldq;
            float *o = out + b * H * D;
            const int64_t *lens = context_lens + b;
            for (int64_t h = h0; h < h0 + heads; h++) {
                if (bf16)
                    attend_rows_any(q, ldq, kv, values, 1, table, lens, rows, o, H, scores, acc,
                                    parts, start, L, G, KVH, BS, h, D, scale);
                else
                    attend_rows_any(q, ldq, kv, values, 0, table, lens, rows, o, H, scores, acc,
                                    parts, start, L, G, KVH, BS, h, D, scale);
            }
#endif
            free(scores);
            continue;
        }
        const int64_t len = context_lens[b];
        const float *q = query + b * ldq + h0 * G * D; /* this task's nq query heads */
        float *o = out + (b * H + h0 * G) * D;
#ifdef HAVE_ATTEND_VEC
        if (part_floats > 0) { /* a row of several parts alone in its task: part by part */
            for (int64_t p = 0; p < P; p++) {
                if (bf16)
                    attend_heads_part(q, kv, values, 1, table, parts, scores, start, len, p, P,
                                      h0, heads, G, KVH, BS, D, scale);
                else
                    attend_heads_part(q, kv, values, 0, table, parts, scores, start, len, p, P,
                                      h0, heads, G, KVH, BS, D, scale);
            }
            for (int64_t j = 0; j < nq; j++)
                merge_parts(parts + j * P * PART_FLOATS(D), P, D, o + j * D);
            free(scores);
            continue;
        }
#endif
        if (bf16)
            attend_any(q, kv, values, 1, table, o, scores, acc, start, len, heads, G, KVH, BS, h0,
                       D, scale);
        else
            attend_any(q, kv, values, 0, table, o, scores, acc, start, len, heads, G, KVH, BS, h0,
                       D, scale);
        free(scores);
    }
}

/* Whether rows a and b read the same keys: the same block table and window start. */
static inline int same_keys(const int64_t *block_table, const int64_t *context_lens, int64_t MB,
                            int64_t window, int64_t a, int64_t b) {
    return window_start(context_lens[a], window) == window_start(context_lens[b], window) &&
           memcmp(block_table + a * MB, block_table + b * MB, sizeof(int64_t) * (size_t)MB) == 0;
}

/* The tasks of a step with a group of rows (see above) in units [n, UNIT_FIELDS]; returns n,
   0 when no two consecutive rows read the same keys (the tasks are then one row each), -1 out
   of memory. */
static int64_t group_units(const int64_t *block_table, const int64_t *context_lens, int64_t B,
                           int64_t KVH, int64_t G, int64_t D, int64_t MB, int64_t window,
                           int64_t heads_per_task, int64_t threads, int64_t **units_out) {
    *units_out = NULL;
    if (!rows_grouped(D)) return 0;
    int64_t b = 1;
    while (b < B && !same_keys(block_table, context_lens, MB, window, b - 1, b)) b++;
    if (b >= B) return 0;
    int64_t *units = malloc(sizeof(int64_t) * UNIT_FIELDS * (size_t)(B * KVH));
    if (units == NULL) return -1;
    int64_t n = 0;
    for (b = 0; b < B;) {
        int64_t e = b + 1;
        while (e < B && same_keys(block_table, context_lens, MB, window, b, e)) e++;
        const int64_t R = e - b;
        if (R == 1) {
            for (int64_t h = 0; h < KVH; h += heads_per_task, n++) {
                int64_t *u = units + n * UNIT_FIELDS;
                u[0] = b, u[1] = 1, u[2] = h, u[3] = heads_per_task;
            }
        } else {
            /* at most GROUP_ROWS rows a task, and GROUP_SCORES scores, in parts enough for
               every thread to have one */
            int64_t L = 1;
            for (int64_t r = b; r < e; r++) {
                const int64_t len = context_lens[r] - window_start(context_lens[r], window);
                L = len > L ? len : L;
            }
            int64_t most = GROUP_SCORES / (G * L);
            most = most < 1 ? 1 : most > GROUP_ROWS ? GROUP_ROWS : most;
            int64_t parts = (R + most - 1) / most;
            const int64_t balanced = (2 * threads + KVH - 1) / KVH;
            parts = parts > balanced ? parts : balanced < R ? balanced : R;
            for (int64_t s = 0, r0 = b; s < parts; s++) {
                const int64_t rows = R / parts + (s < R % parts);
                for (int64_t h = 0; h < KVH; h++, n++) {
                    int64_t *u = units + n * UNIT_FIELDS;
                    u[0] = r0, u[1] = rows, u[2] = h, u[3] = 1;
                }
                r0 += rows;
            }
        }
        b = e;
    }
    *units_out = units;
    return n;
}

/* A step of fewer rows alone (no groups) than keep the threads busy, where a row's keys are in
   several parts: its tasks are the rows' parts (each run of KV heads of a row, part by part),
   then each row's parts merged. Returns 1 when done so, 0 when not (enough tasks without it,
   no row of several parts, or the parts do not apply: the scalar code, AVX-512's head sizes:
   a row's task then takes its parts one after the other), -1 out of memory. */
static int split_rows(struct decode_task *t, int64_t B, int bf16) {
#ifdef HAVE_ATTEND_VEC
    const int64_t D = t->D, H = t->H, BS = t->BS, C = part_span(BS);
    (void)bf16;
#ifdef HAVE_ATTEND_512
    if (takes512(D, bf16)) return 0;
#endif
    if (!rows_grouped(D) || B * t->tasks_per_row >= 2 * (int64_t)omp_get_max_threads()) return 0;
    int64_t n = 0, floats = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = t->context_lens[b], P = parts_of(window_start(len, t->window), len, C);
        n += t->tasks_per_row * (P > 1 ? P : 1);
        floats += P > 1 ? H * P : 0;
    }
    if (floats == 0) return 0;
    int64_t *part_units = malloc(sizeof(int64_t) * (size_t)(4 * n + B));
    float *partials = malloc(sizeof(float) * (size_t)(floats * PART_FLOATS(D)));
    if (part_units == NULL || partials == NULL) {
        free(part_units);
        free(partials);
        return -1;
    }
    int64_t *row_parts = part_units + 4 * n, i = 0, offset = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = t->context_lens[b], P = parts_of(window_start(len, t->window), len, C);
        row_parts[b] = offset;
        offset += P > 1 ? H * P : 0;
        for (int64_t k = 0; k < t->tasks_per_row; k++)
            for (int64_t p = 0; p < (P > 1 ? P : 1); p++, i++) {
                int64_t *unit = part_units + 4 * i;
                unit[0] = b, unit[1] = t->heads_per_task, unit[2] = k * t->heads_per_task;
                unit[3] = P > 1 ? p : -1;
            }
    }
    t->part_units = part_units, t->row_parts = row_parts, t->partials = partials;
    switchboard_parallel_for(n, 1, decode_tasks, t);
    for (int64_t b = 0; b < B && !atomic_load(&t->failed); b++) {
        const int64_t len = t->context_lens[b], P = parts_of(window_start(len, t->window), len, C);
        if (P == 1) continue;
        for (int64_t j = 0; j < H; j++)
            merge_parts(partials + (row_parts[b] + j * P) * PART_FLOATS(D), P, D,
                        t->out + (b * H + j) * D);
    }
    free(part_units);
    free(partials);
    return 1;
#else
    (void)t, (void)B, (void)bf16;
    return 0;
#endif
}

static int paged_decode(const float *query, int64_t ldq, const void *kv, int bf16,
                        const int64_t *block_table, const int64_t *context_lens, float *out,
                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t NB, int64_t BS,
                        int64_t MB, float scale, int64_t window) {
    const int64_t threads = omp_get_max_threads();
    const int64_t heads_per_task = B >= threads ? KVH : 1;
    const int64_t element = bf16 ? 2 : 4;
    int64_t *units;
    const int64_t n_units = group_units(block_table, context_lens, B, KVH, H / KVH, D, MB, window,
                                        heads_per_task, threads, &units);
    if (n_units < 0) return -1;
    struct decode_task task = {
        query, kv, (const char *)kv + NB * BS * KVH * D * element, bf16, block_table,
        context_lens, out, ldq, H, KVH, D, H / KVH, BS, MB, window, heads_per_task,
        KVH / heads_per_task, scale, units, NULL, NULL, NULL, 0};
    if (units == NULL) {
        const int split = split_rows(&task, B, bf16);
        if (split != 0) return split < 0 ? -1 : atomic_load(&task.failed) ? -1 : 0;
    }
    switchboard_parallel_for(units != NULL ? n_units : B * task.tasks_per_row, 1, decode_tasks,
                             &task);
    free(units);
    return atomic_load(&task.failed) ? -1 : 0;
}

int paged_decode_f32(const float *query, int64_t ldq, const float *kv, const int64_t *block_table,
                     const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t KVH,
                     int64_t D, int64_t NB, int64_t BS, int64_t MB, float scale,
                     int64_t window) {
    return paged_decode(query, ldq, kv, 0, block_table, context_lens, out, B, H, KVH, D, NB, BS,
                        MB, scale, window);
}

int paged_decode_bf16kv(const float *query, int64_t ldq, const uint16_t *kv,
                        const int64_t *block_table, const int64_t *context_lens, float *out,
                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t NB, int64_t BS,
                        int64_t MB, float scale, int64_t window) {
    return paged_decode(query, ldq, kv, 1, block_table, context_lens, out, B, H, KVH, D, NB, BS,
                        MB, scale, window);
}

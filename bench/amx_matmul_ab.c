/* Two builds of the bfloat16 AMX matmul (csrc/bf16_amx.c) in one process, alternated call set by
   call set: bench/amx_matmul_ab.sh compiles a base revision's file with its entry points renamed
   lin_a / ready_a and this tree's as lin_b / ready_b, with this tree's work pool (the threads:
   OMP_NUM_THREADS, as torch's count in the worker).

     amx_matmul_ab MODEL ROWS SETS ROUNDS

   MODEL: the four layer matrices of llama-100m, smollm2 or tiny (QKV, output, gate/up, down,
   as the one-call stack multiplies them), or head (the LM heads of llama-100m and SmolLM2);
   ROWS: the rows a call; SETS: copies of the weights cycled call set by call set (one: they
   stay in the CPU's caches; 14 of llama-100m's: 176 MB, about its whole model, read from memory
   each time as in a served step). Random bfloat16 weights and rows. The two builds' outputs
   must be the same floats (checked first). Prints the median time of a call set for each and
   their ratio.

     amx_matmul_ab tiles

   What the tiles themselves give a core: TDPBF16PS on random bfloat16 tiles held in the tile
   registers (four sums, no loads), then with four tile loads from L1 per four multiplies. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int ready_a(void);
int ready_b(void);
void lin_a(const uint32_t *xp, const uint32_t *p, const float *bias, float *y, int64_t M,
           int64_t KP, int64_t N);
void lin_b(const uint32_t *xp, const uint32_t *p, const float *bias, float *y, int64_t M,
           int64_t KP, int64_t N);
typedef void (*linear_fn)(const uint32_t *, const uint32_t *, const float *, float *, int64_t,
                          int64_t, int64_t);

#define MATRICES 4
#define MAX_SETS 64
#define MAX_ROUNDS 1000

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* two bfloat16 values of about N(0, 0.03) in one 32-bit pair */
static uint32_t random_pair(void) {
    uint32_t pair = 0;
    for (int half = 0; half < 2; half++) {
        const float f = ((float)rand() / (float)RAND_MAX - 0.5f) * 0.1f;
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        pair |= (bits >> 16) << (16 * half);
    }
    return pair;
}

static uint32_t *random_pairs(size_t n) {
    uint32_t *p = aligned_alloc(64, (n * 4 + 63) / 64 * 64);
    if (p == NULL) exit(2);
    for (size_t i = 0; i < n; i++) p[i] = random_pair();
    return p;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"

static void tile_rates(void) {
    struct amx_tile_config config = amx_tile_config_empty();
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    amx_tile_config_load(&config);
    uint32_t *data = random_pairs(4 * 256);
    _tile_loadd(4, data, 64);
    _tile_loadd(5, data + 256, 64);
    _tile_loadd(6, data + 512, 64);
    _tile_loadd(7, data + 768, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const long n = 2000000;
    for (int loads = 0; loads < 2; loads++) {
        const double t0 = now();
        for (long i = 0; i < n; i++) {
            if (loads) {
                _tile_loadd(4, data, 64);
                _tile_loadd(7, data + 256, 64);
                _tile_loadd(5, data + 512, 64);
            }
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(2, 7, 5);
            if (loads) _tile_loadd(6, data + 768, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(3, 7, 6);
        }
        const double t = now() - t0;
        printf("tiles, %s: %.0f GFLOP/s a core\n",
               loads ? "four loads from L1 per four multiplies" : "no loads",
               (double)n * 4 * 16 * 16 * 32 * 2 / t * 1e-9);
    }
    _tile_release();
}
#else
static void tile_rates(void) { printf("tiles: not in this build\n"); }
#endif

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "tiles") == 0) {
        if (!ready_a()) return 3;
        tile_rates();
        return 0;
    }
    if (argc != 5) {
        fprintf(stderr, "usage: %s llama-100m|smollm2|tiny|head ROWS SETS ROUNDS\n", argv[0]);
        return 2;
    }
    static const struct {
        const char *name;
        int K[MATRICES], N[MATRICES];
    } models[] = {
        {"llama-100m", {768, 768, 768, 2048}, {1280, 768, 4096, 768}},
        {"smollm2", {576, 576, 576, 1536}, {960, 576, 3072, 576}},
        {"tiny", {256, 256, 256, 688}, {512, 256, 1376, 256}},
        {"head", {768, 576, 768, 576}, {16000, 49152, 16000, 49152}},
    };
    int model = -1;
    for (int i = 0; i < 4; i++)
        if (strcmp(argv[1], models[i].name) == 0) model = i;
    const int M = atoi(argv[2]), sets = atoi(argv[3]), rounds = atoi(argv[4]);
    if (model < 0 || M < 1 || sets < 1 || sets > MAX_SETS || rounds < 1 || rounds > MAX_ROUNDS) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    if (!ready_a() || !ready_b()) {
        fprintf(stderr, "no AMX tiles granted to this process\n");
        return 3;
    }
    const int *K = models[model].K, *N = models[model].N;
    /* the rows as bf16_linear hands them to the kernel: whole tiles, rows padded to 16 and
       pairs to 16 (zero there would change nothing measured: random is as fast) */
    const int64_t MA = (M + 15) / 16 * 16;
    uint32_t *weights[MAX_SETS][MATRICES], *rows[MATRICES];
    size_t most = 0;
    double flop = 0;
    for (int m = 0; m < MATRICES; m++) {
        const int64_t KP = K[m] / 2, KPA = (KP + 15) / 16 * 16;
        for (int s = 0; s < sets; s++) weights[s][m] = random_pairs((size_t)KP * N[m]);
        rows[m] = random_pairs((size_t)(MA * KPA));
        most = (size_t)M * N[m] > most ? (size_t)M * N[m] : most;
        flop += 2.0 * M * K[m] * N[m];
    }
    float *ya = aligned_alloc(64, most * 4 + 64), *yb = aligned_alloc(64, most * 4 + 64);
    if (ya == NULL || yb == NULL) return 2;
    for (int m = 0; m < MATRICES; m++) {
        lin_a(rows[m], weights[0][m], NULL, ya, M, K[m] / 2, N[m]);
        lin_b(rows[m], weights[0][m], NULL, yb, M, K[m] / 2, N[m]);
        if (memcmp(ya, yb, (size_t)M * N[m] * 4) != 0) {
            printf("the two builds' sums differ (matrix %d)\n", m);
            return 1;
        }
    }
    static double times[2][MAX_ROUNDS];
    int s = 0;
    for (int r = 0; r < rounds; r++)
        for (int v = 0; v < 2; v++) {
            const linear_fn f = v ? lin_b : lin_a;
            const double t0 = now();
            for (int m = 0; m < MATRICES; m++)
                f(rows[m], weights[s][m], NULL, ya, M, K[m] / 2, N[m]);
            times[v][r] = now() - t0;
            s = (s + 1) % sets;
        }
    qsort(times[0], (size_t)rounds, sizeof(double), by_value);
    qsort(times[1], (size_t)rounds, sizeof(double), by_value);
    const double a = times[0][rounds / 2], b = times[1][rounds / 2];
    printf("%s, %d rows, %d sets: base %.0f us (%.0f GFLOP/s), this tree %.0f us (%.0f GFLOP/s),"
           " ratio %.3f\n",
           argv[1], M, sets, a * 1e6, flop / a * 1e-9, b * 1e6, flop / b * 1e-9, b / a);
    return 0;
}

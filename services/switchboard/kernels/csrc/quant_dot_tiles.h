/* The tiles of quant_dot.c's matmuls, R rows times P panels, one per variant (VNNI-512 and
   AVX2), and what they share: the quantized rows, the prefetches, the store. Included by
   quant_dot.c alone, inside its AVX2 section (HAVE_VNNI512 and immintrin.h defined). */
#ifndef SWITCHBOARD_QUANT_DOT_TILES_H
#define SWITCHBOARD_QUANT_DOT_TILES_H
#include "quant_dot.h"

/* The rows quantized per block: the int8 values as groups of 4 consecutive inputs, the M rows'
   groups of one line side by side ([K / 4][M] int32: a tile reads its rows' inputs at constant
   offsets from one pointer; with a row's values together it kept a pointer per row, which ran
   short of registers at 8 rows), and per block d, d * sum(xq) and -128 * sum(xq) */
struct qrows {
    const int32_t *q4;
    const float *d, *ds;
    const int32_t *corr;
    int64_t M, blocks; /* the rows, and a row's blocks */
};

/* How a variant asks for the weights ahead of its loads. Into L2 (_MM_HINT_T1), or non-temporally
   (PREFETCHNTA): a step reads each weight once, and fetched into L2 the 96 MB of the default
   model's matrices push everything else out of L2 and L3 every step: the hidden states, the KV
   cache, the worker's interpreter. The AVX2 variant fetches non-temporally: on the AVX2-only
   AMD EPYC the matmuls alone took the same time either way (30 layers' one-row matmuls, C
   harness), and a one-row step in process took 4.41 ms against 4.84 (medians of five
   alternations), one user's ITL p50 served 5.17 ms against 5.62 (eight alternated rounds).
   The VNNI-512 variant keeps fetching into L2: not measured on its CPUs. fetch_of: a
   variant's way, for its tiles and the start of its chunks. */
enum fetch { FETCH_L2, FETCH_NTA };
static inline enum fetch fetch_of(int v) { return v == AVX2 ? FETCH_NTA : FETCH_L2; }

static inline __attribute__((always_inline)) void fetch_line(const void *at, enum fetch how) {
    if (how == FETCH_NTA)
        _mm_prefetch((const char *)at, _MM_HINT_NTA);
    else
        _mm_prefetch((const char *)at, _MM_HINT_T1);
}

/* What both variants do over a block of a panel: fetch the line `ahead` bytes after the one
   `off` bytes into `panel`, one of a tile's P panels. The P panels are read side by side, so
   past its end a panel's fetch goes on in the same panel of the next tile (the panel right after
   it is being read already): fetched straight on, the last `ahead` bytes of every panel's
   fetches were wasted and the next tile's panels but its first started cold (the matmuls of a
   1-row SmolLM2 step took ~25 % longer on one thread). A fetch past the matrix or the thread's
   panels is a wasted line, not a fault. (4 bits: the lines of the low nibbles hold the high
   ones too.) */
static inline __attribute__((always_inline)) void prefetch_line(const uint8_t *panel, int64_t off,
                                                                int64_t ahead, int P,
                                                                int64_t panel_bytes,
                                                                enum fetch how) {
    const int64_t at = off + ahead >= panel_bytes ? off + ahead + (P - 1) * panel_bytes
                                                  : off + ahead;
    fetch_line(panel + at, how);
}

/* the first `ahead` bytes of `panels` panels, which no earlier fetch of this thread covered:
   the start of a thread's chunk of panels */
static void prefetch_start(const uint8_t *p, int64_t panels, int64_t panel_bytes, int64_t ahead,
                           enum fetch how) {
    const int64_t warm = ahead < panel_bytes ? ahead : panel_bytes;
    for (int64_t pq = 0; pq < panels; pq++)
        for (int64_t off = 0; off < warm; off += 64) fetch_line(p + pq * panel_bytes + off, how);
}

/* and the quantized inputs of line k4 of block b from row r0 on: row r0 + r's 4 at [r] */
static inline __attribute__((always_inline)) const int32_t *line_of(const struct qrows *x,
                                                                    int64_t r0, int64_t b,
                                                                    int64_t B, int64_t k4) {
    return x->q4 + (b * (B / 4) + k4) * x->M + r0;
}

/* Tile of R rows times P panels (constants where inlined), variant V; the last panel has
   ncols_last columns. acc: float sums, one per (row, panel) pair. */
#define PREFETCH_AHEAD 2048

static inline __attribute__((always_inline)) void store_tile(const int R, const int P,
                                                             const float *acc, float *y,
                                                             int64_t ldy, int64_t ncols_last,
                                                             const float *bias) {
    for (int r = 0; r < R; r++)
        for (int pp = 0; pp < P; pp++) {
            const int64_t ncols = pp == P - 1 ? ncols_last : PW;
            const float *a = acc + (r * P + pp) * PW, *bp = bias ? bias + pp * PW : 0;
            float *yp = y + r * ldy + pp * PW;
            for (int64_t j = 0; j < ncols; j++) yp[j] = bp ? a[j] + bp[j] : a[j];
        }
}

#if HAVE_VNNI512
/* A panel block's 16 scales and offsets (zero where the layout has none) at so, as float32 */
static inline __attribute__((always_inline)) void block_factors(const uint8_t *so, int half,
                                                              int offsets, __m512 *s, __m512 *o) {
    *s = half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)so))
              : _mm512_loadu_ps((const float *)so);
    const __m256i *o16 = (const __m256i *)(so + 32);
    *o = !offsets ? _mm512_setzero_ps()
         : half   ? _mm512_cvtph_ps(_mm256_loadu_si256(o16))
                  : _mm512_loadu_ps((const float *)so + PW);
}

static inline __attribute__((always_inline)) void tile_vnni(
    const int R, const int P, const int nibbles, const int layout, const int64_t B,
    const struct qrows *x,
    int64_t r0, const uint8_t *p, int64_t panel_bytes, int64_t ahead, float *y, int64_t ldy,
    int64_t ncols_last, const float *bias) {
    const int64_t bb = block_bytes(B, nibbles, layout), values = nibbles ? B * PW / 2 : B * PW;
    const int half = layout & HALF, offsets = !(layout & NO_OFFSETS);
    __m512 acc[8 * 4];
    for (int i = 0; i < R * P; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < x->blocks; b++) {
        __m512i sums[8 * 4];
        for (int r = 0; r < R; r++) {
            const __m512i c = _mm512_set1_epi32(nibbles ? 0 : x->corr[(r0 + r) * x->blocks + b]);
            for (int pp = 0; pp < P; pp++) sums[r * P + pp] = c;
        }
        /* lines k4 and k4 + B / 8 (4 bits: one line's low and high nibbles, loaded once). With
           fewer (row, panel) pairs than a dot product's latency in cycles, each pair's sums run
           as two chains, added at the end (the dot products of one chain wait on each other);
           with more, one chain a pair: the second chains' registers spilled, and their adds
           and zeroing cost ~15 % at 8 rows and ~30 % at 4. Integer sums are exact either way,
           so the same integers. */
        const int split = R * P < 5;
        __m512i more[8 * 4];
        if (split)
            for (int i = 0; i < R * P; i++) more[i] = _mm512_setzero_si512();
        for (int64_t k4 = 0; k4 < B / 8; k4++) {
            __m512i w[4], w2[4];
            for (int pp = 0; pp < P; pp++) {
                const uint8_t *panel = p + pp * panel_bytes;
                const int64_t off = b * bb + k4 * 4 * PW, off2 = off + B / 8 * 4 * PW;
                prefetch_line(panel, off, ahead, P, panel_bytes, fetch_of(VNNI512));
                if (nibbles) {
                    const __m512i v = _mm512_loadu_si512((const void *)(panel + off));
                    const __m512i low = _mm512_set1_epi8(0x0f);
                    w[pp] = _mm512_and_si512(v, low);
                    w2[pp] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                } else {
                    prefetch_line(panel, off2, ahead, P, panel_bytes, fetch_of(VNNI512));
                    w[pp] = _mm512_loadu_si512((const void *)(panel + off));
                    w2[pp] = _mm512_loadu_si512((const void *)(panel + off2));
                }
            }
            const int32_t *line = line_of(x, r0, b, B, k4);
            const int32_t *line2 = line_of(x, r0, b, B, k4 + B / 8);
            for (int r = 0; r < R; r++) {
                const __m512i xa = _mm512_set1_epi32(line[r]);
                const __m512i xb = _mm512_set1_epi32(line2[r]);
                for (int pp = 0; pp < P; pp++) {
                    sums[r * P + pp] = _mm512_dpbusd_epi32(sums[r * P + pp], w[pp], xa);
                    if (split)
                        more[r * P + pp] = _mm512_dpbusd_epi32(more[r * P + pp], w2[pp], xb);
                    else
                        sums[r * P + pp] = _mm512_dpbusd_epi32(sums[r * P + pp], w2[pp], xb);
                }
            }
        }
        if (split)
            for (int i = 0; i < R * P; i++) sums[i] = _mm512_add_epi32(sums[i], more[i]);
        for (int pp = 0; pp < P; pp++) {
            const uint8_t *panel = p + pp * panel_bytes, *so = panel + b * bb + values;
            prefetch_line(panel, b * bb + values, ahead, P, panel_bytes, fetch_of(VNNI512));
            if (factor_bytes(layout) > 64)
                prefetch_line(panel, b * bb + values + 64, ahead, P, panel_bytes,
                              fetch_of(VNNI512));
            __m512 s, o;
            block_factors(so, half, offsets, &s, &o);
            for (int r = 0; r < R; r++) {
                const int64_t i = (r0 + r) * x->blocks + b;
                const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(x->d[i]));
                __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r * P + pp]), sd,
                                           acc[r * P + pp]);
                acc[r * P + pp] = offsets ? _mm512_fmadd_ps(o, _mm512_set1_ps(x->ds[i]), a) : a;
            }
        }
    }
    float out[8 * 4 * PW];
    for (int i = 0; i < R * P; i++) _mm512_storeu_ps(out + i * PW, acc[i]);
    store_tile(R, P, out, y, ldy, ncols_last, bias);
}
#endif

/* the float32 value of float16 bits h */
static inline float from_half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0) { /* zero or subnormal: m * 2^-24 */
        float f = (float)m * 0x1p-24f;
        __builtin_memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | (e + 112) << 23 | m << 13;
    }
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

/* A block's `count` float16 factors as float32 */
static inline void widen_factors(const uint8_t *at, float *so, int count) {
#if defined(__F16C__)
    for (int i = 0; i < count; i += 8)
        _mm256_storeu_ps(so + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 2 * i))));
#else
    for (int i = 0; i < count; i++) {
        uint16_t h;
        __builtin_memcpy(&h, at + 2 * i, 2);
        so[i] = from_half(h);
    }
#endif
}

/* The AVX2 variant: a panel's 4 inputs are two vectors of 8 columns, and a tile's float sums
   stay in memory (an L1 line per vector, read and written once a block): AVX2's 16 registers
   then hold the integer sums of MAX_ROWS_256 rows (4 bits) or MAX_ROWS_256_8BIT (8 bits).

   4 bits: u (at most 15) times xq (|xq| <= 127) by _mm256_maddubs_epi16 is a pair of inputs in
   a 16-bit lane, at most 2 * 15 * 127 = 3,810; a lane takes one pair a line, so over a block of
   32 inputs (8 lines) it sums at most 30,480 < 32,767: the pairs add in 16 bits and widen to 32
   once a block with _mm256_madd_epi16, a multiply and an add a line and row instead of two
   multiplies and an add (the same integers, hence the same floats). 8 bits (q = u ^ 0x80,
   |q| * sign(xq, q), pairs up to 32,512) widen every line. */
static inline __m256i nibbles256(const uint8_t *blk, int64_t k4, int h, int high) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + k4 * 4 * PW + 32 * h));
    const __m256i low = _mm256_set1_epi8(0x0f);
    return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, low);
}

static inline __attribute__((always_inline)) void tile_avx2(
    const int R, const int P, const int nibbles, const int layout, const int64_t B,
    const struct qrows *x,
    int64_t r0, const uint8_t *p, int64_t panel_bytes, int64_t ahead, float *y, int64_t ldy,
    int64_t ncols_last, const float *bias) {
    const int64_t bb = block_bytes(B, nibbles, layout), values = nibbles ? B * PW / 2 : B * PW;
    const int half = layout & HALF, offsets = !(layout & NO_OFFSETS);
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    float acc[MAX_ROWS_256 * 2 * PW];
    for (int i = 0; i < R * P * PW; i++) acc[i] = 0.0f;
    for (int64_t b = 0; b < x->blocks; b++) {
        __m256i sums[2 * MAX_ROWS_256 * 2];
        for (int i = 0; i < 2 * R * P; i++) sums[i] = _mm256_setzero_si256();
        if (nibbles) {
            /* line k4's low nibbles, then line k4 + B / 8's high ones (the same bytes) */
            for (int64_t k4 = 0; k4 < B / 8; k4++)
                for (int high = 0; high < 2; high++) {
                    __m256i w[2 * 2];
                    for (int pp = 0; pp < P; pp++) {
                        const uint8_t *blk = p + pp * panel_bytes + b * bb;
                        if (!high)
                            prefetch_line(p + pp * panel_bytes, b * bb + k4 * 4 * PW, ahead, P,
                                          panel_bytes, fetch_of(AVX2));
                        for (int h = 0; h < 2; h++) w[2 * pp + h] = nibbles256(blk, k4, h, high);
                    }
                    const int32_t *line = line_of(x, r0, b, B, k4 + high * (B / 8));
                    for (int r = 0; r < R; r++) {
                        const __m256i xb = _mm256_set1_epi32(line[r]);
                        for (int i = 0; i < 2 * P; i++)
                            sums[2 * r * P + i] = _mm256_add_epi16(
                                sums[2 * r * P + i], _mm256_maddubs_epi16(w[i], xb));
                    }
                }
            for (int i = 0; i < 2 * R * P; i++) sums[i] = _mm256_madd_epi16(sums[i], ones);
        } else {
            for (int64_t k4 = 0; k4 < B / 4; k4++) {
                __m256i wq[2 * 2], wa[2 * 2];
                for (int pp = 0; pp < P; pp++) {
                    const uint8_t *blk = p + pp * panel_bytes + b * bb;
                    prefetch_line(p + pp * panel_bytes, b * bb + k4 * 4 * PW, ahead, P,
                                  panel_bytes, fetch_of(AVX2));
                    for (int h = 0; h < 2; h++) {
                        wq[2 * pp + h] = _mm256_xor_si256(
                            _mm256_loadu_si256((const __m256i *)(blk + k4 * 4 * PW + 32 * h)),
                            flip);
                        wa[2 * pp + h] = _mm256_abs_epi8(wq[2 * pp + h]);
                    }
                }
                const int32_t *line = line_of(x, r0, b, B, k4);
                for (int r = 0; r < R; r++) {
                    const __m256i xb = _mm256_set1_epi32(line[r]);
                    for (int i = 0; i < 2 * P; i++) {
                        const __m256i pairs =
                            _mm256_maddubs_epi16(wa[i], _mm256_sign_epi8(xb, wq[i]));
                        sums[2 * r * P + i] =
                            _mm256_add_epi32(sums[2 * r * P + i], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
        }
        for (int pp = 0; pp < P; pp++) {
            const uint8_t *at = p + pp * panel_bytes + b * bb + values;
            prefetch_line(p + pp * panel_bytes, b * bb + values, ahead, P, panel_bytes,
                          fetch_of(AVX2));
            if (factor_bytes(layout) > 64)
                prefetch_line(p + pp * panel_bytes, b * bb + values + 64, ahead, P, panel_bytes,
                              fetch_of(AVX2));
            float widened[2 * PW];
            const float *so = half ? widened : (const float *)at;
            if (half) widen_factors(at, widened, offsets ? 2 * PW : PW);
            for (int r = 0; r < R; r++) {
                const int64_t i = (r0 + r) * x->blocks + b;
                const __m256 d = _mm256_set1_ps(x->d[i]), ds = _mm256_set1_ps(x->ds[i]);
                for (int h = 0; h < 2; h++) {
                    const int t = 2 * (r * P + pp) + h;
                    const __m256 sd = _mm256_mul_ps(_mm256_loadu_ps(so + 8 * h), d);
                    const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), sd,
                                                     _mm256_loadu_ps(acc + 8 * t));
                    _mm256_storeu_ps(acc + 8 * t, offsets ? _mm256_fmadd_ps(_mm256_loadu_ps(so + PW + 8 * h), ds, a) : a);
                }
            }
        }
    }
    store_tile(R, P, acc, y, ldy, ncols_last, bias);
}

#endif

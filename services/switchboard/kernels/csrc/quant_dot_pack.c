/* Packing quantized weights into quant_dot.c's panels (the layout: its opening comment):
   the 8-bit values, or 4 bits where q spans at most 16 values, and the factors as float32 or
   float16. */
#include <stdint.h>

#include "kernels.h"
#include "quant_dot.h"

/* float16 bits of f, and whether they hold f exactly (finite, normal or subnormal) */
static int to_half(float f, uint16_t *h) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const int32_t e = (int32_t)((u >> 23) & 0xff) - 127;
    uint32_t m = u & 0x7fffffu;
    if ((u & 0x7fffffffu) == 0) return *h = sign, 1;
    if (e > 15 || e < -24 || e == 128) return *h = 0, 0;
    if (e >= -14) { /* normal: 10 bits of mantissa */
        *h = (uint16_t)(sign | (uint32_t)(e + 15) << 10 | m >> 13);
        return (m & 0x1fffu) == 0;
    }
    m |= 0x800000u; /* subnormal: value = m * 2^(e - 23), in units of 2^-24 */
    const int shift = -e - 1;
    *h = (uint16_t)(sign | m >> shift);
    return (m & ((1u << shift) - 1)) == 0;
}

/* the scales and offsets of one block of a panel, so[0..2 PW), at `at` as `layout` says; how
   many it does not hold exactly (offsets other than zero without offsets, values float16 does
   not hold) */
static int64_t store_factors(uint8_t *at, const float *so, int layout) {
    const int count = layout & NO_OFFSETS ? PW : 2 * PW;
    int64_t inexact = 0;
    if (layout & NO_OFFSETS)
        for (int i = PW; i < 2 * PW; i++) inexact += so[i] != 0.0f;
    if (!(layout & HALF)) {
        __builtin_memcpy(at, so, count * sizeof(float));
        return inexact;
    }
    uint16_t h[2 * PW];
    for (int i = 0; i < count; i++) inexact += !to_half(so[i], h + i);
    __builtin_memcpy(at, h, count * sizeof(uint16_t));
    return inexact;
}

/* column j's scale and offset of one block into so (so[j], so[PW + j]): factor `at` of a row
   below N (inside: 0, zero factors past N); offset NULL: zeros; a 4-bit row (nibbles), stored
   as q - qmin, gets qmin * scale added to its offset */
static inline void panel_factors(float so[2 * PW], int64_t j, int inside, const float *scale,
                                 const float *offset, int64_t at, int nibbles, int64_t qmin) {
    const float s = inside ? scale[at] : 0.0f, o = inside && offset ? offset[at] : 0.0f;
    so[j] = s;
    so[PW + j] = nibbles ? o + (float)qmin * s : o;
}

/* q [N, K] int8, scale and offset [N, K / B] (offset NULL: zeros) -> panels, zero past N (a
   zero weight: u = 128, scale and offset 0); B with QUANT_HALF_SCALES / QUANT_NO_OFFSETS: the
   factors in that layout. Returns how many factors the layout does not hold exactly (0: the
   panels are good). */
int64_t quant_dot_pack(const int8_t *q, const float *scale, const float *offset, uint8_t *p,
                       int64_t N, int64_t K, int64_t B) {
    const int layout = layout_of(B);
    B = block_of(B);
    const int64_t panels = (N + PW - 1) / PW, blocks = K / B, bb = block_bytes(B, 0, layout);
    int64_t inexact = 0;
#pragma omp parallel for schedule(static) reduction(+ : inexact)
    for (int64_t pq = 0; pq < panels; pq++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *blk = p + (pq * blocks + b) * bb;
            float so[2 * PW];
            for (int64_t j = 0; j < PW; j++) {
                const int64_t n = pq * PW + j;
                for (int64_t k = 0; k < B; k++) {
                    const int8_t v = n < N ? q[n * K + b * B + k] : 0;
                    blk[(k / 4) * 4 * PW + j * 4 + k % 4] = (uint8_t)v ^ 0x80u;
                }
                panel_factors(so, j, n < N, scale, offset, n * blocks + b, 0, 0);
            }
            inexact += store_factors(blk + B * PW, so, layout);
        }
    return inexact;
}

/* the same as 4 bits: q - qmin in 0..15 (the caller checks), offset + qmin * scale */
int64_t quant_dot4_pack(const int8_t *q, const float *scale, const float *offset, uint8_t *p,
                        int64_t N, int64_t K, int64_t B, int64_t qmin) {
    const int layout = layout_of(B);
    B = block_of(B);
    const int64_t panels = (N + PW - 1) / PW, blocks = K / B, bb = block_bytes(B, 1, layout);
    int64_t inexact = 0;
#pragma omp parallel for schedule(static) reduction(+ : inexact)
    for (int64_t pq = 0; pq < panels; pq++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *blk = p + (pq * blocks + b) * bb;
            float so[2 * PW];
            for (int64_t j = 0; j < PW; j++) {
                const int64_t n = pq * PW + j;
                for (int64_t k = 0; k < B / 2; k++) {
                    const int64_t at = n * K + b * B + k;
                    const uint8_t lo = n < N ? (uint8_t)(q[at] - qmin) : 0;
                    const uint8_t hi = n < N ? (uint8_t)(q[at + B / 2] - qmin) : 0;
                    blk[(k / 4) * 4 * PW + j * 4 + k % 4] = (uint8_t)(lo | hi << 4);
                }
                panel_factors(so, j, n < N, scale, offset, n * blocks + b, 1, qmin);
            }
            inexact += store_factors(blk + B * PW / 2, so, layout);
        }
    return inexact;
}

/* What quant_dot.c (the matmuls) and quant_dot_pack.c (the panels they read) share: the
   panels' layout, described in quant_dot.c. */
#ifndef SWITCHBOARD_QUANT_DOT_H
#define SWITCHBOARD_QUANT_DOT_H
#include <stdint.h>

#include "kernels.h"

#define PW 16 /* output columns per panel */

/* the factors' layout: bits of B above the block size */
#define HALF 1       /* float16 */
#define NO_OFFSETS 2 /* scales only */
static inline int layout_of(int64_t B) {
    return (B & QUANT_HALF_SCALES ? HALF : 0) | (B & QUANT_NO_OFFSETS ? NO_OFFSETS : 0);
}
static inline int64_t block_of(int64_t B) {
    return B & ~(int64_t)(QUANT_HALF_SCALES | QUANT_NO_OFFSETS);
}

/* the bytes of a block's factors, and of the whole block: the values (4 bits each when
   `nibbles`), the scales and the offsets, as `layout` says */
static inline int64_t factor_bytes(int layout) {
    return (layout & NO_OFFSETS ? 1 : 2) * PW * (layout & HALF ? 2 : (int64_t)sizeof(float));
}
static inline int64_t block_bytes(int64_t B, int nibbles, int layout) {
    return (nibbles ? B * PW / 2 : B * PW) + factor_bytes(layout);
}

#endif

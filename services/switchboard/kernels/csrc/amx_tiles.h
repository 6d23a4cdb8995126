/* The AMX tile configuration (palette 1) as LDTILECFG reads it, and its loading: shared by the
   AMX kernels (bf16_amx.c, quant_dot_amx.h) and bench/amx_matmul_ab.c. Include where the AMX
   intrinsics are compiled in. */
#ifndef SWITCHBOARD_AMX_TILES_H
#define SWITCHBOARD_AMX_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* tile t: rows[t] rows of colsb[t] bytes (16 rows of 64 bytes at most); tiles 8-15 unused */
struct amx_tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* A configuration of palette 1 with every tile empty: the caller sets the tiles it uses. */
static inline struct amx_tile_config amx_tile_config_empty(void) {
    struct amx_tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    return c;
}

/* Loads `c` on this thread (an invalid configuration faults). */
static inline void amx_tile_config_load(const struct amx_tile_config *c) {
    /* GCC does not count LDTILECFG as reading c: without this it may drop the stores to it */
    __asm__ volatile("" : : "m"(*c) : "memory");
    _tile_loadconfig(c);
}
#endif

/* bfloat16 <-> float32, one value at a time: a bfloat16 is a float32's high 16 bits. */
#ifndef SWITCHBOARD_BF16_H
#define SWITCHBOARD_BF16_H
#include <stdint.h>
#include <string.h>

/* round to nearest even, as torch converts (a NaN becomes torch's quiet NaN, 0x7fc0) */
static inline uint16_t bf16_from_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* f rounded to bfloat16 and back: the value torch holds after a bfloat16 operation */
static inline float bf16_round(float f) { return bf16_to_f32(bf16_from_f32(f)); }
#endif

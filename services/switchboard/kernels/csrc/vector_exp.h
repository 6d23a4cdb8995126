/* e^x in float32 that the compiler vectorises inside an `omp simd` loop (libm's expf is a call
   per element unless built with -ffast-math, which would loosen every other line of a kernel).
   Cody-Waite reduction to r in [-ln2/2, ln2/2] and Cephes' degree-5 polynomial: within 2 ulp of
   the exact value; the input is clamped to [-87.3, 88.3], where e^x is a normal float (below,
   the true value underflows to about 1e-38 instead of 0). */
#ifndef SWITCHBOARD_VECTOR_EXP_H
#define SWITCHBOARD_VECTOR_EXP_H
#include <stdint.h>
#include <string.h>

static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    /* round to nearest: adding 1.5 * 2^23 leaves no fraction bits */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
#endif

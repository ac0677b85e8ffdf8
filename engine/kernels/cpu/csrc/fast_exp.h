/* exp(x) in float32 without libm, for the kernels' softmax and SiLU. */
#ifndef SPLITSERVE_FAST_EXP_H
#define SPLITSERVE_FAST_EXP_H

#include <stdint.h>

/* exp(x) over float32's range (clamped to [-87, 88]): Cody-Waite range reduction and a degree-6
 * polynomial, ~1 ulp, branch-free so that it vectorizes. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* round to nearest via the 1.5 * 2^23 trick (vectorizes without libm) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } e;
    e.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * e.f;
}

#endif

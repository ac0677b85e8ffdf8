/* 8-bit KV pages (--kv-cache-dtype int8|fp8_e4m3): quantize new K/V as they are written, bit for
 * bit as splitserve.engine.kv_quant.quantize_kv does with torch ops, and give the decode cache
 * the values a reader of the pool gets back (round_trip_kv).
 *
 * Per [D] vector of one token and KV head, in float32: amax = max |x|; scale = amax / QMAX (1 if
 * amax is 0); y = x / scale (a true division, as torch divides); then
 *   int8:     q = rint(y) (nearest, ties to even, as torch.round), clamped to [-127, 127];
 *   fp8_e4m3: y clamped to [-448, 448], rounded to the nearest float8_e4m3fn (ties to even, as
 *             torch's float -> float8_e4m3fn conversion), subnormals (below 2^-6) kept.
 * Read back: bf16(float(q) * scale), rounded to nearest even. Inputs are finite bfloat16
 * (NaN or infinity in K/V are not matched to torch).
 *
 * Page layout (splitserve.engine.kv_pool): one page is value_bytes of 1-byte values
 * [L, 2, page_size, Hkv, D], then float32 scales [L, 2, page_size, Hkv]: the scale of the values
 * at byte v of a page sits at scale index v / D.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* |y| <= 448 -> the float8_e4m3fn code of round-to-nearest-even(y) (sign in bit 7), and the
 * value that code holds in *value. The grid step between 2^e and 2^(e+1) is 2^(e-3) (three
 * mantissa bits), and 2^-9 below 2^-6 (subnormals): scaling by a power of two is exact, so
 * rintf on the scaled value rounds to the grid as the format does. A carry to m = 16 lands on
 * the next binade's code by the same formula. */
static inline uint8_t fp8_e4m3_round(float y, float *value) {
    float a = fabsf(y);
    uint32_t bits;
    memcpy(&bits, &a, sizeof bits);
    int e = (int)(bits >> 23) - 127;
    if (e < -6) e = -6;
    float m = rintf(a * bits_to_f32((uint32_t)(127 + 3 - e) << 23)); /* a / 2^(e-3) */
    float mag = m * bits_to_f32((uint32_t)(127 + e - 3) << 23);
    uint8_t sign = signbit(y) ? 0x80 : 0;
    *value = sign ? -mag : mag;
    return (uint8_t)(sign | (((e + 6) << 3) + (int)m));
}

/* One vector x [d] -> q [d] (int8 or e4m3 bits), its scale, and rt [d]: what a reader gets. */
static inline float quantize_vec(const uint16_t *x, int64_t d, int64_t kind, uint8_t *q,
                                 uint16_t *rt) {
    float xf[d > 0 ? d : 1];
    float amax = 0.0f;
    for (int64_t e = 0; e < d; e++) {
        xf[e] = bf16_to_f32(x[e]);
        float a = fabsf(xf[e]);
        amax = a > amax ? a : amax;
    }
    if (kind == KV_INT8) {
        float s = amax > 0.0f ? amax / 127.0f : 1.0f;
        for (int64_t e = 0; e < d; e++) {
            float y = rintf(xf[e] / s);
            y = y < -127.0f ? -127.0f : (y > 127.0f ? 127.0f : y);
            int8_t qi = (int8_t)y; /* read back from the integer: rint's -0.0 is +0 there */
            q[e] = (uint8_t)qi;
            rt[e] = f32_to_bf16((float)qi * s);
        }
        return s;
    }
    float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int64_t e = 0; e < d; e++) {
        float y = xf[e] / s, v;
        y = y < -448.0f ? -448.0f : (y > 448.0f ? 448.0f : y);
        q[e] = fp8_e4m3_round(y, &v);
        rt[e] = f32_to_bf16(v * s);
    }
    return s;
}

/* x [n, d] bfloat16 contiguous -> q [n, d] bytes, scales [n] float32, rt [n, d] bfloat16
 * (rt may be NULL). kind: KV_INT8 or KV_FP8_E4M3. For tests against kv_quant.quantize_kv. */
void kv_quantize_bf16(const uint16_t *x, int64_t n, int64_t d, int64_t kind, uint8_t *q,
                      float *scales, uint16_t *rt) {
    uint16_t tmp[d > 0 ? d : 1];
    for (int64_t i = 0; i < n; i++)
        scales[i] = quantize_vec(x + i * d, d, kind, q + i * d, rt ? rt + i * d : tmp);
}

/* One layer's new K/V into an 8-bit pool and (ckt non-NULL) into the decode cache, like
 * kv_append_bf16 with quantization. k, v [t, hkv, d] bfloat16 (rows k_stride / v_stride
 * elements apart); pool: page 0's first byte, pages page_stride bytes apart, this layer's K
 * at byte k_off of a page and V at v_off, scales from byte value_bytes of a page; page_ids,
 * offsets [t]: where each token goes; cache ckt [slots, Hkv, D, cap], cv [slots, Hkv, cap, D]
 * bfloat16 of this layer, slots, pos [t] (ignored when ckt is NULL). */
void kv_append_q8(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                  int64_t t, int64_t hkv, int64_t d, uint8_t *pool, int64_t k_off, int64_t v_off,
                  int64_t page_stride, int64_t value_bytes, int64_t kind,
                  const int64_t *page_ids, const int64_t *offsets, uint16_t *ckt, uint16_t *cv,
                  int64_t cap, const int64_t *slots, const int64_t *pos) {
#pragma omp parallel for schedule(static) if (ckt && t >= 8)
    for (int64_t i = 0; i < t; i++) {
        uint8_t *page = pool + page_ids[i] * page_stride;
        float *page_scales = (float *)(void *)(page + value_bytes);
        uint16_t rt[d > 0 ? d : 1];
        for (int kv = 0; kv < 2; kv++) {
            const uint16_t *src = kv ? v + i * v_stride : k + i * k_stride;
            int64_t at = (kv ? v_off : k_off) + offsets[i] * hkv * d;
            for (int64_t h = 0; h < hkv; h++) {
                int64_t byte = at + h * d;
                float s = quantize_vec(src + h * d, d, kind, page + byte, rt);
                memcpy(page_scales + byte / d, &s, sizeof s);
                if (!ckt) continue;
                int64_t base = (slots[i] * hkv + h) * d * cap;
                if (kv) {
                    memcpy(cv + base + pos[i] * d, rt, sizeof(uint16_t) * (size_t)d);
                } else {
                    uint16_t *kt = ckt + base + pos[i];
                    for (int64_t e = 0; e < d; e++) kt[e * cap] = rt[e];
                }
            }
        }
    }
}

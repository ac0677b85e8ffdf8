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

#if defined(__AVX512F__)
/* float32 -> bfloat16 bits, round to nearest even, 16 finite lanes (f32_to_bf16's rounding). */
static inline __m256i bf16_rne16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

/* quantize_vec for d a multiple of 16, 16 lanes at a time: the same operations (IEEE division,
 * round to nearest even, the fp8 grid by exponent) with the same results. */
static float quantize_vec16(const uint16_t *x, int64_t d, int64_t kind, uint8_t *q,
                            uint16_t *rt) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), sign_mask = _mm512_set1_epi32(
        (int)0x80000000u);
    const int rne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; e += 16)
        amax = _mm512_max_ps(amax, _mm512_castsi512_ps(_mm512_and_si512(
                                       _mm512_castps_si512((__m512)load_bf16x16(x + e)), abs_mask)));
    float a = _mm512_reduce_max_ps(amax), qmax = kind == KV_INT8 ? 127.0f : 448.0f;
    float s = a > 0.0f ? a / qmax : 1.0f;
    __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
    for (int64_t e = 0; e < d; e += 16) {
        __m512 y = _mm512_div_ps((__m512)load_bf16x16(x + e), vs), val;
        __m512i code;
        if (kind == KV_INT8) {
            y = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(y, rne), lo), hi);
            code = _mm512_cvtps_epi32(y); /* integral already: exact */
            val = _mm512_cvtepi32_ps(code); /* from the integer: no -0.0 */
        } else {
            y = _mm512_min_ps(_mm512_max_ps(y, lo), hi);
            __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), sign_mask);
            __m512i bits = _mm512_and_si512(_mm512_castps_si512(y), abs_mask);
            __m512i ex = _mm512_max_epi32(
                _mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127)),
                _mm512_set1_epi32(-6));
            __m512 up = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(130), ex), 23));
            __m512 down = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_add_epi32(ex, _mm512_set1_epi32(124)), 23));
            __m512 m = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_castsi512_ps(bits), up), rne);
            __m512i mag = _mm512_castps_si512(_mm512_mul_ps(m, down));
            code = _mm512_add_epi32(
                _mm512_slli_epi32(_mm512_add_epi32(ex, _mm512_set1_epi32(6)), 3),
                _mm512_cvtps_epi32(m));
            code = _mm512_or_si512(code, _mm512_srli_epi32(sign, 24));
            val = _mm512_castsi512_ps(_mm512_or_si512(mag, sign));
        }
        _mm_storeu_si128((void *)(q + e), _mm512_cvtepi32_epi8(code));
        _mm256_storeu_si256((void *)(rt + e), bf16_rne16(_mm512_mul_ps(val, vs)));
    }
    return s;
}
#endif

/* One vector x [d] -> q [d] (int8 or e4m3 bits), its scale, and rt [d]: what a reader gets. */
static inline float quantize_vec(const uint16_t *x, int64_t d, int64_t kind, uint8_t *q,
                                 uint16_t *rt) {
#if defined(__AVX512F__)
    if (d % 16 == 0) return quantize_vec16(x, d, kind, q, rt);
#endif
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
 * offsets [t]: where each token goes; cache ckt [slots, Hkv, cap / KT_TILE, D, KT_TILE]
 * (kernels.h), cv [slots, Hkv, cap, D] bfloat16 of this layer, slots, pos [t] (ignored when ckt is NULL). */
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
                    uint16_t *kt = ckt + base + kt_offset(d, pos[i], 0);
                    for (int64_t e = 0; e < d; e++) kt[e * KT_TILE] = rt[e];
                }
            }
        }
    }
}

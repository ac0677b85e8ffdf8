/* Activations quantized per row and per group of 32 input channels to int8, for the vpdpbusd
 * products of gemm_w8.c and gemm_w4.c (header-only, AVX-512), and the same codes on AVX2 for
 * gemm_w8.c's AVX2 path (vpsignb / vpmaddubsw; quantize_x_groups8, without the sums).
 *
 * For each row r and group g of x [m, k] bfloat16: xscale[r, g] = max|x_g| / 127 (1 for an
 * all-zero group), xq = round(x / xscale) to nearest even, clamped to -127..127, and xsum[r, g]
 * = sum(xq) as an int32 (both kernels' offset terms need the group's quantized sum). A group
 * past k (k not a multiple of 32) is padded with zeros. This is llama.cpp's Q8_0 block for
 * activations: a step of 1/254 of the group's largest value, ~2x bfloat16's own relative
 * rounding for that value, and one outlier costs precision in its own group only.
 */
#ifndef SPLITSERVE_X_QUANT_H
#define SPLITSERVE_X_QUANT_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#define XQ_GROUP 32

/* 4 consecutive int8 of a quantized row as one int32, in all 16 lanes: vpdpbusd's signed
 * operand, 4 K values against each column's 4 packed weights. */
static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

static inline __m512 xq_load16(const uint16_t *p, int64_t left) {
    __mmask16 mk = left >= 16 ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, p)), 16));
}

/* x [m, k] bfloat16, rows x_stride elements apart; groups = ceil(k / 32). Writes xq [m, groups *
 * 32] int8 (row-major, zero past k), xscale and xsum [m, groups]. */
static inline void quantize_x_groups(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                                     int64_t groups, int8_t *xq, float *xscale, int32_t *xsum) {
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * x_stride;
        for (int64_t g = 0; g < groups; g++) {
            int64_t i = g * XQ_GROUP;
            __m512 v0 = xq_load16(row + i, k - i), v1 = xq_load16(row + i + 16, k - i - 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            float s = amax > 0.0f ? amax / 127.0f : 1.0f;
            __m512 inv = _mm512_set1_ps(1.0f / s);
            __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q0 = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, q0));
            q1 = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, q1));
            int8_t *q = xq + r * groups * XQ_GROUP + i;
            _mm_storeu_si128((void *)q, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((void *)(q + 16), _mm512_cvtepi32_epi8(q1));
            xscale[r * groups + g] = s;
            xsum[r * groups + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#define XQ_GROUP 32

/* quantize_x_groups on AVX2, without the sums (gemm_w8.c's AVX2 path multiplies signed weights,
 * no offset to take off): xq [m, groups * 32] int8 and xscale [m, groups]. The same float steps
 * as the AVX-512 version (the group's largest |x| / 127, x times its inverse rounded to nearest
 * even, clamped to +-127), so the same codes and scales. */
static inline void quantize_x_groups8(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                                      int64_t groups, int8_t *xq, float *xscale) {
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * x_stride;
        for (int64_t g = 0; g < groups; g++) {
            int64_t i = g * XQ_GROUP;
            uint16_t pad[XQ_GROUP];
            const uint16_t *src = row + i;
            if (i + XQ_GROUP > k) { /* the last, short group: zeros past k */
                memset(pad, 0, sizeof pad);
                memcpy(pad, src, sizeof(uint16_t) * (size_t)(k - i));
                src = pad;
            }
            __m256 v[4];
            for (int j = 0; j < 4; j++)
                v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 8 * j))), 16));
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]),
                                                    _mm256_andnot_ps(sign, v[1])),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]),
                                                    _mm256_andnot_ps(sign, v[3])));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            float amax = _mm_cvtss_f32(m4);
            float s = amax > 0.0f ? amax / 127.0f : 1.0f;
            __m256 inv = _mm256_set1_ps(1.0f / s);
            __m256i q[4];
            for (int j = 0; j < 4; j++) {
                q[j] = _mm256_cvtps_epi32(_mm256_round_ps(
                    _mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                q[j] = _mm256_max_epi32(nlim, _mm256_min_epi32(lim, q[j]));
            }
            /* packs interleaves 128-bit lanes: 4-byte runs come out as q0 q1 q2 q3 of the low
             * halves, then of the high halves; vpermd puts them back in order. */
            __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                           _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(xq + r * groups * XQ_GROUP + i),
                                _mm256_permutevar8x32_epi32(b, order));
            xscale[r * groups + g] = s;
        }
    }
}
#endif

#endif

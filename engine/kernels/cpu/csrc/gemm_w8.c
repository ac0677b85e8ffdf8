/* Weight-only int8 products y = x @ (s * Q).T (+ b) for decode steps (1-128 rows), AVX512-VNNI.
 *
 * Q [N, K] int8 in -127..127 with one float32 scale s[n] per output channel (--quantization
 * int8). A decode step is memory-bound at a few rows, so the point is reading 1 byte per weight
 * instead of bfloat16's 2. Converting each int8 to float32 in registers costs three
 * instructions per 16 weights and made the product compute-bound (torch's
 * _weight_int8pack_mm does this: bench/quant_matmul.py), so instead x is quantized per row to
 * int16 (symmetric, scale max|x| / 32767: a relative step of 3e-5 of the row's largest value,
 * ~100x finer than x's own bfloat16 rounding) and the products are exact integer sums with
 * vpdpwssd, which multiplies two int16 pairs and adds both products into one int32 lane: 32
 * multiply-adds per instruction, fed by one sign-extending load of 32 weights.
 *
 * Q is packed as wq [N / 16, P, 16, 2] int8 with P = ceil(K / 2) (the bfloat16 pair layout of
 * gemm_bf16.c, one byte per weight): for 16 output columns, each K pair is 32 bytes that
 * sign-extend to one 64-byte vector of int16 pairs. An odd K is padded with a zero weight.
 * int32 sums cannot overflow within 256 pairs (256 * 2 * 32767 * 127 < 2^31), so every 256 pairs
 * the tile's int32 sums are added into float32 ones (exact up to 2^24, rounded beyond).
 * y = float(sum) * (x_scale[row] * s[n]) + b, rounded to bfloat16 once, nearest even.
 *
 * Threads split the N blocks (NV vectors each), as in gemm_bf16.c.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define W8_MR 6     /* rows per register tile */
#define W8_NV 4     /* 16-column vectors per tile: 6 x 4 = 24 int32 + 24 float32 sums */
#define W8_FLUSH 256 /* K pairs between int32 -> float32 flushes (overflow bound above) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __m256i round_bf16x16_w8(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* One mr x (nv * 16) tile over all K pairs. xq: mr rows of 2 * pairs int16 (xs elements
 * apart); wb: the first of nv N blocks (ps bytes apart); ws: nv * 16 weight scales. */
static inline __attribute__((always_inline)) void tile_w8(
    const int16_t *xq, int64_t xs, const float *xscale, int mr, const int8_t *wb, int64_t ps,
    int nv, int64_t pairs, const float *ws, const uint16_t *bias, uint16_t *y, int64_t ys) {
    __m512 accf[W8_MR][W8_NV];
    __m512i acc[W8_MR][W8_NV];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nv; j++) accf[r][j] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < pairs; p0 += W8_FLUSH) {
        int64_t p1 = p0 + W8_FLUSH < pairs ? p0 + W8_FLUSH : pairs;
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < nv; j++) acc[r][j] = _mm512_setzero_si512();
        for (int64_t p = p0; p < p1; p++) {
            __m512i w[W8_NV];
            for (int j = 0; j < nv; j++)
                w[j] = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const void *)(wb + j * ps + p * 32)));
            for (int r = 0; r < mr; r++) {
                int32_t pair;
                memcpy(&pair, xq + r * xs + 2 * p, sizeof pair);
                __m512i a = _mm512_set1_epi32(pair);
                for (int j = 0; j < nv; j++) acc[r][j] = _mm512_dpwssd_epi32(acc[r][j], a, w[j]);
            }
        }
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < nv; j++)
                accf[r][j] = _mm512_add_ps(accf[r][j], _mm512_cvtepi32_ps(acc[r][j]));
    }
    for (int j = 0; j < nv; j++) {
        __m512 s = _mm512_loadu_ps(ws + j * 16);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(bias + j * 16))), 16));
        for (int r = 0; r < mr; r++) {
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(accf[r][j], _mm512_set1_ps(xscale[r])), s);
            _mm256_storeu_si256((void *)(y + r * ys + j * 16), round_bf16x16_w8(_mm512_add_ps(v, b)));
        }
    }
}

/* Constant mr and nv per call site, so the tile's loops unroll into registers. */
#define W8_TILE(MR, NV)                                                                        \
    tile_w8(xq + r0 * xs, xs, xscale + r0, (MR), wb, ps, (NV), pairs, ws, bias, y + r0 * ys, ys)
#define W8_ROWS(NV)                                                                            \
    do {                                                                                       \
        int64_t r0 = 0;                                                                        \
        for (; r0 + W8_MR <= m; r0 += W8_MR) W8_TILE(W8_MR, NV);                               \
        switch (m - r0) {                                                                      \
        case 1: W8_TILE(1, NV); break;                                                         \
        case 2: W8_TILE(2, NV); break;                                                         \
        case 3: W8_TILE(3, NV); break;                                                         \
        case 4: W8_TILE(4, NV); break;                                                         \
        case 5: W8_TILE(5, NV); break;                                                         \
        default: break;                                                                        \
        }                                                                                      \
    } while (0)

static void block_w8(int nv, const int16_t *xq, int64_t xs, const float *xscale, int64_t m,
                     const int8_t *wb, int64_t ps, int64_t pairs, const float *ws,
                     const uint16_t *bias, uint16_t *y, int64_t ys) {
    switch (nv) {
    case 1: W8_ROWS(1); break;
    case 2: W8_ROWS(2); break;
    case 3: W8_ROWS(3); break;
    default: W8_ROWS(4); break;
    }
}
#endif

/* Quantize x [m, k] bfloat16 (rows x_stride apart) per row to int16 (xq [m, 2 * pairs], a zero
 * column padding an odd k) with xscale[r] = max|x_r| / 32767 (1 for an all-zero row). */
static void quantize_rows_i16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                              int64_t pairs, int16_t *xq, float *xscale) {
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * x_stride;
        float amax = 0.0f;
        for (int64_t i = 0; i < k; i++) amax = fmaxf(amax, fabsf(bf16_to_f32(row[i])));
        float s = amax > 0.0f ? amax / 32767.0f : 1.0f;
        float inv = 1.0f / s;
        int16_t *q = xq + r * 2 * pairs;
        for (int64_t i = 0; i < k; i++) {
            float v = nearbyintf(bf16_to_f32(row[i]) * inv);
            q[i] = (int16_t)fmaxf(-32767.0f, fminf(32767.0f, v));
        }
        if (k & 1) q[k] = 0;
        xscale[r] = s;
    }
}

/* x [m, k] bfloat16 (rows x_stride elements apart), m >= 1; wq [n_out / 16, ceil(k / 2), 16, 2]
 * int8 (see above); ws [n_out] float32 scales; bias [n_out] bfloat16 or NULL; y [m, n_out]
 * bfloat16 contiguous. Returns 0, -1 out of memory, -2 for n_out not a multiple of 16 or a build
 * without AVX512-VNNI (callers keep their torch path). */
int gemm_w8_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const int8_t *wq,
                 const float *ws, const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (n_out % 16 != 0 || m < 1 || k < 1) return -2;
    int64_t pairs = (k + 1) / 2, xs = 2 * pairs;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)(m * xs));
    float *xscale = malloc(sizeof(float) * (size_t)m);
    if (!xq || !xscale) {
        free(xq), free(xscale);
        return -1;
    }
    quantize_rows_i16(x, x_stride, m, k, pairs, xq, xscale);
    int64_t ps = pairs * 32; /* bytes per 16-column block */
    int64_t vecs = n_out / 16, nblocks = (vecs + W8_NV - 1) / W8_NV;
#pragma omp parallel for schedule(static) if (m * n_out * k >= (1 << 19))
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t v0 = b * W8_NV;
        int nv = (int)(vecs - v0 < W8_NV ? vecs - v0 : W8_NV);
        block_w8(nv, xq, xs, xscale, m, wq + v0 * ps, ps, pairs, ws + v0 * 16,
                 bias ? bias + v0 * 16 : NULL, y + v0 * 16, n_out);
    }
    free(xq), free(xscale);
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)wq, (void)ws, (void)bias, (void)n_out, (void)k;
    (void)y;
    return -2;
#endif
}

/* 1 when this build has the kernel (AVX512-VNNI), else 0. */
int gemm_w8_available(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* Weight-only int4 products y = x @ W'.T (+ b) for decode steps, AVX512-VNNI (--quantization
 * int4; engine/model/quant_int4.py has the scheme: W' = s * U + m, U in 0..15, one float16
 * scale s and offset m per 32 input channels and output column).
 *
 * A decode step reads every weight once, so 4 bits a weight is the point; the cost to avoid is
 * turning nibbles into something a multiply takes. Here a 64-byte load of packed weights splits
 * with two ANDs into two vectors of unsigned 4-bit values, which are vpdpbusd's unsigned byte
 * operand directly (the high ones kept in place, 16 x their value, and their sum shifted back):
 * 4 byte products summed into each int32 lane, 64 multiply-adds per instruction. x is quantized
 * per row and per group of 32 to int8 (symmetric, scale max|x_g| / 127: vpdpbusd's signed
 * operand, broadcast from memory), so a group's sum is exact in int32 (32 * 15 * 127 < 2^31);
 * the offset's share is m * sum(x_g), from the group's precomputed (quantized) sum. Per group,
 * row and 16 columns: acc = sum(xq * U); y += float(acc) * (s * x_scale) + m * (x_scale *
 * sum(xq)), in float32. Per-group x scales follow the weight's groups, so one outlier in x
 * costs precision in its own group only. The bound this gives against x @ W'.T in exact
 * arithmetic is in tests/engine/test_quant_int4.py.
 *
 * Packing: wq [N / 16, K / 8, 16, 4] uint8 (quant_int4.pack_int4), ws [N / 16, K / 32, 2, 16]
 * float16: per group the 16 columns' scales, then their offsets (pack_int4_scales). Threads
 * split the N blocks (NV vectors each), as in gemm_w8.c.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define W4_MR 4     /* rows per register tile */
#define W4_NV 4     /* 16-column vectors per tile: 16 float32 sums + 8 weight vectors */
#define W4_GROUP 32 /* input channels per scale (quant_int4.GROUP) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __m256i round_bf16x16_w4(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* One mr x (nv * 16) tile over all groups. xq: mr rows of k int8 (xs apart); xscale / xsumf:
 * per row (groups apart) the group's x scale and its sum; wb: the first of nv N blocks (ps
 * bytes apart); sb: their scales and offsets (ss halves apart). */
static inline __attribute__((always_inline)) void tile_w4(
    const int8_t *xq, int64_t xs, const float *xscale, const float *xsumf, int64_t groups,
    int mr, const uint8_t *wb, int64_t ps, const uint16_t *sb, int64_t ss, int nv,
    const uint16_t *bias, uint16_t *y, int64_t ys) {
    __m512 accf[W4_MR][W4_NV];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nv; j++) accf[r][j] = _mm512_setzero_ps();
    const __m512i lo_mask = _mm512_set1_epi8(0x0f), hi_mask = _mm512_set1_epi8((char)0xf0);
    for (int64_t g = 0; g < groups; g++) {
        for (int j = 0; j < nv; j++) {
            const uint8_t *wp = wb + j * ps + g * (W4_GROUP / 8) * 64;
            /* High nibbles stay in place (16 x their value): one AND each, no shift; their
             * sum is 16 x the true one, shifted back once per group (exact). */
            __m512i lo[4], hi[4];
            for (int o = 0; o < 4; o++) {
                __m512i v = _mm512_loadu_si512((const void *)(wp + o * 64));
                lo[o] = _mm512_and_si512(v, lo_mask);
                hi[o] = _mm512_and_si512(v, hi_mask);
            }
            const uint16_t *sg = sb + j * ss + g * 32; /* 16 scales, then 16 offsets */
            __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)sg));
            __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(sg + 16)));
            for (int r = 0; r < mr; r++) {
                const int8_t *xr = xq + r * xs + g * W4_GROUP;
                /* Two independent chains (low and high nibbles) halve the dependency chain of
                 * a group's sum: at one row that chain, not memory, bounded the loop. */
                __m512i acc = _mm512_setzero_si512();
                __m512i acc16 = _mm512_setzero_si512();
                for (int o = 0; o < 4; o++) {
                    acc = _mm512_dpbusd_epi32(acc, lo[o], bcast4(xr + 8 * o));
                    acc16 = _mm512_dpbusd_epi32(acc16, hi[o], bcast4(xr + 8 * o + 4));
                }
                acc = _mm512_add_epi32(acc, _mm512_srai_epi32(acc16, 4));
                __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(xscale[r * groups + g]));
                accf[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale, accf[r][j]);
                accf[r][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsumf[r * groups + g]), accf[r][j]);
            }
        }
    }
    for (int j = 0; j < nv; j++) {
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(bias + j * 16))), 16));
        for (int r = 0; r < mr; r++)
            _mm256_storeu_si256((void *)(y + r * ys + j * 16),
                                round_bf16x16_w4(_mm512_add_ps(accf[r][j], b)));
    }
}

/* Constant mr and nv per call site, so the tile's loops unroll into registers. */
#define W4_TILE(MR, NV)                                                                        \
    tile_w4(xq + r0 * xs, xs, xscale + r0 * groups, xsumf + r0 * groups, groups, (MR), wb, ps,  \
            sb, ss, (NV), bias, y + r0 * ys, ys)
#define W4_ROWS(NV)                                                                            \
    do {                                                                                       \
        int64_t r0 = 0;                                                                        \
        for (; r0 + W4_MR <= m; r0 += W4_MR) W4_TILE(W4_MR, NV);                               \
        switch (m - r0) {                                                                      \
        case 1: W4_TILE(1, NV); break;                                                         \
        case 2: W4_TILE(2, NV); break;                                                         \
        case 3: W4_TILE(3, NV); break;                                                         \
        default: break;                                                                        \
        }                                                                                      \
    } while (0)

static void block_w4(int nv, const int8_t *xq, int64_t xs, const float *xscale,
                     const float *xsumf, int64_t groups, int64_t m, const uint8_t *wb,
                     int64_t ps, const uint16_t *sb, int64_t ss, const uint16_t *bias,
                     uint16_t *y, int64_t ys) {
    switch (nv) {
    case 1: W4_ROWS(1); break;
    case 2: W4_ROWS(2); break;
    case 3: W4_ROWS(3); break;
    default: W4_ROWS(4); break;
    }
}

/* Quantize x [m, k] bfloat16 (rows x_stride apart) per row and group of 32 to int8 (xq [m, k]):
 * xscale[r, g] = max|x| / 127 over the group (1 for an all-zero group), xsumf = xscale * sum(xq).
 * Two vectors a group: done scalar this cost more than the products it feeds from ~8 rows on.
 * The same float32 operations as a scalar loop (x * inv, nearest even, clamped to +-127). */
static void quantize_rows_i8(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                             int8_t *xq, float *xscale, float *xsumf) {
    int64_t groups = k / W4_GROUP;
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * x_stride;
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *xg = row + g * W4_GROUP;
            __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)xg)), 16));
            __m512 v1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(xg + 16))), 16));
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            float s = amax > 0.0f ? amax / 127.0f : 1.0f;
            __m512 inv = _mm512_set1_ps(1.0f / s);
            __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q0 = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, q0));
            q1 = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, q1));
            int8_t *q = xq + r * k + g * W4_GROUP;
            _mm_storeu_si128((void *)q, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((void *)(q + 16), _mm512_cvtepi32_epi8(q1));
            int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            xscale[r * groups + g] = s;
            xsumf[r * groups + g] = s * (float)sum; /* x_g's sum as quantized */
        }
    }
}
#endif

/* x [m, k] bfloat16 (rows x_stride elements apart), m >= 1; wq [n_out / 16, k / 8, 16, 4]
 * uint8 and ws [n_out / 16, k / 32, 2, 16] float16 (see above); bias [n_out] bfloat16 or NULL;
 * y [m, n_out] bfloat16 contiguous. Returns 0, -1 out of memory, -2 for n_out not a multiple
 * of 16, k not of 32, or a build without AVX512-VNNI (callers keep their torch path). */
int gemm_w4_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *wq,
                 const uint16_t *ws, const uint16_t *bias, int64_t n_out, int64_t k,
                 uint16_t *y) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (n_out % 16 != 0 || k % W4_GROUP != 0 || m < 1 || k < 1) return -2;
    int64_t groups = k / W4_GROUP;
    int8_t *xq = malloc((size_t)(m * k));
    float *xscale = malloc(sizeof(float) * (size_t)(m * groups));
    float *xsumf = malloc(sizeof(float) * (size_t)(m * groups));
    if (!xq || !xscale || !xsumf) {
        free(xq), free(xscale), free(xsumf);
        return -1;
    }
    quantize_rows_i8(x, x_stride, m, k, xq, xscale, xsumf);
    int64_t ps = k * 8;       /* bytes per 16-column block: 16 columns x k / 2 */
    int64_t ss = groups * 32; /* scales and offsets per 16-column block */
    int64_t vecs = n_out / 16, nblocks = (vecs + W4_NV - 1) / W4_NV;
#pragma omp parallel for schedule(static) if (m * n_out * k >= (1 << 19))
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t v0 = b * W4_NV;
        int nv = (int)(vecs - v0 < W4_NV ? vecs - v0 : W4_NV);
        block_w4(nv, xq, k, xscale, xsumf, groups, m, wq + v0 * ps, ps, ws + v0 * ss, ss,
                 bias ? bias + v0 * 16 : NULL, y + v0 * 16, n_out);
    }
    free(xq), free(xscale), free(xsumf);
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)wq, (void)ws, (void)bias, (void)n_out, (void)k;
    (void)y;
    return -2;
#endif
}

/* 1 when this build has the kernel (AVX512-VNNI), else 0. */
int gemm_w4_available(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

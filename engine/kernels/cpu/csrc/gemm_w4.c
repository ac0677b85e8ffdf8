/* Weight-only int4 products y = x @ W'.T (+ b) for decode steps, AVX512-VNNI (--quantization
 * int4; engine/model/quant_int4.py has the scheme: W' = s * U + m, U in 0..15, one float16
 * scale s and offset m per 32 input channels and output column).
 *
 * A decode step reads every weight once, so 4 bits a weight is the point; the cost to avoid is
 * turning nibbles into something a multiply takes. Here a 64-byte load of packed weights splits
 * with an AND and a shift-and-AND into two vectors of unsigned 4-bit values, which are
 * vpdpbusd's unsigned byte operand directly: 4 byte products summed into each int32 lane, 64
 * multiply-adds per instruction. x is quantized per row and per group of 32 to int8 (x_quant.h:
 * symmetric, scale max|x_g| / 127: vpdpbusd's signed operand, broadcast from memory), so a
 * group's sum is exact in int32 (32 * 15 * 127 < 2^31); the offset's share is m * sum(x_g),
 * from the group's precomputed (quantized) sum. Per group, row and 16 columns: acc = sum(xq *
 * U); y += float(acc) * (s * x_scale) + m * (x_scale * sum(xq)), in float32. Per-group x scales follow the weight's groups, so one outlier in x
 * costs precision in its own group only. The bound this gives against x @ W'.T in exact
 * arithmetic is in tests/engine/test_quant_int4.py.
 *
 * Packing: wq [N / 16, K / 8, 16, 4] uint8 (quant_int4.pack_int4), ws [N / 16, K / 32, 2, 16]
 * float16: per group the 16 columns' scales, then their offsets (pack_int4_scales). Threads
 * split the N blocks (NV vectors each), as in gemm_w8.c; a tile runs one group at a time.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "x_quant.h"

/* gemm_w8.c's tile shape: 12 int32 + 12 float32 sums + 4 nibble vectors in registers (one
 * Zen 5 core, SmolLM2's gate_up at 32 rows: 285 GMAC/s; 4 x 4 238; bf16's tiles ~200). */
#define W4_MR 6     /* rows per register tile */
#define W4_NV 2     /* 16-column vectors per tile */
#define W4_GROUP 32 /* input channels per scale (quant_int4.GROUP) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

/* One mr x (nv * 16) tile over all groups. xq: mr rows of k int8 (xs apart); xscale / xsumf:
 * per row (groups apart) the group's x scale and its sum; wb: the first of nv N blocks (ps
 * bytes apart); sb: their scales and offsets (ss halves apart). Each 64-byte load of 8 K per
 * column splits into low nibbles (K 0-3) and high ones shifted down (K 4-7), both multiplied
 * into the same int32 sums, which live for one group (the w8 tile's shape and loop order:
 * with every nibble vector of a group loaded up front, the tile did not fit the registers). */
static inline __attribute__((always_inline)) void tile_w4(
    const int8_t *xq, int64_t xs, const float *xscale, const float *xsumf, int64_t groups,
    int mr, const uint8_t *wb, int64_t ps, const uint16_t *sb, int64_t ss, int nv,
    const uint16_t *bias, uint16_t *y, int64_t ys) {
    __m512 accf[W4_MR][W4_NV];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nv; j++) accf[r][j] = _mm512_setzero_ps();
    const __m512i lo_mask = _mm512_set1_epi8(0x0f);
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[W4_MR][W4_NV];
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < nv; j++) acc[r][j] = _mm512_setzero_si512();
        const uint8_t *wg = wb + g * (W4_GROUP / 8) * 64;
        if (mr == 2) /* fetch each stream two groups ahead (one row: the hardware's prefetch
                      * alone is faster, 2.2 against 2.5 ms a step, bench/quant_matmul.py) */
            for (int j = 0; j < nv; j++)
                for (int l = 0; l < 4; l++)
                    _mm_prefetch((const char *)(wg + j * ps + (8 + l) * 64), _MM_HINT_T0);
        for (int o = 0; o < W4_GROUP / 8; o++) {
            __m512i lo[W4_NV], hi[W4_NV];
            for (int j = 0; j < nv; j++) {
                __m512i v = _mm512_loadu_si512((const void *)(wg + j * ps + o * 64));
                lo[j] = _mm512_and_si512(v, lo_mask);
                hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo_mask);
            }
            for (int r = 0; r < mr; r++) {
                const int8_t *xr = xq + r * xs + g * W4_GROUP + 8 * o;
                __m512i a = bcast4(xr), b = bcast4(xr + 4);
                for (int j = 0; j < nv; j++) {
                    acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], lo[j], a);
                    acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], hi[j], b);
                }
            }
        }
        for (int j = 0; j < nv; j++) {
            const uint16_t *sg = sb + j * ss + g * 32; /* 16 scales, then 16 offsets */
            __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)sg));
            __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(sg + 16)));
            for (int r = 0; r < mr; r++) {
                __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(xscale[r * groups + g]));
                accf[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][j]), scale, accf[r][j]);
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
                                round_bf16x16(_mm512_add_ps(accf[r][j], b)));
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
        case 4: W4_TILE(4, NV); break;                                                         \
        case 5: W4_TILE(5, NV); break;                                                         \
        default: break;                                                                        \
        }                                                                                      \
    } while (0)

static void block_w4(int nv, const int8_t *xq, int64_t xs, const float *xscale,
                     const float *xsumf, int64_t groups, int64_t m, const uint8_t *wb,
                     int64_t ps, const uint16_t *sb, int64_t ss, const uint16_t *bias,
                     uint16_t *y, int64_t ys) {
    if (nv == 1)
        W4_ROWS(1);
    else
        W4_ROWS(2);
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
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)(m * groups));
    if (!xq || !xscale || !xsumf || !xsum) {
        free(xq), free(xscale), free(xsumf), free(xsum);
        return -1;
    }
    quantize_x_groups(x, x_stride, m, k, groups, xq, xscale, xsum);
    for (int64_t i = 0; i < m * groups; i++) /* x_g's sum as quantized, times its scale */
        xsumf[i] = xscale[i] * (float)xsum[i];
    int64_t ps = k * 8;       /* bytes per 16-column block: 16 columns x k / 2 */
    int64_t ss = groups * 32; /* scales and offsets per 16-column block */
    /* One row: tiles of one vector, one sequential stream per thread (gemm_w8.c; a SmolLM2
     * step's int4 layer products, two threads, Zen 5: 1.29-1.42 ms against 1.53-1.60). */
    int64_t nvt = m == 1 ? 1 : W4_NV;
    int64_t vecs = n_out / 16, nblocks = (vecs + nvt - 1) / nvt;
#pragma omp parallel for schedule(static) if (m * n_out * k >= (1 << 19) || n_out * k >= (1 << 17))
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t v0 = b * nvt;
        int nv = (int)(vecs - v0 < nvt ? vecs - v0 : nvt);
        block_w4(nv, xq, k, xscale, xsumf, groups, m, wq + v0 * ps, ps, ws + v0 * ss, ss,
                 bias ? bias + v0 * 16 : NULL, y + v0 * 16, n_out);
    }
    free(xq), free(xscale), free(xsumf), free(xsum);
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

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

/* Tile 4 rows x 3 vectors (12 int32 sums): GCC 12 spills a 6 x 4 int32 tile inside the K
 * loop (104 against 159 GMAC/s at 32 rows, one Zen 5 core; bf16's 8 x 3 tile: ~210). */
#define W8_MR 4 /* rows per register tile */
#define W8_NV 3 /* 16-column vectors per tile */
#define W8_PF_PAIRS 32 /* 1 KB ahead per stream at 1-2 rows: +10% on the LM head, one core */
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

/* Pairs p0..p1 of one mr x (nv * 16) tile, added into sums (W8_MR * W8_NV * 16 float32, set
 * when p0 is 0). xq: mr rows of int16 pairs (xs elements apart); wb: the first of nv N blocks
 * (ps bytes apart). Only the int32 tile lives in registers here: with the float32 sums beside
 * it (48 vectors) the compiler spilled or shuffled the int32 ones inside the K loop, at 2-3x
 * the cost from 8 rows on. */
static inline __attribute__((always_inline)) void chunk_w8(const int16_t *xq, int64_t xs, int mr,
                                                          const int8_t *wb, int64_t ps, int nv,
                                                          int64_t p0, int64_t p1, float *sums) {
    /* At 1-2 rows the tile is too few independent sums to hide vpdpwssd's latency: there odd
     * pairs go to a second set (ways = 2), added at the end. */
    enum { WAYS_MAX = 2 };
    const int ways = mr <= 2 ? 2 : 1;
    __m512i acc[WAYS_MAX][W8_MR][W8_NV];
    for (int u = 0; u < ways; u++)
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < nv; j++) acc[u][r][j] = _mm512_setzero_si512();
    int64_t p = p0;
    for (; p + ways <= p1; p += ways) {
        if (mr <= 2) /* memory-bound here: fetch each stream W8_PF_PAIRS pairs ahead */
            for (int j = 0; j < nv; j++)
                _mm_prefetch((const char *)(wb + j * ps + (p + W8_PF_PAIRS) * 32), _MM_HINT_T0);
        for (int u = 0; u < ways; u++) {
            __m512i w[W8_NV];
            for (int j = 0; j < nv; j++)
                w[j] = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const void *)(wb + j * ps + (p + u) * 32)));
            for (int r = 0; r < mr; r++) {
                int32_t pair;
                memcpy(&pair, xq + r * xs + 2 * (p + u), sizeof pair);
                __m512i a = _mm512_set1_epi32(pair);
                for (int j = 0; j < nv; j++)
                    acc[u][r][j] = _mm512_dpwssd_epi32(acc[u][r][j], a, w[j]);
            }
        }
    }
    for (; p < p1; p++) { /* an odd pair left at ways = 2 */
        __m512i w[W8_NV];
        for (int j = 0; j < nv; j++)
            w[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)(wb + j * ps + p * 32)));
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, xq + r * xs + 2 * p, sizeof pair);
            __m512i a = _mm512_set1_epi32(pair);
            for (int j = 0; j < nv; j++) acc[0][r][j] = _mm512_dpwssd_epi32(acc[0][r][j], a, w[j]);
        }
    }
    for (int u = 1; u < ways; u++)
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < nv; j++) acc[0][r][j] = _mm512_add_epi32(acc[0][r][j], acc[u][r][j]);
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nv; j++) {
            float *sp = sums + (r * W8_NV + j) * 16;
            __m512 f = _mm512_cvtepi32_ps(acc[0][r][j]);
            _mm512_storeu_ps(sp, p0 ? _mm512_add_ps(_mm512_loadu_ps(sp), f) : f);
        }
}

/* One out-of-line chunk function per tile shape: the K loop compiled on its own. */
#define W8_CHUNK_NAME(MR, NV) W8_CHUNK_NAME_(MR, NV) /* MR expanded first (W8_MR) */
#define W8_CHUNK_NAME_(MR, NV) chunk_w8_##MR##_##NV
typedef void (*chunk_fn)(const int16_t *, int64_t, const int8_t *, int64_t, int64_t, int64_t,
                         float *);
#define W8_CHUNK_FN(MR, NV)                                                                    \
    static __attribute__((noinline)) void chunk_w8_##MR##_##NV(                                \
        const int16_t *xq, int64_t xs, const int8_t *wb, int64_t ps, int64_t p0, int64_t p1,    \
        float *sums) {                                                                         \
        chunk_w8(xq, xs, (MR), wb, ps, (NV), p0, p1, sums);                                    \
    }
#define W8_CHUNK_FNS(MR) W8_CHUNK_FN(MR, 1) W8_CHUNK_FN(MR, 2) W8_CHUNK_FN(MR, 3)
W8_CHUNK_FNS(1)
W8_CHUNK_FNS(2)
W8_CHUNK_FNS(3)
W8_CHUNK_FNS(4)

/* One mr x (nv * 16) tile over all K pairs (chunk: its chunk_w8_MR_NV); ws: nv * 16 weight
 * scales; sums: scratch as in chunk_w8. */
static inline __attribute__((always_inline)) void tile_w8(
    const int16_t *xq, int64_t xs, const float *xscale, int mr, const int8_t *wb, int64_t ps,
    int nv, int64_t pairs, const float *ws, const uint16_t *bias, uint16_t *y, int64_t ys,
    float *sums, chunk_fn chunk) {
    for (int64_t p0 = 0; p0 < pairs; p0 += W8_FLUSH)
        chunk(xq, xs, wb, ps, p0, p0 + W8_FLUSH < pairs ? p0 + W8_FLUSH : pairs, sums);
    for (int j = 0; j < nv; j++) {
        __m512 s = _mm512_loadu_ps(ws + j * 16);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(bias + j * 16))), 16));
        for (int r = 0; r < mr; r++) {
            __m512 sum = _mm512_loadu_ps(sums + (r * W8_NV + j) * 16);
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(sum, _mm512_set1_ps(xscale[r])), s);
            _mm256_storeu_si256((void *)(y + r * ys + j * 16), round_bf16x16_w8(_mm512_add_ps(v, b)));
        }
    }
}

/* Constant mr and nv per call site, so the tile's loops unroll into registers. */
#define W8_TILE(MR, NV)                                                                        \
    tile_w8(xq + r0 * xs, xs, xscale + r0, (MR), wb, ps, (NV), pairs, ws, bias, y + r0 * ys, ys, \
            sums, W8_CHUNK_NAME(MR, NV))
#define W8_ROWS(NV)                                                                            \
    do {                                                                                       \
        int64_t r0 = 0;                                                                        \
        for (; r0 + W8_MR <= m; r0 += W8_MR) W8_TILE(W8_MR, NV);                               \
        switch (m - r0) {                                                                      \
        case 1: W8_TILE(1, NV); break;                                                         \
        case 2: W8_TILE(2, NV); break;                                                         \
        case 3: W8_TILE(3, NV); break;                                                         \
        default: break;                                                                        \
        }                                                                                      \
    } while (0)

static void block_w8(int nv, const int16_t *xq, int64_t xs, const float *xscale, int64_t m,
                     const int8_t *wb, int64_t ps, int64_t pairs, const float *ws,
                     const uint16_t *bias, uint16_t *y, int64_t ys, float *sums) {
    switch (nv) {
    case 1: W8_ROWS(1); break;
    case 2: W8_ROWS(2); break;
    default: W8_ROWS(3); break;
    }
}

/* Quantize x [m, k] bfloat16 (rows x_stride apart) per row to int16 (xq [m, 2 * pairs], a zero
 * column padding an odd k) with xscale[r] = max|x_r| / 32767 (1 for an all-zero row).
 * Vectorized, 16 values at a time: done scalar it cost more than the products it feeds from
 * ~8 rows on (it runs once per product, on one thread). The same float32 operations as the
 * scalar form (x * inv, rounded to nearest even, clamped), so the same integers. */
static void quantize_rows_i16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                              int64_t pairs, int16_t *xq, float *xscale) {
    const __m512i lim = _mm512_set1_epi32(32767), nlim = _mm512_set1_epi32(-32767);
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * x_stride;
        __m512 amaxv = _mm512_setzero_ps();
        for (int64_t i = 0; i < k; i += 16) {
            __mmask16 mk = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, row + i)), 16));
            amaxv = _mm512_max_ps(amaxv, _mm512_abs_ps(v));
        }
        float amax = _mm512_reduce_max_ps(amaxv);
        float s = amax > 0.0f ? amax / 32767.0f : 1.0f;
        __m512 inv = _mm512_set1_ps(1.0f / s);
        int16_t *q = xq + r * 2 * pairs;
        for (int64_t i = 0; i < k; i += 16) {
            __mmask16 mk = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, row + i)), 16));
            __m512i n = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v, inv),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            n = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, n));
            _mm256_mask_storeu_epi16(q + i, mk, _mm512_cvtepi32_epi16(n));
        }
        if (k & 1) q[k] = 0;
        xscale[r] = s;
    }
}
#endif

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
        float sums[W8_MR * W8_NV * 16]; /* memory the out-of-line chunks add into */
        block_w8(nv, xq, xs, xscale, m, wq + v0 * ps, ps, pairs, ws + v0 * 16,
                 bias ? bias + v0 * 16 : NULL, y + v0 * 16, n_out, sums);
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

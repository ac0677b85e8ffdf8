/* bfloat16 products y = x @ W.T (+ b) for batched decode steps (3-128 rows), on AVX512_BF16.
 *
 * At these row counts the product is compute-bound but too short for oneDNN's blocking to reach
 * the core's vdpbf16ps rate (it does at thousands of rows). vdpbf16ps multiplies pairs of
 * adjacent-K bfloat16 values and adds both products into one float32 lane, so W is packed as
 * wp [N / 16, P, 16, 2] with P = ceil(K / 2): for 16 output columns, each K pair is one 64-byte
 * vector (an odd K is padded with a zero weight). A register tile of MR rows x NV vectors holds
 * MR * NV float32 accumulators; each K pair loads NV weight vectors and broadcasts each row's
 * x pair (one 32-bit load), so a weight vector serves MR rows and an x pair NV vectors.
 *
 * Threads split the N blocks (NV vectors each); a thread runs every row block against one N
 * block before moving on, so that block's weight panel (NV * P * 64 bytes, 55 KB at K = 576)
 * is read from memory once and from L2 for the other row blocks. Sums are float32 (the pair
 * products are exact; the hardware flushes denormals); the result, plus the bias, is rounded to
 * bfloat16 once, nearest even, as gemv.c rounds.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* Tile shapes tried (bench/cpu_gemm.py), rows x 16-column vectors: 8x3 (the default), 4x6,
 * 6x4, 12x2, all 24 accumulators; this is the vector count of each. */
static const int BLOCK_NV[] = {3, 6, 4, 2};
#define NUM_BLOCKINGS 4

static inline __m512i load_pair(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32((int)v);
}

/* One MR x (NV * 16) tile over all of K (MR, NV constants once inlined).
 * x: MR rows (xs elements apart); wb: the first of NV N blocks (ps elements apart). */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t xs, int mr,
                                                       const uint16_t *wb, int64_t ps, int nv,
                                                       int64_t k, const uint16_t *bias,
                                                       uint16_t *y, int64_t ys, const char *pf,
                                                       int64_t pf_lines, int pf_step) {
    __m512 acc[12][6];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nv; j++) acc[r][j] = _mm512_setzero_ps();
    int64_t pairs = k / 2;
    for (int64_t p = 0; p < pairs; p++) {
        /* Prefetch this tile's share of the next N block's panel into L2, so the memory
         * stream is spread over every row block instead of stalling the first one. */
        for (int q = 0; q < pf_step; q++) {
            int64_t line = p * pf_step + q;
            if (line < pf_lines) _mm_prefetch(pf + line * 64, _MM_HINT_T1);
        }
        __m512bh w[6];
        for (int j = 0; j < nv; j++)
            w[j] = (__m512bh)_mm512_loadu_si512((const void *)(wb + j * ps + p * 32));
        for (int r = 0; r < mr; r++) {
            __m512bh a = (__m512bh)load_pair(x + r * xs + 2 * p);
            for (int j = 0; j < nv; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w[j]);
        }
    }
    if (k & 1) { /* the last K alone: its pair's upper half is zero (so is the weight's) */
        for (int j = 0; j < nv; j++) {
            __m512bh w = (__m512bh)_mm512_loadu_si512((const void *)(wb + j * ps + pairs * 32));
            for (int r = 0; r < mr; r++) {
                __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[r * xs + k - 1]);
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w);
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
                                round_bf16x16(_mm512_add_ps(acc[r][j], b)));
    }
}

/* Every row of x against one N block of NV vectors: full MR-row tiles, then one tile of the
 * remaining rows. Row block i prefetches the i-th share of the next block's panel. */
#define TILE(R, MR, NV)                                                                        \
    tile(x + r0 * xs, xs, (R), wb, ps, (NV), k, bias, y + r0 * ys, ys,                         \
         pf + (r0 / (MR)) * pf_chunk * 64, pf_lines - (r0 / (MR)) * pf_chunk, pf_step)
#define TAIL(R, MR, NV)                                                                        \
    case R:                                                                                    \
        if ((MR) > (R)) TILE(R, MR, NV);                                                       \
        break;
#define ROWS(MR, NV)                                                                           \
    do {                                                                                       \
        int64_t r0 = 0, row_blocks = (m + (MR) - 1) / (MR);                                    \
        int64_t pf_chunk = (pf_lines + row_blocks - 1) / row_blocks;                           \
        int pf_step = k / 2 > 0 ? (int)((pf_chunk + k / 2 - 1) / (k / 2)) : 0;                 \
        for (; r0 + (MR) <= m; r0 += (MR)) TILE(MR, MR, NV);                                   \
        switch (m - r0) {                                                                      \
            TAIL(1, MR, NV) TAIL(2, MR, NV) TAIL(3, MR, NV) TAIL(4, MR, NV) TAIL(5, MR, NV)    \
            TAIL(6, MR, NV) TAIL(7, MR, NV) TAIL(8, MR, NV) TAIL(9, MR, NV) TAIL(10, MR, NV)   \
            TAIL(11, MR, NV) default: break;                                                   \
        }                                                                                      \
    } while (0)

/* One blocking (MR rows x NV_FULL vectors); nv < NV_FULL is the last, narrower N block. */
#define NV_CASE(MR, NV_FULL, NV)                                                               \
    case NV:                                                                                   \
        if ((NV_FULL) >= (NV)) ROWS(MR, NV);                                                   \
        break;
#define BLOCKING(MR, NV_FULL)                                                                  \
    switch (nv) {                                                                              \
        NV_CASE(MR, NV_FULL, 1) NV_CASE(MR, NV_FULL, 2) NV_CASE(MR, NV_FULL, 3)                \
        NV_CASE(MR, NV_FULL, 4) NV_CASE(MR, NV_FULL, 5) NV_CASE(MR, NV_FULL, 6)                \
        default: break;                                                                        \
    }

static void rows_blocking(int blocking, int nv, const uint16_t *x, int64_t xs, int64_t m,
                          const uint16_t *wb, int64_t ps, int64_t k, const uint16_t *bias,
                          uint16_t *y, int64_t ys, const char *pf, int64_t pf_lines) {
    switch (blocking) { /* each case inlines every tile shape it needs (constants) */
    case 1: BLOCKING(4, 6); break;
    case 2: BLOCKING(6, 4); break;
    case 3: BLOCKING(12, 2); break;
    default: BLOCKING(8, 3); break;
    }
}
#endif

/* x [m, k] bfloat16 (rows x_stride elements apart), m >= 1; wp [n_out / 16, ceil(k / 2), 16, 2]
 * bfloat16 (see above); bias [n_out] bfloat16 or NULL; y [m, n_out] bfloat16 contiguous.
 * blocking: index into the tile shapes (0: 8 rows x 3 vectors). Returns 0, or -2 for an
 * unsupported shape or a CPU build without AVX512_BF16 (callers keep oneDNN). */
int gemm_packed_bf16_blocked(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *wp,
                             const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y,
                             int blocking) {
#if defined(__AVX512BF16__)
    if (n_out % 16 != 0 || m < 1 || k < 1 || blocking < 0 || blocking >= NUM_BLOCKINGS)
        return -2;
    int nv_full = BLOCK_NV[blocking];
    int64_t ps = (k + 1) / 2 * 32; /* elements per 16-column block */
    int64_t vecs = n_out / 16, nblocks = (vecs + nv_full - 1) / nv_full;
    /* A parallel region costs a few microseconds: only for products of ~1 MFLOP up. */
#pragma omp parallel for schedule(static) if (m * n_out * k >= (1 << 19))
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t v0 = b * nv_full;
        int nv = (int)(vecs - v0 < nv_full ? vecs - v0 : nv_full);
        /* The next block's panel: 64-byte lines, none past the end of wp. */
        int64_t next = v0 + nv_full < vecs ? v0 + nv_full : vecs;
        int64_t next_vecs = vecs - next < nv_full ? vecs - next : nv_full;
        rows_blocking(blocking, nv, x, x_stride, m, wp + v0 * ps, ps, k,
                      bias ? bias + v0 * 16 : NULL, y + v0 * 16, n_out,
                      (const char *)(wp + next * ps), next_vecs * ps * 2 / 64);
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)wp, (void)bias, (void)n_out, (void)k, (void)y;
    (void)blocking;
    return -2;
#endif
}

/* gemm_packed_bf16_blocked with the default blocking. */
int gemm_packed_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *wp,
                     const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y) {
    return gemm_packed_bf16_blocked(x, x_stride, m, wp, bias, n_out, k, y, 0);
}

/* 1 when this build has the kernel (AVX512_BF16), else 0. */
int gemm_packed_bf16_available(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* Rows from which the AMX tiles (gemm_amx.c) take a decode product where the CPU has them. */
#define AMX_MIN_ROWS 1

/* The decode step's product on the pair layout, for both the per-op and the fused path (one
 * choice, so both give the same bits): gemv.c's float32 FMA stream for 1-2 rows (memory-bound:
 * ~5-15% faster than the tiles there), from 3 rows the AMX tiles where the CPU has them and K
 * is a multiple of 32 (6-10x these tiles at 16-64 rows on Sapphire Rapids), else these tiles,
 * or gemv.c at any row count without AVX512_BF16 (AVX2 CPUs: four rows per pass over each
 * block). Same arguments as gemm_packed_bf16; -2 where none applies. */
int decode_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *wp,
                       const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y) {
    if (m >= AMX_MIN_ROWS && gemm_amx_bf16(x, x_stride, m, wp, bias, n_out, k, y) == 0) return 0;
    if (m <= 2 || !gemm_packed_bf16_available())
        return gemv_packed_bf16(x, x_stride, m, wp, bias, n_out, k, y);
    return gemm_packed_bf16(x, x_stride, m, wp, bias, n_out, k, y);
}

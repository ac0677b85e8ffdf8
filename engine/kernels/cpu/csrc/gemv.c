/* Skinny bfloat16 products y = x @ W.T (+ b) for the few-row decode steps, where the cost is
 * reading W once from memory: a batch-1 step of SmolLM2-135M reads ~270 MB of weights.
 *
 * W is packed as wp [N / 16, ceil(K / 2), 16, 2] (gemm_bf16.c's layout, so one copy serves both
 * kernels): each block of 16 output rows is one contiguous run in which every K pair holds those
 * 16 rows' weights side by side, so the whole product is one sequential stream (measured here, one core: 24-30 GB/s against oneDNN's 13-15 GB/s on its own
 * packed layout at one row) and the 16 sums of a block fill one vector register with no
 * horizontal adds. x is converted to float32 once; sums are float32; outputs are rounded to
 * bfloat16 (nearest even) once. Blocks are split over torch's OpenMP threads for big weights.
 *
 * Any number of rows: they go through each 16-column block four at a time, so the block is read
 * from memory once and from L1/L2 for the other groups. That is the decode product of CPUs
 * without the AVX512_BF16 tiles (gemm_bf16.c); on AVX2 (16 registers of 8 floats) the block is
 * written with AVX2 intrinsics (block16_avx2): GCC's lowering of the 16-float vector code there
 * ran at 4-13 GFLOP/s, a fifth of torch's float32 product.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

#define KU 4 /* K indices per step: independent accumulators hide the FMA latency */

/* One block of 16 output rows for M x rows (M a constant once inlined). */
static inline __attribute__((always_inline)) void block16(const float *xf, int64_t m,
                                                          const uint16_t *wb, int64_t k,
                                                          v16f *sums) {
    v16f a[4][KU];
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < KU; j++) a[r][j] = (v16f){0};
    int64_t i = 0;
    /* K index i sits in pair i / 2, which starts at wb + (i & ~1) * 16. */
    for (; i + KU <= k; i += KU) {
        v16f w[KU];
        load_bf16_pairs(wb + i * 16, &w[0], &w[1]);
        load_bf16_pairs(wb + i * 16 + 32, &w[2], &w[3]);
        for (int64_t r = 0; r < m; r++)
            for (int j = 0; j < KU; j++) a[r][j] += xf[r * k + i + j] * w[j];
    }
    for (; i < k; i++) {
        v16f even, odd;
        load_bf16_pairs(wb + (i & ~(int64_t)1) * 16, &even, &odd);
        v16f w = (i & 1) ? odd : even;
        for (int64_t r = 0; r < m; r++) a[r][0] += xf[r * k + i] * w;
    }
    for (int64_t r = 0; r < m; r++) sums[r] = (a[r][0] + a[r][1]) + (a[r][2] + a[r][3]);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* The same block for at most 4 rows on AVX2 (see the file's comment), in 8-float registers: a
 * pair's 64 bytes are columns 0-7 and 8-15, each 32-bit lane one column's (even K, odd K): the
 * even K's weights are the lane shifted left by 16, the odd K's the lane's high half. At 1-2
 * rows the even and odd K sum apart (more independent FMA chains); at 3-4 rows into one register
 * per row and half. */
/* One row's FMAs of one half of a K pair (W0, W1: columns 0-7 and 8-15, even or odd K). */
#define GEMV_FMA(A0, A1, XP)                                                                   \
    do {                                                                                       \
        __m256 x_ = _mm256_broadcast_ss(XP);                                                   \
        A0 = _mm256_fmadd_ps(x_, w0, A0);                                                      \
        A1 = _mm256_fmadd_ps(x_, w1, A1);                                                      \
    } while (0)

/* The even K of the pair at WP for every row (x of row 0 at XP): w0, w1 left holding its
 * weights. */
#define GEMV_EVEN(WP, XP)                                                                      \
    do {                                                                                       \
        w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(WP), 16));               \
        w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((WP) + 1), 16));         \
        GEMV_FMA(a00, a01, (XP));                                                              \
        if (m > 1) GEMV_FMA(a10, a11, (XP) + k);                                               \
        if (m > 2) GEMV_FMA(a20, a21, (XP) + 2 * k);                                           \
        if (m > 3) GEMV_FMA(a30, a31, (XP) + 3 * k);                                           \
    } while (0)

static inline __attribute__((always_inline)) void store_sums_avx2(__m256 lo, __m256 hi,
                                                                  v16f *sum) {
    float out[16];
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
    memcpy(sum, out, sizeof out);
}

/* The sums are named registers, not arrays, and each K pair is taken in two halves (the even
 * K's weights, then the odd K's, loaded again from L1), so 8 sums, 2 weights, one x and the
 * mask fit the 16 registers: with arrays of sums and both halves live GCC kept the sums on the
 * stack, loading and storing them at every K pair (as it did gemm_w8.c's AVX2 sums). At 1-2
 * rows the odd K sum apart (b..: more independent FMA chains); the sums add in the same order
 * either way as before this layout (even K, then odd K, pair by pair). */
static inline __attribute__((always_inline)) void block16_avx2(const float *xf, int64_t m,
                                                               const uint16_t *wb, int64_t k,
                                                               v16f *sums) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00, b00 = a00, b01 = a00, b10 = a00, b11 = a00;
    int64_t pairs = k / 2;
    for (int64_t p = 0; p < pairs; p++) {
        const __m256i *wp = (const __m256i *)(wb + p * 32);
        const float *xp = xf + 2 * p;
        __m256 w0, w1;
        GEMV_EVEN(wp, xp);
        w0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wp), hi));
        w1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wp + 1), hi));
        if (m <= 2) {
            GEMV_FMA(b00, b01, xp + 1);
            if (m > 1) GEMV_FMA(b10, b11, xp + k + 1);
        } else {
            GEMV_FMA(a00, a01, xp + 1);
            GEMV_FMA(a10, a11, xp + k + 1);
            GEMV_FMA(a20, a21, xp + 2 * k + 1);
            if (m > 3) GEMV_FMA(a30, a31, xp + 3 * k + 1);
        }
    }
    if (k & 1) {  /* the last pair's odd K is padding */
        __m256 w0, w1;
        GEMV_EVEN((const __m256i *)(wb + pairs * 32), xf + k - 1);
    }
    if (m <= 2) {
        a00 = _mm256_add_ps(a00, b00), a01 = _mm256_add_ps(a01, b01);
        a10 = _mm256_add_ps(a10, b10), a11 = _mm256_add_ps(a11, b11);
    }
    store_sums_avx2(a00, a01, &sums[0]);
    if (m > 1) store_sums_avx2(a10, a11, &sums[1]);
    if (m > 2) store_sums_avx2(a20, a21, &sums[2]);
    if (m > 3) store_sums_avx2(a30, a31, &sums[3]);
}
#define block16 block16_avx2
#endif

/* One function per row count: inlined together into one, GCC's register allocation kept the
 * AVX2 sums on the stack. */
#define GEMV_BLOCK_M(M)                                                                        \
    static __attribute__((noinline)) void block_m##M(const float *xf, const uint16_t *wb,     \
                                                     int64_t k, v16f *sums) {                 \
        block16(xf, M, wb, k, sums);                                                           \
    }
GEMV_BLOCK_M(1)
GEMV_BLOCK_M(2)
GEMV_BLOCK_M(3)
GEMV_BLOCK_M(4)

static void block_any(const float *xf, int64_t m, const uint16_t *wb, int64_t k, v16f *sums) {
    switch (m) {
    case 1: block_m1(xf, wb, k, sums); break;
    case 2: block_m2(xf, wb, k, sums); break;
    case 3: block_m3(xf, wb, k, sums); break;
    default: block_m4(xf, wb, k, sums); break;
    }
}

/* x [m, k] bfloat16 (rows x_stride elements apart), m >= 1; wp [n_out / 16, ceil(k / 2), 16, 2]
 * bfloat16 (see above); bias [n_out] bfloat16 or NULL; y [m, n_out] bfloat16 contiguous. n_out a
 * multiple of 16. Returns 0, -1 if out of memory, -2 for an unsupported shape. */
int gemv_packed_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *wp,
                     const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y) {
    if (n_out % 16 != 0 || m < 1) return -2;
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    if (!xf) return -1;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = bf16_to_f32(x[r * x_stride + i]);
    int64_t blocks = n_out / 16;
    /* A parallel region costs a few microseconds: only for weights of a few hundred KB up. */
#pragma omp parallel for schedule(static) if (n_out * k >= (1 << 18))
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            int64_t rows = m - r0 < 4 ? m - r0 : 4;
            v16f sums[4];
            block_any(xf + r0 * k, rows, wp + b * ((k + 1) / 2) * 32, k, sums);
            for (int64_t r = 0; r < rows; r++)
                for (int e = 0; e < 16; e++) {
                    float bb = bias ? bf16_to_f32(bias[b * 16 + e]) : 0.0f;
                    y[(r0 + r) * n_out + b * 16 + e] = f32_to_bf16(sums[r][e] + bb);
                }
        }
    }
    free(xf);
    return 0;
}

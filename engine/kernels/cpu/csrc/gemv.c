/* Skinny bfloat16 products y = x @ W.T (+ b) for the few-row decode steps, where the cost is
 * reading W once from memory: a batch-1 step of SmolLM2-135M reads ~270 MB of weights.
 *
 * W is packed as wp [N / 16, ceil(K / 2), 16, 2] (gemm_bf16.c's layout, so one copy serves both
 * kernels): each block of 16 output rows is one contiguous run in which every K pair holds those
 * 16 rows' weights side by side, so the whole product is one sequential stream (measured here, one core: 24-30 GB/s against oneDNN's 13-15 GB/s on its own
 * packed layout at one row) and the 16 sums of a block fill one vector register with no
 * horizontal adds. x is converted to float32 once; sums are float32; outputs are rounded to
 * bfloat16 (nearest even) once. Blocks are split over torch's OpenMP threads for big weights.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

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

static void block_any(const float *xf, int64_t m, const uint16_t *wb, int64_t k, v16f *sums) {
    switch (m) {
    case 1: block16(xf, 1, wb, k, sums); break;
    case 2: block16(xf, 2, wb, k, sums); break;
    case 3: block16(xf, 3, wb, k, sums); break;
    default: block16(xf, 4, wb, k, sums); break;
    }
}

/* x [m, k] bfloat16 (rows x_stride elements apart), 1 <= m <= 4; wp [n_out / 16, ceil(k / 2),
 * 16, 2] bfloat16 (see above); bias [n_out] bfloat16 or NULL; y [m, n_out] bfloat16 contiguous.
 * n_out a multiple of 16. Returns 0, -1 if out of memory, -2 for an unsupported shape. */
int gemv_packed_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *wp,
                     const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y) {
    if (n_out % 16 != 0 || m < 1 || m > 4) return -2;
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    if (!xf) return -1;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = bf16_to_f32(x[r * x_stride + i]);
    int64_t blocks = n_out / 16;
    /* A parallel region costs a few microseconds: only for weights of a few hundred KB up. */
#pragma omp parallel for schedule(static) if (n_out * k >= (1 << 18))
    for (int64_t b = 0; b < blocks; b++) {
        v16f sums[4];
        block_any(xf, m, wp + b * ((k + 1) / 2) * 32, k, sums);
        for (int64_t r = 0; r < m; r++)
            for (int e = 0; e < 16; e++) {
                float bb = bias ? bf16_to_f32(bias[b * 16 + e]) : 0.0f;
                y[r * n_out + b * 16 + e] = f32_to_bf16(sums[r][e] + bb);
            }
    }
    free(xf);
    return 0;
}

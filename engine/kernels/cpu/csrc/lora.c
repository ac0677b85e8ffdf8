/* LoRA products of one projection for the rows of a step that run under adapters, grouped by
 * adapter slot: Punica's SGMV (Chen et al., arXiv 2310.18547) on the CPU. Per row r of slot i:
 *   t = x[r] A_i^T              (float32, R values: the "shrink")
 *   y[r][off_s + c] += sum_j t[ro_s + j] * Bt_s[j][c]   for each slice s ("expand")
 * where A_i [R, K] stacks the A of every adapted module the projection fuses (q, k, v), and each
 * slice's Bt_s [r_s, n_s] is s * B^T of one module, writing its columns of y. t stays float32;
 * y is rounded to bfloat16 once, after the sum (the base product rounded it once before).
 *
 * Rows go in blocks of up to 4 so that each A and Bt vector is loaded once per block; blocks
 * are split over torch's OpenMP threads when there are enough rows.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

#define RB 4 /* rows per block */

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define LORA_AVX2 1 /* shrink and expand in AVX2 intrinsics (below) */
#endif

#ifndef LORA_AVX2

static inline float hsum(v16f v) {
    float s = 0.0f;
    for (int e = 0; e < 16; e++) s += v[e];
    return s;
}

/* t[r][j] = x[r] . a[j] for nb rows (x rows x_stride apart, gathered by idx). */
static void shrink(const uint16_t *x, int64_t x_stride, const int64_t *idx, int nb,
                   const uint16_t *a, int64_t rr, int64_t k, float t[RB][LORA_MAX_RANK]) {
    for (int64_t j = 0; j < rr; j++) {
        const uint16_t *w = a + j * k;
        v16f acc[RB];
        for (int r = 0; r < nb; r++) acc[r] = (v16f){0};
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) {
            v16f wv = load_bf16x16(w + i);
            for (int r = 0; r < nb; r++) acc[r] += load_bf16x16(x + idx[r] * x_stride + i) * wv;
        }
        for (int r = 0; r < nb; r++) {
            float s = hsum(acc[r]);
            for (int64_t q = i; q < k; q++)
                s += bf16_to_f32(x[idx[r] * x_stride + q]) * bf16_to_f32(w[q]);
            t[r][j] = s;
        }
    }
}

/* y[r][off + c] += sum_j t[r][ro + j] * bt[j][c], c < n, for nb rows. */
static void expand(const float t[RB][LORA_MAX_RANK], int nb, const uint16_t *bt, int64_t n,
                   int64_t ro, int64_t rank, uint16_t *y, int64_t y_stride, const int64_t *idx,
                   int64_t off) {
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        v16f acc[RB];
        for (int r = 0; r < nb; r++) acc[r] = (v16f){0};
        for (int64_t j = 0; j < rank; j++) {
            v16f bv = load_bf16x16(bt + j * n + c);
            for (int r = 0; r < nb; r++) acc[r] += t[r][ro + j] * bv;
        }
        for (int r = 0; r < nb; r++) {
            uint16_t *yr = y + idx[r] * y_stride + off + c;
            v16f sum = load_bf16x16(yr) + acc[r];
            for (int e = 0; e < 16; e++) yr[e] = f32_to_bf16(sum[e]);
        }
    }
    for (; c < n; c++)
        for (int r = 0; r < nb; r++) {
            float s = 0.0f;
            for (int64_t j = 0; j < rank; j++) s += t[r][ro + j] * bf16_to_f32(bt[j * n + c]);
            uint16_t *yr = y + idx[r] * y_stride + off + c;
            *yr = f32_to_bf16(bf16_to_f32(*yr) + s);
        }
}

#else
#include <immintrin.h>
/* AVX2 (16 registers of 8 floats): the same arithmetic as shrink and expand above, lane for lane
 * (each 16-float vector as two registers, the FMAs in the same order, the horizontal sum in lane
 * order), so the same bits; GCC's lowering of the 16-float vector code spills there (as
 * gemv.c's comment says). One function per row count (nbv), the sums in named registers. */
#define LORA_LOAD16(P, LO, HI) (LO = load_bf16x8(P), HI = load_bf16x8((P) + 8))

static inline float hsum16_avx2(__m256 lo, __m256 hi) {
    float v[16];
    _mm256_storeu_ps(v, lo);
    _mm256_storeu_ps(v + 8, hi);
    float s = 0.0f;
    for (int e = 0; e < 16; e++) s += v[e];
    return s;
}

#define LORA_SHRINK_ROW(R, L, H)                                                               \
    if (nbv > R) {                                                                              \
        __m256 xl, xh;                                                                         \
        LORA_LOAD16(x + idx[R] * x_stride + i, xl, xh);                                        \
        L = _mm256_fmadd_ps(xl, wl, L);                                                        \
        H = _mm256_fmadd_ps(xh, wh, H);                                                        \
    }
#define LORA_SHRINK_TAIL(R, L, H)                                                              \
    if (nbv > R) {                                                                              \
        float s = hsum16_avx2(L, H);                                                           \
        for (int64_t q = i; q < k; q++)                                                        \
            s += bf16_to_f32(x[idx[R] * x_stride + q]) * bf16_to_f32(w[q]);                    \
        t[R][j] = s;                                                                           \
    }
#define LORA_EXPAND_ROW(R, L, H)                                                               \
    if (nbv > R) {                                                                              \
        __m256 tv = _mm256_set1_ps(t[R][ro + j]);                                              \
        L = _mm256_fmadd_ps(tv, bl, L);                                                        \
        H = _mm256_fmadd_ps(tv, bh, H);                                                        \
    }
#define LORA_EXPAND_STORE(R, L, H)                                                             \
    if (nbv > R) {                                                                              \
        uint16_t *yr = y + idx[R] * y_stride + off + c;                                        \
        __m256 yl, yh;                                                                         \
        LORA_LOAD16(yr, yl, yh);                                                               \
        store_bf16x8(yr, _mm256_add_ps(yl, L));                                                \
        store_bf16x8(yr + 8, _mm256_add_ps(yh, H));                                            \
    }

#define LORA_AVX2_NB(NB)                                                                       \
    static __attribute__((noinline)) void shrink_avx2_##NB(                                   \
        const uint16_t *x, int64_t x_stride, const int64_t *idx, const uint16_t *a,           \
        int64_t rr, int64_t k, float t[RB][LORA_MAX_RANK]) {                                   \
        const int nbv = NB;                                                                    \
        for (int64_t j = 0; j < rr; j++) {                                                     \
            const uint16_t *w = a + j * k;                                                     \
            __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0,      \
                   l3 = l0, h3 = l0;                                                           \
            int64_t i = 0;                                                                     \
            for (; i + 16 <= k; i += 16) {                                                     \
                __m256 wl, wh;                                                                 \
                LORA_LOAD16(w + i, wl, wh);                                                    \
                LORA_SHRINK_ROW(0, l0, h0)                                                     \
                LORA_SHRINK_ROW(1, l1, h1)                                                     \
                LORA_SHRINK_ROW(2, l2, h2)                                                     \
                LORA_SHRINK_ROW(3, l3, h3)                                                     \
            }                                                                                  \
            LORA_SHRINK_TAIL(0, l0, h0)                                                        \
            LORA_SHRINK_TAIL(1, l1, h1)                                                        \
            LORA_SHRINK_TAIL(2, l2, h2)                                                        \
            LORA_SHRINK_TAIL(3, l3, h3)                                                        \
        }                                                                                      \
    }                                                                                          \
    static __attribute__((noinline)) void expand_avx2_##NB(                                   \
        const float t[RB][LORA_MAX_RANK], const uint16_t *bt, int64_t n, int64_t ro,          \
        int64_t rank, uint16_t *y, int64_t y_stride, const int64_t *idx, int64_t off) {       \
        const int nbv = NB;                                                                    \
        for (int64_t c = 0; c + 16 <= n; c += 16) {                                            \
            __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0,      \
                   l3 = l0, h3 = l0;                                                           \
            for (int64_t j = 0; j < rank; j++) {                                               \
                __m256 bl, bh;                                                                 \
                LORA_LOAD16(bt + j * n + c, bl, bh);                                           \
                LORA_EXPAND_ROW(0, l0, h0)                                                     \
                LORA_EXPAND_ROW(1, l1, h1)                                                     \
                LORA_EXPAND_ROW(2, l2, h2)                                                     \
                LORA_EXPAND_ROW(3, l3, h3)                                                     \
            }                                                                                  \
            LORA_EXPAND_STORE(0, l0, h0)                                                       \
            LORA_EXPAND_STORE(1, l1, h1)                                                       \
            LORA_EXPAND_STORE(2, l2, h2)                                                       \
            LORA_EXPAND_STORE(3, l3, h3)                                                       \
        }                                                                                      \
    }
LORA_AVX2_NB(1)
LORA_AVX2_NB(2)
LORA_AVX2_NB(3)
LORA_AVX2_NB(4)

/* shrink on AVX2, by row count. */
static void shrink_avx2(const uint16_t *x, int64_t x_stride, const int64_t *idx, int nb,
                        const uint16_t *a, int64_t rr, int64_t k, float t[RB][LORA_MAX_RANK]) {
    switch (nb) {
    case 1: shrink_avx2_1(x, x_stride, idx, a, rr, k, t); break;
    case 2: shrink_avx2_2(x, x_stride, idx, a, rr, k, t); break;
    case 3: shrink_avx2_3(x, x_stride, idx, a, rr, k, t); break;
    default: shrink_avx2_4(x, x_stride, idx, a, rr, k, t); break;
    }
}

/* expand on AVX2: the 16-column blocks by row count, the last columns as expand does them. */
static void expand_avx2(const float t[RB][LORA_MAX_RANK], int nb, const uint16_t *bt, int64_t n,
                        int64_t ro, int64_t rank, uint16_t *y, int64_t y_stride,
                        const int64_t *idx, int64_t off) {
    switch (nb) {
    case 1: expand_avx2_1(t, bt, n, ro, rank, y, y_stride, idx, off); break;
    case 2: expand_avx2_2(t, bt, n, ro, rank, y, y_stride, idx, off); break;
    case 3: expand_avx2_3(t, bt, n, ro, rank, y, y_stride, idx, off); break;
    default: expand_avx2_4(t, bt, n, ro, rank, y, y_stride, idx, off); break;
    }
    for (int64_t c = n - n % 16; c < n; c++)
        for (int r = 0; r < nb; r++) {
            float s = 0.0f;
            for (int64_t j = 0; j < rank; j++) s += t[r][ro + j] * bf16_to_f32(bt[j * n + c]);
            uint16_t *yr = y + idx[r] * y_stride + off + c;
            *yr = f32_to_bf16(bf16_to_f32(*yr) + s);
        }
}
#define shrink shrink_avx2
#define expand expand_avx2
#endif

/* One block of nb rows of one slot's entry e (LORA_F int64s: A, R, slices, then per slice
 * Bt, output offset, output size, rank offset, rank; see lora_sgmv_bf16). */
static void block(const uint16_t *x, int64_t x_stride, int64_t k, const int64_t *e,
                  const int64_t *idx, int nb, uint16_t *y, int64_t y_stride) {
    float t[RB][LORA_MAX_RANK];
    shrink(x, x_stride, idx, nb, (const uint16_t *)(uintptr_t)e[0], e[1], k, t);
    for (int64_t s = 0; s < e[2]; s++) {
        const int64_t *sl = e + 3 + 5 * s;
        expand((const float(*)[LORA_MAX_RANK])t, nb, (const uint16_t *)(uintptr_t)sl[0], sl[2],
               sl[3], sl[4], y, y_stride, idx, sl[1]);
    }
}

/* x [T, k] bfloat16 (rows x_stride apart, last dim contiguous); y [T, n] bfloat16 (rows
 * y_stride apart), updated in place. tab: this projection's entry of slot 0; slot i's is
 * tab + i * slot_stride (an entry with A = 0: the slot's adapter does not adapt this
 * projection). rows [N]: the adapted rows of T grouped by slot; segs [n_segs, 3]: (slot, start
 * in rows, count). Returns 0, -1 out of memory, -2 a rank above LORA_MAX_RANK. */
int lora_sgmv_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride,
                   int64_t k, const int64_t *tab, int64_t slot_stride, const int64_t *rows,
                   const int64_t *segs, int64_t n_segs) {
    int64_t n_blocks = 0;
    for (int64_t g = 0; g < n_segs; g++) {
        const int64_t *e = tab + segs[3 * g] * slot_stride;
        if (!e[0]) continue;
        if (e[1] > LORA_MAX_RANK) return -2;
        n_blocks += (segs[3 * g + 2] + RB - 1) / RB;
    }
    if (n_blocks == 0) return 0;
    /* (entry, first row index into rows, rows) per block */
    int64_t *blocks = malloc(sizeof(int64_t) * 3 * (size_t)n_blocks);
    if (!blocks) return -1;
    int64_t b = 0, n_rows = 0;
    for (int64_t g = 0; g < n_segs; g++) {
        const int64_t *e = tab + segs[3 * g] * slot_stride;
        if (!e[0]) continue;
        for (int64_t r = 0; r < segs[3 * g + 2]; r += RB, b++) {
            int64_t left = segs[3 * g + 2] - r;
            blocks[3 * b] = segs[3 * g] * slot_stride;
            blocks[3 * b + 1] = segs[3 * g + 1] + r;
            blocks[3 * b + 2] = left < RB ? left : RB;
            n_rows += blocks[3 * b + 2];
        }
    }
    /* A parallel region costs a few microseconds: only for several blocks of rows. */
#pragma omp parallel for schedule(static) if (n_blocks >= 2 && n_rows >= 8)
    for (int64_t i = 0; i < n_blocks; i++)
        block(x, x_stride, k, tab + blocks[3 * i], rows + blocks[3 * i + 1],
              (int)blocks[3 * i + 2], y, y_stride);
    free(blocks);
    return 0;
}

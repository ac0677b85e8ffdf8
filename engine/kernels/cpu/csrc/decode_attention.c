/* Fused single-pass decode attention on CPU, bfloat16 K/V, one new token per row.
 *
 * For each (row r, KV head h) task: the G = Hq / Hkv query heads of that KV head score the row's
 * keys 0..len-1 (only the last `window` of them with a sliding window), softmax, and weight the
 * values, all in float32 while the head's K/V are in L1/L2; the output is rounded to bfloat16
 * (round to nearest even, as torch rounds). Keys are stored transposed in tiles of KT_TILE = 32
 * positions ([cap / 32, D, 32] per slot and head, kernels.h), values [cap, D]: the layout of
 * splitserve.engine.attention.decode_kv_cache.DecodeKVCache's C mode. One block of 32 keys is
 * then one contiguous 4 KB run (D = 64) the hardware prefetcher follows; with keys [D, cap] it
 * was D rows of a few lines each, and at batch 32, ~175 keys, 30 layers the kernel read 13.8
 * GB/s against 19-20 tiled (8.3 -> 6.9 ms on 2 threads, 1.4x at 2k keys; Zen 4). Only
 * positions < len count, so no work goes into padding (a last partial block reads the rest of
 * its tile and drops those scores). With AVX512-BF16 the
 * scores come from vdpbf16ps (exact bfloat16 products, float32 sums): the score loop took
 * 25-29 us per layer against 46 us converting K to float32 first (batch 32, ~100 keys, in cache). Built with -O3 -march=native by splitserve.engine.cpu_kernels;
 * the other loops are written for the compiler's auto-vectorizer, except on AVX2 without
 * AVX-512, where the score and value loops and the softmax's exp are intrinsics on 8-float
 * registers (ATTN_AVX2; one layer at batch 32, ~190 keys, one Zen 3 core: 5.0 ms -> 0.31 ms).
 * Tasks are split over torch's OpenMP threads (same libgomp, loaded by soname) when the step
 * is big enough to pay for a parallel region.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "softmax.h"
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define ATTN_AVX2 1
#include <immintrin.h>
#endif

#define KB KT_TILE /* keys per register block of the score loop (one tile): two vectors of 16 */
#define GMAX 8 /* query heads per KV head that the register-blocked loops take */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Scores of KB keys (columns of kt, row stride `stride`) for G query heads: partial sums stay
 * in registers over all of D (G and D are constants once inlined). Writes `count` <= KB of them
 * per head to scores[g * n + j0 ...]. */
ALWAYS_INLINE void score_block(const float *qs, const uint16_t *kt, int64_t stride, int64_t g_n,
                               int64_t d_n, float *scores, int64_t n, int64_t j0,
                               int64_t count) {
    v16f acc[GMAX][2];
#pragma GCC unroll 8
    for (int64_t g = 0; g < g_n; g++) acc[g][0] = acc[g][1] = (v16f){0};
    for (int64_t d = 0; d < d_n; d++) {
        const uint16_t *krow = kt + d * stride;
        v16f k0 = load_bf16x16(krow), k1 = load_bf16x16(krow + 16);
#pragma GCC unroll 8
        for (int64_t g = 0; g < g_n; g++) {
            float qd = qs[g * d_n + d];
            acc[g][0] += qd * k0;
            acc[g][1] += qd * k1;
        }
    }
#pragma GCC unroll 8
    for (int64_t g = 0; g < g_n; g++) {
        float tmp[KB];
        memcpy(tmp, &acc[g][0], sizeof(v16f));
        memcpy(tmp + 16, &acc[g][1], sizeof(v16f));
        memcpy(scores + g * n + j0, tmp, sizeof(float) * (size_t)count);
    }
}

#if defined(__AVX512BF16__)
/* score_block with vdpbf16ps: rows d and d+1 of K are interleaved in registers into (d, d+1)
 * pairs per key, so one instruction multiplies-adds two dimensions of 16 keys for one query
 * head against its broadcast (q[d], q[d+1]) pair (exact bfloat16 products, float32 sums). The
 * interleave leaves keys in the order 0-3, 8-11, ... (lo) and 4-7, 12-15, ... (hi): one
 * two-source permute per 16 scores puts them back. Scores are scaled after the sums. */
ALWAYS_INLINE void score_block_dp(const uint16_t *q, const uint16_t *kt, int64_t stride,
                                  int64_t g_n, int64_t d_n, float scale, float *scores,
                                  int64_t n, int64_t j0, int64_t count) {
    __m512 lo[GMAX], hi[GMAX];
#pragma GCC unroll 8
    for (int64_t g = 0; g < g_n; g++) lo[g] = hi[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < d_n; d += 2) {
        const uint16_t *r0 = kt + d * stride, *r1 = r0 + stride;
        __m512i a = _mm512_loadu_si512(r0), b = _mm512_loadu_si512(r1);
        __m512bh plo = (__m512bh)_mm512_unpacklo_epi16(a, b);
        __m512bh phi = (__m512bh)_mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
        for (int64_t g = 0; g < g_n; g++) {
            int32_t pair;
            memcpy(&pair, q + g * d_n + d, sizeof pair);
            __m512bh qp = (__m512bh)_mm512_set1_epi32(pair);
            lo[g] = _mm512_dpbf16_ps(lo[g], plo, qp);
            hi[g] = _mm512_dpbf16_ps(hi[g], phi, qp);
        }
    }
    /* key f of the block: 128-bit lane L = f / 8 of lo (f % 8 < 4) or hi (index + 16) */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28,
                                             29, 30, 31);
    const __m512 s = _mm512_set1_ps(scale);
#pragma GCC unroll 8
    for (int64_t g = 0; g < g_n; g++) {
        float tmp[KB];
        _mm512_storeu_ps(tmp, _mm512_mul_ps(_mm512_permutex2var_ps(lo[g], first, hi[g]), s));
        _mm512_storeu_ps(tmp + 16,
                         _mm512_mul_ps(_mm512_permutex2var_ps(lo[g], second, hi[g]), s));
        memcpy(scores + g * n + j0, tmp, sizeof(float) * (size_t)count);
    }
}
#endif

#if defined(ATTN_AVX2)
/* AVX2 (16 registers of 8 floats): GCC lowers the 16-float vector code above badly there
 * (partial sums spilled and moved through general registers: 2.6 GFLOP/s at batch 32, ~190
 * keys, one Zen 3 core), so the score and value loops are written with intrinsics, in blocks
 * that fit the registers: 16 keys or 16 value columns (two registers) for up to 4 query heads
 * (8 registers of sums), more heads in a second pass over the same K/V (in L1/L2 by then). */
/* Scores of 16 keys (k + 0..15 of each K row) for query heads g0 .. g0 + gc - 1. */
ALWAYS_INLINE void score16_avx2(const float *qs, const uint16_t *kt, int64_t stride,
                                int64_t g0, int64_t gc, int64_t d_n, float out[][16]) {
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int64_t g = 0; g < gc; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < d_n; d++) {
        const uint16_t *krow = kt + d * stride;
        __m256 k0 = load_bf16x8(krow), k1 = load_bf16x8(krow + 8);
#pragma GCC unroll 4
        for (int64_t g = 0; g < gc; g++) {
            __m256 qd = _mm256_broadcast_ss(qs + (g0 + g) * d_n + d);
            acc[g][0] = _mm256_fmadd_ps(qd, k0, acc[g][0]);
            acc[g][1] = _mm256_fmadd_ps(qd, k1, acc[g][1]);
        }
    }
#pragma GCC unroll 4
    for (int64_t g = 0; g < gc; g++) {
        _mm256_storeu_ps(out[g0 + g], acc[g][0]);
        _mm256_storeu_ps(out[g0 + g] + 8, acc[g][1]);
    }
}

/* score_block's contract (KB keys, G heads, `count` stored per head) on AVX2. */
ALWAYS_INLINE void score_block_avx2(const float *qs, const uint16_t *kt, int64_t stride,
                                    int64_t g_n, int64_t d_n, float *scores, int64_t n,
                                    int64_t j0, int64_t count) {
    float tmp[GMAX][16];
    for (int64_t half = 0; half < KB && half < count; half += 16) {
        for (int64_t g0 = 0; g0 < g_n; g0 += 4)
            score16_avx2(qs, kt + half, stride, g0, g_n - g0 < 4 ? g_n - g0 : 4, d_n, tmp);
        int64_t c = count - half < 16 ? count - half : 16;
        for (int64_t g = 0; g < g_n; g++)
            memcpy(scores + g * n + j0 + half, tmp[g], sizeof(float) * (size_t)c);
    }
}

/* Value columns c0 .. c0 + 15 of heads g0 .. g0 + gc - 1: sum_j probs[g][j] * v[start + j]. */
ALWAYS_INLINE void values16_avx2(const float *probs, const uint16_t *v, int64_t g0, int64_t gc,
                                 int64_t d_n, int64_t c0, int64_t start, int64_t n,
                                 uint16_t *out) {
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int64_t g = 0; g < gc; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *vrow = v + (start + j) * d_n + c0;
        __builtin_prefetch(vrow + 8 * d_n);
        __m256 v0 = load_bf16x8(vrow), v1 = load_bf16x8(vrow + 8);
#pragma GCC unroll 4
        for (int64_t g = 0; g < gc; g++) {
            __m256 p = _mm256_broadcast_ss(probs + (g0 + g) * n + j);
            acc[g][0] = _mm256_fmadd_ps(p, v0, acc[g][0]);
            acc[g][1] = _mm256_fmadd_ps(p, v1, acc[g][1]);
        }
    }
#pragma GCC unroll 4
    for (int64_t g = 0; g < gc; g++) {
        store_bf16x8(out + (g0 + g) * d_n + c0, acc[g][0]);
        store_bf16x8(out + (g0 + g) * d_n + c0 + 8, acc[g][1]);
    }
}

/* weight_values's contract on AVX2. */
ALWAYS_INLINE void weight_values_avx2(const float *probs, const uint16_t *v, int64_t g_n,
                                      int64_t d_n, int64_t start, int64_t n, uint16_t *out) {
    for (int64_t c0 = 0; c0 < d_n; c0 += 16)
        for (int64_t g0 = 0; g0 < g_n; g0 += 4)
            values16_avx2(probs, v, g0, g_n - g0 < 4 ? g_n - g0 : 4, d_n, c0, start, n, out);
}
#endif

/* One block of up to KB keys: the bfloat16 dot-product instruction where the CPU has it. */
ALWAYS_INLINE void score_any(const uint16_t *q, const float *qs, const uint16_t *kt,
                             int64_t stride, int64_t g_n, int64_t d_n, float scale,
                             float *scores, int64_t n, int64_t j0, int64_t count) {
#if defined(__AVX512BF16__)
    (void)qs;
    score_block_dp(q, kt, stride, g_n, d_n, scale, scores, n, j0, count);
#elif defined(ATTN_AVX2)
    (void)q, (void)scale;
    score_block_avx2(qs, kt, stride, g_n, d_n, scores, n, j0, count);
#else
    (void)q, (void)scale;
    score_block(qs, kt, stride, g_n, d_n, scores, n, j0, count);
#endif
}

/* scores[g][j] = scale * q[g] . k[start + j] for j < n, over one slot and head's tiled keys
 * (kt [cap / KB, D, KB]). Each block is one tile, read whole (a last partial block's extra
 * lanes are never stored); keys that start inside a tile (a sliding window's first ones) are
 * copied into a zero-padded tile first. */
ALWAYS_INLINE void score_keys(const uint16_t *q, const uint16_t *kt, int64_t g_n, int64_t d_n,
                              int64_t start, int64_t n, float scale, float *scores) {
    float qs[GMAX * 256];
#if !defined(__AVX512BF16__)
    for (int64_t i = 0; i < g_n * d_n; i++) qs[i] = bf16_to_f32(q[i]) * scale;
#endif
    int64_t j = 0, skew = start % KB;
    if (skew && n > 0) {
        uint16_t tile[256 * KB];
        const uint16_t *src = kt + (start / KB) * d_n * KB;
        j = KB - skew < n ? KB - skew : n;
        for (int64_t d = 0; d < d_n; d++) {
            memcpy(tile + d * KB, src + d * KB + skew, sizeof(uint16_t) * (size_t)j);
            memset(tile + d * KB + j, 0, sizeof(uint16_t) * (size_t)(KB - j));
        }
        score_any(q, qs, tile, KB, g_n, d_n, scale, scores, n, 0, j);
    }
    for (; j < n; j += KB)
        score_any(q, qs, kt + (start + j) / KB * d_n * KB, KB, g_n, d_n, scale, scores, n, j,
                  n - j < KB ? n - j : KB);
}

/* out[g] = sum_j probs[g][j] * v[start + j], rounded to bfloat16; G * D sums in registers
 * (D a multiple of 16, at most 256). */
ALWAYS_INLINE void weight_values(const float *probs, const uint16_t *v, int64_t g_n,
                                 int64_t d_n, int64_t start, int64_t n, uint16_t *out) {
    v16f acc[GMAX][16];
    int64_t dv = d_n / 16;
#pragma GCC unroll 8
    for (int64_t g = 0; g < g_n; g++)
#pragma GCC unroll 8
        for (int64_t c = 0; c < dv; c++) acc[g][c] = (v16f){0};
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *vrow = v + (start + j) * d_n;
        __builtin_prefetch(vrow + 8 * d_n);
        __builtin_prefetch(vrow + 8 * d_n + 32);
        v16f vr[16];
#pragma GCC unroll 8
        for (int64_t c = 0; c < dv; c++) vr[c] = load_bf16x16(vrow + 16 * c);
#pragma GCC unroll 8
        for (int64_t g = 0; g < g_n; g++) {
            float p = probs[g * n + j];
#pragma GCC unroll 8
            for (int64_t c = 0; c < dv; c++) acc[g][c] += p * vr[c];
        }
    }
    for (int64_t g = 0; g < g_n; g++)
        for (int64_t c = 0; c < dv; c++)
            for (int e = 0; e < 16; e++) out[g * d_n + 16 * c + e] = f32_to_bf16(acc[g][c][e]);
}

ALWAYS_INLINE void attend_one(const uint16_t *q, const uint16_t *kt, const uint16_t *v,
                              int64_t g_n, int64_t d_n, int64_t start, int64_t end,
                              float scale, float *scores, uint16_t *out) {
    int64_t n = end - start;
    score_keys(q, kt, g_n, d_n, start, n, scale, scores);
    softmax_rows(scores, g_n, n);
#if defined(ATTN_AVX2)
    weight_values_avx2(scores, v, g_n, d_n, start, n, out);
#else
    weight_values(scores, v, g_n, d_n, start, n, out);
#endif
}

/* Specializations for the common (G, D): constants let the compiler keep sums in registers.
 * Each is its own (not inlined) function: one giant dispatcher took ~5 s to compile. */
#define ATTEND_FN(G, D)                                                                        \
    static __attribute__((noinline)) void attend_##G##_##D(                                    \
        const uint16_t *q, const uint16_t *kt, const uint16_t *v, int64_t start,              \
        int64_t end, float scale, float *scores, uint16_t *out) {                              \
        attend_one(q, kt, v, G, D, start, end, scale, scores, out);                            \
    }
ATTEND_FN(1, 64) ATTEND_FN(2, 64) ATTEND_FN(3, 64) ATTEND_FN(4, 64)
ATTEND_FN(5, 64) ATTEND_FN(6, 64) ATTEND_FN(7, 64) ATTEND_FN(8, 64)
ATTEND_FN(1, 128) ATTEND_FN(2, 128) ATTEND_FN(4, 128) ATTEND_FN(6, 128)
ATTEND_FN(7, 128) ATTEND_FN(8, 128)

#define ATTEND_CASE(G, D)                                                                      \
    if (g_n == G && d_n == D) {                                                                \
        attend_##G##_##D(q, kt, v, start, end, scale, scores, out);                            \
        return;                                                                                \
    }

static void attend_dispatch(const uint16_t *q, const uint16_t *kt, const uint16_t *v,
                            int64_t g_n, int64_t d_n, int64_t start, int64_t end,
                            float scale, float *scores, uint16_t *out) {
    ATTEND_CASE(1, 64) ATTEND_CASE(2, 64) ATTEND_CASE(3, 64) ATTEND_CASE(4, 64)
    ATTEND_CASE(5, 64) ATTEND_CASE(6, 64) ATTEND_CASE(7, 64) ATTEND_CASE(8, 64)
    ATTEND_CASE(1, 128) ATTEND_CASE(2, 128) ATTEND_CASE(4, 128) ATTEND_CASE(6, 128)
    ATTEND_CASE(7, 128) ATTEND_CASE(8, 128)
    attend_one(q, kt, v, g_n, d_n, start, end, scale, scores, out); /* other G <= 8 */
}

/* q [R, Hkv * G, D] (rows q_stride elements apart, heads contiguous); kt [slots, Hkv,
 * cap / KT_TILE, D, KT_TILE] (tiled, kernels.h; cap a multiple of KT_TILE); v [slots, Hkv, cap,
 * D]; slots, lens [R] int64 (row r attends to keys 0..lens[r]-1 of slot
 * slots[r]; window > 0 keeps the last `window`); out [R, Hkv * G, D] contiguous. G <= 8,
 * D a multiple of 16 and at most 256. Returns 0, -1 if out of memory, -2 for an unsupported
 * shape. */
int decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kt,
                          const uint16_t *v, const int64_t *slots, const int64_t *lens,
                          int64_t rows, int64_t hkv, int64_t g_n, int64_t d_n, int64_t cap,
                          int64_t window, float scale, uint16_t *out) {
    if (g_n < 1 || g_n > GMAX || d_n % 16 != 0 || d_n > 256 || cap % KT_TILE != 0) return -2;
    int64_t max_len = 0, total = 0;
    for (int64_t r = 0; r < rows; r++) {
        max_len = lens[r] > max_len ? lens[r] : max_len;
        total += lens[r];
    }
    int failed = 0;
    /* A parallel region costs a few microseconds: only worth it for enough K/V to read. */
#pragma omp parallel if (total * hkv >= 2048)
    {
        float *scores = malloc(sizeof(float) * (size_t)(g_n * max_len + 1));
        /* Rows differ in length: hand out tasks in small chunks, not halves. */
#pragma omp for schedule(dynamic, 4)
        for (int64_t t = 0; t < rows * hkv; t++) {
            int64_t r = t / hkv, h = t % hkv;
            int64_t end = lens[r];
            int64_t start = (window > 0 && end > window) ? end - window : 0;
            if (!scores) {
                failed = 1; /* every thread still reaches the loop's barrier */
                continue;
            }
            if (end <= 0) continue;
            int64_t base = slots[r] * hkv + h;
            attend_dispatch(q + r * q_stride + h * g_n * d_n, kt + base * d_n * cap,
                            v + base * cap * d_n, g_n, d_n, start, end, scale, scores,
                            out + (r * hkv + h) * g_n * d_n);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

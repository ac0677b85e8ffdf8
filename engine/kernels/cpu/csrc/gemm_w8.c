/* Weight-only int8 products y = x @ (s * Q).T (+ b) for decode steps (1-128 rows), AVX512-VNNI.
 *
 * Q [N, K] int8 in -127..127 with one float32 scale s[n, g] per output channel and block g of
 * 32 input channels (--quantization int8 on CPU: llama.cpp's Q8_0 grid, engine/model/quant.py).
 * A decode step is memory-bound at a few rows, so the point is reading 1 byte per weight instead
 * of bfloat16's 2; from ~8 rows on it is compute-bound, so the point is the most
 * multiply-adds per instruction. vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds
 * the 4 products into one int32 lane: 64 multiply-adds per instruction, twice vdpbf16ps's 32.
 * x is quantized per row and group of 32 to int8 (x_quant.h: llama.cpp's Q8_0 activations, as
 * gemm_w4.c does) and Q is stored offset by 128 as the unsigned operand, U = Q + 128, so
 *
 *   sum_k xq * Q = sum_k xq * U - 128 * sum_k xq,
 *
 * one group's sum exact in int32 (32 * 127 * 255 < 2^31), started at -128 * sum(xq) (the
 * group's quantized sum, from the quantizer) instead of zero. Per group, row and 16 columns:
 * acc = that sum, y += float(acc) * (x_scale[r, g] * s[n, g]); at the end y + b, rounded to
 * bfloat16 once, nearest even. (The int16 x of the first version, with vpdpwssd, was exact to
 * 3e-5 of a row's largest value but 32 multiply-adds per instruction plus a sign extension per
 * 32 weights: 0.7x bfloat16 at 32 rows.)
 *
 * Packing (quant.pack_int8_quads): wq [N / 16, G * 8, 16, 4] uint8, G = ceil(K / 32): for 16
 * output columns, each 4 consecutive K are one 64-byte vector (column c's 4 bytes at 4c); K is
 * padded to G * 32 with U = 128 (a zero weight). Scales ws [N / 16, G, 16] float32: per block
 * of 16 columns and group, the 16 columns' scales. Threads split the N blocks (NV vectors each).
 *
 * On AVX2 CPUs (no AVX-512; AMD Zen 3, Intel before Ice Lake's servers) the same layout serves
 * an AVX2 path (w8_products_avx2). There is no vpdpbusd, and vpmaddubsw on U would saturate (two
 * products of U <= 255 and |xq| <= 127 pass int16), so it multiplies signed weights instead: per
 * 64-byte quad vector (16 columns x 4 K, two registers) Q = U ^ 0x80 and |Q| (vpabsb; 128 for
 * Q = -128, read as unsigned), once per vector for a tile's 4 rows; per row, its 4 int8 codes of
 * x broadcast to every 32-bit lane take each weight's sign (vpsignb(x, Q): -x where Q < 0, 0
 * where Q = 0), vpmaddubsw(|Q|, that) gives the pairs Q*x + Q'*x' exactly (|.| <= 2 * 128 * 127
 * < 2^15) and vpmaddwd by ones sums each column's two pairs into its int32 lane, in column
 * order: no offset term (the x quantizer no longer sums), no fold at the group's end. Tiles are 4
 * rows x 16 columns (W8A_MR). The group sums are the same exact integers and the float steps
 * (convert, scale by x_scale * s, add, bias, round) the same operations in the same order as the
 * AVX-512 path and as the previous AVX2 path (U widened to int16, vpmaddwd against int16 x, a
 * vphaddd fold per group), so all give the same bits by construction; this path was compared
 * bit for bit with the previous one on rows 1-40, K in {7, 32, 33, 65, 100, 200, 576, 1000,
 * 1536}, weights of +-127 only, with Q = -128 (U = 0), x of +-1 only, with zeros, and with
 * subnormal x.
 *
 * Measured against the previous AVX2 path on an AMD EPYC Zen 3 (2 cores, the other one busy with
 * other work), one thread, both builds in one process, alternated, weights streamed from memory
 * (~100 MB per pass), new/old speed at rows 1/2/4/8/16/32, min of 9 (median): gate_up (N 3072, K
 * 576) 1.13/1.18/1.16/1.15/1.28/1.18x (1.09/1.46/1.32/1.33/1.18/1.16x; 32 rows 43.6 -> 51.6
 * GMAC/s); 576 x 576 1.13/1.19/1.30/1.23/1.22/1.19x (1.16/1.24/1.30/1.26/1.22/1.23x). These from a
 * C harness linking both versions of this file (not in the repository); a whole decode step's int8
 * products (python bench/w8_old_new.py --old-lib <the previous build>, SmolLM2-135M, one thread,
 * both cores loaded): 1.10/1.21/1.42/1.26/1.29/1.16x (1.10/1.23/1.24/1.21/1.32/1.16x; 32 rows
 * 118.8 -> 102.7 ms). Two threads were not measurable with the other core loaded (the parallel
 * loop waits on its descheduled thread: 2-8x swings between repeats). The bound on Zen 3 is the
 * multiply pipes: vpsignb and vpabsb measured competing with vpmaddubsw and vpmaddwd, and the
 * 4-row group loop alone (sums in registers, inline assembly) runs at ~20 multiply-adds per cycle,
 * as does the previous method's loop alone (vpmovzxbw + 2 vpmaddwd); the previous path lost the
 * rest to its per-group fold. Tried and dropped: weights xor'ed and abs'ed once per block into a
 * stack buffer (0.9x at 8 rows), 8-column tiles of 6-8 rows (no better), the inline-assembly tile
 * (same speed as the intrinsics).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "x_quant.h"

/* Tile shape measured on Zen 5 (one core, SmolLM2's gate_up at 32 rows; bench/quant_matmul.py):
 * 6 x 2 332 GMAC/s, 4 x 2 305, 3 x 4 289, 4 x 4 217, 4 x 3 168 (fewer broadcasts per weight
 * load is not the whole story: the 4 x 3 loop is spill-free too); bf16's 8 x 3 tile ~210. */
#define W8_MR 6        /* rows per register tile */
#define W8_NV 2        /* 16-column vectors per tile: 12 int32 + 12 float32 sums in registers */
/* 1 KB ahead per weight stream at 2 rows. At one row, where each thread is one sequential
 * stream, the hardware prefetcher does better alone: a step's products 2.9 against 3.35 ms
 * (bench/quant_matmul.py, Zen 5). */
#define W8_PF_LINES 16
#define W8_AMX_MIN_ROWS 16 /* below, the VNNI tiles win (memory-bound rows; the AMX epilogue per group costs) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

/* One mr x (nv * 16) tile over all groups. xq: mr rows of groups * 32 int8 (xs apart); xscale,
 * xoff: per row (groups apart) the group's x scale and -128 * its quantized sum; wb: the first
 * of nv N blocks (ps bytes apart); ws: their scales (groups * 16 floats apart). */
static inline __attribute__((always_inline)) void tile_w8(
    const int8_t *xq, int64_t xs, const float *xscale, const int32_t *xoff, int64_t groups,
    int mr, const uint8_t *wb, int64_t ps, int nv, const float *ws, const uint16_t *bias,
    uint16_t *y, int64_t ys) {
    __m512 accf[W8_MR][W8_NV];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nv; j++) accf[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[W8_MR][W8_NV];
        for (int r = 0; r < mr; r++) {
            __m512i start = _mm512_set1_epi32(xoff[r * groups + g]);
            for (int j = 0; j < nv; j++) acc[r][j] = start;
        }
        const uint8_t *wg = wb + g * (XQ_GROUP / 4) * 64;
        if (mr == 2)
            for (int j = 0; j < nv; j++)
                for (int l = 0; l < 8; l++)
                    _mm_prefetch((const char *)(wg + j * ps + (W8_PF_LINES + l) * 64), _MM_HINT_T0);
        for (int o = 0; o < XQ_GROUP / 4; o++) {
            __m512i w[W8_NV];
            for (int j = 0; j < nv; j++)
                w[j] = _mm512_loadu_si512((const void *)(wg + j * ps + o * 64));
            for (int r = 0; r < mr; r++) {
                __m512i a = bcast4(xq + r * xs + g * XQ_GROUP + 4 * o);
                for (int j = 0; j < nv; j++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], w[j], a);
            }
        }
        __m512 sw[W8_NV];
        for (int j = 0; j < nv; j++) sw[j] = _mm512_loadu_ps(ws + (j * groups + g) * 16);
        for (int r = 0; r < mr; r++) {
            __m512 sx = _mm512_set1_ps(xscale[r * groups + g]);
            for (int j = 0; j < nv; j++)
                accf[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][j]),
                                             _mm512_mul_ps(sw[j], sx), accf[r][j]);
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
#define W8_TILE(MR, NV)                                                                        \
    tile_w8(xq + r0 * xs, xs, xscale + r0 * groups, xoff + r0 * groups, groups, (MR), wb, ps,  \
            (NV), ws, bias, y + r0 * ys, ys)
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

static void block_w8(int nv, const int8_t *xq, int64_t xs, const float *xscale,
                     const int32_t *xoff, int64_t groups, int64_t m, const uint8_t *wb,
                     int64_t ps, const float *ws, const uint16_t *bias, uint16_t *y, int64_t ys) {
    if (nv == 1)
        W8_ROWS(1);
    else
        W8_ROWS(2);
}
#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__)) && defined(__AVX2__) &&              \
    defined(__FMA__) && !defined(__AVX512F__)
#define W8_AVX2 1
#include <immintrin.h>

/* Rows per AVX2 register tile of 16 columns: 8 int32 sums, 4 weight registers (Q and |Q| of
 * both halves), the ones and the 0x80 flip (GCC keeps a few of the sums on the stack; the
 * assembly version with all of them in registers was no faster). Zen 3, one thread, gate_up at
 * 32 rows: 4 rows 54-56 GMAC/s, 3 rows 51-54, 2 rows 51-52; unrolled by 8 instead of 2, GCC
 * computed every product first and spilled them (43 GMAC/s). */
#define W8A_MR 4

/* One quad step of one row against 16 columns: its 4 codes of x broadcast to every 32-bit lane,
 * signed by each weight's sign (vpsignb: zero where the weight is), times |Q| (vpmaddubsw: two
 * products a pair, |sum| <= 2 * 128 * 127 < 2^15, exact), pairs summed into one int32 per column
 * (vpmaddwd by ones) and added to the column's group sum. */
#define W8A_ROW(A0, A1, XP)                                                                    \
    do {                                                                                       \
        int32_t four_;                                                                         \
        memcpy(&four_, (XP), sizeof four_);                                                    \
        __m256i x_ = _mm256_set1_epi32(four_);                                                 \
        A0 = _mm256_add_epi32(                                                                 \
            A0, _mm256_madd_epi16(_mm256_maddubs_epi16(m0, _mm256_sign_epi8(x_, s0)), ones));  \
        A1 = _mm256_add_epi32(                                                                 \
            A1, _mm256_madd_epi16(_mm256_maddubs_epi16(m1, _mm256_sign_epi8(x_, s1)), ones));  \
    } while (0)

/* A group's column sums of one row (A0: columns 0-7, A1: 8-15) as float32, scaled and added. */
#define W8A_SCALE(F0, F1, A0, A1, R)                                                           \
    do {                                                                                       \
        __m256 sx_ = _mm256_set1_ps(xscale[(R) * groups + g]);                                 \
        F0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(A0), _mm256_mul_ps(sw0, sx_), F0);             \
        F1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(A1), _mm256_mul_ps(sw1, sx_), F1);             \
    } while (0)

#define W8A_STORE(F0, F1, R)                                                                   \
    do {                                                                                       \
        store_bf16x8(y + (R) * ys, _mm256_add_ps(F0, b0));                                     \
        store_bf16x8(y + (R) * ys + 8, _mm256_add_ps(F1, b1));                                 \
    } while (0)

/* One mr-row tile (1 <= mr <= 4) of a 16-column block over all groups. xq: mr rows of groups *
 * 32 int8 codes (xs apart); xscale: per row (groups apart) the group's x scale; wb: the block's
 * packed weights; ws: its scales [groups, 16]; bias: its 16 bfloat16 or NULL; y: the rows'
 * outputs (ys apart). */
static inline __attribute__((always_inline)) void tile_w8_avx2(
    const int8_t *xq, int64_t xs, const float *xscale, int64_t groups, int mr,
    const uint8_t *wb, const float *ws, const uint16_t *bias, uint16_t *y, int64_t ys) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 f00 = _mm256_setzero_ps(), f01 = f00, f10 = f00, f11 = f00, f20 = f00, f21 = f00,
           f30 = f00, f31 = f00;
    for (int64_t g = 0; g < groups; g++) {
        __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00,
                a21 = a00, a30 = a00, a31 = a00;
        const uint8_t *wg = wb + g * (XQ_GROUP / 4) * 64;
        const int8_t *xg = xq + g * XQ_GROUP;
#pragma GCC unroll 2
        for (int o = 0; o < XQ_GROUP / 4; o++) {
            __m256i s0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wg + o * 64)), flip);
            __m256i s1 =
                _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wg + o * 64 + 32)), flip);
            __m256i m0 = _mm256_abs_epi8(s0), m1 = _mm256_abs_epi8(s1);
            W8A_ROW(a00, a01, xg + 4 * o);
            if (mr > 1) W8A_ROW(a10, a11, xg + xs + 4 * o);
            if (mr > 2) W8A_ROW(a20, a21, xg + 2 * xs + 4 * o);
            if (mr > 3) W8A_ROW(a30, a31, xg + 3 * xs + 4 * o);
        }
        __m256 sw0 = _mm256_loadu_ps(ws + g * 16), sw1 = _mm256_loadu_ps(ws + g * 16 + 8);
        W8A_SCALE(f00, f01, a00, a01, 0);
        if (mr > 1) W8A_SCALE(f10, f11, a10, a11, 1);
        if (mr > 2) W8A_SCALE(f20, f21, a20, a21, 2);
        if (mr > 3) W8A_SCALE(f30, f31, a30, a31, 3);
    }
    __m256 b0 = bias ? load_bf16x8(bias) : _mm256_setzero_ps();
    __m256 b1 = bias ? load_bf16x8(bias + 8) : _mm256_setzero_ps();
    W8A_STORE(f00, f01, 0);
    if (mr > 1) W8A_STORE(f10, f11, 1);
    if (mr > 2) W8A_STORE(f20, f21, 2);
    if (mr > 3) W8A_STORE(f30, f31, 3);
}

#define W8A_TILE(MR)                                                                           \
    tile_w8_avx2_m##MR(xq + r0 * xs, xs, xscale + r0 * groups, groups, wb, ws, bias,          \
                       y + r0 * ys, ys)

/* One function per row count: inlined together into one, GCC's register allocation spilled
 * the sums (as in gemv.c). */
#define W8A_TILE_M(MR)                                                                         \
    static __attribute__((noinline)) void tile_w8_avx2_m##MR(                                 \
        const int8_t *xq, int64_t xs, const float *xscale, int64_t groups, const uint8_t *wb,  \
        const float *ws, const uint16_t *bias, uint16_t *y, int64_t ys) {                      \
        tile_w8_avx2(xq, xs, xscale, groups, MR, wb, ws, bias, y, ys);                         \
    }
W8A_TILE_M(1)
W8A_TILE_M(2)
W8A_TILE_M(3)
W8A_TILE_M(4)

/* One 16-column block for all m rows, W8A_MR rows at a time (the block's weights, a few KB per
 * group range, stay in L1/L2 between row tiles). */
static void block_w8_avx2(const int8_t *xq, int64_t xs, const float *xscale, int64_t groups,
                          int64_t m, const uint8_t *wb, const float *ws, const uint16_t *bias,
                          uint16_t *y, int64_t ys) {
    int64_t r0 = 0;
    for (; r0 + W8A_MR <= m; r0 += W8A_MR) W8A_TILE(4);
    switch (m - r0) {
    case 1: W8A_TILE(1); break;
    case 2: W8A_TILE(2); break;
    case 3: W8A_TILE(3); break;
    default: break;
    }
}

/* w8_products on AVX2 (arguments as there). */
static int w8_products_avx2(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *wq,
                            const float *ws, const uint16_t *bias, int64_t n_out, int64_t k,
                            uint16_t *y) {
    if (n_out % 16 != 0 || m < 1 || k < 1) return -2;
    int64_t groups = (k + XQ_GROUP - 1) / XQ_GROUP, xs = groups * XQ_GROUP;
    int8_t *xq = malloc((size_t)(m * xs));
    float *xscale = malloc(sizeof(float) * (size_t)(m * groups));
    if (!xq || !xscale) {
        free(xq), free(xscale);
        return -1;
    }
    quantize_x_groups8(x, x_stride, m, k, groups, xq, xscale);
    int64_t ps = xs * 16, blocks = n_out / 16;
#pragma omp parallel for schedule(static) if (m * n_out * k >= (1 << 19) || n_out * k >= (1 << 17))
    for (int64_t b = 0; b < blocks; b++)
        block_w8_avx2(xq, xs, xscale, groups, m, wq + b * ps, ws + b * groups * 16,
                      bias ? bias + b * 16 : NULL, y + b * 16, n_out);
    free(xq), free(xscale);
    return 0;
}
#endif

/* x [m, k] bfloat16 (rows x_stride elements apart), m >= 1; wq [n_out / 16, ceil(k / 32) * 8,
 * 16, 4] uint8 and ws [n_out / 16, ceil(k / 32), 16] float32 scales (see above); bias [n_out]
 * bfloat16 or NULL; y [m, n_out] bfloat16 contiguous. Returns 0, -1 out of memory, -2 for n_out
 * not a multiple of 16 or a build with neither AVX512-VNNI nor the AVX2 path (callers keep
 * their torch path). */
static int w8_products(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *wq,
                       const float *ws, const uint16_t *bias, int64_t n_out, int64_t k,
                       uint16_t *y, int amx) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (n_out % 16 != 0 || m < 1 || k < 1) return -2;
    int64_t groups = (k + XQ_GROUP - 1) / XQ_GROUP, xs = groups * XQ_GROUP;
    int8_t *xq = malloc((size_t)(m * xs));
    float *xscale = malloc(sizeof(float) * (size_t)(m * groups));
    int32_t *xoff = malloc(sizeof(int32_t) * (size_t)(m * groups));
    if (!xq || !xscale || !xoff) {
        free(xq), free(xscale), free(xoff);
        return -1;
    }
    quantize_x_groups(x, x_stride, m, k, groups, xq, xscale, xoff);
    for (int64_t i = 0; i < m * groups; i++) xoff[i] *= -128; /* the U = Q + 128 offset */
    /* From W8_AMX_MIN_ROWS rows, AMX-INT8 tiles where the CPU has them (gemm_amx.c: the same
     * integer sums and float operations, so the same bits). */
    if (amx && m >= W8_AMX_MIN_ROWS &&
        gemm_amx_w8(xq, xs, xscale, xoff, groups, m, wq, ws, bias, n_out, y) == 0) {
        free(xq), free(xscale), free(xoff);
        return 0;
    }
    int64_t ps = xs * 16; /* bytes per 16-column block */
    /* One row reads the weights once and multiplies little: a tile of one 16-column vector
     * makes each thread one sequential stream (a SmolLM2 step's products, two threads, Zen 5:
     * 2.8-3.2 ms against 3.2-3.9 with two vectors, alternated runs); from two rows on, two
     * vectors per broadcast win. */
    int64_t nvt = m == 1 ? 1 : W8_NV;
    int64_t vecs = n_out / 16, nblocks = (vecs + nvt - 1) / nvt;
    /* Memory-bound small weights (SmolLM2's 576 x 576 o_proj, 332 KB) also split: one core
     * streams less than half the memory bandwidth. */
#pragma omp parallel for schedule(static) if (m * n_out * k >= (1 << 19) || n_out * k >= (1 << 17))
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t v0 = b * nvt;
        int nv = (int)(vecs - v0 < nvt ? vecs - v0 : nvt);
        block_w8(nv, xq, xs, xscale, xoff, groups, m, wq + v0 * ps, ps, ws + v0 * groups * 16,
                 bias ? bias + v0 * 16 : NULL, y + v0 * 16, n_out);
    }
    free(xq), free(xscale), free(xoff);
    return 0;
#elif defined(W8_AVX2)
    (void)amx;
    return w8_products_avx2(x, x_stride, m, wq, ws, bias, n_out, k, y);
#else
    (void)x, (void)x_stride, (void)m, (void)wq, (void)ws, (void)bias, (void)n_out, (void)k;
    (void)y, (void)amx;
    return -2;
#endif
}

int gemm_w8_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *wq,
                 const float *ws, const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y) {
    return w8_products(x, x_stride, m, wq, ws, bias, n_out, k, y, 1);
}

/* gemm_w8_bf16 on the AVX512-VNNI tiles only (never AMX): the reference the AMX path's bits
 * are tested against, and a benchmark's baseline. */
int gemm_w8_bf16_vnni(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *wq,
                      const float *ws, const uint16_t *bias, int64_t n_out, int64_t k,
                      uint16_t *y) {
    return w8_products(x, x_stride, m, wq, ws, bias, n_out, k, y, 0);
}

/* 1 when this build has the kernel (AVX512-VNNI, or the AVX2 path), else 0. */
int gemm_w8_available(void) {
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(W8_AVX2)
    return 1;
#else
    return 0;
#endif
}

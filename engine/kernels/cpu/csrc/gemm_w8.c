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
 * an AVX2 path (w8_products_avx2): there is no vpdpbusd, and vpmaddubsw would saturate (two
 * products of U <= 255 and |xq| <= 127 pass int16), so the weights are widened to int16
 * (vpmovzxbw: 4 columns x 4 K of a quad vector in one register) and multiplied with vpmaddwd
 * against x in int16 (4 K broadcast per 64-bit lane): 16 multiply-adds per instruction into
 * int32 lanes that hold each column's two half-sums (K 0-1 and 2-3 of a quad), folded by one
 * vphaddd per group. The group sums are the same exact integers and the float steps (convert,
 * scale by x_scale * s, add, bias, round) the same operations in the same order, so both paths
 * give the same bits by construction (no machine has both to compare them: the AVX2 path is
 * built only without AVX-512).
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

/* Rows per AVX2 register tile of 8 columns: 8 int32 sums, 2 weight registers, 4 float32 sums. */
#define W8A_MR 4

/* One quad step of one row: its 4 codes of x against 8 columns (w0: columns 0-3, w1: 4-7). */
#define W8A_ROW(LO, HI, XP)                                                                    \
    do {                                                                                       \
        long long four_;                                                                       \
        memcpy(&four_, (XP), sizeof four_);                                                    \
        __m256i a_ = _mm256_set1_epi64x(four_);                                                \
        LO = _mm256_add_epi32(LO, _mm256_madd_epi16(w0, a_));                                  \
        HI = _mm256_add_epi32(HI, _mm256_madd_epi16(w1, a_));                                  \
    } while (0)

/* A group's two half-sum registers of one row -> its 8 column sums as float32, scaled and added
 * to ACC: [c0 c1 c4 c5 | c2 c3 c6 c7] after vphaddd, put in order by vpermq. */
#define W8A_FOLD(ACC, LO, HI, R)                                                               \
    do {                                                                                       \
        __m256i s_ = _mm256_permute4x64_epi64(_mm256_hadd_epi32(LO, HI), 0xD8);                \
        s_ = _mm256_add_epi32(s_, _mm256_set1_epi32(xoff[(R) * groups + g]));                  \
        __m256 sx_ = _mm256_set1_ps(xscale[(R) * groups + g]);                                 \
        ACC = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_), _mm256_mul_ps(sw, sx_), ACC);            \
    } while (0)

/* One mr-row tile (1 <= mr <= W8A_MR) of columns 8h..8h+7 of a 16-column block, over all
 * groups (see the file's comment). Each row's sums are named registers, not arrays: with arrays
 * GCC reassociated the unrolled group and spilled every product to the stack (~1.3x slower). xq:
 * mr rows of groups * 32 int16 codes (xs apart); xscale, xoff: per row (groups apart) the
 * group's x scale and -128 * its quantized sum; wb: the block's packed weights; ws: its scales
 * [groups, 16]; bias: its 16 bfloat16 or NULL; y: the rows' outputs (ys apart). */
static inline __attribute__((always_inline)) void tile_w8_avx2(
    const int16_t *xq, int64_t xs, const float *xscale, const int32_t *xoff, int64_t groups,
    int mr, const uint8_t *wb, int h, const float *ws, const uint16_t *bias, uint16_t *y,
    int64_t ys) {
    __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    for (int64_t g = 0; g < groups; g++) {
        __m256i l0 = _mm256_setzero_si256(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0,
                l3 = l0, h3 = l0;
        const uint8_t *wg = wb + g * (XQ_GROUP / 4) * 64 + h * 32;
        const int16_t *xg = xq + g * XQ_GROUP;
#pragma GCC unroll 2
        for (int o = 0; o < XQ_GROUP / 4; o++) {
            __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wg + o * 64)));
            __m256i w1 =
                _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wg + o * 64 + 16)));
            W8A_ROW(l0, h0, xg + 4 * o);
            if (mr > 1) W8A_ROW(l1, h1, xg + xs + 4 * o);
            if (mr > 2) W8A_ROW(l2, h2, xg + 2 * xs + 4 * o);
            if (mr > 3) W8A_ROW(l3, h3, xg + 3 * xs + 4 * o);
        }
        __m256 sw = _mm256_loadu_ps(ws + g * 16 + h * 8);
        W8A_FOLD(f0, l0, h0, 0);
        if (mr > 1) W8A_FOLD(f1, l1, h1, 1);
        if (mr > 2) W8A_FOLD(f2, l2, h2, 2);
        if (mr > 3) W8A_FOLD(f3, l3, h3, 3);
    }
    __m256 b = bias ? load_bf16x8(bias + h * 8) : _mm256_setzero_ps();
    store_bf16x8(y + h * 8, _mm256_add_ps(f0, b));
    if (mr > 1) store_bf16x8(y + ys + h * 8, _mm256_add_ps(f1, b));
    if (mr > 2) store_bf16x8(y + 2 * ys + h * 8, _mm256_add_ps(f2, b));
    if (mr > 3) store_bf16x8(y + 3 * ys + h * 8, _mm256_add_ps(f3, b));
}

#define W8A_TILE(MR)                                                                           \
    tile_w8_avx2_m##MR(xq + r0 * xs, xs, xscale + r0 * groups, xoff + r0 * groups, groups, wb, \
                       h, ws, bias, y + r0 * ys, ys)

/* One function per row count: inlined together into one, GCC's register allocation spilled
 * the sums (as in gemv.c). */
#define W8A_TILE_M(MR)                                                                         \
    static __attribute__((noinline)) void tile_w8_avx2_m##MR(                                 \
        const int16_t *xq, int64_t xs, const float *xscale, const int32_t *xoff,              \
        int64_t groups, const uint8_t *wb, int h, const float *ws, const uint16_t *bias,      \
        uint16_t *y, int64_t ys) {                                                             \
        tile_w8_avx2(xq, xs, xscale, xoff, groups, MR, wb, h, ws, bias, y, ys);                \
    }
W8A_TILE_M(1)
W8A_TILE_M(2)
W8A_TILE_M(3)
W8A_TILE_M(4)

/* One 16-column block for all m rows: each half of 8 columns, W8A_MR rows at a time (the
 * block's weights, a few KB per group range, stay in L1/L2 between row tiles). */
static void block_w8_avx2(const int16_t *xq, int64_t xs, const float *xscale,
                          const int32_t *xoff, int64_t groups, int64_t m, const uint8_t *wb,
                          const float *ws, const uint16_t *bias, uint16_t *y, int64_t ys) {
    for (int h = 0; h < 2; h++) {
        int64_t r0 = 0;
        for (; r0 + W8A_MR <= m; r0 += W8A_MR) W8A_TILE(4);
        switch (m - r0) {
        case 1: W8A_TILE(1); break;
        case 2: W8A_TILE(2); break;
        case 3: W8A_TILE(3); break;
        default: break;
        }
    }
}

/* w8_products on AVX2 (arguments as there). */
static int w8_products_avx2(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *wq,
                            const float *ws, const uint16_t *bias, int64_t n_out, int64_t k,
                            uint16_t *y) {
    if (n_out % 16 != 0 || m < 1 || k < 1) return -2;
    int64_t groups = (k + XQ_GROUP - 1) / XQ_GROUP, xs = groups * XQ_GROUP;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)(m * xs));
    float *xscale = malloc(sizeof(float) * (size_t)(m * groups));
    int32_t *xoff = malloc(sizeof(int32_t) * (size_t)(m * groups));
    if (!xq || !xscale || !xoff) {
        free(xq), free(xscale), free(xoff);
        return -1;
    }
    quantize_x_groups16(x, x_stride, m, k, groups, xq, xscale, xoff);
    for (int64_t i = 0; i < m * groups; i++) xoff[i] *= -128; /* the U = Q + 128 offset */
    int64_t ps = xs * 16, blocks = n_out / 16;
#pragma omp parallel for schedule(static) if (m * n_out * k >= (1 << 19) || n_out * k >= (1 << 17))
    for (int64_t b = 0; b < blocks; b++)
        block_w8_avx2(xq, xs, xscale, xoff, groups, m, wq + b * ps, ws + b * groups * 16,
                      bias ? bias + b * 16 : NULL, y + b * 16, n_out);
    free(xq), free(xscale), free(xoff);
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

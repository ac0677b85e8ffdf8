/* bfloat16 products y = x @ W.T (+ b) on AMX tiles (Sapphire Rapids and later), for the decode
 * steps of 16 rows and more, on gemm_bf16.c's packed weight.
 *
 * gemm_bf16.c's pair layout wp [N / 16, P, 16, 2] is already what an AMX B tile holds: for one
 * 16-column block, 16 consecutive K pairs (32 K values) are 16 rows of 64 bytes, 64 bytes
 * apart. So a tile step is: load A (up to 16 rows of x, 32 K values each), load the B tiles of
 * two column blocks, and TDPBF16PS into up to four float32 accumulator tiles (two row tiles x
 * two column blocks: all eight tiles of the palette). Each pair product is exact and summed in
 * float32 in K order, as vdpbf16ps does (Intel SDM, TDPBF16PS; denormals flushed), then the
 * bias is added and the sum rounded to bfloat16 once, nearest even.
 *
 * Threads split the pairs of column blocks (as gemm_bf16.c splits its N blocks); a thread
 * runs every 32-row chunk of x against its pair, so that pair's weight panel is read from
 * memory once. A tile configuration is per thread: each thread loads its own, and releases
 * the tiles when done. Linux hands AMX state to a process only on request
 * (arch_prctl(ARCH_REQ_XCOMP_PERM)): gemm_amx_bf16_available() asks once.
 *
 * K must be a multiple of 32 and N of 16; other shapes return -2 (the caller keeps the
 * AVX512_BF16 tiles).
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* The 64-byte tile configuration (palette 1): per tile, bytes per row and rows. */
struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles: 0, 1 = A (row tiles of x: rows0 and rows1 rows of a_bytes); 2, 3 = B (two column
 * blocks: b_rows rows of 64 bytes); 4, 5 = C of row tile 0, 6, 7 = C of row tile 1 (16
 * float32 or int32 sums per row). bfloat16: a_bytes 64 (32 K), b_rows 16 (32 K as pairs);
 * int8: a_bytes 32 (one group of 32 K), b_rows 8 (32 K as quads). */
static void configure(int rows0, int rows1, int a_bytes, int b_rows) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = (uint8_t)rows0, cfg.colsb[0] = (uint16_t)a_bytes;
    cfg.rows[1] = (uint8_t)rows1, cfg.colsb[1] = (uint16_t)a_bytes;
    cfg.rows[2] = (uint8_t)b_rows, cfg.colsb[2] = 64;
    cfg.rows[3] = (uint8_t)b_rows, cfg.colsb[3] = 64;
    cfg.rows[4] = (uint8_t)rows0, cfg.colsb[4] = 64;
    cfg.rows[5] = (uint8_t)rows0, cfg.colsb[5] = 64;
    cfg.rows[6] = (uint8_t)rows1, cfg.colsb[6] = 64;
    cfg.rows[7] = (uint8_t)rows1, cfg.colsb[7] = 64;
    if (rows1 == 0) /* a tile with no rows must be all zero: unconfigured */
        cfg.colsb[1] = cfg.colsb[6] = cfg.colsb[7] = 0;
    _tile_loadconfig(&cfg);
}

/* float32 sums [rows][16] (+ bias) rounded to bfloat16 into y (ys elements apart). */
static inline void write_rows(const float *c, int rows, const uint16_t *bias, uint16_t *y,
                              int64_t ys) {
    __m512 b = _mm512_setzero_ps();
    if (bias)
        b = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)bias)), 16));
    for (int r = 0; r < rows; r++)
        _mm256_storeu_si256((void *)(y + r * ys),
                            round_bf16x16(_mm512_add_ps(_mm512_loadu_ps(c + r * 16), b)));
}

/* Rows [r0, r0 + rows0 + rows1) of x against column blocks wb0 (and wb1 unless NULL), over
 * all of K: up to 32 rows x 32 columns of y. */
static void chunk(const uint16_t *x, int64_t xs, int rows0, int rows1, const uint16_t *wb0,
                  const uint16_t *wb1, int64_t k, const uint16_t *bias, uint16_t *y, int64_t ys) {
    const int64_t sa = xs * 2; /* bytes between rows of x */
    const uint16_t *x1 = x + 16 * xs;
    _tile_zero(4);
    _tile_zero(5);
    if (rows1) {
        _tile_zero(6);
        _tile_zero(7);
    }
    for (int64_t kk = 0; kk < k; kk += 32) {
        int64_t off = kk * 16; /* 16 pairs of 16 columns x 2 per 32 K values */
        _tile_loadd(0, x + kk, sa);
        _tile_loadd(2, wb0 + off, 64);
        _tile_dpbf16ps(4, 0, 2);
        if (wb1) {
            _tile_loadd(3, wb1 + off, 64);
            _tile_dpbf16ps(5, 0, 3);
        }
        if (rows1) {
            _tile_loadd(1, x1 + kk, sa);
            _tile_dpbf16ps(6, 1, 2);
            if (wb1) _tile_dpbf16ps(7, 1, 3);
        }
    }
    float c[16 * 16];
    _tile_stored(4, c, 64);
    write_rows(c, rows0, bias, y, ys);
    if (wb1) {
        _tile_stored(5, c, 64);
        write_rows(c, rows0, bias ? bias + 16 : NULL, y + 16, ys);
    }
    if (rows1) {
        _tile_stored(6, c, 64);
        write_rows(c, rows1, bias, y + 16 * ys, ys);
        if (wb1) {
            _tile_stored(7, c, 64);
            write_rows(c, rows1, bias ? bias + 16 : NULL, y + 16 * ys + 16, ys);
        }
    }
}

static int permitted = -1; /* -1: not asked yet; 0: refused; 1: granted */

static int request_amx(void) {
    if (permitted < 0) /* idempotent: a race asks twice and gets the same answer */
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}
#endif

/* gemm_w8.c's int8 weight products on AMX-INT8 tiles, on the x it quantized (x_quant.h):
 * xq [m, groups * 32] int8 (rows xs bytes apart), xscale and xoff [m, groups] (xoff: -128
 * times the group's quantized sum, the U = Q + 128 offset); wq [n_out / 16, groups * 8, 16, 4]
 * uint8 and ws [n_out / 16, groups, 16] float32 (gemm_w8.c's packing, which is an AMX B tile:
 * 4 K values x 16 columns per 64-byte row). Per group of 32 K, TDPBSUD (signed x, unsigned U)
 * gives each (row, column) its exact int32 sum, the same integer vpdpbusd reaches; plus the
 * offset, converted, scaled by s[n, g] * xscale[r, g] and added to the row's float32 sums
 * with the same operations in the same order as gemm_w8.c's VNNI tile, so the result has
 * the same bits. Returns 0, or -2 without AMX or for n_out not a multiple of 16. */
int gemm_amx_w8(const int8_t *xq, int64_t xs, const float *xscale, const int32_t *xoff,
                int64_t groups, int64_t m, const uint8_t *wq, const float *ws,
                const uint16_t *bias, int64_t n_out, uint16_t *y) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && \
    defined(__AVX512BF16__)
    if (n_out % 16 != 0 || m < 1 || groups < 1 || !request_amx()) return -2;
    const int64_t ps = xs * 16; /* bytes per 16-column block */
    const int64_t vecs = n_out / 16, pairs = (vecs + 1) / 2;
#pragma omp parallel if (m * n_out * xs >= (1 << 19) || n_out * xs >= (1 << 17))
    {
        int cfg0 = -1, cfg1 = -1;
        float acc[32 * 32] __attribute__((aligned(64)));
        int32_t c[4][16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            int64_t v0 = 2 * p;
            int nvb = v0 + 1 < vecs ? 2 : 1;
            const uint8_t *wb[2] = {wq + v0 * ps, wq + (v0 + 1) * ps};
            const float *wsb[2] = {ws + v0 * groups * 16, ws + (v0 + 1) * groups * 16};
            for (int64_t r0 = 0; r0 < m; r0 += 32) {
                int rows0 = (int)(m - r0 < 16 ? m - r0 : 16);
                int64_t rest = m - r0 - 16;
                int rows1 = (int)(rest <= 0 ? 0 : rest < 16 ? rest : 16);
                if (rows0 != cfg0 || rows1 != cfg1) {
                    configure(rows0, rows1, 32, 8);
                    cfg0 = rows0, cfg1 = rows1;
                }
                int rows = rows0 + rows1;
                memset(acc, 0, sizeof acc);
                const int8_t *x0 = xq + r0 * xs, *x1 = x0 + 16 * xs;
                for (int64_t g = 0; g < groups; g++) {
                    int64_t wo = g * 8 * 64, xo = g * 32;
                    _tile_loadd(0, x0 + xo, xs);
                    _tile_loadd(2, wb[0] + wo, 64);
                    _tile_zero(4);
                    _tile_dpbsud(4, 0, 2);
                    if (nvb == 2) {
                        _tile_loadd(3, wb[1] + wo, 64);
                        _tile_zero(5);
                        _tile_dpbsud(5, 0, 3);
                    }
                    if (rows1) {
                        _tile_loadd(1, x1 + xo, xs);
                        _tile_zero(6);
                        _tile_dpbsud(6, 1, 2);
                        if (nvb == 2) {
                            _tile_zero(7);
                            _tile_dpbsud(7, 1, 3);
                        }
                    }
                    _tile_stored(4, c[0], 64);
                    if (nvb == 2) _tile_stored(5, c[1], 64);
                    if (rows1) {
                        _tile_stored(6, c[2], 64);
                        if (nvb == 2) _tile_stored(7, c[3], 64);
                    }
                    __m512 sw[2];
                    for (int j = 0; j < nvb; j++) sw[j] = _mm512_loadu_ps(wsb[j] + g * 16);
                    for (int r = 0; r < rows; r++) {
                        int64_t i = (r0 + r) * groups + g;
                        __m512 sx = _mm512_set1_ps(xscale[i]);
                        __m512i off = _mm512_set1_epi32(xoff[i]);
                        const int32_t *cr = c[(r >= 16) * 2] + (r & 15) * 16;
                        for (int j = 0; j < nvb; j++) {
                            float *a = acc + r * 32 + j * 16;
                            __m512i sum = _mm512_add_epi32(off, _mm512_load_si512(cr + j * 256));
                            _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                                               _mm512_mul_ps(sw[j], sx),
                                                               _mm512_load_ps(a)));
                        }
                    }
                }
                for (int j = 0; j < nvb; j++) {
                    __m512 b = _mm512_setzero_ps();
                    if (bias)
                        b = _mm512_castsi512_ps(_mm512_slli_epi32(
                            _mm512_cvtepu16_epi32(
                                _mm256_loadu_si256((const void *)(bias + (v0 + j) * 16))),
                            16));
                    for (int r = 0; r < rows; r++)
                        _mm256_storeu_si256(
                            (void *)(y + (r0 + r) * n_out + (v0 + j) * 16),
                            round_bf16x16(_mm512_add_ps(_mm512_load_ps(acc + r * 32 + j * 16), b)));
                }
            }
        }
        if (cfg0 >= 0) _tile_release();
    }
    return 0;
#else
    (void)xq, (void)xs, (void)xscale, (void)xoff, (void)groups, (void)m, (void)wq, (void)ws;
    (void)bias, (void)n_out, (void)y;
    return -2;
#endif
}

/* 1 when this build has the AMX kernel and the kernel granted this process AMX state. */
int gemm_amx_bf16_available(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return request_amx();
#else
    return 0;
#endif
}

/* x [m, k] bfloat16 (rows x_stride elements apart); wp [n_out / 16, k / 2, 16, 2] bfloat16
 * (gemm_bf16.c's layout); bias [n_out] bfloat16 or NULL; y [m, n_out] bfloat16 contiguous.
 * Returns 0, or -2 for a shape it does not take (k % 32, n_out % 16) or a machine without AMX
 * (callers keep the AVX512_BF16 tiles). */
int gemm_amx_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *wp,
                  const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (n_out % 16 != 0 || k % 32 != 0 || m < 1 || k < 32 || !request_amx()) return -2;
    const int64_t ps = k / 2 * 32; /* elements per 16-column block */
    const int64_t vecs = n_out / 16, pairs = (vecs + 1) / 2;
#pragma omp parallel if (m * n_out * k >= (1 << 19))
    {
        int cfg0 = -1, cfg1 = -1;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            int64_t v0 = 2 * p;
            const uint16_t *wb0 = wp + v0 * ps;
            const uint16_t *wb1 = v0 + 1 < vecs ? wb0 + ps : NULL;
            for (int64_t r0 = 0; r0 < m; r0 += 32) {
                int rows0 = (int)(m - r0 < 16 ? m - r0 : 16);
                int64_t rest = m - r0 - 16;
                int rows1 = (int)(rest <= 0 ? 0 : rest < 16 ? rest : 16);
                if (rows0 != cfg0 || rows1 != cfg1) {
                    configure(rows0, rows1, 64, 16);
                    cfg0 = rows0, cfg1 = rows1;
                }
                chunk(x + r0 * x_stride, x_stride, rows0, rows1, wb0, wb1, k,
                      bias ? bias + v0 * 16 : NULL, y + r0 * n_out + v0 * 16, n_out);
            }
        }
        if (cfg0 >= 0) _tile_release();
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)wp, (void)bias, (void)n_out, (void)k, (void)y;
    return -2;
#endif
}

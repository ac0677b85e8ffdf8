/* Prototypes of the CPU kernels, for the fused decode layers (decode_layers.c). */
#ifndef SPLITSERVE_KERNELS_H
#define SPLITSERVE_KERNELS_H

#include <stdint.h>
#include <string.h>

/* The decode KV cache's keys (and a gathered copy the decode kernel reads) are tiled by
 * KT_TILE positions: per slot and KV head, kt [cap / KT_TILE, D, KT_TILE] (cap a multiple of
 * KT_TILE), so one score block of KT_TILE keys is one contiguous D * KT_TILE run that the
 * hardware prefetcher follows (the untransposed [D, cap] rows were D separate streams of a
 * few lines each). Element (position p, dimension e) of one slot and head: */
#define KT_TILE 32
static inline int64_t kt_offset(int64_t d, int64_t p, int64_t e) {
    return (p / KT_TILE) * d * KT_TILE + e * KT_TILE + p % KT_TILE;
}

int decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kt,
                          const uint16_t *v, const int64_t *slots, const int64_t *lens,
                          int64_t rows, int64_t hkv, int64_t g_n, int64_t d_n, int64_t cap,
                          int64_t window, float scale, uint16_t *out);
int gemv_packed_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *wp,
                     const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y);
int gemm_packed_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *wp,
                     const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y);
int gemm_packed_bf16_available(void);
int gemm_amx_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *wp,
                  const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y);
int gemm_amx_bf16_available(void);
int gemm_amx_w8(const int8_t *xq, int64_t xs, const float *xscale, const int32_t *xoff,
                int64_t groups, int64_t m, const uint8_t *wq, const float *ws,
                const uint16_t *bias, int64_t n_out, uint16_t *y);
int decode_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *wp,
                       const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y);
int gemm_w8_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *wq,
                 const float *ws, const uint16_t *bias, int64_t n_out, int64_t k, uint16_t *y);
int gemm_w4_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *wq,
                 const uint16_t *ws, const uint16_t *bias, int64_t n_out, int64_t k,
                 uint16_t *y);
void kv_append_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                    int64_t t, int64_t hkv, int64_t d, uint16_t *pool_k, uint16_t *pool_v,
                    int64_t page_stride, const int64_t *page_ids, const int64_t *offsets,
                    uint16_t *ckt, uint16_t *cv, int64_t cap, const int64_t *slots,
                    const int64_t *pos);
/* KV pool kinds (decode_layers_bf16's kv_kind; kv_quant.c): bfloat16 pages, or 8-bit values
 * with per-token-and-head float32 scales. */
enum { KV_BF16 = 0, KV_INT8 = 1, KV_FP8_E4M3 = 2 };

/* A float8_e4m3fn code's value (sign, 4 exponent bits biased by 7, 3 mantissa bits; exponent 0:
 * subnormal, m * 2^-9). The NaN codes (0x7f, 0xff) are never written by kv_quant.c. */
static inline float fp8_e4m3_to_f32(uint8_t c) {
    uint32_t e = (c >> 3) & 15, m = c & 7, bits = (uint32_t)(c & 0x80) << 24;
    float f;
    if (e) { /* normal: 2^(e-7) * (1 + m/8), the same fields in float32 */
        bits |= ((e - 7 + 127) << 23) | (m << 20);
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    f = (float)m * 0x1p-9f;
    return (c & 0x80) ? -f : f;
}
int decode_attention_q8(const uint16_t *q, int64_t q_stride, const uint8_t *pool, int64_t k_off,
                        int64_t v_off, int64_t page_stride, int64_t value_bytes, int64_t kind,
                        int64_t ps, const int64_t *pages, int64_t pt_stride, const int64_t *lens,
                        int64_t rows, int64_t hkv, int64_t g_n, int64_t d_n, int64_t window,
                        float scale, uint16_t *out);
void kv_append_q8(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                  int64_t t, int64_t hkv, int64_t d, uint8_t *pool, int64_t k_off, int64_t v_off,
                  int64_t page_stride, int64_t value_bytes, int64_t kind,
                  const int64_t *page_ids, const int64_t *offsets, uint16_t *ckt, uint16_t *cv,
                  int64_t cap, const int64_t *slots, const int64_t *pos);
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual,
                   const uint16_t *w, float eps, int64_t t, int64_t h, uint16_t *res_out,
                   uint16_t *out);
void rope_bf16(uint16_t *qk, int64_t row_stride, int64_t t, int64_t heads, int64_t d,
               const int64_t *positions, const float *cos_table, const float *sin_table);
void silu_mul_bf16(const uint16_t *gate_up, int64_t t, int64_t n, uint16_t *out);

/* LoRA (lora.c): the int64s of one slot's entry for one projection (A, R, slices, then 5 per
 * slice: Bt, output offset, output size, rank offset, rank), and the largest rank served. */
#define LORA_F 20
#define LORA_MAX_RANK 512
int lora_sgmv_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride,
                   int64_t k, const int64_t *tab, int64_t slot_stride, const int64_t *rows,
                   const int64_t *segs, int64_t n_segs);

#endif

/* Every decoder layer of a decode-only step (1-3 rows; up to 128 with AVX512_BF16) in one call:
 * the same kernels, in the same order and with the same rounding, as the per-op path (llama.py
 * with cpu_kernels), minus ~10 Python-level calls per layer (at batch 1 that overhead was ~1/4
 * of the step; at batch 32, 2 threads, ~9%).
 *
 * Per layer l, from the hidden state x [m, H] (updated in place, the residual stream):
 *   h = norm1(x); qkv = h W_qkv + b; RoPE on q, k; K/V into pool and decode cache;
 *   a = attention(q); o = a W_o + b; x = x + o; n = norm2(x); x = x + down(silu(gate) * up).
 * With LoRA rows (lora_segs), each of the four products then adds its adapters' low-rank
 * products (lora.c), as the per-op path's Linear does.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

/* Per-layer addresses, NPTR per layer in this order (0 for an absent bias). Each projection
 * has its weight, bias and scales: with scales the weight is quantized, in gemm_w8.c's layout
 * (--quantization int8) or gemm_w4.c's (int4, float16 group scales) as the layer's BITS entry
 * (a number, 8 or 4, not an address) says; without, it is bfloat16 for decode_linear_bf16. */
enum {
    IN_NORM, QKV_W, QKV_B, QKV_S, O_W, O_B, O_S, POST_NORM, GU_W, GU_B, GU_S,
    DOWN_W, DOWN_B, DOWN_S, BITS, NPTR
};

#define P(l, i) ((const uint16_t *)(uintptr_t)ptrs[(l) * NPTR + (i)])
/* Projection p (0 qkv, 1 o, 2 gate_up, 3 down) of layer l: its adapters' products on y. */
#define LORA(p, x, xs, y, ys, k)                                                              \
    if (lora_nsegs && rc == 0)                                                                \
        rc = lora_sgmv_bf16(x, xs, y, ys, k, lora_tab + (l * 4 + (p)) * LORA_F,               \
                            lora_slot_stride, lora_rows, lora_segs, lora_nsegs)

/* Projection W of layer l (W, W + 1, W + 2: weight, bias, scales) on x [m, k] -> y [m, n]. */
static int project(const int64_t *ptrs, int64_t l, int w, const uint16_t *x, int64_t m,
                   int64_t n, int64_t k, uint16_t *y) {
    /* int4: float16 scales and offsets per group; int8: float32 scales per block of 32 */
    const void *scales = (const void *)(uintptr_t)ptrs[l * NPTR + w + 2];
    if (scales && ptrs[l * NPTR + BITS] == 4)
        return gemm_w4_bf16(x, k, m, (const uint8_t *)P(l, w), (const uint16_t *)scales,
                            P(l, w + 1), n, k, y);
    if (scales)
        return gemm_w8_bf16(x, k, m, (const uint8_t *)P(l, w), (const float *)scales,
                            P(l, w + 1), n, k, y);
    return decode_linear_bf16(x, k, m, P(l, w), P(l, w + 1), n, k, y);
}

/* dims: H, Hq, Hkv, D, I (intermediate); pool: this step's K of layer 0 page 0 at pool,
 * layers layer_stride elements apart, V at + v_offset, pages page_stride apart; kv_kind: the
 * pool's values (KV_BF16: bfloat16 elements; KV_INT8 / KV_FP8_E4M3: bytes, the strides in bytes
 * and each page's scales from byte value_bytes, kv_quant.c); cache: kt / cv of layer 0, layers
 * cache_stride apart; NULL kt: no cache, and then an 8-bit pool is read in place
 * (decode_attention_q8.c) through page_table [m, >= ceil(len / ps)] (rows pt_stride apart),
 * while a bfloat16 pool is refused (-2). lora_tab: the LoRA
 * entries of slot 0, LORA_F int64s per projection, four projections per layer (qkv, o,
 * gate_up, down), slots lora_slot_stride apart; lora_rows / lora_segs / lora_nsegs: the
 * adapted rows by slot (lora_sgmv_bf16); lora_nsegs 0: no LoRA this step.
 * Returns 0, -1 if out of memory, or a kernel's error code. */
int decode_layers_bf16(int64_t n_layers, const int64_t *ptrs, uint16_t *x, int64_t m,
                       int64_t hid, int64_t hq, int64_t hkv, int64_t d, int64_t inter,
                       float eps, float scale, int64_t window, const int64_t *positions,
                       const float *cos_table, const float *sin_table, void *pool,
                       int64_t layer_stride, int64_t v_offset, int64_t page_stride,
                       const int64_t *page_ids, const int64_t *offsets, uint16_t *ckt,
                       uint16_t *cv, int64_t cache_stride, int64_t cap, const int64_t *slots,
                       const int64_t *pos, const int64_t *lens, int64_t kv_kind,
                       int64_t value_bytes, const int64_t *page_table, int64_t pt_stride,
                       int64_t ps, const int64_t *lora_tab, int64_t lora_slot_stride,
                       const int64_t *lora_rows, const int64_t *lora_segs, int64_t lora_nsegs) {
    if (!ckt && kv_kind == KV_BF16) return -2;
    int64_t nqkv = (hq + 2 * hkv) * d;
    size_t need = (size_t)m * (size_t)(hid + nqkv + hq * d + hid + 2 * inter + inter + hid);
    uint16_t *buf = malloc(sizeof(uint16_t) * need);
    if (!buf) return -1;
    uint16_t *h = buf, *qkv = h + m * hid, *att = qkv + m * nqkv, *o = att + m * hq * d;
    uint16_t *gu = o + m * hid, *act = gu + m * 2 * inter, *dn = act + m * inter;
    int rc = 0;
    for (int64_t l = 0; l < n_layers && rc == 0; l++) {
        rms_norm_bf16(x, hid, NULL, P(l, IN_NORM), eps, m, hid, NULL, h);
        rc = project(ptrs, l, QKV_W, h, m, nqkv, hid, qkv);
        LORA(0, h, hid, qkv, nqkv, hid);
        if (rc) break;
        rope_bf16(qkv, nqkv, m, hq + hkv, d, positions, cos_table, sin_table);
        if (kv_kind == KV_BF16) {
            uint16_t *pk = (uint16_t *)pool + l * layer_stride;
            kv_append_bf16(qkv + hq * d, nqkv, qkv + (hq + hkv) * d, nqkv, m, hkv, d, pk,
                           pk + v_offset, page_stride, page_ids, offsets,
                           ckt + l * cache_stride, cv + l * cache_stride, cap, slots, pos);
        } else {
            kv_append_q8(qkv + hq * d, nqkv, qkv + (hq + hkv) * d, nqkv, m, hkv, d, pool,
                         l * layer_stride, l * layer_stride + v_offset, page_stride,
                         value_bytes, kv_kind, page_ids, offsets,
                         ckt ? ckt + l * cache_stride : NULL, ckt ? cv + l * cache_stride : NULL,
                         cap, slots, pos);
        }
        if (ckt)
            rc = decode_attention_bf16(qkv, nqkv, ckt + l * cache_stride, cv + l * cache_stride,
                                       slots, lens, m, hkv, hq / hkv, d, cap, window, scale, att);
        else
            rc = decode_attention_q8(qkv, nqkv, pool, l * layer_stride, l * layer_stride + v_offset,
                                     page_stride, value_bytes, kv_kind, ps, page_table, pt_stride,
                                     lens, m, hkv, hq / hkv, d, window, scale, att);
        if (rc) break;
        rc = project(ptrs, l, O_W, att, m, hid, hq * d, o);
        LORA(1, att, hq * d, o, hid, hq * d);
        if (rc) break;
        rms_norm_bf16(o, hid, x, P(l, POST_NORM), eps, m, hid, x, h); /* x += o; h = norm */
        rc = project(ptrs, l, GU_W, h, m, 2 * inter, hid, gu);
        LORA(2, h, hid, gu, 2 * inter, hid);
        if (rc) break;
        silu_mul_bf16(gu, m, inter, act);
        rc = project(ptrs, l, DOWN_W, act, m, hid, inter, dn);
        LORA(3, act, inter, dn, hid, inter);
        for (int64_t i = 0; i < m * hid; i++)
            x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(dn[i]));
    }
    free(buf);
    return rc;
}

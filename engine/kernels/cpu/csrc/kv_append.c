/* One decode step's new K/V, one layer: into the paged pool and into the decode KV cache in one
 * call (four indexed torch copies before: two pool writes, two cache appends). Pure copies, all
 * bfloat16 (any 2-byte dtype moves the same way).
 *
 * Pool: this layer's K of page 0 at pool_k and V at pool_v, pages page_stride elements apart,
 * tokens hkv * d apart inside a page. Cache (optional, ckt NULL to skip): ckt [slots, Hkv,
 * cap / KT_TILE, D, KT_TILE] (keys tiled, kernels.h) and cv [slots, Hkv, cap, D] of this layer.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* k, v [t, hkv, d] (rows k_stride / v_stride elements apart, heads contiguous); page_ids,
 * offsets [t] int64: where each token goes in the pool; slots, pos [t] int64: its cache slot
 * and position (ignored when ckt is NULL). */
void kv_append_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                    int64_t t, int64_t hkv, int64_t d, uint16_t *pool_k, uint16_t *pool_v,
                    int64_t page_stride, const int64_t *page_ids, const int64_t *offsets,
                    uint16_t *ckt, uint16_t *cv, int64_t cap, const int64_t *slots,
                    const int64_t *pos) {
    size_t row = sizeof(uint16_t) * (size_t)(hkv * d);
    /* Each token's tiled key touches d * 2 / 64 ... d cache lines of the cache (one per
     * dimension, KT_TILE positions to a tile row), and those misses, not the bytes, are the
     * cost: two threads take twice as many at once. */
#pragma omp parallel for schedule(static) if (ckt && t >= 8)
    for (int64_t i = 0; i < t; i++) {
        const uint16_t *ki = k + i * k_stride, *vi = v + i * v_stride;
        int64_t at = page_ids[i] * page_stride + offsets[i] * hkv * d;
        memcpy(pool_k + at, ki, row);
        memcpy(pool_v + at, vi, row);
        if (!ckt) continue;
        for (int64_t h = 0; h < hkv; h++) {
            int64_t base = (slots[i] * hkv + h) * d * cap;
            uint16_t *kt = ckt + base + kt_offset(d, pos[i], 0);
            for (int64_t e = 0; e < d; e++) kt[e * KT_TILE] = ki[h * d + e];
            memcpy(cv + base + pos[i] * d, vi + h * d, sizeof(uint16_t) * (size_t)d);
        }
    }
}

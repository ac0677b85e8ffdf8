/* Extend (prefill) attention on CPU, bfloat16: one sequence's n new query tokens against its
 * whole paged K/V (a cached prefix, then the new tokens), causal, optional sliding window.
 *
 * Flash-attention style (Dao et al., 2022, "FlashAttention"): each task takes RT query rows
 * (a row is one (token, query head) pair of one KV head) and walks that head's keys in blocks
 * of KB, keeping a running max, a running sum and float32 output sums per row (online softmax),
 * so no [n, seq_len] score matrix exists. Both products use vdpbf16ps (exact bfloat16
 * products, float32 sums): scores Q.K^T against keys packed as (d, d+1) pairs per key, and
 * P.V with the probabilities rounded to bfloat16 (as torch's CPU flash kernel rounds them for
 * its reduced-precision product) against values packed as (key j, key j+1) pairs per column.
 *
 * Key blocks start at multiples of KB in absolute position and a row only takes blocks that
 * hold one of its keys, so a row's output does not depend on which task, chunk or prefix split
 * it was computed in: a prompt gives the same bits with the radix cache on or off and with any
 * chunked-prefill size.
 *
 * K/V are read from the pool (layout of splitserve.engine.kv_pool.KVPool) and packed once per
 * call into the two pair layouts (~S * Hkv * D * 4 bytes); keys past seq_len are zero there, so
 * no pool bytes past the sequence are read. AVX512-BF16 only; elsewhere the entry point returns
 * -2 and the caller keeps torch's scaled_dot_product_attention.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"
#include "kernels.h"

#define KB 32  /* keys per block: two vectors of 16 scores */
#define RT 12  /* query rows per task: 24 score accumulators + 2 key vectors fit 32 registers */
#define RG 6   /* rows per P.V register group: 6 x 4 output vectors (64 columns) */
#define DMAX 256
#define ALWAYS_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512BF16__)

/* exp of 16 lanes: the polynomial of fast_exp.h, with the power of two applied by scalef. */
ALWAYS_INLINE __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.3981999507e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One layer's K or V in the pool: bfloat16 pages (kind KV_BF16: base is this layer's K or V of
 * page 0, page_stride in elements) or 8-bit ones (base is the pool's first byte, off this
 * layer's K or V in a page, page_stride in bytes, scales from byte value_bytes of a page:
 * kv_quant.c's layout). */
struct kv_rows {
    const void *base;
    int64_t page_stride, ps, hkv, off, value_bytes, kind;
};

/* Key `key`'s row of head h as bfloat16: in the pool, or de-quantized into tmp [d_n] as
 * kv_quant.dequantize_kv reads it (bf16(float(q) * scale)). */
static const uint16_t *kv_row(const struct kv_rows *src, const int64_t *pages, int64_t key,
                              int64_t h, int64_t d_n, uint16_t *tmp) {
    int64_t at = (key % src->ps) * src->hkv * d_n + h * d_n;
    if (src->kind == KV_BF16)
        return (const uint16_t *)src->base + pages[key / src->ps] * src->page_stride + at;
    const uint8_t *page = (const uint8_t *)src->base + pages[key / src->ps] * src->page_stride;
    const uint8_t *q = page + src->off + at;
    float s;
    memcpy(&s, page + src->value_bytes + 4 * ((src->off + at) / d_n), sizeof s);
    for (int64_t e = 0; e < d_n; e++) {
        float x = src->kind == KV_INT8 ? (float)(int8_t)q[e] : fp8_e4m3_to_f32(q[e]);
        tmp[e] = f32_to_bf16(x * s);
    }
    return tmp;
}

/* Keys [blk * KB, +KB) of one head as (d, d+1) pairs: kp[p * KB + j] holds dimensions 2p and
 * 2p+1 of key j, so one 32-bit broadcast of a query pair scores 16 keys per instruction. */
static void pack_keys(const struct kv_rows *src, const int64_t *pages, int64_t seq_len,
                      int64_t h, int64_t d_n, int64_t blk, uint32_t *kp) {
    int64_t pairs = d_n / 2;
    uint16_t tmp[DMAX];
    for (int64_t j = 0; j < KB; j++) {
        int64_t key = blk * KB + j;
        if (key >= seq_len) {
            for (int64_t p = 0; p < pairs; p++) kp[p * KB + j] = 0;
            continue;
        }
        const uint16_t *row = kv_row(src, pages, key, h, d_n, tmp);
        uint32_t w[DMAX / 2];
        memcpy(w, row, sizeof(uint16_t) * (size_t)d_n);
        for (int64_t p = 0; p < pairs; p++) kp[p * KB + j] = w[p];
    }
}

/* Values of keys [blk * KB, +KB) of one head as (key 2t, key 2t+1) pairs per column:
 * vp[t * D + c] (t < KB / 2), low half the even key. */
static void pack_values(const struct kv_rows *src, const int64_t *pages, int64_t seq_len,
                        int64_t h, int64_t d_n, int64_t blk, uint32_t *vp) {
    /* index e < 32 of a pair of 32-column chunks: even e from a, odd from b (the +32) */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25,
                                        56, 24, 55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18,
                                        49, 17, 48, 16);
    uint16_t zero[DMAX] = {0}, tmp[2][DMAX];
    for (int64_t t = 0; t < KB / 2; t++) {
        const uint16_t *rows[2];
        for (int s = 0; s < 2; s++) {
            int64_t key = blk * KB + 2 * t + s;
            rows[s] = key < seq_len ? kv_row(src, pages, key, h, d_n, tmp[s]) : zero;
        }
        uint32_t *out = vp + t * d_n;
        int64_t c = 0;
        for (; c + 32 <= d_n; c += 32) {
            __m512i a = _mm512_loadu_si512(rows[0] + c), b = _mm512_loadu_si512(rows[1] + c);
            _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(out + c + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
        for (; c < d_n; c++) out[c] = (uint32_t)rows[0][c] | ((uint32_t)rows[1][c] << 16);
    }
}

/* s[r][0..1] = Q_r . K_j for the RT rows and the KB keys of one packed block (unscaled). */
ALWAYS_INLINE void score_block(const uint32_t *qp, const uint32_t *kp, int64_t pairs,
                               __m512 s[RT][2]) {
#pragma GCC unroll 12
    for (int r = 0; r < RT; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * KB);
        __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + p * KB + 16);
#pragma GCC unroll 12
        for (int r = 0; r < RT; r++) {
            __m512bh q = (__m512bh)_mm512_set1_epi32((int)qp[r * (DMAX / 2) + p]);
            s[r][0] = _mm512_dpbf16_ps(s[r][0], k0, q);
            s[r][1] = _mm512_dpbf16_ps(s[r][1], k1, q);
        }
    }
}

/* o[r] += P_r . V for RG rows starting at r0 and W (<= 4) vectors of 16 columns at column c;
 * pb[r] holds row r's KB probabilities as bfloat16 pairs. */
ALWAYS_INLINE void weight_values(const uint32_t *pb, const uint32_t *vp, int64_t d_n,
                                 int64_t c, int w, int r0, float *o) {
    __m512 acc[RG][4];
#pragma GCC unroll 6
    for (int r = 0; r < RG; r++)
#pragma GCC unroll 4
        for (int x = 0; x < w; x++) acc[r][x] = _mm512_loadu_ps(o + (r0 + r) * DMAX + c + 16 * x);
    for (int t = 0; t < KB / 2; t++) {
        __m512bh v[4];
#pragma GCC unroll 4
        for (int x = 0; x < w; x++)
            v[x] = (__m512bh)_mm512_loadu_si512(vp + t * d_n + c + 16 * x);
#pragma GCC unroll 6
        for (int r = 0; r < RG; r++) {
            __m512bh p = (__m512bh)_mm512_set1_epi32((int)pb[(r0 + r) * (KB / 2) + t]);
#pragma GCC unroll 4
            for (int x = 0; x < w; x++) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], v[x], p);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < RG; r++)
#pragma GCC unroll 4
        for (int x = 0; x < w; x++) _mm512_storeu_ps(o + (r0 + r) * DMAX + c + 16 * x, acc[r][x]);
}

static void weight_all(const uint32_t *pb, const uint32_t *vp, int64_t d_n, float *o) {
    for (int r0 = 0; r0 < RT; r0 += RG) {
        int64_t c = 0;
        for (; c + 64 <= d_n; c += 64) weight_values(pb, vp, d_n, c, 4, r0, o);
        switch ((d_n - c) / 16) { /* constant widths, so the sums stay in registers */
        case 3: weight_values(pb, vp, d_n, c, 3, r0, o); break;
        case 2: weight_values(pb, vp, d_n, c, 2, r0, o); break;
        case 1: weight_values(pb, vp, d_n, c, 1, r0, o); break;
        default: break;
        }
    }
}

/* Per-row state of one task. */
typedef struct {
    int64_t pos, lo; /* the row's position and its first visible key */
    float m;         /* running max of the scaled scores */
    __m512 l;        /* running sum of exp(score - m), 16 lanes (one reduction, at the end) */
} row_state;

/* One task: rows [r0, r0 + RT) of head h (row r = token r / g_n, query head h * g_n + r % g_n;
 * rows past n * g_n are padding and write nothing). */
static void attend_task(const uint16_t *q, int64_t q_stride, int64_t n, int64_t prefix,
                        const uint32_t *kp, const uint32_t *vp, int64_t hkv, int64_t g_n,
                        int64_t d_n, int64_t h, int64_t r0, int64_t window, float scale,
                        uint16_t *out) {
    int64_t rows = n * g_n, pairs = d_n / 2;
    uint32_t qp[RT * (DMAX / 2)];
    uint32_t pb[RT * (KB / 2)];
    float o[RT * DMAX];
    row_state st[RT];
    memset(o, 0, sizeof o);
    for (int r = 0; r < RT; r++) {
        int64_t row = r0 + r < rows ? r0 + r : rows - 1; /* padding repeats the last row */
        int64_t tok = row / g_n, head = h * g_n + row % g_n;
        memcpy(qp + r * (DMAX / 2), q + tok * q_stride + head * d_n,
               sizeof(uint16_t) * (size_t)d_n);
        st[r].pos = prefix + tok;
        st[r].lo = window > 0 && st[r].pos >= window ? st[r].pos - window + 1 : 0;
        st[r].m = -INFINITY;
        st[r].l = _mm512_setzero_ps();
    }
    int64_t first = st[0].lo / KB, last = st[RT - 1].pos / KB;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t blk = first; blk <= last; blk++) {
        __m512 s[RT][2];
        score_block(qp, kp + blk * pairs * KB, pairs, s);
        int any = 0;
        for (int r = 0; r < RT; r++) {
            /* keys blk * KB + j visible to row r: lo <= key <= pos */
            __m512i key0 = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(blk * KB)));
            __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(16));
            __m512i lo = _mm512_set1_epi32((int)st[r].lo), hi = _mm512_set1_epi32((int)st[r].pos);
            __mmask16 v0 = _mm512_cmpge_epi32_mask(key0, lo) & _mm512_cmple_epi32_mask(key0, hi);
            __mmask16 v1 = _mm512_cmpge_epi32_mask(key1, lo) & _mm512_cmple_epi32_mask(key1, hi);
            uint32_t *pr = pb + r * (KB / 2);
            if (!(v0 | v1)) { /* no key of this row here: nothing to add */
                memset(pr, 0, sizeof(uint32_t) * (KB / 2));
                continue;
            }
            any = 1;
            __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
            __m512 a = _mm512_mask_mul_ps(ninf, v0, s[r][0], sc);
            __m512 b = _mm512_mask_mul_ps(ninf, v1, s[r][1], sc);
            float bm = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
            float m_new = bm > st[r].m ? bm : st[r].m;
            __m512 mv = _mm512_set1_ps(m_new);
            __m512 pa = _mm512_maskz_mov_ps(v0, exp16(_mm512_sub_ps(a, mv)));
            __m512 pbv = _mm512_maskz_mov_ps(v1, exp16(_mm512_sub_ps(b, mv)));
            if (m_new > st[r].m) {
                /* rescale the old sums; the first block of a row has none (m = -inf) */
                float alpha = st[r].m == -INFINITY ? 0.0f : exp_approx(st[r].m - m_new);
                __m512 av = _mm512_set1_ps(alpha);
                for (int64_t c = 0; c < d_n; c += 16)
                    _mm512_storeu_ps(o + r * DMAX + c,
                                     _mm512_mul_ps(_mm512_loadu_ps(o + r * DMAX + c), av));
                st[r].l = _mm512_mul_ps(st[r].l, av);
                st[r].m = m_new;
            }
            st[r].l = _mm512_add_ps(st[r].l, _mm512_add_ps(pa, pbv));
            /* 32 probabilities as bfloat16, in key order: (key 2t, key 2t+1) per 32 bits */
            _mm512_storeu_si512(pr, (__m512i)_mm512_cvtne2ps_pbh(pbv, pa));
        }
        if (any) weight_all(pb, vp + blk * (KB / 2) * d_n, d_n, o);
    }
    for (int r = 0; r < RT && r0 + r < rows; r++) {
        int64_t row = r0 + r, tok = row / g_n, head = h * g_n + row % g_n;
        float inv = 1.0f / _mm512_reduce_add_ps(st[r].l);
        uint16_t *dst = out + (tok * hkv * g_n + head) * d_n;
        for (int64_t c = 0; c < d_n; c++) dst[c] = f32_to_bf16(o[r * DMAX + c] * inv);
    }
}

/* q [n, Hkv * G, D] (tokens q_stride elements apart, heads contiguous): the sequence's last n
 * tokens, at positions seq_len - n .. seq_len - 1, whose K/V are already in the pool.
 * k_base / v_base: this layer's K / V of page 0 ([page_size, Hkv, D] per page, pages
 * page_stride elements apart); pages [ceil(seq_len / ps)] int64. window > 0 keeps each query's
 * last `window` keys (itself included). out [n, Hkv * G, D] contiguous. D even and at most 256.
 * Returns 0, -1 if out of memory, -2 where the kernel does not apply (no AVX512-BF16, shape). */
static int extend_attention(const uint16_t *q, int64_t q_stride, int64_t n,
                            const struct kv_rows *k_src, const struct kv_rows *v_src,
                            const int64_t *pages, int64_t seq_len, int64_t hkv, int64_t g_n,
                            int64_t d_n, int64_t window, float scale, uint16_t *out) {
    if (n < 1 || n > seq_len || g_n < 1 || d_n % 16 != 0 || d_n > DMAX || seq_len >= INT32_MAX)
        return -2;
    int64_t blocks = (seq_len + KB - 1) / KB;
    int64_t first = window > 0 && seq_len - n >= window ? (seq_len - n - window + 1) / KB : 0;
    size_t per_head = (size_t)(blocks * KB * d_n / 2);
    uint32_t *kp = malloc(sizeof(uint32_t) * per_head * (size_t)hkv);
    uint32_t *vp = malloc(sizeof(uint32_t) * per_head * (size_t)hkv);
    if (!kp || !vp) {
        free(kp);
        free(vp);
        return -1;
    }
    int64_t row_tasks = (n * g_n + RT - 1) / RT;
#pragma omp parallel if (n * seq_len >= 4096)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < hkv * (blocks - first); t++) {
            int64_t h = t / (blocks - first), blk = first + t % (blocks - first);
            uint32_t *kh = kp + per_head * (size_t)h, *vh = vp + per_head * (size_t)h;
            pack_keys(k_src, pages, seq_len, h, d_n, blk, kh + blk * KB * d_n / 2);
            pack_values(v_src, pages, seq_len, h, d_n, blk, vh + blk * KB * d_n / 2);
        }
        /* Later rows see more keys: hand out the longest tasks first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < hkv * row_tasks; t++) {
            int64_t h = t % hkv, r0 = (row_tasks - 1 - t / hkv) * RT;
            attend_task(q, q_stride, n, seq_len - n, kp + per_head * (size_t)h,
                        vp + per_head * (size_t)h, hkv, g_n, d_n, h, r0, window, scale, out);
        }
    }
    free(kp);
    free(vp);
    return 0;
}

int extend_attention_bf16(const uint16_t *q, int64_t q_stride, int64_t n, const uint16_t *k_base,
                          const uint16_t *v_base, int64_t page_stride, int64_t ps,
                          const int64_t *pages, int64_t seq_len, int64_t hkv, int64_t g_n,
                          int64_t d_n, int64_t window, float scale, uint16_t *out) {
    struct kv_rows k = {k_base, page_stride, ps, hkv, 0, 0, KV_BF16};
    struct kv_rows v = {v_base, page_stride, ps, hkv, 0, 0, KV_BF16};
    return extend_attention(q, q_stride, n, &k, &v, pages, seq_len, hkv, g_n, d_n, window,
                            scale, out);
}

/* extend_attention_bf16 over an 8-bit pool (kind KV_INT8 or KV_FP8_E4M3): pool is its first
 * byte, this layer's K at byte k_off of a page and V at v_off, pages page_stride bytes apart,
 * scales from byte value_bytes of a page. Rows are de-quantized as they are packed: the result
 * is the bfloat16 kernel's over a pool holding the de-quantized values. */
int extend_attention_q8(const uint16_t *q, int64_t q_stride, int64_t n, const uint8_t *pool,
                        int64_t k_off, int64_t v_off, int64_t page_stride, int64_t value_bytes,
                        int64_t kind, int64_t ps, const int64_t *pages, int64_t seq_len,
                        int64_t hkv, int64_t g_n, int64_t d_n, int64_t window, float scale,
                        uint16_t *out) {
    if (kind != KV_INT8 && kind != KV_FP8_E4M3) return -2;
    struct kv_rows k = {pool, page_stride, ps, hkv, k_off, value_bytes, kind};
    struct kv_rows v = {pool, page_stride, ps, hkv, v_off, value_bytes, kind};
    return extend_attention(q, q_stride, n, &k, &v, pages, seq_len, hkv, g_n, d_n, window,
                            scale, out);
}

#else

int extend_attention_q8(const uint16_t *q, int64_t q_stride, int64_t n, const uint8_t *pool,
                        int64_t k_off, int64_t v_off, int64_t page_stride, int64_t value_bytes,
                        int64_t kind, int64_t ps, const int64_t *pages, int64_t seq_len,
                        int64_t hkv, int64_t g_n, int64_t d_n, int64_t window, float scale,
                        uint16_t *out) {
    (void)q, (void)q_stride, (void)n, (void)pool, (void)k_off, (void)v_off, (void)page_stride;
    (void)value_bytes, (void)kind, (void)ps, (void)pages, (void)seq_len, (void)hkv, (void)g_n;
    (void)d_n, (void)window, (void)scale, (void)out;
    return -2;
}

int extend_attention_bf16(const uint16_t *q, int64_t q_stride, int64_t n, const uint16_t *k_base,
                          const uint16_t *v_base, int64_t page_stride, int64_t ps,
                          const int64_t *pages, int64_t seq_len, int64_t hkv, int64_t g_n,
                          int64_t d_n, int64_t window, float scale, uint16_t *out) {
    (void)q, (void)q_stride, (void)n, (void)k_base, (void)v_base, (void)page_stride, (void)ps;
    (void)pages, (void)seq_len, (void)hkv, (void)g_n, (void)d_n, (void)window, (void)scale;
    (void)out;
    return -2;
}

#endif

/* Decode attention straight from an 8-bit KV pool (--kv-cache-dtype int8 | fp8_e4m3), one new
 * token per row: no bfloat16 copy of the sequence (the decode KV cache) and no gather.
 *
 * For each (row r, KV head h) task, as decode_attention.c does over the decode cache: the
 * G = Hq / Hkv query heads of that KV head score the row's keys 0..len-1 (the last `window`
 * of them with a sliding window), softmax, and weight the values, all in float32. Each key
 * and value vector is read where the pool keeps it (page pages[r][j / page_size], slot
 * j % page_size, kv_quant.c's layout) and de-quantized in registers: a token's D bytes become
 * float32 (int8: sign-extended; fp8_e4m3: its bits placed in a float16 and widened, times 256)
 * and its float32 scale is applied once to the dot product (keys) or to the probability
 * (values). So the step reads 1 byte per value plus 4 per token and head, against 2 per value
 * for the bfloat16 cache, and nothing is rounded to bfloat16 but the output (nearest even).
 *
 * Keys are token-major in the pool, so a score is a dot product across D: per key, the G
 * heads' D / 16 products stay as 16-lane partial sums, and the partial sums of 16 keys are
 * reduced together by a shuffle tree (45 instructions for 16 scores instead of 16 separate
 * horizontal sums). Tasks are split over torch's OpenMP threads like decode_attention.c's.
 * Built with -O3 -march=native; without AVX-512 the same arithmetic runs on AVX2 + F16C in
 * 8-float registers (batch 32, ~190 keys, one Zen 3 core: 3.4 -> 0.52 ms per layer, the bfloat16
 * cache's kernel 0.31), and elsewhere in plain C loops.
 *
 * int8 keys' scores are integer dot products where the CPU has integer multiply-adds: the G
 * query heads rounded to int16 per head (quantize_q: scale max |q| / 32767), each key's bytes
 * sign-extended to int16 and multiplied-and-summed into int32 lanes (vpdpwssd with
 * AVX512-VNNI; vpmaddwd + vpaddd with AVX2, 16 products an instruction against the float path's
 * 8 per FMA plus a conversion per 8 bytes), the exact integer sum converted to float and scaled
 * by the head's q scale, then the token's scale. The sums being exact and the float steps the
 * same, an AVX2 build's int8 scores equal an AVX512-VNNI build's bit for bit (checked against a
 * scalar model of that arithmetic over 14.6k scores, G 1-8, D 16-256); the outputs can still
 * differ in the last bit, from softmax's vector width. fp8_e4m3 keys keep the float path.
 * On AVX2 the value sum takes 3 heads x 32 columns a pass (a lone head 64), the scale folded
 * into the probability once by the first pass: 2 passes over a head's values for G 3, D 64,
 * where 4 heads x 16 columns took 4 (the same products, so the same bits as before).
 * Measured on a shared 2-core Zen 3 (AVX2, no AVX-512), one thread, SmolLM2-135M's heads
 * (G 3, D 64), batch 32, 512 keys, int8, old (float scores, 4 value passes) vs new alternated in
 * one process: per layer, one layer over and over, min 1327 -> 728 us (the bfloat16 cache's
 * kernel 1330); 30 layers in turn (cold caches, as in a step) 2078 -> 1097 us (bf16 1858).
 * `python bench/kv8_decode_step.py --batch 32 --context 512 --steps 10 --threads 1 --configs
 * bf16 int8` (int8 in place against bf16 with its decode cache, one process), runs of the old
 * and new kernels alternated on that shared machine: old 0.82-1.03x (median of 7 runs 0.98x),
 * new 0.97-1.13x (median 1.08x); issue 36 asks 1.1x, so not reliably there on AVX2 yet.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "softmax.h"

#define KB 16   /* keys per block of the score loop: one 16-lane vector of scores */
#define GMAX 8  /* query heads per KV head */
#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* Pages asked for ahead of the one being read, into L2 (prefetcht1): one page ahead into L1
 * left the kernel waiting on memory (5.0 ms per layer at batch 32, 2k tokens, one thread,
 * against 3.6-4.1 ms four pages ahead; the bfloat16 cache's kernel took 5.4). */
#define PF_DIST 4
#define PF_LOC 2

/* Where this task's tokens sit: pool bytes, pages `stride` bytes apart, scales from byte
 * value_bytes; vec0: the index of this layer's K (or V) vector of slot 0 and the task's KV
 * head (byte offset / D), slots hkv vectors apart. */
struct q8_rows {
    const uint8_t *pool;
    const int64_t *pages; /* the row's page ids */
    int64_t n_pages;      /* how many of them the row reaches */
    int64_t vec0, stride, value_bytes, ps, hkv, d_n;
};

/* Ask for page p's vectors of this head (and their scales) ahead of use: a head's tokens are
 * every hkv-th vector of a page, too short a run for the hardware prefetcher to pick up
 * before it ends (the bfloat16 decode cache, one long run per head, streams ~2.5x faster). */
ALWAYS_INLINE void q8_prefetch_page(const struct q8_rows *t, int64_t p) {
    if (p >= t->n_pages) return;
    const uint8_t *page = t->pool + t->pages[p] * t->stride;
    for (int64_t slot = 0; slot < t->ps; slot++) {
        const uint8_t *vec = page + (t->vec0 + slot * t->hkv) * t->d_n;
        for (int64_t b = 0; b < t->d_n; b += 64) __builtin_prefetch(vec + b, 0, PF_LOC);
    }
    const uint8_t *sc = page + t->value_bytes + 4 * t->vec0;
    for (int64_t b = 0; b < 4 * t->ps * t->hkv; b += 64) __builtin_prefetch(sc + b, 0, PF_LOC);
}

/* A walk over consecutive tokens: the current token's vector and scale, its slot and page,
 * stepped by pointer increments (a 64-bit divide is tens of cycles: one per token, to find
 * its page, cost more than its arithmetic; so did recomputing each address from the page). */
struct q8_walk {
    const uint8_t *vec;
    const uint8_t *scale;
    int64_t page, slot;
};

ALWAYS_INLINE void q8_seek(const struct q8_rows *t, struct q8_walk *w) {
    const uint8_t *page = t->pool + t->pages[w->page] * t->stride;
    int64_t vec = t->vec0 + w->slot * t->hkv; /* [D]-vector index in the page */
    w->vec = page + vec * t->d_n;
    w->scale = page + t->value_bytes + 4 * vec;
}

ALWAYS_INLINE struct q8_walk q8_at(const struct q8_rows *t, int64_t j) {
    struct q8_walk w = {0, 0, j / t->ps, j % t->ps};
    q8_seek(t, &w);
    return w;
}

/* The walk's token's D bytes and its scale (fp8's factor 256 folded in, see load_q8x16);
 * then the walk moves to the next token (which must exist when it is in another page). */
ALWAYS_INLINE const uint8_t *q8_next(const struct q8_rows *t, struct q8_walk *w,
                                     float fp8_factor, float *scale) {
    const uint8_t *vec = w->vec;
    float s;
    memcpy(&s, w->scale, sizeof s);
    *scale = s * fp8_factor;
    if (++w->slot == t->ps) {
        w->slot = 0;
        if (++w->page < t->n_pages) q8_seek(t, w);
    } else {
        w->vec += t->hkv * t->d_n;
        w->scale += 4 * t->hkv;
    }
    return vec;
}

/* The G query heads as int16 for the integer key scores (vpdpwssd with AVX512-VNNI, vpmaddwd
 * with AVX2): per head, scale = max |q| / 32767 (1 for a zero
 * head) and q16 = q / scale rounded to nearest even (~2^-16 of the head's largest value:
 * far below the bfloat16 rounding q already carries), padded with zeros to a multiple of 32. */
ALWAYS_INLINE void quantize_q(const float *q, int64_t g_n, int64_t d_n, int16_t *q16,
                              float *qscale) {
    int64_t d_pad = (d_n + 31) / 32 * 32;
    for (int64_t g = 0; g < g_n; g++) {
        float amax = 0.0f;
        for (int64_t d = 0; d < d_n; d++) {
            float a = q[g * d_n + d] < 0 ? -q[g * d_n + d] : q[g * d_n + d];
            amax = a > amax ? a : amax;
        }
        float s = amax > 0.0f ? amax / 32767.0f : 1.0f, inv = 1.0f / s;
        for (int64_t d = 0; d < d_pad; d++) {
            int32_t v = d < d_n ? (int32_t)__builtin_rintf(q[g * d_n + d] * inv) : 0;
            v = v > 32767 ? 32767 : (v < -32767 ? -32767 : v);
            q16[g * d_pad + d] = (int16_t)v;
        }
        qscale[g] = s;
    }
}

#if defined(__AVX512F__)
/* 16 stored values -> float32: int8 sign-extended; a float8_e4m3fn code c as the float16
 * whose bits are (c & 0x80) << 8 | (c & 0x7f) << 7, which is c's value / 256 exactly
 * (subnormals included; kv_quant.c never writes the NaN codes). */
ALWAYS_INLINE __m512 load_q8x16(const uint8_t *p, int fp8) {
    __m128i b = _mm_loadu_si128((const void *)p);
    if (!fp8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    __m256i w = _mm256_cvtepu8_epi16(b);
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_cvtph_ps(h);
}

/* a[j] for j < 16 -> lane j holds the sum of a[j]'s 16 lanes. Pairs are folded within 128-bit
 * lanes (unpack + add), then across them (shuffle_f32x4 + add); lane L of the result holds
 * keys 4L..4L+3 in order. */
ALWAYS_INLINE __m512 sum16(const __m512 *a) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
}

/* scores[g * n + j] = q[g] . k_j * scale_j for the keys start + j0 .. start + j0 + count - 1
 * (count <= KB); q holds the G heads in float32, softmax scale applied. */
ALWAYS_INLINE void score_block(const float *q, const struct q8_rows *k, int fp8, int64_t g_n,
                               int64_t d_n, int64_t start, int64_t j0, int64_t count,
                               float *scores, int64_t n) {
    __m512 part[GMAX][KB];
    float ks[KB];
    float factor = fp8 ? 256.0f : 1.0f;
    struct q8_walk w = q8_at(k, start + j0);
    q8_prefetch_page(k, w.page + PF_DIST);
    for (int64_t jj = 0; jj < count; jj++) {
        const uint8_t *kp = q8_next(k, &w, factor, &ks[jj]);
        __m512 kv[16];
#pragma GCC unroll 16
        for (int64_t c = 0; c < d_n / 16; c++) kv[c] = load_q8x16(kp + 16 * c, fp8);
#pragma GCC unroll 8
        for (int64_t g = 0; g < g_n; g++) {
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + g * d_n), kv[0]);
#pragma GCC unroll 16
            for (int64_t c = 1; c < d_n / 16; c++)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d_n + 16 * c), kv[c], acc);
            part[g][jj] = acc;
        }
    }
    for (int64_t jj = count; jj < KB; jj++) {
        ks[jj] = 0.0f;
        for (int64_t g = 0; g < g_n; g++) part[g][jj] = _mm512_setzero_ps();
    }
    __m512 vs = _mm512_loadu_ps(ks);
    __mmask16 keep = (__mmask16)((1u << count) - 1u);
    for (int64_t g = 0; g < g_n; g++)
        _mm512_mask_storeu_ps(scores + g * n + j0, keep, _mm512_mul_ps(sum16(part[g]), vs));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_INT_SCORES 1
/* sum16 in int32. */
ALWAYS_INLINE __m512i sum16_epi32(const __m512i *a) {
    __m512i t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(w[0], w[1], 0x88),
                            _mm512_shuffle_i32x4(w[0], w[1], 0xdd));
}

/* score_block for int8 pages with AVX512-VNNI: scores[g * n + j] = qscale[g] * scale_j *
 * (sum_d q16[g][d] * k_j[d]), the integer sum exact (|q16 * k| < 2^22, D <= 256 of them):
 * each key's bytes sign-extended to 16 bits, 32 at a time, against the head's q16 with
 * vpdpwssd; 16 keys' lanes then reduced together (sum16_epi32). */
ALWAYS_INLINE void score_block_i8(const int16_t *q16, const float *qscale,
                                  const struct q8_rows *k, int64_t g_n, int64_t d_n,
                                  int64_t start, int64_t j0, int64_t count, float *scores,
                                  int64_t n) {
    __m512i part[GMAX][KB];
    float ks[KB];
    int64_t chunks = (d_n + 31) / 32, tail = d_n - 32 * (chunks - 1);
    __mmask32 last = tail == 32 ? ~(__mmask32)0 : (((__mmask32)1 << tail) - 1);
    struct q8_walk w = q8_at(k, start + j0);
    q8_prefetch_page(k, w.page + PF_DIST);
    for (int64_t jj = 0; jj < count; jj++) {
        const uint8_t *kp = q8_next(k, &w, 1.0f, &ks[jj]);
        __m512i acc[GMAX];
#pragma GCC unroll 8
        for (int64_t g = 0; g < g_n; g++) acc[g] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int64_t c = 0; c < chunks; c++) {
            __m256i b = c + 1 < chunks ? _mm256_loadu_si256((const void *)(kp + 32 * c))
                                       : _mm256_maskz_loadu_epi8(last, kp + 32 * c);
            __m512i kv = _mm512_cvtepi8_epi16(b);
#pragma GCC unroll 8
            for (int64_t g = 0; g < g_n; g++)
                acc[g] = _mm512_dpwssd_epi32(
                    acc[g], kv, _mm512_loadu_si512((const void *)(q16 + (g * chunks + c) * 32)));
        }
#pragma GCC unroll 8
        for (int64_t g = 0; g < g_n; g++) part[g][jj] = acc[g];
    }
    for (int64_t jj = count; jj < KB; jj++) {
        ks[jj] = 0.0f;
        for (int64_t g = 0; g < g_n; g++) part[g][jj] = _mm512_setzero_si512();
    }
    __m512 vs = _mm512_loadu_ps(ks);
    __mmask16 keep = (__mmask16)((1u << count) - 1u);
    for (int64_t g = 0; g < g_n; g++) {
        __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(sum16_epi32(part[g])),
                                  _mm512_set1_ps(qscale[g]));
        _mm512_mask_storeu_ps(scores + g * n + j0, keep, _mm512_mul_ps(sc, vs));
    }
}
#endif

/* out[g] = sum_j probs[g][j] * v_j * scale_j over the n values from start, rounded to
 * bfloat16; G * D sums in registers. */
ALWAYS_INLINE void weight_values(const float *probs, const struct q8_rows *v, int fp8,
                                 int64_t g_n, int64_t d_n, int64_t start, int64_t n,
                                 uint16_t *out) {
    __m512 acc[GMAX][16];
    float factor = fp8 ? 256.0f : 1.0f;
#pragma GCC unroll 8
    for (int64_t g = 0; g < g_n; g++)
#pragma GCC unroll 16
        for (int64_t c = 0; c < d_n / 16; c++) acc[g][c] = _mm512_setzero_ps();
    struct q8_walk w = q8_at(v, start);
    for (int64_t p = 1; p < PF_DIST; p++) q8_prefetch_page(v, w.page + p);
    for (int64_t j = 0; j < n; j++) {
        float vs;
        if (w.slot == 0) q8_prefetch_page(v, w.page + PF_DIST);
        const uint8_t *vp = q8_next(v, &w, factor, &vs);
        __m512 vv[16];
#pragma GCC unroll 16
        for (int64_t c = 0; c < d_n / 16; c++) vv[c] = load_q8x16(vp + 16 * c, fp8);
#pragma GCC unroll 8
        for (int64_t g = 0; g < g_n; g++) {
            __m512 p = _mm512_set1_ps(probs[g * n + j] * vs);
#pragma GCC unroll 16
            for (int64_t c = 0; c < d_n / 16; c++) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
        }
    }
    for (int64_t g = 0; g < g_n; g++)
        for (int64_t c = 0; c < d_n / 16; c++)
            _mm256_storeu_si256((void *)(out + g * d_n + 16 * c), round_bf16x16(acc[g][c]));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
/* AVX2 (16 registers of 8 floats): the AVX-512 path's arithmetic on 8-float registers (the
 * plain C loops below ran 11x slower than the bfloat16 cache's kernel on a Zen 3 core), int8
 * keys' scores in int32 as with AVX512-VNNI. */

/* 8 stored values -> float32, as load_q8x16 does for 16 (fp8: its value / 256, via F16C). */
ALWAYS_INLINE __m256 load_q8x8(const uint8_t *p, int fp8) {
    __m128i b = _mm_loadl_epi64((const void *)p);
    if (!fp8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    __m128i w = _mm_cvtepu8_epi16(b);
    __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                             _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
    return _mm256_cvtph_ps(h);
}

/* a[j] for j < 8 -> lane j holds the sum of a[j]'s 8 lanes (two rounds of hadd, then the
 * 128-bit halves added). */
ALWAYS_INLINE __m256 sum8(const __m256 *a) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The first min(c, 8) lanes of x to p (a memcpy of a partial block compiled to rep movsl,
 * whose start-up cost showed in the profile). */
ALWAYS_INLINE void store_first(float *p, int64_t c, __m256 x) {
    if (c >= 8) {
        _mm256_storeu_ps(p, x);
        return;
    }
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)c), lane), x);
}

/* The AVX-512 score_block's contract: a key's D values converted once, each head's dot
 * product in two 8-lane partial sums, 8 keys' partial sums reduced together. */
ALWAYS_INLINE void score_block(const float *q, const struct q8_rows *k, int fp8, int64_t g_n,
                               int64_t d_n, int64_t start, int64_t j0, int64_t count,
                               float *scores, int64_t n) {
    __m256 part[GMAX][KB];
    float ks[KB];
    float factor = fp8 ? 256.0f : 1.0f;
    struct q8_walk w = q8_at(k, start + j0);
    q8_prefetch_page(k, w.page + PF_DIST);
    for (int64_t jj = 0; jj < count; jj++) {
        const uint8_t *kp = q8_next(k, &w, factor, &ks[jj]);
        __m256 kv[32];
#pragma GCC unroll 32
        for (int64_t c = 0; c < d_n / 8; c++) kv[c] = load_q8x8(kp + 8 * c, fp8);
#pragma GCC unroll 8
        for (int64_t g = 0; g < g_n; g++) {
            const float *qg = q + g * d_n;
            __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qg), kv[0]);
            __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(qg + 8), kv[1]);
#pragma GCC unroll 16
            for (int64_t c = 2; c < d_n / 8; c += 2) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), kv[c], a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c + 8), kv[c + 1], a1);
            }
            part[g][jj] = _mm256_add_ps(a0, a1);
        }
    }
    for (int64_t jj = count; jj < KB; jj++) {
        ks[jj] = 0.0f;
        for (int64_t g = 0; g < g_n; g++) part[g][jj] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < g_n; g++)
        for (int64_t h = 0; h < KB && h < count; h += 8) {
            store_first(scores + g * n + j0 + h, count - h,
                        _mm256_mul_ps(sum8(&part[g][h]), _mm256_loadu_ps(ks + h)));
        }
}

#define HAVE_INT_SCORES 1
/* sum8 in int32, without phaddd (3-4 uops each on Zen 3): pairs folded within 128-bit lanes
 * (unpack + add), then the halves (permute2x128 + add); lane j holds a[j]'s sum. */
ALWAYS_INLINE __m256i sum8_epi32(const __m256i *a) {
    __m256i t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                _mm256_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        u[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                _mm256_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u[0], u[1], 0x20),
                            _mm256_permute2x128_si256(u[0], u[1], 0x31));
}

/* The AVX512-VNNI score_block_i8's arithmetic with AVX2: each key's bytes sign-extended to 16
 * bits, 16 at a time (vpmovsxbw), multiplied by the head's q16 and summed in pairs into 8 int32
 * lanes (vpmaddwd: 16 products an instruction, against 8 for the float path's FMA, and no
 * int -> float conversion per key byte); the integer sums are exact (as with vpdpwssd), so
 * converted to float and scaled by qscale[g], then scale_j, in the same order, a score is the
 * VNNI path's bit for bit. 8 keys' lanes reduced together (sum8_epi32). */
ALWAYS_INLINE void score_block_i8(const int16_t *q16, const float *qscale,
                                  const struct q8_rows *k, int64_t g_n, int64_t d_n,
                                  int64_t start, int64_t j0, int64_t count, float *scores,
                                  int64_t n) {
    __m256i part[GMAX][KB];
    float ks[KB];
    int64_t d_pad = (d_n + 31) / 32 * 32; /* quantize_q's row length */
    struct q8_walk w = q8_at(k, start + j0);
    q8_prefetch_page(k, w.page + PF_DIST);
    for (int64_t jj = 0; jj < count; jj++) {
        const uint8_t *kp = q8_next(k, &w, 1.0f, &ks[jj]);
        __m256i kv[16];
#pragma GCC unroll 16
        for (int64_t c = 0; c < d_n / 16; c++)
            kv[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const void *)(kp + 16 * c)));
#pragma GCC unroll 8
        for (int64_t g = 0; g < g_n; g++) {
            const int16_t *qg = q16 + g * d_pad;
            __m256i acc = _mm256_madd_epi16(kv[0], _mm256_loadu_si256((const void *)qg));
#pragma GCC unroll 16
            for (int64_t c = 1; c < d_n / 16; c++)
                acc = _mm256_add_epi32(
                    acc, _mm256_madd_epi16(kv[c], _mm256_loadu_si256((const void *)(qg + 16 * c))));
            part[g][jj] = acc;
        }
    }
    for (int64_t jj = count; jj < KB; jj++) {
        ks[jj] = 0.0f;
        for (int64_t g = 0; g < g_n; g++) part[g][jj] = _mm256_setzero_si256();
    }
    for (int64_t g = 0; g < g_n; g++)
        for (int64_t h = 0; h < KB && h < count; h += 8) {
            __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(sum8_epi32(&part[g][h])),
                                      _mm256_set1_ps(qscale[g]));
            store_first(scores + g * n + j0 + h, count - h, _mm256_mul_ps(sc, _mm256_loadu_ps(ks + h)));
        }
}

/* Value columns c0 .. c0 + 8 * nc - 1 of heads g0 .. g0 + gc - 1 (gc * nc <= 12 registers of
 * sums, gc broadcast probabilities, one converted value chunk). The head group's first pass
 * folds scale_j into its probabilities in place (probs[g][j] * scale_j, the product the sum
 * takes either way) and asks for the pages ahead; later passes read the folded probabilities
 * and find the head's values in L1/L2. */
ALWAYS_INLINE void values_cols(float *probs, const struct q8_rows *v, int fp8, int64_t g0,
                               int64_t gc, int64_t nc, int64_t d_n, int64_t c0, int64_t start,
                               int64_t n, int first, uint16_t *out) {
    float factor = fp8 ? 256.0f : 1.0f;
    __m256 acc[3][8];
#pragma GCC unroll 3
    for (int64_t g = 0; g < gc; g++)
#pragma GCC unroll 8
        for (int64_t c = 0; c < nc; c++) acc[g][c] = _mm256_setzero_ps();
    struct q8_walk w = q8_at(v, start);
    int ahead = first && g0 == 0; /* the first pass of all */
    if (ahead)
        for (int64_t p = 1; p < PF_DIST; p++) q8_prefetch_page(v, w.page + p);
    for (int64_t j = 0; j < n; j++) {
        float vs;
        if (ahead && w.slot == 0) q8_prefetch_page(v, w.page + PF_DIST);
        const uint8_t *vp = q8_next(v, &w, factor, &vs) + c0;
        __m256 p[3];
#pragma GCC unroll 3
        for (int64_t g = 0; g < gc; g++) {
            float *pg = probs + (g0 + g) * n + j;
            if (first) *pg *= vs;
            p[g] = _mm256_set1_ps(*pg);
        }
#pragma GCC unroll 8
        for (int64_t c = 0; c < nc; c++) {
            __m256 x = load_q8x8(vp + 8 * c, fp8);
#pragma GCC unroll 3
            for (int64_t g = 0; g < gc; g++) acc[g][c] = _mm256_fmadd_ps(p[g], x, acc[g][c]);
        }
    }
#pragma GCC unroll 3
    for (int64_t g = 0; g < gc; g++)
#pragma GCC unroll 8
        for (int64_t c = 0; c < nc; c++) store_bf16x8(out + (g0 + g) * d_n + c0 + 8 * c, acc[g][c]);
}

/* values_cols with gc, nc, fp8 and first as constants (the sums stay in registers, no
 * branch in the loop). */
ALWAYS_INLINE void values_pass(float *probs, const struct q8_rows *v, int fp8, int64_t g0,
                               int64_t gc, int64_t nc, int64_t d_n, int64_t c0, int64_t start,
                               int64_t n, int first, uint16_t *out) {
#define VALUES_COLS(GC, NC)                                                                    \
    if (gc == GC && nc == NC) {                                                                \
        if (fp8) {                                                                             \
            if (first) values_cols(probs, v, 1, g0, GC, NC, d_n, c0, start, n, 1, out);         \
            else values_cols(probs, v, 1, g0, GC, NC, d_n, c0, start, n, 0, out);               \
        } else {                                                                               \
            if (first) values_cols(probs, v, 0, g0, GC, NC, d_n, c0, start, n, 1, out);         \
            else values_cols(probs, v, 0, g0, GC, NC, d_n, c0, start, n, 0, out);               \
        }                                                                                      \
        return;                                                                                \
    }
    VALUES_COLS(1, 8) VALUES_COLS(1, 4) VALUES_COLS(1, 2)
    VALUES_COLS(2, 4) VALUES_COLS(2, 2) VALUES_COLS(3, 4) VALUES_COLS(3, 2)
#undef VALUES_COLS
}

/* out[g] = sum_j probs[g][j] * scale_j * v_j, rounded to bfloat16 (probs scaled in place).
 * Heads in groups of 3 over 32 columns a pass (a lone head: 64): for 3 heads of D = 64, two
 * passes over the values, where 4 heads x 16 columns took four, each multiplying every
 * probability by the scale again. */
ALWAYS_INLINE void weight_values(float *probs, const struct q8_rows *v, int fp8, int64_t g_n,
                                 int64_t d_n, int64_t start, int64_t n, uint16_t *out) {
    for (int64_t g0 = 0; g0 < g_n; g0 += 3) {
        int64_t gc = g_n - g0 < 3 ? g_n - g0 : 3;
        int64_t nc = gc == 1 ? 8 : 4; /* 8-column chunks a pass */
        for (int64_t c0 = 0; c0 < d_n;) {
            int64_t left = (d_n - c0) / 8, k = left >= nc ? nc : (left >= 4 ? 4 : 2);
            values_pass(probs, v, fp8, g0, gc, k, d_n, c0, start, n, c0 == 0, out);
            c0 += 8 * k;
        }
    }
}

#else /* plain C: the same arithmetic, a value at a time */

ALWAYS_INLINE float q8_value(uint8_t c, int fp8) {
    return fp8 ? fp8_e4m3_to_f32(c) : (float)(int8_t)c;
}

ALWAYS_INLINE void score_block(const float *q, const struct q8_rows *k, int fp8, int64_t g_n,
                               int64_t d_n, int64_t start, int64_t j0, int64_t count,
                               float *scores, int64_t n) {
    struct q8_walk w = q8_at(k, start + j0);
    for (int64_t jj = 0; jj < count; jj++) {
        float ks;
        const uint8_t *kp = q8_next(k, &w, 1.0f, &ks);
        for (int64_t g = 0; g < g_n; g++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < d_n; d++) acc += q[g * d_n + d] * q8_value(kp[d], fp8);
            scores[g * n + j0 + jj] = acc * ks;
        }
    }
}

ALWAYS_INLINE void weight_values(const float *probs, const struct q8_rows *v, int fp8,
                                 int64_t g_n, int64_t d_n, int64_t start, int64_t n,
                                 uint16_t *out) {
    float acc[GMAX * 256] = {0};
    struct q8_walk w = q8_at(v, start);
    for (int64_t j = 0; j < n; j++) {
        float vs;
        const uint8_t *vp = q8_next(v, &w, 1.0f, &vs);
        for (int64_t g = 0; g < g_n; g++) {
            float p = probs[g * n + j] * vs;
            for (int64_t d = 0; d < d_n; d++) acc[g * d_n + d] += p * q8_value(vp[d], fp8);
        }
    }
    for (int64_t i = 0; i < g_n * d_n; i++) out[i] = f32_to_bf16(acc[i]);
}

#endif

ALWAYS_INLINE void attend_one(const uint16_t *q, const struct q8_rows *k,
                              const struct q8_rows *v, int fp8, int64_t g_n, int64_t d_n,
                              int64_t start, int64_t end, float scale, float *scores,
                              uint16_t *out) {
    float qs[GMAX * 256];
    for (int64_t i = 0; i < g_n * d_n; i++) qs[i] = bf16_to_f32(q[i]) * scale;
    int64_t n = end - start;
    q8_prefetch_page(v, start / v->ps); /* read after the scores: on its way meanwhile */
    for (int64_t p = 1; p < PF_DIST; p++) q8_prefetch_page(k, start / k->ps + p);
#if defined(HAVE_INT_SCORES)
    if (!fp8) {
        int16_t q16[GMAX * 256];
        float qscale[GMAX];
        quantize_q(qs, g_n, d_n, q16, qscale);
        for (int64_t j = 0; j < n; j += KB)
            score_block_i8(q16, qscale, k, g_n, d_n, start, j, n - j < KB ? n - j : KB, scores,
                           n);
    } else
#endif
        for (int64_t j = 0; j < n; j += KB)
            score_block(qs, k, fp8, g_n, d_n, start, j, n - j < KB ? n - j : KB, scores, n);
    softmax_rows(scores, g_n, n);
    weight_values(scores, v, fp8, g_n, d_n, start, n, out);
}

/* Specializations for the common (G, D), as in decode_attention.c: constants keep the sums in
 * registers; each is its own function (compile time). */
#define ATTEND_FN(G, D)                                                                        \
    static __attribute__((noinline)) void attend_##G##_##D(                                    \
        const uint16_t *q, const struct q8_rows *k, const struct q8_rows *v, int fp8,          \
        int64_t start, int64_t end, float scale, float *scores, uint16_t *out) {               \
        attend_one(q, k, v, fp8, G, D, start, end, scale, scores, out);                        \
    }
ATTEND_FN(1, 64) ATTEND_FN(2, 64) ATTEND_FN(3, 64) ATTEND_FN(4, 64)
ATTEND_FN(5, 64) ATTEND_FN(6, 64) ATTEND_FN(7, 64) ATTEND_FN(8, 64)
ATTEND_FN(1, 128) ATTEND_FN(2, 128) ATTEND_FN(4, 128) ATTEND_FN(6, 128)
ATTEND_FN(7, 128) ATTEND_FN(8, 128)

#define ATTEND_CASE(G, D)                                                                      \
    if (g_n == G && d_n == D) {                                                                \
        attend_##G##_##D(q, k, v, fp8, start, end, scale, scores, out);                        \
        return;                                                                                \
    }

static void attend_dispatch(const uint16_t *q, const struct q8_rows *k,
                            const struct q8_rows *v, int fp8, int64_t g_n, int64_t d_n,
                            int64_t start, int64_t end, float scale, float *scores,
                            uint16_t *out) {
    ATTEND_CASE(1, 64) ATTEND_CASE(2, 64) ATTEND_CASE(3, 64) ATTEND_CASE(4, 64)
    ATTEND_CASE(5, 64) ATTEND_CASE(6, 64) ATTEND_CASE(7, 64) ATTEND_CASE(8, 64)
    ATTEND_CASE(1, 128) ATTEND_CASE(2, 128) ATTEND_CASE(4, 128) ATTEND_CASE(6, 128)
    ATTEND_CASE(7, 128) ATTEND_CASE(8, 128)
    attend_one(q, k, v, fp8, g_n, d_n, start, end, scale, scores, out); /* other G <= 8 */
}

/* q [R, Hkv * G, D] bfloat16 (rows q_stride elements apart, heads contiguous); pool: the 8-bit
 * pool's first byte, kind KV_INT8 or KV_FP8_E4M3, this layer's K at byte k_off of a page and V
 * at v_off, pages page_stride bytes apart, scales from byte value_bytes of a page
 * (kv_quant.c); pages [R, >= ceil(len / ps)] int64 page ids, rows pt_stride apart; lens [R]
 * (row r attends to positions 0..lens[r]-1, the last `window` with window > 0; 0 leaves its
 * output untouched); out [R, Hkv * G, D] bfloat16 contiguous. G <= 8, D a multiple of 16 up
 * to 256. Returns 0, -1 if out of memory, -2 for an unsupported shape or kind. */
int decode_attention_q8(const uint16_t *q, int64_t q_stride, const uint8_t *pool, int64_t k_off,
                        int64_t v_off, int64_t page_stride, int64_t value_bytes, int64_t kind,
                        int64_t ps, const int64_t *pages, int64_t pt_stride, const int64_t *lens,
                        int64_t rows, int64_t hkv, int64_t g_n, int64_t d_n, int64_t window,
                        float scale, uint16_t *out) {
    if (g_n < 1 || g_n > GMAX || d_n % 16 != 0 || d_n > 256) return -2;
    if (kind != KV_INT8 && kind != KV_FP8_E4M3) return -2;
    int fp8 = kind == KV_FP8_E4M3;
    int64_t max_len = 0, total = 0;
    for (int64_t r = 0; r < rows; r++) {
        max_len = lens[r] > max_len ? lens[r] : max_len;
        total += lens[r];
    }
    int failed = 0;
#pragma omp parallel if (total * hkv >= 2048)
    {
        float *scores = malloc(sizeof(float) * (size_t)(g_n * max_len + 1));
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
            struct q8_rows k = {pool, pages + r * pt_stride, (end + ps - 1) / ps,
                                k_off / d_n + h, page_stride, value_bytes, ps, hkv, d_n};
            struct q8_rows v = k;
            v.vec0 = v_off / d_n + h;
            attend_dispatch(q + r * q_stride + h * g_n * d_n, &k, &v, fp8, g_n, d_n, start, end,
                            scale, scores, out + (r * hkv + h) * g_n * d_n);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

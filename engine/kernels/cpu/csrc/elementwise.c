/* The small per-layer ops of a bfloat16 Llama step, one C call each instead of 5-12 torch ops
 * (at batch 1 each torch op costs more in dispatch than in arithmetic). Each rounds to bfloat16
 * where transformers' eager bfloat16 code rounds (after every torch op), so results equal the
 * torch path's except for float32 summation order in the RMSNorm statistic.
 * Rows are split over torch's OpenMP threads when there are enough of them (prefill).
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "fast_exp.h"

#define PAR_ELEMS (1 << 16) /* elements from which a parallel region pays */

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* res = x + residual (rounded), when residual is given (else res = x); out = w * bf16(res *
 * rsqrt(mean(res^2) + eps)) rounded. x, residual, res_out, out: [t, h] rows x_stride /
 * h / h / h elements apart. res_out may be NULL when residual is NULL. */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual,
                   const uint16_t *w, float eps, int64_t t, int64_t h, uint16_t *res_out,
                   uint16_t *out) {
#pragma omp parallel for schedule(static) if (t * h >= PAR_ELEMS)
    for (int64_t i = 0; i < t; i++) {
        const uint16_t *xi = x + i * x_stride;
        float buf[h];
        for (int64_t e = 0; e < h; e++) {
            float v = bf16_to_f32(xi[e]);
            if (residual) {
                uint16_t r = f32_to_bf16(v + bf16_to_f32(residual[i * h + e]));
                res_out[i * h + e] = r;
                v = bf16_to_f32(r);
            }
            buf[e] = v;
        }
        /* 16 independent partial sums: vectorizes without reassociation flags */
        float lane[16] = {0};
        int64_t e = 0;
        for (; e + 16 <= h; e += 16)
            for (int l = 0; l < 16; l++) lane[l] += buf[e + l] * buf[e + l];
        for (; e < h; e++) lane[0] += buf[e] * buf[e];
        float ss = 0.0f;
        for (int l = 0; l < 16; l++) ss += lane[l];
        float inv = 1.0f / sqrtf(ss / (float)h + eps);
        for (e = 0; e < h; e++)
            out[i * h + e] = f32_to_bf16(bf16_to_f32(w[e]) * round_bf16(buf[e] * inv));
    }
}

/* Rotary embedding in place, "rotate_half" convention: for each of the first `heads` heads of
 * every row of qk ([t, heads, d], rows row_stride elements apart), with c = bf16(cos[pos]) and
 * s = bf16(sin[pos]) from the float32 tables [*, d / 2]: x1' = bf16(bf16(x1 c) - bf16(x2 s)),
 * x2' = bf16(bf16(x2 c) + bf16(x1 s)), exactly as the torch ops round. */
void rope_bf16(uint16_t *qk, int64_t row_stride, int64_t t, int64_t heads, int64_t d,
               const int64_t *positions, const float *cos_table, const float *sin_table) {
    int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (t * heads * d >= PAR_ELEMS)
    for (int64_t i = 0; i < t; i++) {
        const float *ct = cos_table + positions[i] * half, *st = sin_table + positions[i] * half;
        float c[half], s[half];
        for (int64_t e = 0; e < half; e++) {
            c[e] = round_bf16(ct[e]);
            s[e] = round_bf16(st[e]);
        }
        for (int64_t hh = 0; hh < heads; hh++) {
            uint16_t *x = qk + i * row_stride + hh * d;
            for (int64_t e = 0; e < half; e++) {
                float x1 = bf16_to_f32(x[e]), x2 = bf16_to_f32(x[e + half]);
                float a = round_bf16(x1 * c[e]), b = round_bf16(x2 * s[e]);
                float p = round_bf16(x2 * c[e]), q = round_bf16(x1 * s[e]);
                x[e] = f32_to_bf16(a - b);
                x[e + half] = f32_to_bf16(p + q);
            }
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* 8 gate and up values -> 8 outputs, the scalar loop's steps (GCC leaves that loop scalar on
 * AVX2: its exp is not vectorized there). */
static inline __attribute__((always_inline)) void silu_mul8(const uint16_t *g, const uint16_t *u,
                                                            uint16_t *out) {
    __m256 x = load_bf16x8(g), up = load_bf16x8(u);
    __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f),
                               exp_approx8(_mm256_sub_ps(_mm256_setzero_ps(), x)));
    __m256 silu = _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16x8(_mm256_div_ps(x, den)), 16));
    store_bf16x8(out, _mm256_mul_ps(silu, up));
}
#endif

/* out = bf16(bf16(silu(gate)) * up) with gate_up [t, 2 * n] (gate first, then up, per row) and
 * out [t, n]. */
void silu_mul_bf16(const uint16_t *gate_up, int64_t t, int64_t n, uint16_t *out) {
#pragma omp parallel for schedule(static) if (t * n >= PAR_ELEMS)
    for (int64_t i = 0; i < t; i++) {
        const uint16_t *g = gate_up + i * 2 * n, *u = g + n;
        int64_t e = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        for (; e + 8 <= n; e += 8) silu_mul8(g + e, u + e, out + i * n + e);
#endif
        for (; e < n; e++) {
            float x = bf16_to_f32(g[e]);
            float silu = round_bf16(x / (1.0f + exp_approx(-x)));
            out[i * n + e] = f32_to_bf16(silu * bf16_to_f32(u[e]));
        }
    }
}

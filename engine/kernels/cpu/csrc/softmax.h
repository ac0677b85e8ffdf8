/* The decode attention kernels' softmax over one row's scores (header-only: decode_attention.c
 * and decode_attention_q8.c inline it). */
#ifndef SPLITSERVE_SOFTMAX_H
#define SPLITSERVE_SOFTMAX_H

#include <stdint.h>

#include "fast_exp.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* softmax_rows on AVX2: max, exp and sum in 8-float registers (exp_approx8). */
static inline __attribute__((always_inline)) void softmax_rows(float *scores, int64_t g_n,
                                                               int64_t n) {
    for (int64_t g = 0; g < g_n; g++) {
        float *s = scores + g * n;
        float lane[8];
        __m256 mv = _mm256_set1_ps(s[0]);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
        _mm256_storeu_ps(lane, mv);
        float m = lane[0];
        for (int e = 1; e < 8; e++) m = lane[e] > m ? lane[e] : m;
        for (; j < n; j++) m = s[j] > m ? s[j] : m;
        const __m256 mb = _mm256_set1_ps(m);
        __m256 sv = _mm256_setzero_ps();
        for (j = 0; j + 8 <= n; j += 8) {
            __m256 e = exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
            _mm256_storeu_ps(s + j, e);
            sv = _mm256_add_ps(sv, e);
        }
        float sum = 0.0f;
        for (; j < n; j++) sum += s[j] = exp_approx(s[j] - m);
        _mm256_storeu_ps(lane, sv);
        for (int e = 0; e < 8; e++) sum += lane[e];
        const __m256 inv = _mm256_set1_ps(1.0f / sum);
        for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
        for (; j < n; j++) s[j] *= 1.0f / sum;
    }
}
#else
/* scores[g] <- softmax(scores[g]) over n keys, in place. */
static inline __attribute__((always_inline)) void softmax_rows(float *scores, int64_t g_n,
                                                               int64_t n) {
    for (int64_t g = 0; g < g_n; g++) {
        float *s = scores + g * n;
        /* 16 independent lanes, so that max and sum vectorize without reassociation flags */
        float lane[16];
        for (int e = 0; e < 16; e++) lane[e] = s[0];
        int64_t j = 0;
        for (; j + 16 <= n; j += 16)
            for (int e = 0; e < 16; e++) lane[e] = s[j + e] > lane[e] ? s[j + e] : lane[e];
        for (; j < n; j++) lane[0] = s[j] > lane[0] ? s[j] : lane[0];
        float m = lane[0];
        for (int e = 1; e < 16; e++) m = lane[e] > m ? lane[e] : m;
        for (j = 0; j < n; j++) s[j] = exp_approx(s[j] - m);
        for (int e = 0; e < 16; e++) lane[e] = 0.0f;
        for (j = 0; j + 16 <= n; j += 16)
            for (int e = 0; e < 16; e++) lane[e] += s[j + e];
        for (; j < n; j++) lane[0] += s[j];
        float sum = 0.0f;
        for (int e = 0; e < 16; e++) sum += lane[e];
        float inv = 1.0f / sum;
        for (j = 0; j < n; j++) s[j] *= inv;
    }
}
#endif

#endif

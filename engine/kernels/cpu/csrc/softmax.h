/* The decode attention kernels' softmax over one row's scores (header-only: decode_attention.c
 * and decode_attention_q8.c inline it). */
#ifndef SPLITSERVE_SOFTMAX_H
#define SPLITSERVE_SOFTMAX_H

#include <stdint.h>

#include "fast_exp.h"

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

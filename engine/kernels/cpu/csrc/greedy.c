/* Greedy sampling with the chosen token's logprob in one pass per row: argmax (first of equal
 * maxima, as torch.argmax) and log_softmax at it, -log(sum(exp(x - max))), without writing the
 * [B, V] log-softmax that torch computes to read one value per row. float32 logits.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "fast_exp.h"

/* logits [b, v] float32 rows `stride` apart -> ids [b] int64, logprobs [b] float32. Returns 0,
 * or -2 if a row holds a NaN or has no finite maximum (the caller falls back to torch). */
int greedy_logprob_f32(const float *logits, int64_t stride, int64_t b, int64_t v, int64_t *ids,
                       float *logprobs) {
    int bad = 0;
#pragma omp parallel for schedule(static) if (b * v >= (1 << 20))
    for (int64_t i = 0; i < b; i++) {
        const float *x = logits + i * stride;
        float lane[16];
        for (int l = 0; l < 16; l++) lane[l] = -INFINITY;
        int nan = 0;
        int64_t j = 0;
        for (; j + 16 <= v; j += 16)
            for (int l = 0; l < 16; l++) {
                float y = x[j + l];
                nan |= y != y;
                lane[l] = y > lane[l] ? y : lane[l];
            }
        for (; j < v; j++) {
            nan |= x[j] != x[j];
            lane[0] = x[j] > lane[0] ? x[j] : lane[0];
        }
        float m = lane[0];
        for (int l = 1; l < 16; l++) m = lane[l] > m ? lane[l] : m;
        if (nan || !isfinite(m)) {
            bad = 1;
            continue;
        }
        int64_t arg = 0;
        while (x[arg] != m) arg++;
        for (int l = 0; l < 16; l++) lane[l] = 0.0f;
        j = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        /* GCC leaves exp_approx scalar on AVX2: the same lanes and steps in two registers */
        __m256 lo = _mm256_setzero_ps(), hi = lo, mv = _mm256_set1_ps(m);
        for (; j + 16 <= v; j += 16) {
            lo = _mm256_add_ps(lo, exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv)));
            hi = _mm256_add_ps(hi, exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), mv)));
        }
        _mm256_storeu_ps(lane, lo);
        _mm256_storeu_ps(lane + 8, hi);
#endif
        for (; j + 16 <= v; j += 16)
            for (int l = 0; l < 16; l++) lane[l] += exp_approx(x[j + l] - m);
        for (; j < v; j++) lane[0] += exp_approx(x[j] - m);
        float sum = 0.0f;
        for (int l = 0; l < 16; l++) sum += lane[l];
        ids[i] = arg;
        logprobs[i] = -logf(sum);
    }
    return bad ? -2 : 0;
}

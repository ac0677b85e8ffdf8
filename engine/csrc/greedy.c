/* Greedy sampling with the chosen token's logprob in one pass per row: argmax (first of equal
 * maxima, as torch.argmax) and log_softmax at it, -log(sum(exp(x - max))), without writing the
 * [B, V] log-softmax that torch computes to read one value per row. float32 logits.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* exp(x) for x <= 0: as in decode_attention.c (~1 ulp, vectorizes). */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } e;
    e.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * e.f;
}

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
        for (j = 0; j + 16 <= v; j += 16)
            for (int l = 0; l < 16; l++) lane[l] += exp_nonpos(x[j + l] - m);
        for (; j < v; j++) lane[0] += exp_nonpos(x[j] - m);
        float sum = 0.0f;
        for (int l = 0; l < 16; l++) sum += lane[l];
        ids[i] = arg;
        logprobs[i] = -logf(sum);
    }
    return bad ? -2 : 0;
}

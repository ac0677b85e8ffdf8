/* bfloat16 <-> float32 helpers shared by the CPU kernels (header-only).
 *
 * v16f is 16 floats as a GCC/clang vector (one AVX-512 register). On AVX-512 the bfloat16 load
 * is two instructions (zero-extend, shift); GCC's generic __builtin_convertvector lowering of the
 * same thing splits into halves and spills (measured ~2x slower in the gemv loop).
 */
#ifndef SPLITSERVE_BF16_H
#define SPLITSERVE_BF16_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) v16f load_bf16x16(const uint16_t *p) {
#if defined(__AVX512F__)
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16);
    return (v16f)_mm512_castsi512_ps(u);
#else
    v16h h;
    memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    return (v16f)u;
#endif
}

/* One K pair of the pair layout (gemm_bf16.c): 32 bfloat16, column c's two K values at 2c and
 * 2c + 1 -> the even-K and the odd-K values of the 16 columns as float32. */
static inline __attribute__((always_inline)) void load_bf16_pairs(const uint16_t *p, v16f *even,
                                                                  v16f *odd) {
#if defined(__AVX512F__)
    __m512i u = _mm512_loadu_si512((const void *)p);
    *even = (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    *odd = (v16f)_mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
#else
    v16u u;
    memcpy(&u, p, sizeof u);
    *even = (v16f)(u << 16);
    *odd = (v16f)(u & 0xffff0000u);
#endif
}

static inline __attribute__((always_inline)) v16f load_f32x16(const float *p) {
#if defined(__AVX512F__)
    return (v16f)_mm512_loadu_ps(p);
#else
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
#endif
}

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

/* Round to nearest even, as torch rounds float32 to bfloat16; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
/* f32_to_bf16 for 16 lanes: nearest even, NaN kept quiet (the products' bfloat16 outputs). */
static inline __m256i round_bf16x16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
/* AVX2 (8-float registers): 8 bfloat16 -> float32. */
static inline __attribute__((always_inline)) __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* f32_to_bf16 on 8 lanes (nearest even, NaN kept quiet), as 32-bit lanes holding the 16 bits. */
static inline __attribute__((always_inline)) __m256i round_bf16x8(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, quiet, nan);
}

/* 8 float32 rounded to bfloat16 and stored at p. */
static inline __attribute__((always_inline)) void store_bf16x8(uint16_t *p, __m256 f) {
    __m256i r = round_bf16x8(f);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
#endif

#endif

/* A row of bf16 values to fp32, each vector of them zero-extended from memory and shifted into
 * the high half: gcc's own loop over q3_bf16_to_f32 widened 32 values with three shuffles, on the
 * port the multiply-adds share (the attention's K and V tiles, the conversions of convert.c). */
#ifndef Q3_KERNELS_CPU_WIDEN_H
#define Q3_KERNELS_CPU_WIDEN_H

#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../dtype.h"

/* dst [n] <- the bf16 values at src as fp32 (exact) */
static inline void q3_bf16_row(float *dst, const uint16_t *src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_si512(dst + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i))), 16));
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i))), 16));
#endif
    for (; i < n; i++) dst[i] = q3_bf16_to_f32(src[i]);
}

#endif

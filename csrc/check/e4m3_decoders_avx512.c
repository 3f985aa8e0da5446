/* e4m3 -> fp32 decoders on AVX-512 (F, BW; compiled with VL, DQ as the avx512 path is), 64
 * codes (one zmm of bytes) into 4 x 16 fp32 a call, each run in e4m3_loops.h's GEMV and
 * dequantization; the AVX2 file's two fp16 constructions at twice the width:
 *
 *   avx512_fp16      the shipped avx512 path's (kernels/cpu/matmul_fp8.c): fp16 S 0EEEE MMM0000000
 *                    from the sign-extended byte (vpmovsxbw), vcvtph2ps
 *   avx512_fp16_mem  the fp16 words by 16-bit shifts, even and odd bytes apart, stored and widened
 *                    by vcvtph2ps from memory (e4m3_decoders_avx2.c says why)
 *
 * avx512_fp16_mem's lanes are not in column order: the GEMV takes x in its order (perm), its
 * exact decoder permutes the 64 bytes first (vpermq, then vpshufb in each 128-bit lane). */
#include "e4m3_decoders.h"

#if Q3_E4M3_X86
#include <immintrin.h>

#define LOOP_VF __m512
#define LOOP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#include "e4m3_loops.h"

static int avx512_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && q3_e4m3_has_f16c();
}

/* ---- avx512_fp16: the shipped construction -------------------------------------------- */

/* 16 codes, NaN codes NaN (the shipped e4m3_v at this width) */
LOOP_INLINE __m512 fp16_16(const uint8_t *p) {
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
                                 _mm256_set1_epi16((short)0xbf80));
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x3f80));
    h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)));
    return _mm512_cvtph_ps(h);
}

/* 32 codes, NaN codes 480 / 256 (the shipped e4m3_v2) */
LOOP_INLINE void fp16_32(const uint8_t *p, __m512 *lo, __m512 *hi) {
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)), 7),
                                       _mm512_set1_epi16((short)0xbf80));
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

LOOP_INLINE void fp16_fast(const uint8_t *p, __m512 o[4]) {
    fp16_32(p, &o[0], &o[1]);
    fp16_32(p + 32, &o[2], &o[3]);
}

LOOP_INLINE void fp16_exact(const uint8_t *p, __m512 o[4]) {
    for (int i = 0; i < 4; i++) o[i] = fp16_16(p + 16 * i);
}

E4M3_VARIANT(fp16, fp16_fast, fp16_exact, NULL, 0, 256.0f)

/* ---- avx512_fp16_mem: fp16 words by shifts, vcvtph2ps from memory -------------------- */

/* as e4m3_decoders_avx2.c's fp16_words */
LOOP_INLINE void fp16_words(__m512i v, __m512i *even, __m512i *odd) {
    const __m512i keep = _mm512_set1_epi16((short)0xbf80);
    *even = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 1), keep);
    *odd = _mm512_and_si512(_mm512_srai_epi16(v, 1), keep);
}

LOOP_INLINE __m512i fp16_nan(__m512i h) {
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(h, _mm512_set1_epi16(0x7fff)),
                                                  _mm512_set1_epi16(0x3f80));
    return _mm512_mask_mov_epi16(h, nan, _mm512_or_si512(h, _mm512_set1_epi16(0x7c00)));
}

/* lanes: o[0] the even columns 0-30, o[1] the even 32-62, o[2] the odd 1-31, o[3] the odd 33-63 */
static const uint8_t fp16_mem_perm[64] = {
    0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
    44, 46, 48, 50, 52, 54, 56, 58, 60, 62, 1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23,
    25, 27, 29, 31, 33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};

LOOP_INLINE void fp16_mem_words(__m512i even, __m512i odd, __m512 o[4]) {
    uint16_t buf[64] __attribute__((aligned(64)));
    _mm512_store_si512(buf, even);
    _mm512_store_si512(buf + 32, odd);
    __asm__ volatile("" : "+m"(*(uint16_t(*)[64])buf)); /* as in e4m3_decoders_avx2.c */
    for (int i = 0; i < 4; i++) o[i] = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(buf + 16 * i)));
}

LOOP_INLINE void fp16_mem_fast(const uint8_t *p, __m512 o[4]) {
    __m512i even, odd;
    fp16_words(_mm512_loadu_si512(p), &even, &odd);
    fp16_mem_words(even, odd, o);
}

/* column order: 128-bit lane l gets qwords l and l + 4 (columns 8l.. and 32 + 8l..), their
 * bytes interleaved: the even bytes give columns 0-31, the odd 32-63 */
LOOP_INLINE void fp16_mem_exact(const uint8_t *p, __m512 o[4]) {
    const __m512i q = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), _mm512_loadu_si512(p));
    const __m512i v = _mm512_shuffle_epi8(
        q, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15)));
    __m512i even, odd;
    fp16_words(v, &even, &odd);
    fp16_mem_words(fp16_nan(even), fp16_nan(odd), o);
}

E4M3_VARIANT(fp16_mem, fp16_mem_fast, fp16_mem_exact, fp16_mem_perm, 0, 256.0f)

#define AVX512_ISA "avx512f, avx512bw, avx512vl, avx512dq, avx2, fma, f16c"
static const q3_e4m3_variant variants[] = {
    {"avx512_fp16", AVX512_ISA, "fp16 bits from the sign-extended byte (vpmovsxbw, shift, and), vcvtph2ps",
     "avx512", 64, NULL, avx512_supported, fp16_decode, fp16_gemv, fp16_dequant},
    {"avx512_fp16_mem", AVX512_ISA, "fp16 bits by 16-bit shifts (even and odd bytes), vcvtph2ps from memory", NULL,
     64, fp16_mem_perm, avx512_supported, fp16_mem_decode, fp16_mem_gemv, fp16_mem_dequant},
};

const q3_e4m3_variant *q3_e4m3_variants_avx512(int *n) {
    *n = (int)(sizeof variants / sizeof variants[0]);
    return variants;
}
#else
const q3_e4m3_variant *q3_e4m3_variants_avx512(int *n) {
    *n = 0;
    return NULL;
}
#endif

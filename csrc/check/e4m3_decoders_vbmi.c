/* An e4m3 -> fp32 decoder on AVX-512 VBMI, 64 codes (one zmm of bytes) into 4 x 16 fp32 a
 * call, run in e4m3_loops.h's GEMV and dequantization:
 *
 *   avx512_vbmi      the bf16 bits of every magnitude (7 bits: 128 entries, a table in two zmm)
 *                    looked up by vpermi2b, high byte and low byte apart, the sign OR-ed in;
 *                    placed in fp32 lanes by unpacks and shifts, as e4m3_decoders_avx2.c's
 *                    avx2_nibble. No arithmetic on the code, NaN included (the tables hold it).
 *
 * Its lanes are not in column order: the GEMV takes x in its order (perm), its exact decoder
 * first permutes the 64 bytes by the inverse order (vpermb). Its own file: its functions are
 * compiled with VBMI enabled, which the other AVX-512 variants must not need. */
#include "e4m3_decoders.h"

#if Q3_E4M3_X86
#include <immintrin.h>

#define LOOP_VF __m512
#define LOOP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c")))
#include "e4m3_loops.h"

static int vbmi_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           q3_e4m3_has_f16c();
}

/* the bf16 of magnitude m (code m, 0 <= m < 128), high byte and low byte: E = m >> 3 > 0 gives
 * exponent E + 120, so the high byte 60 + (E >> 1) and the low byte (E & 1) MMM 0000; E = 0:
 * M 2^-9 (0, 2^-9, 2^-8, 1.5 2^-8, 2^-7, ...); m = 127 (NaN): 0x7fc0 */
static const uint8_t bf16_high[128] __attribute__((aligned(64))) = {
    0x00, 0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c,
    0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d,
    0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e,
    0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f,
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
    0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
    0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
    0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x7f};
static const uint8_t bf16_low[128] __attribute__((aligned(64))) = {
    0x00, 0x00, 0x80, 0xc0, 0x00, 0x20, 0x40, 0x60, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xc0};

/* vpermi2b reads the index's bits 0-6 (bit 6 picks the table's second zmm): the sign bit is
 * ignored, then OR-ed into the high byte (ternary logic: hi | (v & 0x80)) */
LOOP_INLINE void vbmi_core(__m512i v, __m512 o[4]) {
    const __m512i hi = _mm512_ternarylogic_epi32(
        _mm512_permutex2var_epi8(_mm512_load_si512(bf16_high), v, _mm512_load_si512(bf16_high + 64)), v,
        _mm512_set1_epi8((char)0x80), 0xf8);
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(bf16_low), v, _mm512_load_si512(bf16_low + 64));
    const __m512i wa = _mm512_unpacklo_epi8(lo, hi), wb = _mm512_unpackhi_epi8(lo, hi);
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    o[0] = _mm512_castsi512_ps(_mm512_slli_epi32(wa, 16));
    o[1] = _mm512_castsi512_ps(_mm512_and_si512(wa, top));
    o[2] = _mm512_castsi512_ps(_mm512_slli_epi32(wb, 16));
    o[3] = _mm512_castsi512_ps(_mm512_and_si512(wb, top));
}

/* lanes: o[v] holds, in 128-bit lane l, the columns 16 l + 8 (v >> 1) + (v & 1) + {0, 2, 4, 6}
 * (unpacklo / unpackhi of bytes, then even / odd words) */
static const uint8_t vbmi_perm[64] = {
    0,  2,  4,  6,  16, 18, 20, 22, 32, 34, 36, 38, 48, 50, 52, 54, 1,  3,  5,  7,  17, 19,
    21, 23, 33, 35, 37, 39, 49, 51, 53, 55, 8,  10, 12, 14, 24, 26, 28, 30, 40, 42, 44, 46,
    56, 58, 60, 62, 9,  11, 13, 15, 25, 27, 29, 31, 41, 43, 45, 47, 57, 59, 61, 63};
/* its inverse: byte q of the permuted chunk is column vbmi_inverse[q] */
static const uint8_t vbmi_inverse[64] __attribute__((aligned(64))) = {
    0,  16, 1,  17, 2,  18, 3,  19, 32, 48, 33, 49, 34, 50, 35, 51, 4,  20, 5,  21, 6,  22,
    7,  23, 36, 52, 37, 53, 38, 54, 39, 55, 8,  24, 9,  25, 10, 26, 11, 27, 40, 56, 41, 57,
    42, 58, 43, 59, 12, 28, 13, 29, 14, 30, 15, 31, 44, 60, 45, 61, 46, 62, 47, 63};

LOOP_INLINE void vbmi_fast(const uint8_t *p, __m512 o[4]) { vbmi_core(_mm512_loadu_si512(p), o); }

LOOP_INLINE void vbmi_exact(const uint8_t *p, __m512 o[4]) {
    vbmi_core(_mm512_permutexvar_epi8(_mm512_load_si512(vbmi_inverse), _mm512_loadu_si512(p)), o);
}

E4M3_VARIANT(vbmi, vbmi_fast, vbmi_exact, vbmi_perm, 1, 1.0f)

static const q3_e4m3_variant variants[] = {
    {"avx512_vbmi", "avx512f, avx512bw, avx512vl, avx512dq, avx512vbmi, avx2, fma, f16c",
     "bf16 bytes of the 128 magnitudes by vpermi2b, sign OR-ed, placed by unpacks and shifts", NULL, 64, vbmi_perm,
     vbmi_supported, vbmi_decode, vbmi_gemv, vbmi_dequant},
};

const q3_e4m3_variant *q3_e4m3_variants_vbmi(int *n) {
    *n = (int)(sizeof variants / sizeof variants[0]);
    return variants;
}
#else
const q3_e4m3_variant *q3_e4m3_variants_vbmi(int *n) {
    *n = 0;
    return NULL;
}
#endif

/* e4m3 -> fp32 decoders on AVX2 (+ FMA, F16C), 32 codes (one ymm of bytes) into 4 x 8 fp32 a
 * call, each run in e4m3_loops.h's GEMV and dequantization:
 *
 *   avx2_fp16        the shipped avx2 path's (kernels/cpu/matmul_fp8.c): e4m3 S EEEE MMM placed
 *                    as fp16 S 0EEEE MMM0000000 (the value times 2^-8, subnormals included) from
 *                    the sign-extended byte, widened by vcvtph2ps
 *   avx2_fp16_mem    the same fp16 words built in 16-bit lanes by shifts (even and odd bytes
 *                    apart: no vpmovsxbw, no vextracti128), stored, and widened by vcvtph2ps
 *                    from memory, whose load does the widening shuffle (no port-5 uop)
 *   avx2_nibble      bf16 bits by vpshufb lookups on the nibbles, placed in fp32 lanes by
 *                    unpacks and shifts: no conversion instruction at all
 *   avx2_gather      a 256-entry fp32 table read by vpgatherdps
 *   avx2_int         the fp32 bits built with integer ops (as the portable kernels do)
 *
 * The lane orders of avx2_fp16_mem and avx2_nibble are not column order: the GEMV takes x in
 * their order (perm), and their exact decoders first permute the 32 bytes (vpermq or vpermd,
 * then vpshufb in each lane) so that the lanes come out in column order. */
#include "e4m3_decoders.h"

#if Q3_E4M3_X86
#include <immintrin.h>
#include <pthread.h>

#define LOOP_VF __m256
#define LOOP_TARGET __attribute__((target("avx2,fma,f16c")))
#include "e4m3_loops.h"

static int avx2_supported(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && q3_e4m3_has_f16c();
}

/* 16 bytes broadcast to both lanes, for vpshufb */
#define LANES16(...) _mm256_broadcastsi128_si256(_mm_setr_epi8(__VA_ARGS__))

/* ---- avx2_fp16: the shipped construction ---------------------------------------------- */

/* 8 codes, NaN codes NaN: |fp16| = 0x3f80 (S 1111 111) gets the exponent all ones (the
 * shipped e4m3_v) */
LOOP_INLINE __m256 fp16_8(const uint8_t *p) {
    __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7),
                              _mm_set1_epi16((short)0xbf80));
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x3f80));
    h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7c00)));
    return _mm256_cvtph_ps(h);
}

/* 16 codes, NaN codes 480 / 256 (the shipped e4m3_v2) */
LOOP_INLINE void fp16_16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
                                       _mm256_set1_epi16((short)0xbf80));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

LOOP_INLINE void fp16_fast(const uint8_t *p, __m256 o[4]) {
    fp16_16(p, &o[0], &o[1]);
    fp16_16(p + 16, &o[2], &o[3]);
}

LOOP_INLINE void fp16_exact(const uint8_t *p, __m256 o[4]) {
    for (int i = 0; i < 4; i++) o[i] = fp16_8(p + 8 * i);
}

E4M3_VARIANT(fp16, fp16_fast, fp16_exact, NULL, 0, 256.0f)

/* ---- avx2_fp16_mem: fp16 words by shifts, vcvtph2ps from memory ---------------------- */

/* the fp16 words of the even bytes (each shifted to the top of its word first) and of the
 * odd bytes: an arithmetic shift right by one puts S at bits 15 and 14 and the magnitude at
 * bits 13-7; the mask keeps S 0 EEEE MMM (and drops what the low byte shifted in) */
LOOP_INLINE void fp16_words(__m256i v, __m256i *even, __m256i *odd) {
    const __m256i keep = _mm256_set1_epi16((short)0xbf80);
    *even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 1), keep);
    *odd = _mm256_and_si256(_mm256_srai_epi16(v, 1), keep);
}

/* fp16 NaN codes (0x3f80 of either sign) to fp16 NaN, as fp16_8 */
LOOP_INLINE __m256i fp16_nan(__m256i h) {
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x3f80));
    return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)));
}

/* lanes: o[0] the even columns 0-14, o[1] the even 16-30, o[2] the odd 1-15, o[3] the odd 17-31 */
static const uint8_t fp16_mem_perm[32] = {0, 2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                          1, 3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

/* the words stored, then read back by vcvtph2ps: the empty asm says it may have changed buf,
 * so the compiler neither forwards the stored registers (vextracti128 again) nor drops the
 * stores, and folds each load into the conversion */
LOOP_INLINE void fp16_mem_words(__m256i even, __m256i odd, __m256 o[4]) {
    uint16_t buf[32] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)buf, even);
    _mm256_store_si256((__m256i *)(buf + 16), odd);
    __asm__ volatile("" : "+m"(*(uint16_t(*)[32])buf));
    for (int i = 0; i < 4; i++) o[i] = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(buf + 8 * i)));
}

LOOP_INLINE void fp16_mem_fast(const uint8_t *p, __m256 o[4]) {
    __m256i even, odd;
    fp16_words(_mm256_loadu_si256((const __m256i *)p), &even, &odd);
    fp16_mem_words(even, odd, o);
}

/* column order: lane 0's bytes become columns 0-7 and 16-23 interleaved (even bytes 0-7,
 * odd bytes 16-23), lane 1's columns 8-15 and 24-31 */
LOOP_INLINE void fp16_mem_exact(const uint8_t *p, __m256 o[4]) {
    const __m256i q = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)p), 0xd8); /* qwords 0 2 1 3 */
    const __m256i v = _mm256_shuffle_epi8(q, LANES16(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
    __m256i even, odd;
    fp16_words(v, &even, &odd);
    fp16_mem_words(fp16_nan(even), fp16_nan(odd), o);
}

E4M3_VARIANT(fp16_mem, fp16_mem_fast, fp16_mem_exact, fp16_mem_perm, 0, 256.0f)

/* ---- avx2_nibble: bf16 bits by vpshufb on nibbles ------------------------------------- */

/* Code S EEEE MMM: high nibble h = S E3 E2 E1, low nibble l = E0 M2 M1 M0. Its bf16 (every
 * e4m3 value is one, exactly) for E > 0: S (E + 120) MMM0000, whose high byte is S | (60 +
 * (h & 7)), a function of h alone, and whose low byte is E0 MMM 0000 = l << 4, of l alone.
 * Only E = 0 (h & 7 = 0, l < 8: M 2^-9) breaks the split: there a correction indexed by l is
 * added to both bytes, looked up with index l | 0x80 unless h & 7 = 0 (vpshufb gives 0 for an
 * index with bit 7 set). NaN codes come out as 480 (bf16 0x43f0). */
LOOP_INLINE void nibble_core(__m256i v, __m256 o[4]) {
    const __m256i high_bits = LANES16(0x3c, 0x3d, 0x3e, 0x3f, 0x40, 0x41, 0x42, 0x43,               /* 60 + (h & 7) */
                                      (char)0xbc, (char)0xbd, (char)0xbe, (char)0xbf, (char)0xc0, (char)0xc1,
                                      (char)0xc2, (char)0xc3);                                    /* | 0x80 for S */
    const __m256i not_sub = LANES16(0, (char)0x80, (char)0x80, (char)0x80, (char)0x80, (char)0x80, (char)0x80,
                                    (char)0x80, 0, (char)0x80, (char)0x80, (char)0x80, (char)0x80, (char)0x80,
                                    (char)0x80, (char)0x80);
    const __m256i low_bits = LANES16(0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, (char)0x80, (char)0x90,
                                     (char)0xa0, (char)0xb0, (char)0xc0, (char)0xd0, (char)0xe0, (char)0xf0);
    /* E = 0, M = l: bf16 of M 2^-9 less the E > 0 reading (high 60, low l << 4), mod 256:
       high 0 (M 0), 59 (M 1-3: exponent 118 or 119), 60 (M 4-7: 120); low 0, 0, 0x80, 0xc0, 0,
       0x20, 0x40, 0x60; none for l >= 8 (E = 1 reads right) */
    const __m256i sub_high = LANES16((char)0xc4, (char)0xff, (char)0xff, (char)0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m256i sub_low = LANES16(0, (char)0xf0, 0x60, (char)0x90, (char)0xc0, (char)0xd0, (char)0xe0, (char)0xf0,
                                    0, 0, 0, 0, 0, 0, 0, 0);
    const __m256i nib = _mm256_set1_epi8(0x0f);
    const __m256i h = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib), l = _mm256_and_si256(v, nib);
    const __m256i idx = _mm256_or_si256(_mm256_shuffle_epi8(not_sub, h), l);
    const __m256i hi = _mm256_add_epi8(_mm256_shuffle_epi8(high_bits, h), _mm256_shuffle_epi8(sub_high, idx));
    const __m256i lo = _mm256_add_epi8(_mm256_shuffle_epi8(low_bits, l), _mm256_shuffle_epi8(sub_low, idx));
    /* bf16 words: each lane's bytes 0-7 (wa), 8-15 (wb); fp32: the even words shifted up, the odd masked */
    const __m256i wa = _mm256_unpacklo_epi8(lo, hi), wb = _mm256_unpackhi_epi8(lo, hi);
    const __m256i top = _mm256_set1_epi32((int)0xffff0000u);
    o[0] = _mm256_castsi256_ps(_mm256_slli_epi32(wa, 16));
    o[1] = _mm256_castsi256_ps(_mm256_and_si256(wa, top));
    o[2] = _mm256_castsi256_ps(_mm256_slli_epi32(wb, 16));
    o[3] = _mm256_castsi256_ps(_mm256_and_si256(wb, top));
}

/* lanes: o[0] columns 0 2 4 6 16 18 20 22, o[1] 1 3 5 7 17 19 21 23, o[2] 8 10 12 14 24 26 28 30,
 * o[3] 9 11 13 15 25 27 29 31 */
static const uint8_t nibble_perm[32] = {0, 2,  4,  6,  16, 18, 20, 22, 1, 3,  5,  7,  17, 19, 21, 23,
                                        8, 10, 12, 14, 24, 26, 28, 30, 9, 11, 13, 15, 25, 27, 29, 31};

/* NaN codes (fp32 480 of either sign: no e4m3 value is 480) to NaN */
LOOP_INLINE __m256 f32_nan(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i nan = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x43f00000));
    return _mm256_castsi256_ps(_mm256_or_si256(u, _mm256_and_si256(nan, _mm256_set1_epi32(0x7fc00000))));
}

LOOP_INLINE void nibble_fast(const uint8_t *p, __m256 o[4]) { nibble_core(_mm256_loadu_si256((const __m256i *)p), o); }

/* column order: dwords 0 2 4 6 to lane 0, 1 3 5 7 to lane 1, then in each lane the bytes of
 * its dwords 0 and 1 interleaved, and of 2 and 3 */
LOOP_INLINE void nibble_exact(const uint8_t *p, __m256 o[4]) {
    const __m256i d = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)p),
                                                  _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    nibble_core(_mm256_shuffle_epi8(d, LANES16(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15)), o);
    for (int i = 0; i < 4; i++) o[i] = f32_nan(o[i]);
}

E4M3_VARIANT(nibble, nibble_fast, nibble_exact, nibble_perm, 0, 1.0f)

/* ---- avx2_gather: a 256-entry fp32 table ------------------------------------------------ */

static float gather_table[256] __attribute__((aligned(64)));

static void gather_table_init(void) {
    for (int c = 0; c < 256; c++) gather_table[c] = q3_e4m3_to_f32((uint8_t)c);
}

static int gather_supported(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, gather_table_init);
    return avx2_supported();
}

LOOP_INLINE void gather_dec(const uint8_t *p, __m256 o[4]) {
    for (int i = 0; i < 4; i++)
        o[i] = _mm256_i32gather_ps(gather_table, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i))), 4);
}

E4M3_VARIANT(gather, gather_dec, gather_dec, NULL, 1, 1.0f)

/* ---- avx2_int: fp32 bits by integer ops ------------------------------------------------- */

/* 8 codes: E > 0 gives exponent E + 120 and mantissa M << 20 from (S EEEE MMM & 0x7f) << 20
 * plus 120 << 23; E = 0 is read with E = 1 (bit 3 set) and 2^-6 subtracted: M 2^-9 exactly */
LOOP_INLINE __m256 int_8(const uint8_t *p, int with_nan) {
    const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7f));
    const __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x78)), _mm256_setzero_si256());
    const __m256i bits = _mm256_add_epi32(_mm256_slli_epi32(_mm256_or_si256(mag, _mm256_and_si256(sub, _mm256_set1_epi32(8))), 20),
                                          _mm256_set1_epi32(120 << 23));
    __m256 f = _mm256_sub_ps(_mm256_castsi256_ps(bits), _mm256_and_ps(_mm256_castsi256_ps(sub), _mm256_set1_ps(0x1p-6f)));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
    f = _mm256_or_ps(f, _mm256_castsi256_ps(sign));
    return with_nan ? f32_nan(f) : f;
}

LOOP_INLINE void int_fast(const uint8_t *p, __m256 o[4]) {
    for (int i = 0; i < 4; i++) o[i] = int_8(p + 8 * i, 0);
}

LOOP_INLINE void int_exact(const uint8_t *p, __m256 o[4]) {
    for (int i = 0; i < 4; i++) o[i] = int_8(p + 8 * i, 1);
}

E4M3_VARIANT(int, int_fast, int_exact, NULL, 0, 1.0f)

#define AVX2_ISA "avx2, fma, f16c"
static const q3_e4m3_variant variants[] = {
    {"avx2_fp16", AVX2_ISA, "fp16 bits from the sign-extended byte (vpmovsxbw, shift, and), vcvtph2ps", "avx2", 32,
     NULL, avx2_supported, fp16_decode, fp16_gemv, fp16_dequant},
    {"avx2_fp16_mem", AVX2_ISA, "fp16 bits by 16-bit shifts (even and odd bytes), vcvtph2ps from memory", NULL, 32,
     fp16_mem_perm, avx2_supported, fp16_mem_decode, fp16_mem_gemv, fp16_mem_dequant},
    {"avx2_nibble", AVX2_ISA, "bf16 bytes by vpshufb on the nibbles, placed by unpacks and shifts", NULL, 32,
     nibble_perm, avx2_supported, nibble_decode, nibble_gemv, nibble_dequant},
    {"avx2_gather", AVX2_ISA, "a 256-entry fp32 table read by vpgatherdps", NULL, 32, NULL, gather_supported,
     gather_decode, gather_gemv, gather_dequant},
    {"avx2_int", AVX2_ISA, "fp32 bits by integer ops, 2^-6 subtracted for E = 0 (as the portable path)", NULL, 32,
     NULL, avx2_supported, int_decode, int_gemv, int_dequant},
};

const q3_e4m3_variant *q3_e4m3_variants_avx2(int *n) {
    *n = (int)(sizeof variants / sizeof variants[0]);
    return variants;
}
#else
const q3_e4m3_variant *q3_e4m3_variants_avx2(int *n) {
    *n = 0;
    return NULL;
}
#endif

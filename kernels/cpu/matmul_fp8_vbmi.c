/* The FP8 decode GEMV of the avx512bf16 level on a CPU with AVX512-VBMI (the avx512 variant
 * only; matmul_fp8.c's q3_matmul_fp8_cpu_avx512bf16 calls it below 4 tokens):
 * y [T, N] (+)= x [T, K] W^T, W block-scaled e4m3 (kernels/fp8.h), the sums in fp32.
 *
 * 64 codes a step: two byte lookups (vpermi2b over 128-entry tables) give the high and the low
 * byte of each code's magnitude as bf16 (exact: e4m3 has 3 mantissa bits; NaN codes give NaN),
 * the sign ORed into the high byte, and byte unpacks pair them into bf16 words. Then:
 * - where x may be rounded (round_x: a bf16 layer's), below 4 tokens with T K <= BF16_MAX_X
 *   (the layer's every decode projection), x rounded to bf16 once a call, in the words'
 *   order, and two bf16 dot products (vdpbf16ps) a step: 7 vector operations for 64 weights.
 *   x is rounded as the prefill's dot products round it, and a token's x rows take half the
 *   L1 space of fp32 ones (o_proj's K = 8192: 16 KiB);
 * - else the words widened to 4 x 16 fp32 lanes in column order (their bytes put in that order
 *   first, vpermb) and fp32 FMAs with x as given: 14 operations.
 * Rows split over threads; each row's bytes read once, each decoded vector serving up to 3 tokens.
 * On an AMD Zen 4 (2 threads, 256-bit datapaths; C harness, old and new alternated on other
 * weight copies), [1536, 4096] from memory: fp16 construction ~27 GB/s, fp32 lookups 20-30,
 * bf16 dot products 20-42 (40-52 from L3, against 28-37); o_proj's [4096, 8192] 18-20 -> 21-29.
 */
#include "matmul_fp8_vbmi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#include <pthread.h>
#include <string.h>

#include "../fp8.h"

/* the avx512bf16 level's only, so both extensions (the bf16 dot products below 4 tokens) */
#define VBMI_BF16_TARGET __attribute__((target("avx512vbmi,avx512bf16")))

/* bf16 high and low bytes of each magnitude m < 128 (m = 127: NaN 0x7fc0), and the byte order
 * of a step: byte q of the reordered 64 is column step_order[q] */
static uint8_t mag_high[128] __attribute__((aligned(64))), mag_low[128] __attribute__((aligned(64)));
static uint8_t step_order[64] __attribute__((aligned(64)));
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void make_tables(void) { /* once, by pthread_once: no two threads write them */
    for (int m = 0; m < 128; m++) {
        const float f = q3_e4m3_to_f32((uint8_t)m);
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        if (m == 127) u = 0x7fc00000u;
        mag_high[m] = (uint8_t)(u >> 24);
        mag_low[m] = (uint8_t)(u >> 16);
    }
    /* unpacklo/hi of bytes then even/odd words leave, in 128-bit lane l of output v, the
     * columns 16 l + 8 (v >> 1) + (v & 1) + {0, 2, 4, 6} of the step's bytes as loaded; so the
     * byte that output v's lane l, element i (column 16 v + 4 l + i) needs sits at that place */
    for (int v = 0; v < 4; v++)
        for (int l = 0; l < 4; l++)
            for (int i = 0; i < 4; i++) {
                const int from = 16 * l + 8 * (v >> 1) + (v & 1) + 2 * i; /* where unpacking reads */
                step_order[from] = (uint8_t)(16 * v + 4 * l + i);
            }
}

typedef struct {
    __m512i hi0, hi1, lo0, lo1, order;
} vbmi_tables;

#define INLINE static inline __attribute__((always_inline)) VBMI_BF16_TARGET

/* the 64 codes c as two vectors of 32 bf16 words (exact): wa holds, in 128-bit lane l, the
 * codes at bytes 16 l .. 16 l + 7 of c, wb those at 16 l + 8 .. 16 l + 15 */
INLINE void lookup_words(__m512i c, const vbmi_tables *t, __m512i *wa, __m512i *wb) {
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, c, t->hi1), c,
                                                 _mm512_set1_epi8((char)0x80), 0xf8); /* hi | (c & 0x80) */
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, c, t->lo1);
    *wa = _mm512_unpacklo_epi8(lo, hi);
    *wb = _mm512_unpackhi_epi8(lo, hi);
}

/* o[v] = the fp32 weights of columns 16 v .. 16 v + 15 of the 64 codes at p */
INLINE void decode64(const uint8_t *p, const vbmi_tables *t, __m512 o[4]) {
    __m512i wa, wb;
    lookup_words(_mm512_permutexvar_epi8(t->order, _mm512_loadu_si512(p)), t, &wa, &wb);
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    o[0] = _mm512_castsi512_ps(_mm512_slli_epi32(wa, 16));
    o[1] = _mm512_castsi512_ps(_mm512_and_si512(wa, top));
    o[2] = _mm512_castsi512_ps(_mm512_slli_epi32(wb, 16));
    o[3] = _mm512_castsi512_ps(_mm512_and_si512(wb, top));
}

/* x [T, K] -> xq [T, K] bf16 (to nearest even, as round_rows in matmul_dot.c) in the order
 * lookup_words leaves the codes of each whole step of 64 columns as loaded: words j of the
 * step's first half are columns 16 (j / 8) + j % 8, of its second half those + 8; the columns
 * past the last whole step in order */
static void round_steps(uint16_t *xq, const float *x, int64_t T, int64_t K) {
    const int64_t whole = K / 64 * 64;
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * K;
        uint16_t *qt = xq + t * K;
        for (int64_t k = 0; k < whole; k += 64)
            for (int j = 0; j < 32; j++) {
                qt[k + j] = q3_f32_to_bf16(xt[k + 16 * (j / 8) + j % 8]);
                qt[k + 32 + j] = q3_f32_to_bf16(xt[k + 16 * (j / 8) + 8 + j % 8]);
            }
        for (int64_t k = whole; k < K; k++) qt[k] = q3_f32_to_bf16(xt[k]);
    }
}

/* y[t * N] for tokens t < NT (<= 3) of one row wr [K]; srow: the row's scales. BF: x [NT, K]
 * in bf16 as round_steps leaves it, two bf16 dot products a step; else x fp32 as given, four
 * FMAs a step. Two sums a token within a scale block, added into tot times the block's scale. */
INLINE void row_sums(float *y, const void *xv, const uint8_t *wr, const void *scale, q3_dtype sdt, int64_t srow,
                     int64_t N, int64_t K, int acc, const vbmi_tables *tb, const int NT, const int BF) {
    const float *x = (const float *)xv;
    const uint16_t *xq = (const uint16_t *)xv;
    __m512 tot[3], a0[3], a1[3];
    float tail[3] = {0};
    for (int t = 0; t < NT; t++) tot[t] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += Q3_FP8_BLOCK) {
        const int64_t k1 = k0 + Q3_FP8_BLOCK < K ? k0 + Q3_FP8_BLOCK : K;
        const float s = q3_fp8_scale_at(scale, sdt, srow + k0 / Q3_FP8_BLOCK);
        /* 2048 bytes ahead, as matmul_fp8.c's GEMV: into the next rows at a row's end */
        _mm_prefetch((const char *)wr + k0 + 2048, _MM_HINT_T0);
        _mm_prefetch((const char *)wr + k0 + 2048 + 64, _MM_HINT_T0);
        for (int t = 0; t < NT; t++) a0[t] = a1[t] = _mm512_setzero_ps();
        int64_t k = k0;
        for (; k + 64 <= k1; k += 64) {
            if (BF) {
                __m512i wa, wb;
                lookup_words(_mm512_loadu_si512(wr + k), tb, &wa, &wb);
                for (int t = 0; t < NT; t++) {
                    const uint16_t *qt = xq + t * K + k;
                    a0[t] = _mm512_dpbf16_ps(a0[t], (__m512bh)_mm512_loadu_si512(qt), (__m512bh)wa);
                    a1[t] = _mm512_dpbf16_ps(a1[t], (__m512bh)_mm512_loadu_si512(qt + 32), (__m512bh)wb);
                }
            } else {
                __m512 o[4];
                decode64(wr + k, tb, o);
                for (int t = 0; t < NT; t++) {
                    const float *xt = x + t * K + k;
                    a0[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xt), o[0], a0[t]);
                    a1[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 16), o[1], a1[t]);
                    a0[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 32), o[2], a0[t]);
                    a1[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 48), o[3], a1[t]);
                }
            }
        }
        for (int t = 0; t < NT; t++) tot[t] = _mm512_fmadd_ps(_mm512_add_ps(a0[t], a1[t]), _mm512_set1_ps(s), tot[t]);
        for (; k < k1; k++) { /* K % 64, x in order there (NaN codes give NaN here too) */
            const float w = q3_e4m3_to_f32(wr[k]) * s;
            for (int t = 0; t < NT; t++) tail[t] += (BF ? q3_bf16_to_f32(xq[t * K + k]) : x[t * K + k]) * w;
        }
    }
    for (int t = 0; t < NT; t++) y[t * N] = (acc ? y[t * N] : 0.0f) + _mm512_reduce_add_ps(tot[t]) + tail[t];
}

#define BF16_MAX_X (3 * 8192) /* x elements rounded on a thread's stack: o_proj's K for 3 tokens */

VBMI_BF16_TARGET void q3_fp8_gemv_vbmi(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt,
                                       int64_t T, int64_t N, int64_t K, int acc, int threads, int round_x) {
    pthread_once(&tables_once, make_tables);
    const vbmi_tables tb = {_mm512_load_si512(mag_high), _mm512_load_si512(mag_high + 64),
                            _mm512_load_si512(mag_low), _mm512_load_si512(mag_low + 64),
                            _mm512_load_si512(step_order)};
    const int64_t kb = q3_fp8_blocks(K);
    const int bf = round_x && T < 4 && T * K <= BF16_MAX_X;
#pragma omp parallel num_threads(threads) if (T * N * K > (1 << 18))
    {
        uint16_t xq[BF16_MAX_X] __attribute__((aligned(64))); /* bf: x rounded, each thread its own */
        if (bf) round_steps(xq, x, T, K);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *wr = w + n * K;
            const int64_t srow = n / Q3_FP8_BLOCK * kb;
            for (int64_t t = 0; t < T; t += 3) { /* the caller's T < 4: one pass */
                float *yt = y + t * N + n;
                const float *xt = x + t * K;
                switch ((T - t < 3 ? (int)(T - t) : 3) + 8 * bf) { /* constant NT: sums in registers */
                case 1: row_sums(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, 1, 0); break;
                case 2: row_sums(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, 2, 0); break;
                case 3: row_sums(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, 3, 0); break;
                case 8 + 1: row_sums(yt, xq, wr, scale, sdt, srow, N, K, acc, &tb, 1, 1); break;
                case 8 + 2: row_sums(yt, xq, wr, scale, sdt, srow, N, K, acc, &tb, 2, 1); break;
                default: row_sums(yt, xq, wr, scale, sdt, srow, N, K, acc, &tb, 3, 1); break;
                }
            }
        }
    }
}

int q3_cpu_has_vbmi(void) { return __builtin_cpu_supports("avx512vbmi"); }

#endif

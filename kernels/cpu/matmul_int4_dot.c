/* The int4 prefill of a bf16 layer on the avx512bf16 level: bf16 dot products (vdpbf16ps) on
 * the nibbles as they lie in qweight, no panel of dequantized weights.
 *
 * y [T, N] (+)= x [T, K] W^T, T >= Q3_INT4_GEMV_MAX_T, W a GPTQ matrix (kernels/int4.h) whose
 * groups are whole word rows and nest with blocks of 128 inputs (group a multiple of 8 below
 * 128, or a multiple of 128; -1 as K). A qweight row's 16 words of 16 adjacent columns are one
 * vector; vdpbf16ps adds a lane's two bf16 products, so a lane holds two inputs of its column,
 * 8r + j and 8r + j + 4 (nibbles j and j + 4: the word's two 16-bit halves, one shift apart),
 * and each token's x is stored in that order once per call (xp, in the caller's xb):
 *     xp[t, 8r + 2j] = bf16(x[t, 8r + j]),  xp[t, 8r + 2j + 1] = bf16(x[t, 8r + j + 4]),  j < 4.
 * A nibble q becomes the bf16 1 + q/16 by a shift and an and-or (vpternlogd): q in the top
 * mantissa bits under the exponent of 1, exact. Per unit u (the group, or a 128-input block of
 * a larger group), column n and token t, in fp32:
 *     acc = sum_{k in u} xr[t, k] (1 + q[k, n]/16),   xs = sum_{k in u} xr[t, k]  (xr = bf16(x))
 *     y[t, n] += 16 s (acc - (1 + z/16) xs) = s sum xr (q - z)
 * so the weights enter exactly (not rounded to bf16 as the panel path rounds them), x rounded
 * to bf16 as every bf16 path rounds it; the subtraction costs about log2(1 + 16/|q - z|) bits
 * of the sums' fp32 precision (held by csrc/check/cpu_ops/cases_int4.c to the exact product's
 * rounding bound).
 *
 * Threads split the columns in strips of STRIP vectors (64 columns). A strip, unit by unit:
 * its unit's words decoded once into an L1 buffer of bf16 pairs [unit/2][STRIP] vectors (16 KB
 * at 128 inputs), the next unit's lines prefetched, then every token tile of TILE_T tokens
 * runs TILE_T x STRIP accumulators over the buffer (a vector load per column vector and pair,
 * a broadcast of each token's pair) and adds its sums into y. The next unit's lines go to L2,
 * not L1: its 16 rows lie 4N bytes apart, the same L1 sets at N = 4096 or 8192.
 * Measured on an AMD EPYC Zen 4 (family 25 model 17), 2 threads, in one process against the
 * bf16 dot products (matmul_dot.c) on the same matrices in bf16: [32 x 1536 x 4096] 352-370
 * GFLOP/s against 363-378, [32 x 4096 x 1536] 360-368 against 409-416, [512 x 8192 x 4096]
 * 340 against 382-386 (a core's vdpbf16ps peak: 231); the layer's 512-token prefill 0.91x the
 * bf16 layer's (bench_cpu.py --int4), where the bf16 rows of matmul_int4.c gave 0.57x. */
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "ops.h"
#include "vec.h"

#if Q3_LANES == 16 && defined(__AVX512BW__)
#include <immintrin.h>

#define BF16 __attribute__((target("avx512bf16")))
#define STRIP 4      /* column vectors a strip: 64 columns */
#define TILE_T 6     /* tokens a register tile: 6 x 4 accumulators of the 32 zmm */
#define UNIT_MAX 128 /* inputs a unit at most: the buffer's 64 pairs x STRIP vectors */

/* the unit of a group: where the groups nest with 128-input blocks in whole words (0: not) */
static int64_t unit_of(int64_t group) {
    if (group <= 0 || group % Q3_INT4_PACK) return 0;
    return group % UNIT_MAX == 0 ? UNIT_MAX : group < UNIT_MAX ? group : 0;
}

/* xp [T, K] <- x rounded to bf16 in pair order (above); xs [T, K/unit] <- each unit's sum of
 * the rounded values */
static BF16 void prepare_tokens(uint16_t *xp, float *xs, const float *x, int64_t T, int64_t K, int64_t unit,
                                int threads) {
    /* within each 8 inputs: 0 4 1 5 2 6 3 7 */
    const __m512i order = _mm512_set_epi32(15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2, 5, 1, 4, 0);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T * K > (1 << 16))
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * K;
        uint16_t *pt = xp + t * K;
        for (int64_t u = 0; u < K / unit; u++) {
            __m512 sum = _mm512_setzero_ps();
            int64_t k = u * unit;
            for (; k + 16 <= (u + 1) * unit; k += 16) {
                const __m256bh b = _mm512_cvtneps_pbh(_mm512_permutexvar_ps(order, _mm512_loadu_ps(xt + k)));
                _mm256_storeu_si256((__m256i *)(pt + k), (__m256i)b);
                sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(b));
            }
            if (k < (u + 1) * unit) { /* a unit of 8 (or 8 more than 16s): one word's 8 inputs */
                const __m256 v = _mm256_permutexvar_ps(_mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0), _mm256_loadu_ps(xt + k));
                const __m128bh b = _mm256_cvtneps_pbh(v);
                _mm_storeu_si128((__m128i *)(pt + k), (__m128i)b);
                sum = _mm512_add_ps(sum, _mm512_zextps256_ps512(_mm256_cvtpbh_ps(b)));
            }
            xs[t * (K / unit) + u] = _mm512_reduce_add_ps(sum);
        }
    }
}

/* one strip's parameters for a unit: 16 s and 1 + z/16 of each of its column vectors */
typedef struct {
    __m512 s16[STRIP], zz[STRIP];
} unit_scales;

/* buf [unit/2][STRIP] bf16-pair vectors <- word rows [r0, r0 + unit/8) of the strip's columns
 * from n0 (lanes masked per vector: a vector past N loads nothing), and the unit's scales */
static BF16 void decode_unit(__m512i *buf, unit_scales *sc, const q3_int4_matrix *w, int64_t N, int64_t r0,
                             int64_t unit, int64_t n0, const __mmask16 *mask) {
    const __m512i keep = _mm512_set1_epi32(0x00780078), one = _mm512_set1_epi32(0x3f803f80);
    for (int64_t rr = 0; rr < unit / Q3_INT4_PACK; rr++) {
        const int32_t *row = w->qweight + (r0 + rr) * N + n0;
        for (int c = 0; c < STRIP; c++) {
            const __m512i words = _mm512_maskz_loadu_epi32(mask[c], row + 16 * c);
            __m512i *b = buf + rr * 4 * STRIP + c;
            /* pair j: nibble j to bits 3..6, nibble j + 4 to bits 19..22 (a shift of 3 - 4j) */
            b[0 * STRIP] = _mm512_ternarylogic_epi32(_mm512_slli_epi32(words, 3), keep, one, 0xea);
            b[1 * STRIP] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(words, 1), keep, one, 0xea);
            b[2 * STRIP] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(words, 5), keep, one, 0xea);
            b[3 * STRIP] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(words, 9), keep, one, 0xea);
        }
    }
    const int64_t g = Q3_INT4_PACK * r0 / w->group;
    const __m512i shifts = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
    for (int c = 0; c < STRIP; c++) {
        const int64_t n = n0 + 16 * c;
        /* the zeros' two words (one where only 8 columns remain), each spread over 8 lanes */
        const __m512i zw = _mm512_maskz_loadu_epi32((__mmask16)(mask[c] == 0xffff ? 3 : mask[c] ? 1 : 0),
                                                    w->qzeros + g * (N / Q3_INT4_PACK) + n / Q3_INT4_PACK);
        const __m512i words = _mm512_permutexvar_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), zw);
        const __m512i z = _mm512_add_epi32(_mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(0xf)),
                                           _mm512_set1_epi32(w->zero_offset));
        sc->zz[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z), _mm512_set1_ps(0.0625f), _mm512_set1_ps(1.0f));
        const __m256i h = _mm256_maskz_loadu_epi16(mask[c], w->scales + g * N + n);
        sc->s16[c] = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(16.0f));
    }
}

/* y [TT tokens, the strip's columns] += the unit's sums for tokens from xt (pairs of the unit
 * from its first input; token stride K) with unit sums xst (stride U) */
static inline __attribute__((always_inline)) BF16 void tile_unit(float *y, int64_t N, const uint16_t *xt, int64_t K,
                                                                 const float *xst, int64_t U, const __m512i *buf,
                                                                 int64_t pairs, const unit_scales *sc,
                                                                 const __mmask16 *mask, const int TT) {
    __m512 acc[TILE_T][STRIP];
    for (int t = 0; t < TT; t++)
        for (int c = 0; c < STRIP; c++) acc[t][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[STRIP];
        for (int c = 0; c < STRIP; c++) wv[c] = (__m512bh)_mm512_load_si512(buf + p * STRIP + c);
        for (int t = 0; t < TT; t++) {
            int32_t pair;
            memcpy(&pair, xt + t * K + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < STRIP; c++) acc[t][c] = _mm512_dpbf16_ps(acc[t][c], wv[c], xv);
        }
    }
    for (int t = 0; t < TT; t++) {
        const __m512 s = _mm512_set1_ps(xst[t * U]);
        for (int c = 0; c < STRIP; c++) {
            float *yc = y + t * N + 16 * c;
            const __m512 d = _mm512_fnmadd_ps(sc->zz[c], s, acc[t][c]); /* acc - (1 + z/16) xs */
            _mm512_mask_storeu_ps(yc, mask[c], _mm512_fmadd_ps(sc->s16[c], d, _mm512_maskz_loadu_ps(mask[c], yc)));
        }
    }
}

/* y [T, strip] += one unit's products over every token: ceil(T / TILE_T) tiles of sizes that
 * differ by one at most (32 tokens: 6 6 5 5 5 5, not 6 6 6 6 6 2), each tile's accumulators as
 * busy as its size allows */
static BF16 void tiles_unit(float *y, int64_t N, const uint16_t *xp, int64_t K, const float *xs, int64_t U,
                            const __m512i *buf, int64_t unit, const unit_scales *sc, const __mmask16 *mask,
                            int64_t T) {
    const int64_t pairs = unit / 2, tiles = (T + TILE_T - 1) / TILE_T;
    for (int64_t i = 0, t = 0; i < tiles; i++) {
        const int64_t n = T / tiles + (i < T % tiles);
        for (int64_t j = t + n; j < t + 2 * n && j < T; j++) /* the next tile's pairs (x rows K apart) */
            for (int64_t b = 0; b < unit * 2; b += 64) _mm_prefetch((const char *)(xp + j * K) + b, _MM_HINT_T0);
        switch (n) {
#define TILE(n) \
    case n: tile_unit(y + t * N, N, xp + t * K, K, xs + t * U, U, buf, pairs, sc, mask, n); break;
            TILE(6)
            TILE(5)
            TILE(4)
            TILE(3)
            TILE(2)
            TILE(1)
#undef TILE
        default: break;
        }
        t += n;
    }
}

int q3_int4_prefill_dot(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                        int accumulate, float *scratch, int threads, uint16_t *xb) {
    const int64_t unit = unit_of(w->group);
    if (!xb || !scratch || !unit || K % unit || N % Q3_INT4_PACK || T < Q3_INT4_GEMV_MAX_T) return 0;
    if (threads < 1) threads = 1;
    const int64_t U = K / unit, strips = (N + 16 * STRIP - 1) / (16 * STRIP);
    float *xs = scratch; /* [T, U]: within q3_matmul_int4_scratch_floats(T, K) for T >= 16 */
    prepare_tokens(xb, xs, x, T, K, unit, threads);
    const int nt = threads < strips ? threads : (int)strips;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        const int id = omp_get_thread_num(), n_th = omp_get_num_threads();
#else
        const int id = 0, n_th = 1;
#endif
        __m512i buf[UNIT_MAX / 2 * STRIP];
        unit_scales sc;
        for (int64_t s = strips * id / n_th; s < strips * (id + 1) / n_th; s++) {
            const int64_t n0 = s * 16 * STRIP;
            __mmask16 mask[STRIP];
            for (int c = 0; c < STRIP; c++) {
                const int64_t left = N - n0 - 16 * c;
                mask[c] = (__mmask16)(left >= 16 ? 0xffff : left > 0 ? (1u << left) - 1 : 0);
            }
            if (!accumulate)
                for (int64_t t = 0; t < T; t++) {
                    const int64_t width = N - n0 < 16 * STRIP ? N - n0 : 16 * STRIP;
                    memset(y + t * N + n0, 0, (size_t)width * sizeof *y);
                }
            for (int64_t u = 0; u < U; u++) {
                const int64_t r0 = u * unit / Q3_INT4_PACK;
                decode_unit(buf, &sc, w, N, r0, unit, n0, mask);
                if (u + 1 < U) /* the next unit's lines, while this one's tiles run */
                    for (int64_t rr = 0; rr < unit / Q3_INT4_PACK; rr++)
                        for (int c = 0; c < STRIP; c++)
                            if (mask[c]) _mm_prefetch((const char *)(w->qweight + (r0 + unit / 8 + rr) * N + n0 + 16 * c),
                                                      _MM_HINT_T1);
                tiles_unit(y + n0, N, xb + u * unit, K, xs + u, U, buf, unit, &sc, mask, T);
            }
        }
    }
    return 1;
}
#endif

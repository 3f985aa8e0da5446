/* The int4 decode GEMV of a bf16 layer on the avx512bf16 level, on integer dot products
 * (AVX512-VNNI's vpdpbusd: 4 unsigned bytes x 4 signed bytes summed into an int32 lane).
 *
 * y [T, N] (+)= x [T, K] W^T, T < Q3_INT4_GEMV_MAX_T, W a GPTQ matrix (kernels/int4.h) whose
 * groups lie in or over blocks of 128 inputs (group 8, 16, 32, 64 or 128, or a multiple of 128;
 * -1 as K). Each token's x is held per block of 128 inputs as two signed 8-bit digits,
 *     x[k] ~ sx (hi[k] + lo[k] / 256),   sx = max |x over the block| / 127,
 *     hi = round(x / sx) in [-127, 127],  lo = round(256 (x / sx - hi)) in [-128, 127],
 * an error of at most sx / 512 = max / 65024 an input (1.5e-5 of the block's largest), below
 * the bf16 rounding (2^-9 of each input) that a bf16 layer's activations already carry and
 * that the prefill's bf16 path (matmul_int4.c) applies: measured in tests/layer and held by
 * the CPU op harness (csrc/check/cpu_ops/cases_int4.c) to the exact product's rounding bound.
 * An fp32 layer (no xb) keeps the fp32 GEMV of matmul_int4.c: it is held to 1e-5.
 *
 * A qweight word holds inputs 8r .. 8r + 7 of one column; its bytes masked (w & 0x0f0f0f0f)
 * are inputs 8r, +2, +4, +6 and shifted ((w >> 4) & 0x0f0f0f0f) inputs 8r + 1, +3, +5, +7, so
 * the digits are stored in that order (xq: per token and word row, 16 bytes: hi of the even
 * inputs, hi of the odd, lo of the even, lo of the odd; in the caller's xb, 2 bytes an input)
 * and each is one broadcast dword. Per word row and 16 columns: an and, a shift and an and,
 * four vpdpbusd: 128 weights in 7 instructions, against 24 for the fp32 GEMV's decode (a
 * shift, an and-or and an FMA per 16). Per unit (the group, or a block of a larger group) and
 * column, exactly in int32 (|sums| < 2^26):
 *     d = 256 sum q hi + sum q lo - z (256 sum hi + sum lo),   y += s sx / 256 d.
 * Threads split the columns in whole vectors as the fp32 GEMV does. One token: unit by unit,
 * strips of 64 columns whose sums stay in registers through the unit's rows, the next unit's
 * lines prefetched into L2 in memory order meanwhile; several tokens: each row's columns
 * streamed into an L1 tile of int32 sums, [T][hi, lo][columns].
 * Measured, one thread of an AMD EPYC Zen 4 (family 25 model 17), a [1536, 4096] matrix, one
 * token: 32-37 GB/s of qweight, scales and zeros from L2/L3 (the fp32 GEMV 13), 15-17 GB/s
 * from memory (the fp32 GEMV 10-11.6), the other core busy. */
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "int4_digits.h"
#include "ops.h"
#include "vec.h"

#if Q3_LANES == 16 && defined(__AVX512BW__)
#include <immintrin.h>

#define VNNI __attribute__((target("avx512vnni")))
#define TILE_INTS 4096                /* the tile's sums: 2 T columns int32, 16 KB */
#define PREFETCH_ROWS 4               /* qweight rows ahead (several tokens' tiles) */

/* hi, lo += the digits d (4 dwords: hi even, hi odd, lo even, lo odd) times one word row's
 * even and odd nibble bytes */
static inline __attribute__((always_inline, target("avx512vnni"))) void dot_row(__m512i *hi, __m512i *lo,
                                                                               __m512i even, __m512i odd,
                                                                               const int32_t *d) {
    *hi = _mm512_dpbusd_epi32(*hi, even, _mm512_set1_epi32(d[0]));
    *hi = _mm512_dpbusd_epi32(*hi, odd, _mm512_set1_epi32(d[1]));
    *lo = _mm512_dpbusd_epi32(*lo, even, _mm512_set1_epi32(d[2]));
    *lo = _mm512_dpbusd_epi32(*lo, odd, _mm512_set1_epi32(d[3]));
}

/* the tile's sums [T][2][nc] += word rows [r0, r1) of columns [c0, c0 + nc), two rows a pass
 * (each token's sums loaded and stored once for both); a vector of 16 words is one cache line,
 * each prefetched PREFETCH_ROWS rows ahead */
static VNNI void sum_unit(int32_t *acc, const int8_t *xq, const int32_t *qweight, int64_t T, int64_t N, int64_t K,
                          int64_t c0, int64_t nc, int64_t r0, int64_t r1) {
    const __m512i nib = _mm512_set1_epi32(0x0f0f0f0f);
    for (int64_t r = r0; r < r1; r += 2) {
        const int two = r + 1 < r1;
        const int32_t *wr = qweight + r * N + c0;
        for (int64_t v = 0; v < nc; v += 16) {
            __builtin_prefetch(wr + PREFETCH_ROWS * N + v);
            const __m512i w0 = _mm512_loadu_si512(wr + v);
            const __m512i e0 = _mm512_and_si512(w0, nib), o0 = _mm512_and_si512(_mm512_srli_epi32(w0, 4), nib);
            __m512i e1 = e0, o1 = o0;
            if (two) {
                __builtin_prefetch(wr + (PREFETCH_ROWS + 1) * N + v);
                const __m512i w1 = _mm512_loadu_si512(wr + N + v);
                e1 = _mm512_and_si512(w1, nib), o1 = _mm512_and_si512(_mm512_srli_epi32(w1, 4), nib);
            }
            for (int64_t t = 0; t < T; t++) {
                const int32_t *d = (const int32_t *)(xq + (t * (K / 8) + r) * 16);
                int32_t *a = acc + t * 2 * nc + v;
                __m512i hi = _mm512_loadu_si512(a), lo = _mm512_loadu_si512(a + nc);
                dot_row(&hi, &lo, e0, o0, d);
                if (two) dot_row(&hi, &lo, e1, o1, d + 4);
                _mm512_storeu_si512(a, hi);
                _mm512_storeu_si512(a + nc, lo);
            }
        }
    }
}

/* the zeros (stored + zero_offset) of columns [n, n + 16) in one group's row of qzeros */
static VNNI __m512i zeros16(const int32_t *qz, int64_t n, int zero_offset) {
    const __m512i words = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(qz[n / 8]), _mm512_set1_epi32(qz[n / 8 + 1]));
    const __m512i shifts = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
    return _mm512_add_epi32(_mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(0xf)),
                            _mm512_set1_epi32(zero_offset));
}

/* y [T, N] += columns [c0, c0 + nc) (nc a multiple of 16, 2 T nc <= TILE_INTS) */
static VNNI void gemv_tile(float *y, const int8_t *xq, const float *sx, const q3_int4_matrix *w, int64_t T, int64_t N,
                           int64_t K, int64_t unit, int64_t c0, int64_t nc) {
    int32_t acc[TILE_INTS] __attribute__((aligned(64)));
    const int64_t group = w->group;
    for (int64_t u0 = 0; u0 < K; u0 += unit) {
        const int64_t g = u0 / group, r0 = u0 / 8, r1 = (u0 + unit) / 8;
        memset(acc, 0, (size_t)(2 * T * nc) * sizeof *acc);
        sum_unit(acc, xq, w->qweight, T, N, K, c0, nc, r0, r1);
        for (int64_t t = 0; t < T; t++) {
            int32_t shi, slo;
            const int8_t *xt = xq + t * (K / 8) * 16;
            digit_sums(xt, r0, r1, &shi, &slo);
            const __m512i zsum = _mm512_set1_epi32(256 * shi + slo);
            const float f = sx[t * ((K + BLOCK - 1) / BLOCK) + u0 / BLOCK] / 256.0f;
            for (int64_t v = 0; v < nc; v += 16) {
                const int64_t n = c0 + v;
                const __m512 s = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + g * N + n))),
                                               _mm512_set1_ps(f));
                const __m512i z = zeros16(w->qzeros + g * (N / 8), n, w->zero_offset);
                const int32_t *a = acc + t * 2 * nc + v;
                const __m512i d = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(a), 8),
                                                                    _mm512_loadu_si512(a + nc)),
                                                   _mm512_mullo_epi32(z, zsum));
                float *yt = y + t * N + n;
                _mm512_storeu_ps(yt, _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(d), _mm512_loadu_ps(yt)));
            }
        }
    }
}

/* the next unit's lines of a thread's columns, prefetched one a step in memory order while
 * this unit's run (its rows are read strip by strip, a walk the hardware prefetchers do not
 * follow: from memory, one thread on the Zen 4, 8-10 GB/s without this, 15-17 with it):
 * row, the row's first column; col in [0, nc), a multiple of 16 */
typedef struct {
    const int32_t *row;
    int64_t col, nc, N;
} prefetch_cursor;

static inline void prefetch_step(prefetch_cursor *p) {
    if (!p->row) return;
    __builtin_prefetch(p->row + p->col, 0, 1); /* into L2: a unit ahead is more than L1 holds */
    if ((p->col += 16) == p->nc) p->col = 0, p->row += p->N;
}

/* One token, one unit (word rows [r0, r1), group g, digit block scale f = sx / 256, zs = 256
 * sum hi + sum lo of the unit): y [N] += columns [n, n + 16 VB), the 2 VB sums held in
 * registers while the unit's rows go by, the digits' dwords broadcast once a row */
static inline __attribute__((always_inline, target("avx512vnni"))) void strip_one(
    float *y, const int8_t *xq, const q3_int4_matrix *w, int64_t N, int64_t r0, int64_t r1, int64_t g, float f,
    int32_t zs, int64_t n, prefetch_cursor *pf, const int VB) {
    const __m512i nib = _mm512_set1_epi32(0x0f0f0f0f);
    __m512i hi[4], lo[4];
    for (int b = 0; b < VB; b++) hi[b] = lo[b] = _mm512_setzero_si512();
    for (int64_t r = r0; r < r1; r++) {
        const int32_t *d = (const int32_t *)(xq + r * 16), *wr = w->qweight + r * N + n;
        const __m512i he = _mm512_set1_epi32(d[0]), ho = _mm512_set1_epi32(d[1]);
        const __m512i le = _mm512_set1_epi32(d[2]), lO = _mm512_set1_epi32(d[3]);
        for (int b = 0; b < VB; b++) {
            prefetch_step(pf);
            const __m512i words = _mm512_loadu_si512(wr + 16 * b);
            const __m512i even = _mm512_and_si512(words, nib);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(words, 4), nib);
            hi[b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(hi[b], even, he), odd, ho);
            lo[b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lo[b], even, le), odd, lO);
        }
    }
    const __m512i zsum = _mm512_set1_epi32(zs);
    for (int b = 0; b < VB; b++) {
        const int64_t c = n + 16 * b;
        const __m512 s = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + g * N + c))),
                                       _mm512_set1_ps(f));
        const __m512i z = zeros16(w->qzeros + g * (N / 8), c, w->zero_offset);
        const __m512i dsum = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[b], 8), lo[b]),
                                              _mm512_mullo_epi32(z, zsum));
        _mm512_storeu_ps(y + c, _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(dsum), _mm512_loadu_ps(y + c)));
    }
}

/* one token: y [N] += columns [c0, c0 + nc) (a multiple of 16), unit by unit, four vectors a
 * strip; zsum [K / unit]: each unit's 256 sum hi + sum lo */
static VNNI void gemv_one(float *y, const int8_t *xq, const float *sx, const int32_t *zsum, const q3_int4_matrix *w,
                          int64_t N, int64_t K, int64_t unit, int64_t c0, int64_t nc) {
    for (int64_t u0 = 0; u0 < K; u0 += unit) {
        const int64_t r0 = u0 / 8, r1 = (u0 + unit) / 8, g = u0 / w->group;
        const float f = sx[u0 / BLOCK] / 256.0f;
        prefetch_cursor pf = {u0 + unit < K ? w->qweight + r1 * N + c0 : NULL, 0, nc, N};
        int64_t v = 0;
        for (; v + 64 <= nc; v += 64) strip_one(y, xq, w, N, r0, r1, g, f, zsum[u0 / unit], c0 + v, &pf, 4);
        for (; v < nc; v += 16) strip_one(y, xq, w, N, r0, r1, g, f, zsum[u0 / unit], c0 + v, &pf, 1);
    }
}

/* x's digits and block scales as quantize_token makes them (int4_digits.h), 16 inputs at a
 * time with the same operations lane by lane, so the bytes are the same: |x| maxed over the
 * block, x * inv rounded to nearest even, its remainder times 256 rounded and clamped; each
 * pair of word rows' bytes put in the digits' order (even inputs, then odd) by one permute.
 * K a multiple of BLOCK (the caller falls back to quantize_token otherwise). */
static VNNI void quantize_token_avx512(int8_t *xq, float *sx, const float *x, int64_t K) {
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t b0 = 0; b0 < K; b0 += BLOCK) {
        __m512 m = _mm512_setzero_ps();
        for (int64_t k = b0; k < b0 + BLOCK; k += 16) /* a NaN lane keeps m's (the scalar test's) */
            m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + k)), m);
        const float amax = _mm512_reduce_max_ps(m), inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        sx[b0 / BLOCK] = amax / 127.0f;
        for (int64_t k = b0; k < b0 + BLOCK; k += 16) {
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + k), _mm512_set1_ps(inv));
            const __m512 hi = _mm512_roundscale_ps(v, round);
            const __m512 lo = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, hi),
                                                                                             _mm512_set1_ps(256.0f)), round),
                                                          _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
            const __m128i h = _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(order, _mm512_cvtps_epi32(hi)));
            const __m128i l = _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(order, _mm512_cvtps_epi32(lo)));
            _mm_storeu_si128((__m128i *)(xq + k / 8 * 16), _mm_unpacklo_epi64(h, l));
            _mm_storeu_si128((__m128i *)(xq + k / 8 * 16 + 16), _mm_unpackhi_epi64(h, l));
        }
    }
}

int q3_int4_gemv_vnni(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                      int accumulate, int threads, uint16_t *xb) {
    const int64_t unit = unit_of(w->group, K);
    if (!xb || unit == 0 || T < 1 || T >= Q3_INT4_GEMV_MAX_T || N < 16 || K % 8) return 0;
    int8_t *xq = (int8_t *)xb; /* [T][K/8][16]: 2 T K bytes of the caller's T K bf16 */
    float sx[Q3_INT4_GEMV_MAX_T * 64];
    const int64_t blocks = (K + BLOCK - 1) / BLOCK;
    if (T * blocks > (int64_t)(sizeof sx / sizeof sx[0]) || K / unit > 1024) return 0; /* K above 8192 */
    for (int64_t t = 0; t < T; t++) {
        if (K % BLOCK == 0) quantize_token_avx512(xq + t * (K / 8) * 16, sx + t * blocks, x + t * K, K);
        else quantize_token(xq + t * (K / 8) * 16, sx + t * blocks, x + t * K, K);
    }
    int32_t zsum[1024]; /* one token's: 256 sum hi + sum lo of each unit (K / unit <= 1024: K <= 8192) */
    for (int64_t u = 0; T == 1 && u < K / unit; u++) {
        int32_t shi, slo;
        digit_sums(xq, u * unit / 8, (u + 1) * unit / 8, &shi, &slo);
        zsum[u] = 256 * shi + slo;
    }
    const int64_t vectors = N / 16;
    const int nt = threads < 1 ? 1 : threads < vectors ? threads : (int)vectors;
    const int64_t tile = TILE_INTS / (2 * T) / 16 * 16;
#pragma omp parallel num_threads(nt) if (nt > 1 && T * N * K > (1 << 18))
    {
        int64_t c0, cv, c1;
#ifdef _OPENMP
        q3_int4_thread_columns(N, 16, omp_get_thread_num(), omp_get_num_threads(), &c0, &cv, &c1);
#else
        q3_int4_thread_columns(N, 16, 0, 1, &c0, &cv, &c1);
#endif
        if (!accumulate)
            for (int64_t t = 0; t < T; t++) memset(y + t * N + c0, 0, (size_t)(c1 - c0) * sizeof *y);
        if (T == 1) gemv_one(y, xq, sx, zsum, w, N, K, unit, c0, cv - c0);
        else
            for (int64_t n = c0; n < cv; n += tile) gemv_tile(y, xq, sx, w, T, N, K, unit, n, cv - n < tile ? cv - n : tile);
        q3_int4_columns_exact(y, x, w, T, N, K, cv, c1); /* past the last vector: exact in fp32 */
    }
    return 1;
}
#endif

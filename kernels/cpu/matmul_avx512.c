/* AVX-512 matmul (the avx512 variant only; the levels above it, in matmul_dot.c and
 * matmul_amx.c, reuse it).
 *
 * Few tokens (decode): a GEMV that streams W once, 4 rows at a time, 64-byte loads, bf16
 * widened to fp32 in registers; x stays fp32. Many tokens: the packed panels of
 * matmul_packed.c at 16 lanes (with AVX512-BF16, the dot products of matmul_dot.c instead). */
#include "matmul_packed.h"
#include "ops.h"
#include "team.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include "gemv_prefetch.h"

#define GEMV_MAX_TOKENS 16 /* below this, W is streamed once for all tokens */

/* 32 bf16 -> fp32 of the even and of the odd elements, without a shuffle: a bf16 is the top
 * half of its fp32, so even = v << 16 and odd = v & 0xffff0000 */
static inline void widen_pairs(__m512i v, __m512 *even, __m512 *odd) {
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000)));
}

/* x[k .. k + 32) -> its even and odd elements (matching widen_pairs) */
static inline void split_pairs(const float *x, __mmask16 m0, __mmask16 m1, __m512 *even, __m512 *odd) {
    const __m512 a = _mm512_maskz_loadu_ps(m0, x), b = _mm512_maskz_loadu_ps(m1, x + 16);
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    *even = _mm512_permutex2var_ps(a, ie, b);
    *odd = _mm512_permutex2var_ps(a, io, b);
}

/* y[t * ldy + r] (+)= sum_k x[t, k] w[r, k] for t < TT, r < R: W rows read once, 64 bytes a
 * row a step; fp32 weights take 16 elements a step, bf16 weights 32 (split even/odd), fp16
 * weights 32 (two halves of 16) */
static inline __attribute__((always_inline)) void gemv_tile(float *y, int64_t ldy, const float *x,
                                                            const void *w, int64_t K, q3_dtype dt,
                                                            int TT, int R, int accumulate, int wrap) {
    __m512 acc[4][4];
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
    if (dt == Q3_BF16) {
        const uint16_t *wb = (const uint16_t *)w;
        for (int64_t k = 0; k < K; k += 32) {
            const int64_t left = K - k;
            const __mmask32 m = left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1);
            const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            const __mmask16 m1 = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            __m512 we[4], wo[4];
            for (int r = 0; r < R; r++) {
                q3_gemv_prefetch((const char *)(wb + r * K), 2 * k, 2 * K, wrap);
                widen_pairs(_mm512_maskz_loadu_epi16(m, wb + r * K + k), &we[r], &wo[r]);
            }
            for (int t = 0; t < TT; t++) {
                __m512 xe, xo;
                split_pairs(x + t * K + k, m0, m1, &xe, &xo);
                for (int r = 0; r < R; r++) {
                    acc[t][r] = _mm512_fmadd_ps(xe, we[r], acc[t][r]);
                    acc[t][r] = _mm512_fmadd_ps(xo, wo[r], acc[t][r]);
                }
            }
        }
    } else if (dt == Q3_F16) { /* 32 a step as bf16, widened in order (vcvtph2ps: exact) */
        const uint16_t *wh = (const uint16_t *)w;
        for (int64_t k = 0; k < K; k += 32) {
            const int64_t left = K - k;
            const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            const __mmask16 m1 = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            __m512 wl[4], wu[4];
            for (int r = 0; r < R; r++) {
                q3_gemv_prefetch((const char *)(wh + r * K), 2 * k, 2 * K, wrap);
                wl[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m0, wh + r * K + k));
                wu[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m1, wh + r * K + k + 16));
            }
            for (int t = 0; t < TT; t++) {
                const __m512 xl = _mm512_maskz_loadu_ps(m0, x + t * K + k);
                const __m512 xu = _mm512_maskz_loadu_ps(m1, x + t * K + k + 16);
                for (int r = 0; r < R; r++) {
                    acc[t][r] = _mm512_fmadd_ps(xl, wl[r], acc[t][r]);
                    acc[t][r] = _mm512_fmadd_ps(xu, wu[r], acc[t][r]);
                }
            }
        }
    } else {
        const float *wf = (const float *)w;
        for (int64_t k = 0; k < K; k += 16) {
            const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
            __m512 wv[4];
            for (int r = 0; r < R; r++) {
                q3_gemv_prefetch((const char *)(wf + r * K), 4 * k, 4 * K, wrap);
                wv[r] = _mm512_maskz_loadu_ps(m, wf + r * K + k);
            }
            for (int t = 0; t < TT; t++) {
                const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * K + k);
                for (int r = 0; r < R; r++) acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);
            }
        }
    }
    float lanes[4][4][16] __attribute__((aligned(64))); /* not acc itself: see dot_tile (matmul_dot.c) */
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) _mm512_store_ps(lanes[t][r], acc[t][r]);
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) {
            const float s = _mm512_reduce_add_ps(_mm512_load_ps(lanes[t][r]));
            y[t * ldy + r] = accumulate ? y[t * ldy + r] + s : s;
        }
}

/* rows [n0, n0 + R) of W for all T tokens, tokens in groups of up to 4 (WRAP: see gemv_prefetch.h) */
#define GEMV_TOKENS(DT, R, COL)                                                                     \
    for (int64_t t = 0; t < T; t += 4) {                                                            \
        const float *xt = x + t * K;                                                                \
        float *yt = y + t * N + (COL);                                                              \
        switch (T - t >= 4 ? 4 : (int)(T - t)) {                                                    \
        case 4: gemv_tile(yt, N, xt, wr, K, DT, 4, R, accumulate, WRAP); break;                     \
        case 3: gemv_tile(yt, N, xt, wr, K, DT, 3, R, accumulate, WRAP); break;                     \
        case 2: gemv_tile(yt, N, xt, wr, K, DT, 2, R, accumulate, WRAP); break;                     \
        default: gemv_tile(yt, N, xt, wr, K, DT, 1, R, accumulate, WRAP); break;                    \
        }                                                                                           \
    }

static void gemv_rows(float *y, const float *x, const void *w, q3_dtype dt, int64_t T, int64_t N,
                      int64_t K, int64_t n0, int64_t nr, int accumulate) {
    const size_t es = q3_dtype_size(dt);
    if (nr == 4) {
        const void *wr = (const char *)w + (size_t)n0 * K * es;
        const int WRAP = n0 + 8 <= N; /* a whole tile after this one */
        if (dt == Q3_BF16) { GEMV_TOKENS(Q3_BF16, 4, n0) }
        else if (dt == Q3_F16) { GEMV_TOKENS(Q3_F16, 4, n0) }
        else { GEMV_TOKENS(Q3_F32, 4, n0) }
        return;
    }
    const int WRAP = 0;
    for (int64_t n = n0; n < n0 + nr; n++) {
        const void *wr = (const char *)w + (size_t)n * K * es;
        if (dt == Q3_BF16) { GEMV_TOKENS(Q3_BF16, 1, n) }
        else if (dt == Q3_F16) { GEMV_TOKENS(Q3_F16, 1, n) }
        else { GEMV_TOKENS(Q3_F32, 1, n) }
    }
}

static void gemv(float *y, const float *x, const void *w, q3_dtype dt, int64_t T, int64_t N, int64_t K,
                 int accumulate) {
    const int64_t blocks = (N + 3) / 4;
    if (!q3_team(N * K > (1 << 16), 0)) { /* inline (team.h) */
        for (int64_t b = 0; b < blocks; b++)
            gemv_rows(y, x, w, dt, T, N, K, 4 * b, N - 4 * b < 4 ? N - 4 * b : 4, accumulate);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        gemv_rows(y, x, w, dt, T, N, K, 4 * b, N - 4 * b < 4 ? N - 4 * b : 4, accumulate);
}

void Q3_CPU_FN(q3_matmul)(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T,
                          int64_t N, int64_t K, int accumulate, uint16_t *xb) {
    (void)xb;
    if (T < GEMV_MAX_TOKENS) gemv(y, x, w, w_dt, T, N, K, accumulate);
    else Q3_CPU_FN(q3_matmul_packed)(y, x, w, w_dt, T, N, K, accumulate);
}

#endif

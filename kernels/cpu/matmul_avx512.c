/* AVX-512 matmul (the avx512 variant only; the levels above it, in matmul_amx.c, reuse it).
 *
 * Few tokens (decode): a GEMV that streams W once, 4 rows at a time, 64-byte loads, bf16
 * widened to fp32 in registers; x stays fp32. Many tokens: with AVX512-BF16 4 tokens x 6 rows
 * of bf16 dot products (x rounded to bf16 in xb, 32 multiply-adds an instruction), the rows
 * read in place in k blocks that stay in L1; without, the packed panels of matmul_packed.c at
 * 16 lanes. */
#include "cache_sizes.h"
#include "matmul_packed.h"
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#define GEMV_MAX_TOKENS 16 /* below this, W is streamed once for all tokens */

#ifndef GEMV_PREFETCH
#define GEMV_PREFETCH 512 /* bytes ahead in each weight row */
#endif

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
 * row a step; fp32 weights take 16 elements a step, bf16 weights 32 (split even/odd) */
static inline __attribute__((always_inline)) void gemv_tile(float *y, int64_t ldy, const float *x,
                                                            const void *w, int64_t K, q3_dtype dt,
                                                            int TT, int R, int accumulate) {
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
                _mm_prefetch((const char *)(wb + r * K + k) + GEMV_PREFETCH, _MM_HINT_T0);
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
    } else {
        const float *wf = (const float *)w;
        for (int64_t k = 0; k < K; k += 16) {
            const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
            __m512 wv[4];
            for (int r = 0; r < R; r++) {
                _mm_prefetch((const char *)(wf + r * K + k) + GEMV_PREFETCH, _MM_HINT_T0);
                wv[r] = _mm512_maskz_loadu_ps(m, wf + r * K + k);
            }
            for (int t = 0; t < TT; t++) {
                const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * K + k);
                for (int r = 0; r < R; r++) acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);
            }
        }
    }
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) {
            const float s = _mm512_reduce_add_ps(acc[t][r]);
            y[t * ldy + r] = accumulate ? y[t * ldy + r] + s : s;
        }
}

/* rows [n0, n0 + R) of W for all T tokens, tokens in groups of up to 4 */
#define GEMV_TOKENS(DT, R, COL)                                                              \
    for (int64_t t = 0; t < T; t += 4) {                                                     \
        const float *xt = x + t * K;                                                         \
        float *yt = y + t * N + (COL);                                                       \
        switch (T - t >= 4 ? 4 : (int)(T - t)) {                                             \
        case 4: gemv_tile(yt, N, xt, wr, K, DT, 4, R, accumulate); break;                    \
        case 3: gemv_tile(yt, N, xt, wr, K, DT, 3, R, accumulate); break;                    \
        case 2: gemv_tile(yt, N, xt, wr, K, DT, 2, R, accumulate); break;                    \
        default: gemv_tile(yt, N, xt, wr, K, DT, 1, R, accumulate); break;                   \
        }                                                                                    \
    }

static void gemv_rows(float *y, const float *x, const void *w, q3_dtype dt, int64_t T, int64_t N,
                      int64_t K, int64_t n0, int64_t nr, int accumulate) {
    const size_t es = q3_dtype_size(dt);
    if (nr == 4) {
        const void *wr = (const char *)w + (size_t)n0 * K * es;
        if (dt == Q3_BF16) { GEMV_TOKENS(Q3_BF16, 4, n0) } else { GEMV_TOKENS(Q3_F32, 4, n0) }
        return;
    }
    for (int64_t n = n0; n < n0 + nr; n++) {
        const void *wr = (const char *)w + (size_t)n * K * es;
        if (dt == Q3_BF16) { GEMV_TOKENS(Q3_BF16, 1, n) } else { GEMV_TOKENS(Q3_F32, 1, n) }
    }
}

static void gemv(float *y, const float *x, const void *w, q3_dtype dt, int64_t T, int64_t N, int64_t K,
                 int accumulate) {
    const int64_t blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static) if (N * K > (1 << 16))
    for (int64_t b = 0; b < blocks; b++)
        gemv_rows(y, x, w, dt, T, N, K, 4 * b, N - 4 * b < 4 ? N - 4 * b : 4, accumulate);
}

void Q3_CPU_FN(q3_matmul)(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T,
                          int64_t N, int64_t K, int accumulate, uint16_t *xb) {
    (void)xb;
    if (T < GEMV_MAX_TOKENS) gemv(y, x, w, w_dt, T, N, K, accumulate);
    else Q3_CPU_FN(q3_matmul_packed)(y, x, w, w_dt, T, N, K, accumulate);
}

/* ---- AVX512-BF16: 4 tokens x 4 rows of bf16 dot products ------------------------------- */

#define BF16_TARGET __attribute__((target("avx512bf16")))

/* xb [T, Kp] <- x [T, K] rounded to bf16, zero-padded to Kp (a multiple of 32) */
static void round_rows(uint16_t *xb, const float *x, int64_t T, int64_t K, int64_t Kp) {
#pragma omp parallel for schedule(static) if (T * K > (1 << 16))
    for (int64_t t = 0; t < T; t++) {
        for (int64_t k = 0; k < K; k++) xb[t * Kp + k] = q3_f32_to_bf16(x[t * K + k]);
        for (int64_t k = K; k < Kp; k++) xb[t * Kp + k] = 0;
    }
}

static inline BF16_TARGET __m512bh load_pairs(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

/* y[t, n] (+)= for TT <= 4 tokens of xb (row stride Kp) and R <= DOT_ROWS rows of W (bf16, row
 * stride K, read in place), over the k block [0, kc) (xb and w at its first column); first: the
 * block that starts y */
#define DOT_ROWS 6 /* 4 x 6 accumulators of the 32 zmm */
static inline __attribute__((always_inline)) BF16_TARGET void dot_tile(float *y, int64_t ldy,
                                                                      const uint16_t *xb, int64_t Kp,
                                                                      const uint16_t *w, int64_t K, int64_t kc,
                                                                      int TT, int R, int first, int accumulate) {
    __m512 acc[4][DOT_ROWS];
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k += 32) {
        const __mmask32 m = kc - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (kc - k)) - 1);
        __m512bh wv[DOT_ROWS];
        for (int r = 0; r < R; r++) wv[r] = load_pairs(w + r * K + k, m);
        for (int t = 0; t < TT; t++) {
            const __m512bh xv = load_pairs(xb + t * Kp + k, m);
            for (int r = 0; r < R; r++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, wv[r]);
        }
    }
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) {
            const float s = _mm512_reduce_add_ps(acc[t][r]);
            y[t * ldy + r] = first && !accumulate ? s : y[t * ldy + r] + s;
        }
}

/* tokens [T0, T1) against rows [n0, n0 + R) over one k block; R constant, TT by the tail */
static inline __attribute__((always_inline)) BF16_TARGET void dot_rows_k(float *y, const uint16_t *xb,
                                                                        const uint16_t *w, int64_t T0, int64_t T1,
                                                                        int64_t N, int64_t K, int64_t Kp,
                                                                        int64_t n0, int64_t kc, int R, int first,
                                                                        int accumulate) {
    int64_t t = T0;
    for (; t + 4 <= T1; t += 4) dot_tile(y + t * N + n0, N, xb + t * Kp, Kp, w + n0 * K, K, kc, 4, R, first, accumulate);
    switch (T1 - t) {
    case 3: dot_tile(y + t * N + n0, N, xb + t * Kp, Kp, w + n0 * K, K, kc, 3, R, first, accumulate); break;
    case 2: dot_tile(y + t * N + n0, N, xb + t * Kp, Kp, w + n0 * K, K, kc, 2, R, first, accumulate); break;
    case 1: dot_tile(y + t * N + n0, N, xb + t * Kp, Kp, w + n0 * K, K, kc, 1, R, first, accumulate); break;
    default: break;
    }
}

static BF16_TARGET void dot_rows(float *y, const uint16_t *xb, const uint16_t *w, int64_t T0, int64_t T1, int64_t N,
                                 int64_t K, int64_t Kp, int64_t n0, int64_t nr, int64_t kc, int first,
                                 int accumulate) {
#define DOT_R(R) \
    case R: dot_rows_k(y, xb, w, T0, T1, N, K, Kp, n0, kc, R, first, accumulate); break;
    switch (nr) {
        DOT_R(6)
        DOT_R(5)
        DOT_R(4)
        DOT_R(3)
        DOT_R(2)
        default: dot_rows_k(y, xb, w, T0, T1, N, K, Kp, n0, kc, 1, first, accumulate); break;
    }
#undef DOT_R
}

/* Blocked as the packed matmul is, with no panel to pack (bf16 rows are what vdpbf16ps reads):
 * a k block of DOT_ROWS rows fills half of L1d, the token block's x of
 * one k block half of L2; threads split the row blocks of each k block (static: a thread's
 * partial sums in y stay its own) */
static void dot_blocking(int64_t *kc, int64_t *mc) {
    static int64_t kc_once, mc_once;
    if (!__atomic_load_n(&kc_once, __ATOMIC_ACQUIRE)) {
        long l1, l2;
        q3_cache_sizes(&l1, &l2);
        int64_t k = (int64_t)l1 / 2 / (DOT_ROWS * 2) / 32 * 32; /* the x tile streams from L2 beside them */
        k = k < 256 ? 256 : k > 4096 ? 4096 : k;
        const int64_t m = (int64_t)l2 / 2 / (k * 2) / 4 * 4;
        __atomic_store_n(&mc_once, m < 4 ? 4 : m > 1024 ? 1024 : m, __ATOMIC_RELAXED);
        __atomic_store_n(&kc_once, k, __ATOMIC_RELEASE);
    }
    *kc = __atomic_load_n(&kc_once, __ATOMIC_ACQUIRE);
    *mc = __atomic_load_n(&mc_once, __ATOMIC_RELAXED);
}

static void matmul_dot_bf16(float *y, const float *x, const uint16_t *w, int64_t T, int64_t N, int64_t K,
                            int accumulate, uint16_t *xb) {
    const int64_t Kp = (K + 31) / 32 * 32, blocks = (N + DOT_ROWS - 1) / DOT_ROWS;
    int64_t KC, MC;
    dot_blocking(&KC, &MC);
    round_rows(xb, x, T, K, Kp);
#pragma omp parallel
    for (int64_t t0 = 0; t0 < T; t0 += MC) {
        const int64_t t1 = t0 + MC < T ? t0 + MC : T;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC;
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t n0 = DOT_ROWS * b, nr = N - n0 < DOT_ROWS ? N - n0 : DOT_ROWS;
                dot_rows(y, xb + k0, w + k0, t0, t1, N, K, Kp, n0, nr, kc, k0 == 0, accumulate);
            }
        }
    }
}

void q3_matmul_cpu_avx512bf16(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T,
                              int64_t N, int64_t K, int accumulate, uint16_t *xb) {
    if (T >= GEMV_MAX_TOKENS && w_dt == Q3_BF16 && xb)
        matmul_dot_bf16(y, x, (const uint16_t *)w, T, N, K, accumulate, xb);
    else
        Q3_CPU_FN(q3_matmul)(y, x, w, w_dt, T, N, K, accumulate, xb);
}

#endif

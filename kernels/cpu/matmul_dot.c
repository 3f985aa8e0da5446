/* The avx512bf16 level's matmul (the avx512 variant only): from DOT_MIN_TOKENS tokens, 4
 * tokens x 6 rows of bf16 dot products (vdpbf16ps: x rounded to bf16 in xb, 32 multiply-adds
 * an instruction), the weight rows read in place in k blocks that stay in L1 (bf16), or
 * converted into such blocks by a row source (matmul_amx.h: the FP8 prefill); fewer tokens,
 * other dtypes or no xb: the avx512 matmul (matmul_avx512.c). */
#include "cache_sizes.h"
#include "matmul_amx.h"
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#define BF16_TARGET __attribute__((target("avx512bf16")))
/* from this many tokens on, the bf16 dot products rather than the GEMV: on an AMD Zen 5 (2
 * threads, [1536, 4096] bf16 from memory, GB/s of weights) the GEMV reads 28 at 4 tokens, 17.5
 * at 8, 14 at 12 and 15; the dot products 27-29, 25-30, 22-23.5, 18 */
#ifndef DOT_MIN_TOKENS
#define DOT_MIN_TOKENS 8
#endif

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

#define DOT_ROWS 6 /* weight rows a tile: 4 x 6 accumulators of the 32 zmm */

/* the lines of the next row block a thread's tiles fetch towards L2 as they run, column by
 * column (row r, byte col of each of its rows), as many a step as cover the block's tiles:
 * in-place rows are short streams that the hardware prefetcher does not run ahead of, and
 * each block's first tile waited on them (on an AMD Zen 5, 2 threads: the expert shape
 * [32 x 1536 x 4096] from memory 377 -> 404-422 GFLOP/s, [512 x 9216 x 4096] 302 -> 505-536) */
typedef struct {
    const char *base;  /* the next block's first row at the k block's first column */
    int64_t row_bytes; /* between its rows */
    int64_t col, left; /* the next line's byte column; lines still to fetch */
    int rows, r;       /* its rows; the next line's row */
    int per_step;      /* lines a k step: all of them within the block's tiles */
} dot_fetch;

/* the fetch of `rows` rows (NULL base: none) of kc columns of col_bytes each, spread over the
 * k steps of the tiles of tokens tokens */
static inline dot_fetch dot_fetch_rows(const void *base, int64_t row_bytes, int rows, int64_t kc, int col_bytes,
                                       int64_t tokens) {
    const int64_t lines = base ? rows * ((kc * col_bytes + 63) / 64) : 0;
    const int64_t steps = (tokens + 3) / 4 * ((kc + 31) / 32);
    return (dot_fetch){base, row_bytes, 0, lines, rows, 0, steps ? (int)((lines + steps - 1) / steps) : 0};
}

/* y[t, n] (+)= for TT <= 4 tokens of xb (row stride Kp) and R <= DOT_ROWS rows of W (bf16, row
 * stride ldw: in place, or a converted panel), over the k block [0, kc) (xb and w at its first
 * column); first: the block that starts y; f: the next block's fetch, carried on from tile to
 * tile */
static inline __attribute__((always_inline)) BF16_TARGET void dot_tile(float *y, int64_t ldy,
                                                                      const uint16_t *xb, int64_t Kp,
                                                                      const uint16_t *w, int64_t ldw, int64_t kc,
                                                                      int TT, int R, int first, int accumulate,
                                                                      dot_fetch *f) {
    __m512 acc[4][DOT_ROWS];
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
    const char *fb = f->base;
    int64_t fcol = f->col, fleft = f->left;
    int fr = f->r;
    for (int64_t k = 0; k < kc; k += 32) {
        for (int i = 0; i < f->per_step && fleft > 0; i++, fleft--) {
            _mm_prefetch(fb + fr * f->row_bytes + fcol, _MM_HINT_T1);
            if (++fr == f->rows) fr = 0, fcol += 64;
        }
        const __mmask32 m = kc - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (kc - k)) - 1);
        __m512bh wv[DOT_ROWS];
        for (int r = 0; r < R; r++) wv[r] = load_pairs(w + r * ldw + k, m);
        for (int t = 0; t < TT; t++) {
            const __m512bh xv = load_pairs(xb + t * Kp + k, m);
            for (int r = 0; r < R; r++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, wv[r]);
        }
    }
    f->col = fcol, f->left = fleft, f->r = fr;
    /* the sums leave through a plain array: reducing acc[t][r] in a loop that is not fully
     * unrolled makes acc addressable, and gcc then stores all 24 accumulators to the stack at
     * every step (a quarter of the tile's speed on an AMD Zen 5) */
    float lanes[4][DOT_ROWS][16] __attribute__((aligned(64)));
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) _mm512_store_ps(lanes[t][r], acc[t][r]);
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) {
            const float s = _mm512_reduce_add_ps(_mm512_load_ps(lanes[t][r]));
            y[t * ldy + r] = first && !accumulate ? s : y[t * ldy + r] + s;
        }
}

/* tokens [T0, T1) against the R rows at wr (columns n0 .. n0 + R of y) over one k block; R
 * constant, TT by the tail */
static inline __attribute__((always_inline)) BF16_TARGET void dot_rows_k(float *y, const uint16_t *xb,
                                                                        const uint16_t *wr, int64_t ldw, int64_t T0,
                                                                        int64_t T1, int64_t N, int64_t Kp, int64_t n0,
                                                                        int64_t kc, int R, int first, int accumulate,
                                                                        dot_fetch *f) {
    int64_t t = T0;
    for (; t + 4 <= T1; t += 4) dot_tile(y + t * N + n0, N, xb + t * Kp, Kp, wr, ldw, kc, 4, R, first, accumulate, f);
    switch (T1 - t) {
    case 3: dot_tile(y + t * N + n0, N, xb + t * Kp, Kp, wr, ldw, kc, 3, R, first, accumulate, f); break;
    case 2: dot_tile(y + t * N + n0, N, xb + t * Kp, Kp, wr, ldw, kc, 2, R, first, accumulate, f); break;
    case 1: dot_tile(y + t * N + n0, N, xb + t * Kp, Kp, wr, ldw, kc, 1, R, first, accumulate, f); break;
    default: break;
    }
}

static BF16_TARGET void dot_rows(float *y, const uint16_t *xb, const uint16_t *wr, int64_t ldw, int64_t T0, int64_t T1,
                                 int64_t N, int64_t Kp, int64_t n0, int64_t nr, int64_t kc, int first, int accumulate,
                                 dot_fetch *f) {
#define DOT_R(R) \
    case R: dot_rows_k(y, xb, wr, ldw, T0, T1, N, Kp, n0, kc, R, first, accumulate, f); break;
    switch (nr) {
        DOT_R(6)
        DOT_R(5)
        DOT_R(4)
        DOT_R(3)
        DOT_R(2)
        default: dot_rows_k(y, xb, wr, ldw, T0, T1, N, Kp, n0, kc, 1, first, accumulate, f); break;
    }
#undef DOT_R
}

/* Blocked as the packed matmul is: a k block of DOT_ROWS rows fills half of L1d, the token
 * block's x of one k block half of L2; threads split the row blocks of each k block (static:
 * a thread's partial sums in y stay its own) */
#define DOT_KC_MAX 4096
static void dot_blocking(int64_t *kc, int64_t *mc) {
    static int64_t kc_once, mc_once;
    if (!__atomic_load_n(&kc_once, __ATOMIC_ACQUIRE)) {
        long l1, l2;
        q3_cache_sizes(&l1, &l2);
        int64_t k = (int64_t)l1 / 2 / (DOT_ROWS * 2) / 32 * 32; /* the x tile streams from L2 beside them */
        k = k < 256 ? 256 : k > DOT_KC_MAX ? DOT_KC_MAX : k;
        const int64_t m = (int64_t)l2 / 2 / (k * 2) / 4 * 4;
        __atomic_store_n(&mc_once, m < 4 ? 4 : m > 1024 ? 1024 : m, __ATOMIC_RELAXED);
        __atomic_store_n(&kc_once, k, __ATOMIC_RELEASE);
    }
    *kc = __atomic_load_n(&kc_once, __ATOMIC_ACQUIRE);
    *mc = __atomic_load_n(&mc_once, __ATOMIC_RELAXED);
}

/* bf16 weights: the rows are what vdpbf16ps reads, in place */
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
                const int64_t n0 = DOT_ROWS * b, nr = N - n0 < DOT_ROWS ? N - n0 : DOT_ROWS, next = n0 + nr;
                const int rows = next >= N ? 0 : N - next < DOT_ROWS ? (int)(N - next) : DOT_ROWS;
                dot_fetch f = dot_fetch_rows(rows ? w + next * K + k0 : NULL, 2 * K, rows, kc, 2, t1 - t0);
                dot_rows(y, xb + k0, w + n0 * K + k0, K, t0, t1, N, Kp, n0, nr, kc, k0 == 0, accumulate, &f);
            }
        }
    }
}

/* Weights from a row source (matmul_amx.h: the FP8 prefill): a thread converts a block of
 * DOT_ROWS rows by one k block into bf16 in L1 once per token block, and every token tile of
 * the block reads it there, as the packed matmul's panels are read; the tiles fetch the
 * stored bytes of the block after it (row r at bytes + r * row_bytes, column k col_bytes
 * further each) towards L2 as they run. Blocks do not straddle Q3_ROWS_ALIGN rows (the source's
 * contract): 128 rows are 21 blocks of 6 and one of 2. */
#define DOT_SKEW 32 /* panel rows a line more than kc apart: not all in one L1 set at each k */
#define DOT_BLOCKS_ALIGN ((Q3_ROWS_ALIGN + DOT_ROWS - 1) / DOT_ROWS) /* blocks in Q3_ROWS_ALIGN rows */
static inline int64_t dot_block_rows(int64_t b, int64_t N, int64_t *n0) {
    const int64_t g = b / DOT_BLOCKS_ALIGN * Q3_ROWS_ALIGN, end = g + Q3_ROWS_ALIGN < N ? g + Q3_ROWS_ALIGN : N;
    *n0 = g + b % DOT_BLOCKS_ALIGN * DOT_ROWS;
    return *n0 >= end ? 0 : end - *n0 < DOT_ROWS ? end - *n0 : DOT_ROWS;
}

void q3_matmul_dot_from(float *y, const float *x, q3_amx_rows_fn *rows, const void *src, const void *bytes,
                        int64_t row_bytes, int col_bytes, int64_t T, int64_t N, int64_t K, int accumulate,
                        uint16_t *xb, int threads) {
    const int64_t Kp = (K + 31) / 32 * 32;
    const int64_t blocks = (N / Q3_ROWS_ALIGN) * DOT_BLOCKS_ALIGN + (N % Q3_ROWS_ALIGN + DOT_ROWS - 1) / DOT_ROWS;
    int64_t KC, MC;
    dot_blocking(&KC, &MC);
    round_rows(xb, x, T, K, Kp);
#pragma omp parallel num_threads(threads)
    {
        uint16_t panel[DOT_ROWS * (DOT_KC_MAX + DOT_SKEW)] __attribute__((aligned(64)));
        for (int64_t t0 = 0; t0 < T; t0 += MC) {
            const int64_t t1 = t0 + MC < T ? t0 + MC : T;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kc = K - k0 < KC ? K - k0 : KC, ldp = kc + DOT_SKEW;
#pragma omp for schedule(static) nowait
                for (int64_t b = 0; b < blocks; b++) {
                    int64_t n0, n1 = 0;
                    const int64_t nr = dot_block_rows(b, N, &n0);
                    if (!nr) continue;
                    rows(panel, ldp, src, n0, (int)nr, k0, kc);
                    const int next = b + 1 < blocks ? (int)dot_block_rows(b + 1, N, &n1) : 0;
                    dot_fetch f = dot_fetch_rows(next ? (const char *)bytes + n1 * row_bytes + k0 * col_bytes : NULL,
                                                 row_bytes, next, kc, col_bytes, t1 - t0);
                    dot_rows(y, xb + k0, panel, ldp, t0, t1, N, Kp, n0, nr, kc, k0 == 0, accumulate, &f);
                }
            }
        }
    }
}

void q3_matmul_cpu_avx512bf16(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T,
                              int64_t N, int64_t K, int accumulate, uint16_t *xb) {
    if (T >= DOT_MIN_TOKENS && w_dt == Q3_BF16 && xb)
        matmul_dot_bf16(y, x, (const uint16_t *)w, T, N, K, accumulate, xb);
    else
        Q3_CPU_FN(q3_matmul)(y, x, w, w_dt, T, N, K, accumulate, xb);
}

#endif

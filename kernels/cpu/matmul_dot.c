/* The avx512bf16 level's matmul (the avx512 variant only): from DOT_MIN_TOKENS tokens (not 7),
 * 4 tokens x 6 rows of bf16 dot products (vdpbf16ps: x rounded to bf16 in xb, 32 multiply-adds
 * an instruction), the weight rows read in place in k blocks that stay in L2 (bf16), or
 * converted into such blocks by a row source (matmul_amx.h: the FP8 prefill); fewer tokens
 * on bf16 weights: a GEMV on the same dot products; other dtypes or no xb: the avx512 matmul
 * (matmul_avx512.c). */
#include "cache_sizes.h"
#include "matmul_amx.h"
#include "ops.h"
#include "team.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include "gemv_prefetch.h"

#define BF16_TARGET __attribute__((target("avx512bf16")))
/* from this many tokens on, the bf16 dot products' tiles rather than the GEMV (below), except
 * at 7. On an AMD Zen 4 (2 threads, weights from memory, the two alternated in one process,
 * medians of 80 calls, GB/s of weights for [1536, 4096], [4096, 1536], [4096, 8192]) the GEMV
 * reads 26.0, 21.2, 29.6 at 3 tokens, 26.6, 22.3, 27.3 at 4, 21.9, 20.1, 22.3 at 5, 22.5, 19.0,
 * 16.7 at 6, 21.0, 20.2, 24.4 at 7, 15.0, 10.2, 16.7 at 8; the tiles 21.5, 22.5, 20.6; 32.9,
 * 33.5, 29.4; 26.1, 30.4, 23.9; 26.9, 23.3, 16.5; 16.0, 17.2, 22.3; 25.4, 22.7, 24.9 */
#ifndef DOT_MIN_TOKENS
#define DOT_MIN_TOKENS 4
#endif
static inline int dot_tiles_take(int64_t T) { return T >= DOT_MIN_TOKENS && T != 7; }

/* xb's row stride: K rounded up to 32, and one cache line more where that is a multiple of 4 KiB
 * (K = 2048, 4096): a tile's 4 x rows would otherwise share one L1 set with each other and
 * with the in-place weight rows of the same column (on an AMD Zen 4's 8-way 32 KiB L1d, the
 * tile at K = 4096 ran at 150 GFLOP/s a core against 185 at 4160); within
 * q3_matmul_scratch_elems (matmul.h) */
static inline int64_t xb_stride(int64_t K) {
    const int64_t Kp = (K + 31) / 32 * 32;
    return Kp % 2048 ? Kp : Kp + 32;
}

/* xb [T, Kp] <- x [T, K] rounded to bf16, zero-padded to Kp (xb_stride) */
static void round_row(uint16_t *xb, const float *x, int64_t t, int64_t K, int64_t Kp) {
    for (int64_t k = 0; k < K; k++) xb[t * Kp + k] = q3_f32_to_bf16(x[t * K + k]);
    for (int64_t k = K; k < Kp; k++) xb[t * Kp + k] = 0;
}

static void round_rows(uint16_t *xb, const float *x, int64_t T, int64_t K, int64_t Kp) {
    if (!q3_team(T * K > (1 << 16), 0)) { /* inline (team.h) */
        for (int64_t t = 0; t < T; t++) round_row(xb, x, t, K, Kp);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) round_row(xb, x, t, K, Kp);
}

static inline BF16_TARGET __m512bh load_pairs(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

#define DOT_ROWS 6 /* weight rows a tile: 4 x 6 accumulators of the 32 zmm */

/* the 16-lane sums of a0 .. a5 in lanes 0 .. 5 (the others undefined), by halving: a pair's
 * 256-bit halves added into one vector, two pairs' 128-bit quarters into one, then within
 * each quarter: 21 operations, where six _mm512_reduce_add_ps take about 48, then six scalar
 * stores (the tile at 4 x 6, one core, rows in L1: 179 -> 198 GFLOP/s on an AMD Zen 4) */
static inline __attribute__((always_inline)) __m512 sum6(__m512 a0, __m512 a1, __m512 a2, __m512 a3, __m512 a4,
                                                         __m512 a5) {
    /* [x lo 256 + x hi 256 | y lo 256 + y hi 256] */
#define HALVES(x, y) _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xee))
    const __m512 p01 = HALVES(a0, a1), p23 = HALVES(a2, a3), p45 = HALVES(a4, a5);
#undef HALVES
    /* quarters: a0, a1, a2, a3 (4 partial sums each); a4, a5, a4, a5 */
    const __m512 q03 = _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, 0x88), _mm512_shuffle_f32x4(p01, p23, 0xdd));
    const __m512 q45 = _mm512_add_ps(_mm512_shuffle_f32x4(p45, p45, 0x88), _mm512_shuffle_f32x4(p45, p45, 0xdd));
    /* lanes 0, 1 of each quarter: q03's (lane 0 + 2, lane 1 + 3); lanes 2, 3: q45's */
    const __m512 h = _mm512_add_ps(_mm512_shuffle_ps(q03, q45, 0x44), _mm512_shuffle_ps(q03, q45, 0xee));
    /* lane 0 of each quarter: a0 .. a3, lane 2: a4, a5 (quarters 0 and 1) */
    const __m512 g = _mm512_add_ps(h, _mm512_permute_ps(h, 0xb1));
    return _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 6, 2, 12, 8, 4, 0), g);
}

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
        __m512bh wv[DOT_ROWS];
        if (kc - k >= 32) { /* plain loads: masked ones cost a fifth of the tile on an AMD Zen 4 */
            for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * ldw + k);
            for (int t = 0; t < TT; t++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + t * Kp + k);
                for (int r = 0; r < R; r++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, wv[r]);
            }
            continue;
        }
        const __mmask32 m = (__mmask32)((1u << (kc - k)) - 1); /* the block's last, partial step */
        for (int r = 0; r < R; r++) wv[r] = load_pairs(w + r * ldw + k, m);
        for (int t = 0; t < TT; t++) {
            const __m512bh xv = load_pairs(xb + t * Kp + k, m);
            for (int r = 0; r < R; r++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, wv[r]);
        }
    }
    f->col = fcol, f->left = fleft, f->r = fr;
    /* rows past R hold zeros (their sums are not stored); every acc[t][r] is named with
     * constant indices, so the accumulators stay in registers */
    const __mmask16 rows = (__mmask16)((1u << R) - 1);
    for (int t = 0; t < TT; t++) {
        for (int r = R; r < DOT_ROWS; r++) acc[t][r] = _mm512_setzero_ps();
        __m512 s = sum6(acc[t][0], acc[t][1], acc[t][2], acc[t][3], acc[t][4], acc[t][5]);
        if (!first || accumulate) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(rows, y + t * ldy));
        _mm512_mask_storeu_ps(y + t * ldy, rows, s);
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

/* The blocking: a k block of DOT_ROWS weight rows of up to 1/16 of L2 (4096 columns on a 1 MiB
 * L2), which every token tile of the block reads from L2, and the x of a token block for it in
 * half of L2; threads split the row blocks of each k block (static: a thread's partial sums in
 * y stay its own). K is cut into equal k blocks (multiples of 32), so that none is a short
 * tail (4096 = 4096, 5000 = 2528 + 2472). Measured on an AMD Zen 4 (32 KiB L1d, 1 MiB L2, 2
 * threads, weights from memory) against the earlier blocks of half of L1d (1344 columns there):
 * [32 x 1536 x 4096] 283-296 -> 330-356 GFLOP/s, [512 x 9216 x 4096] 332-341 -> 390-410; fewer
 * k blocks rewrite y and reduce the tiles' sums fewer times, and L2 feeds the tile as fast.
 * The FP8 prefill's converted panels take the same length (its projections 350-365 -> 388-399
 * in the layer's profile, its experts level). */
#define DOT_KC_MAX 4096
static int64_t dot_kc_most, dot_x_bytes; /* set once by dot_blocking */

/* *kc: the k block for K; *mc: the token block */
static void dot_blocking(int64_t K, int64_t *kc, int64_t *mc) {
    if (!__atomic_load_n(&dot_kc_most, __ATOMIC_ACQUIRE)) {
        long l1, l2;
        q3_cache_sizes(&l1, &l2);
        const int64_t k = (int64_t)l2 / 16 / (DOT_ROWS * 2) / 32 * 32;
        __atomic_store_n(&dot_x_bytes, (int64_t)l2 / 2, __ATOMIC_RELAXED);
        __atomic_store_n(&dot_kc_most, k < 256 ? 256 : k > DOT_KC_MAX ? DOT_KC_MAX : k, __ATOMIC_RELEASE);
    }
    const int64_t most = __atomic_load_n(&dot_kc_most, __ATOMIC_ACQUIRE);
    const int64_t Kp = (K + 31) / 32 * 32, blocks = Kp > most ? (Kp + most - 1) / most : 1;
    *kc = (Kp / 32 + blocks - 1) / blocks * 32;
    const int64_t m = __atomic_load_n(&dot_x_bytes, __ATOMIC_RELAXED) / (*kc * 2) / 4 * 4;
    *mc = m < 4 ? 4 : m > 1024 ? 1024 : m;
}

/* bf16 weights: the rows are what vdpbf16ps reads, in place */
static void matmul_dot_bf16(float *y, const float *x, const uint16_t *w, int64_t T, int64_t N, int64_t K,
                            int accumulate, uint16_t *xb) {
    const int64_t Kp = xb_stride(K), blocks = (N + DOT_ROWS - 1) / DOT_ROWS;
    int64_t KC, MC;
    dot_blocking(K, &KC, &MC);
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
 * DOT_ROWS rows by one k block into a bf16 panel once per token block, and every token tile
 * of the block reads it there, as the packed matmul's panels are read; the tiles fetch the
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
    const int64_t Kp = xb_stride(K);
    const int64_t blocks = (N / Q3_ROWS_ALIGN) * DOT_BLOCKS_ALIGN + (N % Q3_ROWS_ALIGN + DOT_ROWS - 1) / DOT_ROWS;
    int64_t KC, MC;
    dot_blocking(K, &KC, &MC);
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

/* Below DOT_MIN_TOKENS tokens, and at 7 (decode), on bf16 weights: a GEMV that streams W once,
 * 4 rows x up to 4 tokens a tile, 64 bytes a row a step (prefetched as gemv_prefetch.h says),
 * one bf16 dot product per row and token a step on x rounded once into xb, where the avx512
 * GEMV (matmul_avx512.c) widens each weight's pairs and splits x's: 13 operations for 4 rows a
 * step at one token, against 28. On an AMD Zen 4 (2 threads, weights from memory, the two
 * alternated in one process, medians of 200-300 calls) 1 token: [1536, 4096] 28.7-28.9 ->
 * 29.6-30.0 GB/s, [4096, 1536] 24.8-25.5 -> 26.3-26.4, [9216, 4096] 34.9 -> 35.9, [4096, 8192]
 * 30.0-30.1 -> 30.1-31.2; 2 tokens 2-5% more (at 4-6 tokens the tiles, which beat both). At 7 the
 * tiles lose with their last 3 tokens as one tile or as 2 + 1: the exception is measured, not
 * explained. */
static inline __attribute__((always_inline)) BF16_TARGET void gemv_dot_tile(float *y, int64_t ldy, const uint16_t *xb,
                                                                            int64_t Kp, const uint16_t *w, int64_t K,
                                                                            int TT, int R, int accumulate, int wrap) {
    __m512 acc[4][4];
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
    const int64_t row_bytes = 2 * K;
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[4];
        for (int r = 0; r < R; r++) {
            q3_gemv_prefetch((const char *)(w + r * K), 2 * k, row_bytes, wrap);
            wv[r] = K - k >= 32 ? (__m512bh)_mm512_loadu_si512(w + r * K + k)
                                : load_pairs(w + r * K + k, (__mmask32)((1u << (K - k)) - 1));
        }
        for (int t = 0; t < TT; t++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + t * Kp + k); /* zero past K */
            for (int r = 0; r < R; r++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, wv[r]);
        }
    }
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) {
            const float s = _mm512_reduce_add_ps(acc[t][r]);
            y[t * ldy + r] = accumulate ? y[t * ldy + r] + s : s;
        }
}

#define GEMV_DOT_TOKENS(R, COL)                                                                     \
    for (int64_t t = 0; t < T; t += 4) {                                                            \
        const uint16_t *xt = xb + t * Kp;                                                           \
        float *yt = y + t * N + (COL);                                                              \
        switch (T - t >= 4 ? 4 : (int)(T - t)) {                                                    \
        case 4: gemv_dot_tile(yt, N, xt, Kp, wr, K, 4, R, accumulate, WRAP); break;                 \
        case 3: gemv_dot_tile(yt, N, xt, Kp, wr, K, 3, R, accumulate, WRAP); break;                 \
        case 2: gemv_dot_tile(yt, N, xt, Kp, wr, K, 2, R, accumulate, WRAP); break;                 \
        default: gemv_dot_tile(yt, N, xt, Kp, wr, K, 1, R, accumulate, WRAP); break;                \
        }                                                                                           \
    }

static BF16_TARGET void gemv_dot_rows(float *y, const uint16_t *xb, int64_t Kp, const uint16_t *w, int64_t T,
                                      int64_t N, int64_t K, int64_t n0, int64_t nr, int accumulate) {
    if (nr == 4) {
        const uint16_t *wr = w + n0 * K;
        const int WRAP = n0 + 8 <= N; /* a whole tile after this one */
        GEMV_DOT_TOKENS(4, n0)
        return;
    }
    const int WRAP = 0;
    for (int64_t n = n0; n < n0 + nr; n++) {
        const uint16_t *wr = w + n * K;
        GEMV_DOT_TOKENS(1, n)
    }
}

static void gemv_dot(float *y, const float *x, const uint16_t *w, int64_t T, int64_t N, int64_t K, int accumulate,
                     uint16_t *xb) {
    const int64_t Kp = xb_stride(K), blocks = (N + 3) / 4;
    round_rows(xb, x, T, K, Kp);
    if (!q3_team(N * K > (1 << 16), 0)) { /* inline (team.h) */
        for (int64_t b = 0; b < blocks; b++)
            gemv_dot_rows(y, xb, Kp, w, T, N, K, 4 * b, N - 4 * b < 4 ? N - 4 * b : 4, accumulate);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        gemv_dot_rows(y, xb, Kp, w, T, N, K, 4 * b, N - 4 * b < 4 ? N - 4 * b : 4, accumulate);
}

void q3_matmul_cpu_avx512bf16(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T,
                              int64_t N, int64_t K, int accumulate, uint16_t *xb) {
    if (dot_tiles_take(T) && w_dt == Q3_BF16 && xb)
        matmul_dot_bf16(y, x, (const uint16_t *)w, T, N, K, accumulate, xb);
    else if (w_dt == Q3_BF16 && xb)
        gemv_dot(y, x, (const uint16_t *)w, T, N, K, accumulate, xb);
    else
        Q3_CPU_FN(q3_matmul)(y, x, w, w_dt, T, N, K, accumulate, xb);
}

#endif

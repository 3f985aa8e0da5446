/* y [T, N] = x [T, K] W^T with W [N, K] in fp32, bf16 or fp16: the generic kernel, in C that
 * the compiler vectorises for each variant. The portable variant uses it for every T, avx2
 * below PACKED_MIN_TOKENS (more tokens: the packed panels of matmul_packed.c); the AVX-512
 * variant has its own (matmul_avx512.c).
 *
 * Register tiles of 4 tokens x 4 weight rows: each step over k loads 4 x values and
 * 4 weights and does 16 multiply-adds, so a weight row fetched from memory is used
 * by 4 tokens while it is in registers. Tokens go in blocks of TOKEN_BLOCK so the
 * x rows of a block stay in L2 while the threads sweep the weight rows. Threads
 * split the weight rows: each weight byte is read by one thread once per token block
 * (once per call when T <= TOKEN_BLOCK, as in decode). */
#include "matmul_packed.h"
#include "ops.h"

#define TOKEN_BLOCK 64
#define ROW_TILE 4

#define W_F32(p, k) ((p)[k])
#define W_BF16(p, k) q3_bf16_to_f32((p)[k])
#define W_F16(p, k) q3_f16_to_f32((p)[k])

/* Tiles for one weight dtype: tile_4x4 (4 tokens x 4 rows), tile_1x4, dot_1x1. */
#define DEFINE_TILES(SUF, WT, LOAD)                                                      \
    static void tile_4x4_##SUF(float *y, int64_t ldy, const float *x, int64_t K,          \
                               const WT *w, int acc) {                                   \
        const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;              \
        const WT *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;                 \
        float s00 = 0, s01 = 0, s02 = 0, s03 = 0, s10 = 0, s11 = 0, s12 = 0, s13 = 0;    \
        float s20 = 0, s21 = 0, s22 = 0, s23 = 0, s30 = 0, s31 = 0, s32 = 0, s33 = 0;    \
        _Pragma("omp simd reduction(+ : s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33)") \
        for (int64_t k = 0; k < K; k++) {                                                \
            const float b0 = LOAD(w0, k), b1 = LOAD(w1, k), b2 = LOAD(w2, k), b3 = LOAD(w3, k); \
            const float a0 = x0[k], a1 = x1[k], a2 = x2[k], a3 = x3[k];                  \
            s00 += a0 * b0; s01 += a0 * b1; s02 += a0 * b2; s03 += a0 * b3;              \
            s10 += a1 * b0; s11 += a1 * b1; s12 += a1 * b2; s13 += a1 * b3;              \
            s20 += a2 * b0; s21 += a2 * b1; s22 += a2 * b2; s23 += a2 * b3;              \
            s30 += a3 * b0; s31 += a3 * b1; s32 += a3 * b2; s33 += a3 * b3;              \
        }                                                                                \
        const float s[4][4] = {{s00, s01, s02, s03}, {s10, s11, s12, s13},               \
                               {s20, s21, s22, s23}, {s30, s31, s32, s33}};              \
        for (int i = 0; i < 4; i++)                                                      \
            for (int j = 0; j < 4; j++) y[i * ldy + j] = (acc ? y[i * ldy + j] : 0.0f) + s[i][j]; \
    }                                                                                    \
    static void tile_1x4_##SUF(float *y, const float *x, int64_t K, const WT *w, int acc) { \
        const WT *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;                 \
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                            \
        _Pragma("omp simd reduction(+ : s0, s1, s2, s3)")                                \
        for (int64_t k = 0; k < K; k++) {                                                \
            const float a = x[k];                                                        \
            s0 += a * LOAD(w0, k); s1 += a * LOAD(w1, k);                                \
            s2 += a * LOAD(w2, k); s3 += a * LOAD(w3, k);                                \
        }                                                                                \
        const float s[4] = {s0, s1, s2, s3};                                             \
        for (int j = 0; j < 4; j++) y[j] = (acc ? y[j] : 0.0f) + s[j];                   \
    }                                                                                    \
    static void dot_1x1_##SUF(float *y, const float *x, int64_t K, const WT *w, int acc) { \
        float s = 0;                                                                     \
        _Pragma("omp simd reduction(+ : s)")                                             \
        for (int64_t k = 0; k < K; k++) s += x[k] * LOAD(w, k);                          \
        *y = (acc ? *y : 0.0f) + s;                                                      \
    }                                                                                    \
    /* one token block [t0, t1) against weight rows [n0, n0 + nr), nr <= ROW_TILE */     \
    static void block_##SUF(float *y, const float *x, const WT *w, int64_t t0, int64_t t1, \
                            int64_t n0, int64_t nr, int64_t N, int64_t K, int acc) {     \
        int64_t t = t0;                                                                  \
        if (nr == ROW_TILE) {                                                            \
            for (; t + 4 <= t1; t += 4)                                                  \
                tile_4x4_##SUF(y + t * N + n0, N, x + t * K, K, w + n0 * K, acc);        \
            for (; t < t1; t++) tile_1x4_##SUF(y + t * N + n0, x + t * K, K, w + n0 * K, acc); \
            return;                                                                      \
        }                                                                                \
        for (; t < t1; t++)                                                              \
            for (int64_t n = n0; n < n0 + nr; n++)                                       \
                dot_1x1_##SUF(y + t * N + n, x + t * K, K, w + n * K, acc);              \
    }

DEFINE_TILES(f32, float, W_F32)
DEFINE_TILES(bf16, uint16_t, W_BF16)
DEFINE_TILES(f16, uint16_t, W_F16)

void Q3_CPU_FN(q3_matmul_generic)(float *y, const float *x, const void *w, q3_dtype w_dt,
                                  int64_t T, int64_t N, int64_t K, int accumulate, uint16_t *xb) {
    (void)xb; /* x stays fp32 */
    const int64_t row_tiles = (N + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel if (T * N * K > (1 << 18))
    for (int64_t t0 = 0; t0 < T; t0 += TOKEN_BLOCK) {
        const int64_t t1 = t0 + TOKEN_BLOCK < T ? t0 + TOKEN_BLOCK : T;
#pragma omp for schedule(static) nowait
        for (int64_t rt = 0; rt < row_tiles; rt++) {
            const int64_t n0 = rt * ROW_TILE;
            const int64_t nr = N - n0 < ROW_TILE ? N - n0 : ROW_TILE;
            if (w_dt == Q3_BF16)
                block_bf16(y, x, (const uint16_t *)w, t0, t1, n0, nr, N, K, accumulate);
            else if (w_dt == Q3_F16)
                block_f16(y, x, (const uint16_t *)w, t0, t1, n0, nr, N, K, accumulate);
            else
                block_f32(y, x, (const float *)w, t0, t1, n0, nr, N, K, accumulate);
        }
    }
}

#if !defined(__AVX512F__)
/* avx2: from PACKED_MIN_TOKENS tokens on, the packed panels (matmul_packed.c); below, a pass
 * that streams W once is what counts */
#define PACKED_MIN_TOKENS 8

void Q3_CPU_FN(q3_matmul)(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T,
                          int64_t N, int64_t K, int accumulate, uint16_t *xb) {
#if defined(__AVX2__) && defined(__FMA__)
    if (T >= PACKED_MIN_TOKENS) {
        Q3_CPU_FN(q3_matmul_packed)(y, x, w, w_dt, T, N, K, accumulate);
        return;
    }
#endif
    Q3_CPU_FN(q3_matmul_generic)(y, x, w, w_dt, T, N, K, accumulate, xb);
}
#endif

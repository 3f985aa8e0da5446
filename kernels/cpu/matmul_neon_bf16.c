/* The neon_bf16 level's matmul (csrc/engine/cpu_dispatch.c): on aarch64 CPUs with the ARMv8.6
 * BF16 extension (Neoverse V2: Grace, Graviton4; Cortex-X925: GB10), a bf16-weight product
 * given the bf16 scratch xb runs on BFDOT: x rounded to bf16 once per call, as transformers
 * holds it in bf16 and as the avx512bf16 level's vdpbf16ps does; each lane of an accumulator
 * takes two products a step, 8 inputs a 128-bit load, fp32 sums; from 4 tokens on (prefill),
 * tiles of 4 tokens x 4 rows on BFMMLA (2x4 by 4x2 bf16 blocks into 2x2 fp32: four times
 * BFDOT's products an instruction). Every other product (fp32
 * weights, no xb: the router, which keeps x exact) is the generic kernel's. Compiled in the
 * neon_bf16 variant only (aarch64, -march=armv8.6-a+bf16+dotprod: setup.py), whose other ops
 * are the neon variant's code built for that target: the level is offered where getauxval's
 * HWCAP2_BF16 says the CPU has it.
 *   y [T, N] (=, or +=) x [T, K] * W^T, W [N, K] bf16 */
#include "ops.h"
#include "thread_scratch.h"

#if defined(__aarch64__) && Q3_ISA_BFDOT && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)

#include <arm_neon.h>

/* sum_k a[k] b[k] over K bf16 pairs: 8 a load, two accumulators, the tail converted to fp32 */
static float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t K) {
    float32x4_t s0 = vdupq_n_f32(0.0f), s1 = vdupq_n_f32(0.0f);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        s0 = vbfdotq_f32(s0, vld1q_bf16((const bfloat16_t *)(a + k)), vld1q_bf16((const bfloat16_t *)(b + k)));
        s1 = vbfdotq_f32(s1, vld1q_bf16((const bfloat16_t *)(a + k + 8)), vld1q_bf16((const bfloat16_t *)(b + k + 8)));
    }
    for (; k + 8 <= K; k += 8)
        s0 = vbfdotq_f32(s0, vld1q_bf16((const bfloat16_t *)(a + k)), vld1q_bf16((const bfloat16_t *)(b + k)));
    float s = vaddvq_f32(vaddq_f32(s0, s1));
    for (; k < K; k++) s += q3_bf16_to_f32(a[k]) * q3_bf16_to_f32(b[k]);
    return s;
}

/* two rows' 4 bf16 values a 128-bit register: BFMMLA's 2x4 operand */
static inline bfloat16x8_t rows_2x4(const uint16_t *a, const uint16_t *b) {
    return vcombine_bf16(vld1_bf16((const bfloat16_t *)a), vld1_bf16((const bfloat16_t *)b));
}

/* y [4 tokens, 4 rows] (row stride N; = or +=) from x [4, K] and weight rows w [4, K] (both row
 * stride K), bf16: BFMMLA on 2x2 blocks, c[i][j] = tokens pair i against rows pair j, each
 * [t0 n0, t0 n1, t1 n0, t1 n1]; 4 loads of 2 rows and 4 BFMMLA (64 products) a step of 4
 * inputs, the K % 4 tail in fp32 */
static void tile_4x4(float *y, int64_t N, const uint16_t *x, const uint16_t *w, int64_t K, int accumulate) {
    float32x4_t c[2][2] = {{vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}, {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}};
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        const bfloat16x8_t a01 = rows_2x4(x + k, x + K + k), a23 = rows_2x4(x + 2 * K + k, x + 3 * K + k);
        const bfloat16x8_t b01 = rows_2x4(w + k, w + K + k), b23 = rows_2x4(w + 2 * K + k, w + 3 * K + k);
        c[0][0] = vbfmmlaq_f32(c[0][0], a01, b01);
        c[0][1] = vbfmmlaq_f32(c[0][1], a01, b23);
        c[1][0] = vbfmmlaq_f32(c[1][0], a23, b01);
        c[1][1] = vbfmmlaq_f32(c[1][1], a23, b23);
    }
    float s[4][4];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            float lanes[4];
            vst1q_f32(lanes, c[i][j]);
            s[2 * i][2 * j] = lanes[0], s[2 * i][2 * j + 1] = lanes[1];
            s[2 * i + 1][2 * j] = lanes[2], s[2 * i + 1][2 * j + 1] = lanes[3];
        }
    for (; k < K; k++)
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) s[i][j] += q3_bf16_to_f32(x[i * K + k]) * q3_bf16_to_f32(w[j * K + k]);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) y[i * N + j] = accumulate ? y[i * N + j] + s[i][j] : s[i][j];
}

#define TOKEN_BLOCK 32 /* tokens whose bf16 rows stay in L2 while the threads sweep the weight rows */

/* y [T, N] (= or +=) xb [T, K] W^T, both bf16: tokens [0, T - T % 4) on 4 x 4 BFMMLA tiles (the
 * rows past the last whole 4 and the tokens past the last whole 4 on BFDOT dots), threads
 * splitting the weight rows of a token block; fewer than 4 tokens (decode) on BFDOT alone,
 * each weight row read once */
static void products(float *y, const uint16_t *xb, const uint16_t *wb, int64_t T, int64_t N, int64_t K,
                     int accumulate) {
    const int64_t T4 = T / 4 * 4;
#pragma omp parallel if (T * N * K > (1 << 18))
    {
        for (int64_t t0 = 0; t0 < T4; t0 += TOKEN_BLOCK) {
            const int64_t t1 = t0 + TOKEN_BLOCK < T4 ? t0 + TOKEN_BLOCK : T4;
#pragma omp for schedule(static) nowait
            for (int64_t n0 = 0; n0 < N; n0 += 4)
                for (int64_t t = t0; t < t1; t += 4) {
                    if (n0 + 4 <= N) {
                        tile_4x4(y + t * N + n0, N, xb + t * K, wb + n0 * K, K, accumulate);
                        continue;
                    }
                    for (int64_t i = t; i < t + 4; i++)
                        for (int64_t n = n0; n < N; n++) {
                            const float d = dot_bf16(xb + i * K, wb + n * K, K);
                            y[i * N + n] = accumulate ? y[i * N + n] + d : d;
                        }
                }
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++)
            for (int64_t t = T4; t < T; t++) {
                const float d = dot_bf16(xb + t * K, wb + n * K, K);
                y[t * N + n] = accumulate ? y[t * N + n] + d : d;
            }
    }
}

/* int4 prefill (T >= Q3_INT4_GEMV_MAX_T, given xb): chunks of Q3_INT4_CHUNK_ROWS weight rows
 * dequantized (q3_int4_dequant_rows, exact in fp32), rounded to bf16 as a bf16 layer holds its
 * weights, and multiplied on the tiles above with x rounded to bf16; each thread a chunk at a
 * time in its scratch (q3_matmul_int4_scratch_floats: the chunk's bf16 rows in its first half,
 * a row's fp32 in the second, [T, rows] sums after it) */
void q3_int4_prefill_bfmmla(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                            int accumulate, float *scratch, int threads, uint16_t *xb) {
    for (int64_t i = 0; i < T * K; i++) xb[i] = q3_f32_to_bf16(x[i]);
    const int64_t chunks = (N + Q3_INT4_CHUNK_ROWS - 1) / Q3_INT4_CHUNK_ROWS;
    const int64_t per_thread = q3_matmul_int4_scratch_floats(T, K);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (chunks > 1)
    for (int64_t c = 0; c < chunks; c++) {
        float *tile = q3_thread_scratch(scratch, per_thread);
        uint16_t *rows = (uint16_t *)tile;                        /* [nr, K] bf16 */
        float *row = tile + Q3_INT4_CHUNK_ROWS * K / 2;           /* [K] fp32 */
        float *yt = tile + Q3_INT4_CHUNK_ROWS * K;                /* [T, nr] */
        const int64_t n0 = c * Q3_INT4_CHUNK_ROWS;
        const int64_t nr = N - n0 < Q3_INT4_CHUNK_ROWS ? N - n0 : Q3_INT4_CHUNK_ROWS;
        for (int64_t i = 0; i < nr; i++) {
            q3_int4_dequant_rows(row, w, N, K, n0 + i, 1);
            for (int64_t k = 0; k < K; k++) rows[i * K + k] = q3_f32_to_bf16(row[k]);
        }
        products(yt, xb, rows, T, nr, K, 0); /* (nested: this thread alone) */
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < nr; i++)
                y[t * N + n0 + i] = (accumulate ? y[t * N + n0 + i] : 0.0f) + yt[t * nr + i];
    }
}

void q3_matmul_bfdot_cpu_neon_bf16(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N,
                                   int64_t K, int accumulate, uint16_t *xb) {
    if (w_dt != Q3_BF16 || !xb || T <= 0 || N <= 0 || K <= 0) {
        q3_matmul_cpu_neon_bf16(y, x, w, w_dt, T, N, K, accumulate, xb);
        return;
    }
    for (int64_t i = 0; i < T * K; i++) xb[i] = q3_f32_to_bf16(x[i]); /* T x K fits the scratch */
    products(y, xb, (const uint16_t *)w, T, N, K, accumulate);
}

#endif

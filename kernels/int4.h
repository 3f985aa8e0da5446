/* 4-bit weights as GPTQModel and AutoGPTQ write them (Qwen's Qwen3-235B-A22B-GPTQ-Int4:
 * quant_method "gptq", bits 4, group_size 128, sym true, desc_act false).
 *
 * A weight W [N, K] (out, in; the checkpoint's `<module>.weight` of the dense format) is
 *   qweight [K/8, N] int32: word (r, n) holds q[k, n] for k = 8r + j in bits 4j .. 4j + 3
 *                           (lowest nibble first), each 0 .. 15;
 *   qzeros  [G, N/8] int32: word (g, c) holds the zero of column n = 8c + j, group g, in bits
 *                           4j .. 4j + 3; in the "gptq" (v1) checkpoint format the zero is the
 *                           stored value + 1 (a symmetric checkpoint stores 7 for 8), in
 *                           "gptq_v2" the stored value (zero_offset 1 or 0 below);
 *   scales  [G, N] fp16;
 *   g_idx   [K] int32: the group of input k, in [0, G) (k / group_size unless desc_act).
 *   W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]), formed in fp32.
 * K and N are multiples of 8. */
#ifndef Q3_KERNELS_INT4_H
#define Q3_KERNELS_INT4_H

#include <math.h>

#include "dtype.h"

#define Q3_INT4_PACK 8 /* nibbles a 32-bit word */

/* One GPTQ matrix as the kernels read it. group: the group size when g_idx[k] == k / group
 * for every k (the kernels may then skip g_idx), else 0 (desc_act: g_idx read per input). */
typedef struct {
    const int32_t *qweight; /* [K/8, N] */
    const int32_t *qzeros;  /* [groups, N/8] */
    const uint16_t *scales; /* [groups, N] fp16 bits */
    const int32_t *g_idx;   /* [K], each in [0, groups) */
    int64_t groups;
    int64_t group;
    int zero_offset; /* 1: "gptq" (v1), 0: "gptq_v2" */
} q3_int4_matrix;

static inline int q3_int4_at(const int32_t *words, int64_t word, int nibble) {
    return (int)(((uint32_t)words[word] >> (4 * nibble)) & 0xfu);
}

/* W[n, k] of the matrix (N columns of qweight), fp32: the reference every kernel matches */
static inline float q3_int4_weight(const q3_int4_matrix *m, int64_t N, int64_t n, int64_t k) {
    const int64_t g = m->g_idx[k];
    const int q = q3_int4_at(m->qweight, (k / Q3_INT4_PACK) * N + n, (int)(k % Q3_INT4_PACK));
    const int z = q3_int4_at(m->qzeros, g * (N / Q3_INT4_PACK) + n / Q3_INT4_PACK, (int)(n % Q3_INT4_PACK)) +
                  m->zero_offset;
    return q3_f16_to_f32(m->scales[g * N + n]) * (float)(q - z);
}

/* dst [nr, K] fp32 <- rows [n0, n0 + nr) of W: scalar and exact, the reference */
static inline void q3_int4_dequant_rows(float *dst, const q3_int4_matrix *m, int64_t N, int64_t K, int64_t n0,
                                        int64_t nr) {
    for (int64_t i = 0; i < nr; i++)
        for (int64_t k = 0; k < K; k++) dst[i * K + k] = q3_int4_weight(m, N, n0 + i, k);
}

/* y [T, N] fp32 (=, or += when accumulate) x [T, K] fp32 * W^T, W the GPTQ matrix above.
 * scratch: threads * q3_matmul_int4_scratch_floats(T, K) floats; at most `threads` threads.
 * xb: NULL, or the bf16 scratch of kernels/matmul.h, given which a path with bf16 products
 * (avx512bf16) may round x and the dequantized weights to bf16 for many tokens, as a bf16 layer
 * holds them, and for fewer than Q3_INT4_GEMV_MAX_T hold x there as two 8-bit digits a block
 * of 128 inputs (within 1/65024 of the block's largest |x|) for VNNI's integer dot products
 * (a bf16 layer gives it, an fp32 one does not). */
typedef void q3_matmul_int4_fn(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                               int accumulate, float *scratch, int threads, uint16_t *xb);

/* T below this: the GEMV, each packed word read once for all T tokens; from it on: chunks of
 * Q3_INT4_CHUNK_ROWS output rows dequantized to fp32 and the fp32 matmul */
#define Q3_INT4_GEMV_MAX_T 16
#define Q3_INT4_CHUNK_ROWS 128

static inline int64_t q3_matmul_int4_scratch_floats(int64_t T, int64_t K) {
    return T < Q3_INT4_GEMV_MAX_T ? 0 : Q3_INT4_CHUNK_ROWS * (K + T);
}

/* the GEMVs' share of the columns of thread id of n_th: [*c0, *cv) whole vectors of `lanes`
 * columns (a qzeros word, 8 columns, never split), and up to *c1 the columns past the last
 * vector (the last thread's) */
static inline void q3_int4_thread_columns(int64_t N, int64_t lanes, int64_t id, int64_t n_th, int64_t *c0,
                                          int64_t *cv, int64_t *c1) {
    const int64_t vectors = N / lanes;
    *c0 = vectors * id / n_th * lanes;
    *cv = vectors * (id + 1) / n_th * lanes;
    *c1 = id == n_th - 1 ? N : *cv;
}

/* y [T, N] += x W^T over columns [n0, n1), one weight at a time in fp32 (the columns past the
 * GEMVs' last vector) */
static inline void q3_int4_columns_exact(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N,
                                         int64_t K, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t t = 0; t < T; t++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += x[t * K + k] * q3_int4_weight(w, N, n, k);
            y[t * N + n] += s;
        }
}

/* Round-to-nearest quantization (RTN, not GPTQ's error-compensating algorithm) of W [N, K]
 * fp32 into the symmetric layout above, as GPTQModel's quantizer rounds: per group g of
 * `group` inputs and column n, amax = max |W[n, k]| (1 where the group is all zero), scale =
 * fp16(2 amax / 15), zero 8, q = clamp(round_half_even(W / scale) + 8, 0, 15) by the fp16
 * scale (GPTQModel rounds by the fp32 one and stores it in fp16); qzeros hold 8 -
 * zero_offset; g_idx[k] = k / group. K a multiple of group, group of 8; N of 8. */
static inline void q3_int4_quantize_rtn(const float *w, int64_t N, int64_t K, int64_t group, int zero_offset,
                                        int32_t *qweight, int32_t *qzeros, uint16_t *scales, int32_t *g_idx) {
    const int64_t G = K / group;
    for (int64_t k = 0; k < K; k++) g_idx[k] = (int32_t)(k / group);
    memset(qweight, 0, (size_t)(K / Q3_INT4_PACK * N) * sizeof *qweight);
    memset(qzeros, 0, (size_t)(G * (N / Q3_INT4_PACK)) * sizeof *qzeros);
    for (int64_t g = 0; g < G; g++)
        for (int64_t n = 0; n < N; n++) {
            float amax = 0.0f;
            for (int64_t k = g * group; k < (g + 1) * group; k++) amax = fmaxf(amax, fabsf(w[n * K + k]));
            if (amax == 0.0f) amax = 1.0f;
            const uint16_t sh = q3_f32_to_f16(2.0f * amax / 15.0f);
            const float s = q3_f16_to_f32(sh);
            scales[g * N + n] = sh;
            qzeros[g * (N / Q3_INT4_PACK) + n / Q3_INT4_PACK] |= (int32_t)((uint32_t)(8 - zero_offset)
                                                                           << (4 * (n % Q3_INT4_PACK)));
            for (int64_t k = g * group; k < (g + 1) * group; k++) {
                float q = s > 0.0f ? nearbyintf(w[n * K + k] / s) + 8.0f : 8.0f;
                q = q < 0.0f ? 0.0f : q > 15.0f ? 15.0f : q;
                qweight[(k / Q3_INT4_PACK) * N + n] |= (int32_t)((uint32_t)q << (4 * (k % Q3_INT4_PACK)));
            }
        }
}

#endif

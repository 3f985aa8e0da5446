/* Dense projection y = x W^T (all weights are stored [out, in], as in the checkpoint).
 * fp32 activations, fp32 or bf16 weights, fp32 accumulation. The same call serves decode
 * (T small: one pass over W, memory-bound) and prefill (T tokens per pass, compute-bound).
 *
 * xb is an optional scratch of q3_matmul_scratch_elems(T, K) bf16 elements. Given, a
 * bf16-weight matmul may round x to bf16 there and use bf16 dot products (AVX512-BF16,
 * AMX), as transformers does in bf16; NULL keeps x exact in fp32 (the router does). */
#ifndef Q3_KERNELS_MATMUL_H
#define Q3_KERNELS_MATMUL_H

#include "dtype.h"

/* y [T, N] fp32 (=, or += when accumulate) x [T, K] fp32 * W^T, W [N, K] of dtype w_dt */
typedef void q3_matmul_fn(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T,
                          int64_t N, int64_t K, int accumulate, uint16_t *xb);

/* bf16 activations, padded to whole AMX tiles (16 rows by 32 columns), each row one cache line
 * longer for the dot products' padded stride (matmul_dot.c) */
static inline int64_t q3_matmul_scratch_elems(int64_t T, int64_t K) {
    return (T + 15) / 16 * 16 * ((K + 31) / 32 * 32 + 32);
}

#endif

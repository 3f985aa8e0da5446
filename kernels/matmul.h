/* Dense projection y = x W^T (all weights are stored [out, in], as in the checkpoint).
 * fp32 activations, fp32 or bf16 weights, fp32 accumulation. The same call serves
 * decode (T = 1: a pass over W, memory-bound) and prefill (T tokens per pass). */
#ifndef Q3_KERNELS_MATMUL_H
#define Q3_KERNELS_MATMUL_H

#include "dtype.h"

/* y [T, N] fp32  (=, or += when accumulate) x [T, K] fp32 * W^T, W [N, K] of dtype w_dt */
void q3_matmul_cpu(float *y, const float *x, const void *w, q3_dtype w_dt,
                   int64_t T, int64_t N, int64_t K, int accumulate);

#endif

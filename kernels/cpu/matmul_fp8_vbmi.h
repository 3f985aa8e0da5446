/* The FP8 decode GEMV on AVX512-VBMI byte lookups (kernels/cpu/matmul_fp8_vbmi.c), compiled in
 * the avx512 variant only: the avx512bf16 level's FP8 matmul calls it below 4 tokens where
 * q3_cpu_has_vbmi(). */
#ifndef Q3_KERNELS_CPU_MATMUL_FP8_VBMI_H
#define Q3_KERNELS_CPU_MATMUL_FP8_VBMI_H

#include <stdint.h>

#include "../dtype.h"

#if defined(__x86_64__)
/* y [T, N] (=, or += when acc) x [T, K] W^T, W e4m3 [N, K] with block scales (kernels/fp8.h),
 * fp32 sums; rows split over `threads`. With round_x, below 4 tokens and T K <= 3 x 8192: x
 * rounded to bf16 (as the prefill's dot products take it) and bf16 dot products (AVX512-BF16
 * too); else fp32 products */
void q3_fp8_gemv_vbmi(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t T,
                      int64_t N, int64_t K, int acc, int threads, int round_x);
/* whether this CPU runs it (AVX512-VBMI) */
int q3_cpu_has_vbmi(void);
#endif

#endif

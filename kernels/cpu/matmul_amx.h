/* The AMX bf16 matmul (kernels/cpu/matmul_amx.c) fed by a row source: weight formats other
 * than bf16 (the FP8 prefill) convert a block of rows to bf16 in a thread's scratch and the
 * tiles read it from there. Only in the avx512 variant (the "amx" level). */
#ifndef Q3_KERNELS_CPU_MATMUL_AMX_H
#define Q3_KERNELS_CPU_MATMUL_AMX_H

#include <stdint.h>

#include "../dtype.h"

#define Q3_AMX_ROWS 32 /* weight rows a thread converts and runs at once (two A tiles) */

/* A row source: out [nr][kc] bf16, row stride ld <- the weights of rows [n0, n0 + nr) x columns
 * [k0, k0 + kc), n0 a multiple of Q3_AMX_ROWS, nr <= Q3_AMX_ROWS, k0 and kc multiples of 32;
 * out NULL: only fetch that region's bytes towards L2 (a thread's next rows). src: the source's
 * own description of W. Called by several threads at once. */
typedef void q3_amx_rows_fn(uint16_t *out, int64_t ld, const void *src, int64_t n0, int nr, int64_t k0,
                            int64_t kc);

#if defined(__x86_64__)
/* y [T, N] (+)= x [T, K] W^T, W from `rows`; N % 16 == 0, K % 32 == 0, T >= 1. xb: the bf16
 * scratch of kernels/matmul.h (x rounded to bf16 and packed there once); scratch: `threads`
 * blocks of stride >= Q3_AMX_ROWS * K bf16 each, a thread's converted rows. Up to 32 tokens
 * (an expert's share of a prefill) the rows are converted 128 columns at a time, each stretch
 * while the tiles multiply the last (no pass over a scratch in L2); more tokens convert 32
 * whole rows once for all their token blocks. */
void q3_matmul_amx_from(float *y, const float *x, q3_amx_rows_fn *rows, const void *src, int64_t T, int64_t N,
                        int64_t K, int accumulate, uint16_t *xb, uint16_t *scratch, int64_t stride, int threads);
#endif

#endif

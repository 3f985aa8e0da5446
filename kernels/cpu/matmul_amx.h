/* The bf16 matmuls of the avx512 variant's upper levels fed by a row source: weight formats
 * other than bf16 (the FP8 prefill) convert a block of rows to bf16 in a thread's scratch and
 * the AMX tiles ("amx" level, kernels/cpu/matmul_amx.c) or the bf16 dot products
 * ("avx512bf16", kernels/cpu/matmul_dot.c) read it from there. */
#ifndef Q3_KERNELS_CPU_MATMUL_AMX_H
#define Q3_KERNELS_CPU_MATMUL_AMX_H

#include <stdint.h>

#include "../dtype.h"

#define Q3_AMX_ROWS 32 /* weight rows a thread converts and runs at once (two A tiles) */

#define Q3_ROWS_ALIGN 128 /* a row source's rows lie in one aligned block of this many rows */

/* A row source: out [nr][kc] bf16, row stride ld <- the weights of rows [n0, n0 + nr) x columns
 * [k0, k0 + kc), the rows within one aligned block of Q3_ROWS_ALIGN (the AMX matmul's n0 are
 * multiples of Q3_AMX_ROWS), nr <= Q3_AMX_ROWS, k0 and kc multiples of 32;
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
/* the same, the rows read in stretches of 128 inputs across a thread's whole share of the rows
 * (contiguous strips of 32): one strip's stretch converted into L1 and multiplied at once, each
 * strip's C tiles kept in the scratch between stretches. For a source whose rows are columns of
 * its stored matrix (GPTQ's qweight [K/8, N]) each stored row is then read along, a stream the
 * hardware prefetcher follows, where a strip read whole jumps 4N bytes a word row. Given a
 * stride of at least q3_matmul_amx_panels_stride(T, K) bf16, else q3_matmul_amx_from. The
 * sums are q3_matmul_amx_from's, bit for bit (the C tiles leave and return as fp32). */
int64_t q3_matmul_amx_panels_stride(int64_t T, int64_t K);
void q3_matmul_amx_panels(float *y, const float *x, q3_amx_rows_fn *rows, const void *src, int64_t T, int64_t N,
                          int64_t K, int accumulate, uint16_t *xb, uint16_t *scratch, int64_t stride, int threads);
/* the same on the avx512bf16 level's bf16 dot products (matmul_dot.c): any N, K % 32 == 0,
 * T >= 1; the rows converted DOT_ROWS x one k block at a time into a panel on the stack, the
 * next rows' stored bytes (row r at bytes + r * row_bytes, column k col_bytes further) fetched
 * meanwhile */
void q3_matmul_dot_from(float *y, const float *x, q3_amx_rows_fn *rows, const void *src, const void *bytes,
                        int64_t row_bytes, int col_bytes, int64_t T, int64_t N, int64_t K, int accumulate,
                        uint16_t *xb, int threads);
#endif

#endif

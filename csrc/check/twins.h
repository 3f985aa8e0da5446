/* The CPU twins of the CUDA kernels that have no single CPU kernel of their own: each is
 * the composition of CPU kernels (or the plain loop) that the fused or device-side CUDA
 * kernel must reproduce. Host pointers; kernel_check.c compares the real kernels (on a GPU
 * or on the SIMT executor) with them. Arguments as in
 * kernels/cuda/ops_cuda.h, without the stream; those that need scratch return nonzero when
 * it cannot be allocated. */
#ifndef Q3_CHECK_TWINS_H
#define Q3_CHECK_TWINS_H

#include "../../kernels/attention.h"
#include "../../kernels/cuda/ops_cuda.h"
#include "../../kernels/dtype.h"
#include "../../kernels/fp8.h"

/* rmsnorm, rope (by the table inv_freq [D / 2] and scale) and kv_write in turn */
void q3_qk_rope_kv_host(float *q, float *k, const float *v, const void *q_norm, const void *k_norm, q3_dtype w_dt,
                        const int64_t *pos, const q3_attn_seq *seqs, int n_seqs, const q3_attn_shape *shape,
                        float eps, const float *inv_freq, float scale);
/* x += r, then rmsnorm */
void q3_add_rmsnorm_host(float *out, float *x, const float *r, const void *w, q3_dtype w_dt, int64_t rows,
                         int64_t n, float eps);
void q3_decode_prepare_host(q3_attn_seq *seqs, int64_t *pos, int64_t *lengths, int n_seqs);
/* moe_group, then the active list and each pair's slot */
void q3_moe_route_host(int64_t *offsets, int32_t *rows, float *weights, int32_t *active, int32_t *slot,
                       const int32_t *idx, const float *w, int64_t T, int k, int E);
/* per active expert: gather_rows, matmul, matmul, swiglu */
int q3_moe_gate_up_host(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                        const int32_t *active, const void *const *gate, const void *const *up, q3_dtype w_dt,
                        int64_t I, int64_t K);
/* per active expert: matmul over its slots */
void q3_moe_down_host(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                      const void *const *down, q3_dtype w_dt, int64_t N, int64_t K);
void q3_moe_combine_host(float *x, const float *y, const float *weights, const int32_t *slot, int64_t T, int k,
                         int64_t H);
/* matmul_tc and matmul_wmma: x rounded to bf16 as the tensor cores read it, bf16 weights */
int q3_matmul_tc_host(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K, int accumulate);
/* the grouped prefill MoE (tensor cores: inputs rounded to bf16, bf16 weights) */
int q3_moe_gate_up_tc_host(float *act, const float *x, const int32_t *rows, const q3_moe_tile *tiles, int n_tiles,
                           const void *const *gate, const void *const *up, int64_t I, int64_t K);
int q3_moe_down_tc_host(float *y, const float *act, const q3_moe_tile *tiles, int n_tiles, const void *const *down,
                        int64_t N, int64_t K);
void q3_moe_combine_csr_host(float *x, const float *y, const float *weights, const int32_t *tokens,
                             const int32_t *ptr, const int32_t *slot, int n, int64_t H);

/* FP8 weights (kernels/fp8.h): the CPU's matmul_fp8 with its scratch, one thread */
int q3_matmul_fp8_host(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t T,
                       int64_t N, int64_t K, int accumulate);
/* kernels/fp8.h's scalar dequantization, each value rounded to bf16 */
int q3_fp8_dequant_host(uint16_t *dst, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t N, int64_t K);
/* per active expert: gather_rows, matmul_fp8, matmul_fp8, swiglu; and matmul_fp8 */
int q3_moe_gate_up_fp8_host(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                            const int32_t *active, const uint8_t *const *gate, const uint8_t *const *up,
                            const void *const *gate_scale, const void *const *up_scale, q3_dtype sdt, int64_t I,
                            int64_t K);
int q3_moe_down_fp8_host(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                         const uint8_t *const *down, const void *const *down_scale, q3_dtype sdt, int64_t N,
                         int64_t K);

#endif

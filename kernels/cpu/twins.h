/* The CPU twins of the CUDA kernels that have no single CPU kernel of their own: each is the
 * composition of portable CPU kernels (or the plain loop) that the fused or device-side CUDA
 * kernel must reproduce, the readable oracle the kernel check (csrc/check) compares it with.
 * Each is defined beside its op, in the kernels/cpu file named as the CUDA one
 * (kernels/cuda/<op>.cu: kernels/cpu/<op>.c), and compiled in the portable variant only
 * (isa.h's Q3_ISA_PORTABLE): they call the portable kernels by name, so a copy per
 * instruction set would be the same code under other names, which nothing would call.
 * Host pointers; arguments as in kernels/cuda/ops_cuda.h, without the stream; those that need
 * scratch return nonzero when it cannot be allocated. */
#ifndef Q3_KERNELS_CPU_TWINS_H
#define Q3_KERNELS_CPU_TWINS_H

#include "../attention.h"
#include "../dtype.h"
#include "../int4.h"
#include "../moe_group.h"

/* rmsnorm.c: x += r, then rmsnorm */
void q3_add_rmsnorm_host(float *out, float *x, const float *r, const void *w, q3_dtype w_dt, int64_t rows,
                         int64_t n, float eps);

/* qk_rope_kv.c: rmsnorm, rope (by the table inv_freq [D / 2] and scale) and kv_write in turn */
void q3_qk_rope_kv_host(float *q, float *k, const float *v, const void *q_norm, const void *k_norm, q3_dtype w_dt,
                        const int64_t *pos, const q3_attn_seq *seqs, int n_seqs, const q3_attn_shape *shape,
                        float eps, const float *inv_freq, float scale);
/* decode_prepare.c */
void q3_decode_prepare_host(q3_attn_seq *seqs, int64_t *pos, int64_t *lengths, int n_seqs);

/* moe_grouped.c, the decode experts: moe_group, then the active list and each pair's slot */
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
/* FP8 weights (kernels/fp8.h): per active expert gather_rows, matmul_fp8, matmul_fp8, swiglu;
 * and matmul_fp8 */
int q3_moe_gate_up_fp8_host(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                            const int32_t *active, const uint8_t *const *gate, const uint8_t *const *up,
                            const void *const *gate_scale, const void *const *up_scale, q3_dtype sdt, int64_t I,
                            int64_t K);
int q3_moe_down_fp8_host(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                         const uint8_t *const *down, const void *const *down_scale, q3_dtype sdt, int64_t N,
                         int64_t K);

/* GPTQ 4-bit weights (kernels/int4.h; host matrices): per active expert gather_rows,
 * matmul_int4, matmul_int4, swiglu; and matmul_int4; gate, up, down arrays of E matrices */
int q3_moe_gate_up_int4_host(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                             const int32_t *active, const q3_int4_matrix *gate, const q3_int4_matrix *up, int64_t I,
                             int64_t K);
int q3_moe_down_int4_host(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                          const q3_int4_matrix *down, int64_t N, int64_t K);

/* matmul_tc.c: n rows of src (row i: src + (rows ? rows[i] : i) * K) into dst [n, K] rounded
 * to bf16 values, as the tensor cores read them; matmul_tc and matmul_wmma on such x, bf16
 * weights */
void q3_rows_as_bf16_host(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t K);
int q3_matmul_tc_host(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K, int accumulate);
/* moe_prefill.c, the grouped prefill MoE on tensor cores (inputs rounded to bf16, bf16 weights) */
int q3_moe_gate_up_tc_host(float *act, const float *x, const int32_t *rows, const q3_moe_tile *tiles, int n_tiles,
                           const void *const *gate, const void *const *up, int64_t I, int64_t K);
int q3_moe_down_tc_host(float *y, const float *act, const q3_moe_tile *tiles, int n_tiles, const void *const *down,
                        int64_t N, int64_t K);
void q3_moe_combine_csr_host(float *x, const float *y, const float *weights, const int32_t *tokens,
                             const int32_t *ptr, const int32_t *slot, int n, int64_t H);

/* matmul_fp8.c: the CPU's matmul_fp8 with its scratch, one thread; kernels/fp8.h's scalar
 * dequantization, each value rounded to bf16 */
int q3_matmul_fp8_host(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t T,
                       int64_t N, int64_t K, int accumulate);
int q3_fp8_dequant_host(uint16_t *dst, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t N, int64_t K);

/* matmul_int4.c: the CPU's matmul_int4 with its scratch, one thread; kernels/int4.h's scalar
 * dequantization, each value rounded to bf16 */
int q3_matmul_int4_host(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                        int accumulate);
void q3_int4_dequant_host(uint16_t *dst, const q3_int4_matrix *w, int64_t N, int64_t K);

#endif

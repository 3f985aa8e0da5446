/* The CPU kernels as a table of functions, one table per instruction-set level; the engine
 * picks a table once (csrc/engine/cpu_dispatch.c) and calls every kernel through it. */
#ifndef Q3_KERNELS_CPU_OPS_H
#define Q3_KERNELS_CPU_OPS_H

#include "../attention.h"
#include "../convert.h"
#include "../fp8.h"
#include "../int4.h"
#include "../kv_write.h"
#include "../matmul.h"
#include "../moe_group.h"
#include "../probe.h"
#include "../random.h"
#include "../rmsnorm.h"
#include "../rope.h"
#include "../router.h"
#include "../rows.h"
#include "../swiglu.h"
#include "isa.h"

typedef struct {
    const char *name; /* "portable", "avx2", "avx512", "avx512bf16", "amx"; "neon", "neon_bf16", "sve" */
    q3_matmul_fn *matmul;
    q3_matmul_fp8_fn *matmul_fp8; /* block-scaled e4m3 weights (kernels/fp8.h) */
    q3_matmul_int4_fn *matmul_int4; /* GPTQ 4-bit weights (kernels/int4.h) */
    q3_rmsnorm_fn *rmsnorm;
    q3_rope_fn *rope;
    q3_kv_write_fn *kv_write;
    q3_attention_fn *attention;
    q3_attention_probs_fn *attention_probs; /* introspection only (layer calls that ask for it) */
    q3_router_topk_fn *router_topk;
    q3_moe_group_fn *moe_group;
    q3_gather_rows_fn *gather_rows;
    q3_scatter_add_rows_fn *scatter_add_rows;
    q3_take_rows_fn *take_rows;
    q3_add_rows_fn *add_rows;
    q3_swiglu_fn *swiglu;
    q3_to_f32_fn *to_f32;
    q3_from_f32_fn *from_f32;
    q3_fill_normal_fn *fill_normal;
    q3_probe_read_fn *probe_read;
    q3_probe_fma_fn *probe_fma;
} q3_cpu_ops;

/* the kernels of one compiled variant */
#define Q3_CPU_DECLARE(isa)                                                          \
    q3_matmul_fn q3_matmul_cpu_##isa, q3_matmul_generic_cpu_##isa;                   \
    q3_matmul_fp8_fn q3_matmul_fp8_cpu_##isa;                                        \
    q3_matmul_int4_fn q3_matmul_int4_cpu_##isa;                                      \
    q3_rmsnorm_fn q3_rmsnorm_cpu_##isa;                                              \
    q3_rope_fn q3_rope_cpu_##isa;                                                    \
    q3_kv_write_fn q3_kv_write_cpu_##isa;                                            \
    q3_attention_fn q3_attention_cpu_##isa;                                          \
    q3_attention_probs_fn q3_attention_probs_cpu_##isa;                              \
    q3_router_topk_fn q3_router_topk_cpu_##isa;                                      \
    q3_moe_group_fn q3_moe_group_cpu_##isa;                                          \
    q3_gather_rows_fn q3_gather_rows_cpu_##isa;                                      \
    q3_scatter_add_rows_fn q3_scatter_add_rows_cpu_##isa;                            \
    q3_take_rows_fn q3_take_rows_cpu_##isa;                                          \
    q3_add_rows_fn q3_add_rows_cpu_##isa;                                            \
    q3_swiglu_fn q3_swiglu_cpu_##isa;                                                \
    q3_to_f32_fn q3_to_f32_cpu_##isa;                                                \
    q3_from_f32_fn q3_from_f32_cpu_##isa;                                            \
    q3_fill_normal_fn q3_fill_normal_cpu_##isa;                                      \
    q3_probe_read_fn q3_probe_read_cpu_##isa;                                        \
    q3_probe_fma_fn q3_probe_fma_cpu_##isa;                                          \
    extern const q3_cpu_ops q3_ops_cpu_##isa;

Q3_CPU_DECLARE(portable)
#if defined(__aarch64__)
Q3_CPU_DECLARE(neon)
Q3_CPU_DECLARE(neon_bf16)
Q3_CPU_DECLARE(sve)
/* the neon_bf16 level's bf16 products on BFDOT, its other products its variant's (matmul_neon_bf16.c),
 * and its int4 decode on SDOT (matmul_int4_sdot.c) */
q3_matmul_fn q3_matmul_bfdot_cpu_neon_bf16;
q3_matmul_int4_fn q3_matmul_int4_sdot_cpu_neon_bf16;
/* ... and its int4 prefill given xb on BFMMLA tiles of bf16-rounded weights (matmul_neon_bf16.c) */
q3_matmul_int4_fn q3_int4_prefill_bfmmla;
#endif
#if defined(__x86_64__)
Q3_CPU_DECLARE(avx2)
Q3_CPU_DECLARE(avx512)
/* levels above avx512 differ only in their matmuls (kernels/cpu/matmul_dot.c, matmul_amx.c) */
q3_matmul_fn q3_matmul_cpu_avx512bf16, q3_matmul_cpu_amx;
q3_matmul_fp8_fn q3_matmul_fp8_cpu_amx; /* the FP8 prefill on AMX tiles (kernels/cpu/matmul_fp8.c) */
q3_matmul_fp8_fn q3_matmul_fp8_cpu_avx512bf16; /* ... and on bf16 dot products */
q3_matmul_int4_fn q3_matmul_int4_cpu_avx512bf16; /* the int4 prefill on bf16 dot products (matmul_int4.c) */
q3_matmul_int4_fn q3_matmul_int4_cpu_amx; /* ... and on AMX tiles of bf16-rounded weights (matmul_int4_amx.c) */
/* ... and its decode GEMV on VNNI's int8 dot products, given xb (a bf16 layer's) and groups it
 * takes: 1 done, 0 not taken (matmul_int4_vnni.c) */
int q3_int4_gemv_vnni(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                      int accumulate, int threads, uint16_t *xb);
/* ... and its prefill on bf16 dot products over the nibbles in place, given xb and scratch
 * (threads * q3_matmul_int4_scratch_floats(T, K) floats) and groups it takes: 1 done, 0 not
 * taken (matmul_int4_dot.c) */
int q3_int4_prefill_dot(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                        int accumulate, float *scratch, int threads, uint16_t *xb);
#endif

#endif

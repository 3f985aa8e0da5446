/* The ops table of the variant being compiled (see isa.h). */
#include "ops.h"

const q3_cpu_ops Q3_CPU_FN(q3_ops) = {
    .name = Q3_ISA_NAME,
    .matmul = Q3_CPU_FN(q3_matmul),
    .matmul_fp8 = Q3_CPU_FN(q3_matmul_fp8),
    .matmul_int4 = Q3_CPU_FN(q3_matmul_int4),
    .rmsnorm = Q3_CPU_FN(q3_rmsnorm),
    .rope = Q3_CPU_FN(q3_rope),
    .kv_write = Q3_CPU_FN(q3_kv_write),
    .attention = Q3_CPU_FN(q3_attention),
    .attention_probs = Q3_CPU_FN(q3_attention_probs),
    .router_topk = Q3_CPU_FN(q3_router_topk),
    .moe_group = Q3_CPU_FN(q3_moe_group),
    .gather_rows = Q3_CPU_FN(q3_gather_rows),
    .scatter_add_rows = Q3_CPU_FN(q3_scatter_add_rows),
    .take_rows = Q3_CPU_FN(q3_take_rows),
    .add_rows = Q3_CPU_FN(q3_add_rows),
    .swiglu = Q3_CPU_FN(q3_swiglu),
    .to_f32 = Q3_CPU_FN(q3_to_f32),
    .from_f32 = Q3_CPU_FN(q3_from_f32),
    .fill_normal = Q3_CPU_FN(q3_fill_normal),
    .probe_read = Q3_CPU_FN(q3_probe_read),
    .probe_fma = Q3_CPU_FN(q3_probe_fma),
};

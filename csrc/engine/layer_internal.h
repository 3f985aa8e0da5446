/* The CPU's stages of a pass and its pass loop, shared by layer.c, layer_halves.c,
 * attention_block.c and moe_block.c; the layer object and the pass are layer_object.h's. */
#ifndef Q3_ENGINE_LAYER_INTERNAL_H
#define Q3_ENGINE_LAYER_INTERNAL_H

#include "layer_object.h"

/* y [T, N] (=, or += when acc) x [T, K] m^T on the CPU, in the layer's weight format. xb: the
 * bf16 scratch of kernels/matmul.h (NULL: x stays fp32); threads: the FP8 kernel's, with its
 * scratch in the workspace (1 and T < Q3_FP8_GEMV_MAX_T inside a parallel region: no scratch) */
static inline void q3_project(const q3_layer *l, const q3_cpu_ops *k, float *y, const float *x, q3_matrix m,
                              int64_t T, int64_t N, int64_t K, int acc, uint16_t *xb, int threads) {
    if (m.q4) /* GPTQ (its dense attention: q4 NULL); as FP8, a bf16 layer lets the kernel round to bf16 */
        k->matmul_int4(y, x, m.q4, T, N, K, acc, l->ws.fp8_scratch, threads, l->w.dtype == Q3_BF16 ? xb : NULL);
    else if (l->w.format == Q3_WF_FP8_BLOCK128)
        /* an fp32 layer keeps fp32 products (xb lets the amx path round to bf16) */
        k->matmul_fp8(y, x, m.w, m.scale, l->w.scale_dtype, T, N, K, acc, l->ws.fp8_scratch, threads,
                      l->w.dtype == Q3_BF16 ? xb : NULL);
    else
        k->matmul(y, x, m.w, l->w.dtype, T, N, K, acc, xb);
}

/* A GPTQ layer's matrices (l->int4) from its weights' pointers, each checked as the kernels
 * will read it: every g_idx in [0, G), every scale finite (a NaN or Inf is refused naming its
 * tensor); g_idx[k] == k / group noted for the kernels (layer_int4.c) */
q3_status q3_layer_take_int4(q3_layer *l, q3_error *err);

/* q3_layer_check_call without its demand for every expert (the attention half's checks) */
q3_status q3_layer_check_pass(const q3_layer *l, const q3_cache *c, const q3_forward_args *a, q3_error *err);
/* the CPU passes of a checked call: the whole layer (half NULL), or its attention half
 * (layer.c), all of the call's or the cursor's next (layer_halves.c); a pass's half outputs written from the workspace (layer_halves.c) */
q3_status q3_layer_passes(q3_layer *l, q3_cache *c, const q3_forward_args *a, const q3_attention_half_out *half,
                          q3_pass_cursor *cur, q3_error *err);
void q3_attention_half_write(const q3_layer *l, const q3_pass *p, const q3_attention_half_out *half);
/* x += o_proj(attention(rmsnorm(x))); appends the pass's K/V to the cache */
void q3_attention_block(q3_layer *layer, q3_cache *cache, const q3_pass *p);
/* h = post_attention_layernorm(x); the router's logits and top-k into the workspace (and
 * the call's insides) */
void q3_route_block(q3_layer *layer, const q3_pass *p);
/* dst [R, H] += sum over each row's pairs of w x expert(h): the top-k in ws->topk_idx and
 * ws->topk_w; with `skip` an entry E is another process's expert and is passed over */
void q3_experts_block(q3_layer *layer, const q3_cpu_ops *k, q3_profile *prof, int64_t R, int skip, float *dst);


#endif

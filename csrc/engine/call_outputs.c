/* The tensors a binding makes for a layer call before it runs (q3.h: q3_tensor_spec): the
 * attention half's outputs, of a whole call or of one pass, and the insides a call asks for;
 * each spec's sizes computed here, the binding only makes them and hands their data back. */
#include <string.h>

#include "q3.h"

/* x's shape, its last dim `last`, the tokens dim (x [..., tokens, H] of a call of more than
 * one token a sequence) `tokens` */
static void spec_of(q3_tensor_spec *s, q3_dtype dt, const q3_view *x, const q3_forward_args *a, int64_t tokens,
                    int64_t last) {
    s->dtype = dt;
    s->ndim = x->ndim;
    memcpy(s->shape, x->shape, sizeof s->shape);
    if (a->tokens > 1) s->shape[x->ndim - 2] = tokens;
    s->shape[x->ndim - 1] = last;
}

void q3_attention_half_specs(const q3_config *cfg, const q3_view *x, const q3_forward_args *a, int64_t tokens,
                             q3_tensor_spec spec[4]) {
    spec_of(&spec[0], Q3_F32, x, a, tokens, cfg->hidden);
    spec_of(&spec[1], x->dtype, x, a, tokens, cfg->hidden);
    spec_of(&spec[2], Q3_I32, x, a, tokens, cfg->top_k);
    spec_of(&spec[3], Q3_F32, x, a, tokens, cfg->top_k);
}

q3_attention_half_out q3_attention_half_outputs(void *const data[4], q3_dtype normed_dtype) {
    return (q3_attention_half_out){data[0], data[1], normed_dtype, data[2], data[3]};
}

q3_status q3_call_insides_specs(const q3_config *cfg, const q3_cache *c, const q3_view *x, const q3_forward_args *a,
                                int router, int attention, int64_t limit, q3_tensor_spec spec[4], q3_error *err) {
    memset(spec, 0, 4 * sizeof *spec);
    if (router) {
        spec_of(&spec[0], Q3_F32, x, a, a->tokens, cfg->experts);
        spec_of(&spec[1], Q3_I32, x, a, a->tokens, cfg->top_k);
        spec_of(&spec[2], Q3_F32, x, a, a->tokens, cfg->top_k);
    }
    if (!attention) return Q3_OK;
    spec[3] = (q3_tensor_spec){.dtype = Q3_F32, .ndim = 4};
    return q3_call_attention_maps(cfg, c, a, limit, spec[3].shape, err);
}

void q3_call_insides_bind(q3_forward_args *a, void *const data[4], const q3_tensor_spec spec[4]) {
    a->router_logits = data[0];
    a->router_experts = data[1];
    a->router_weights = data[2];
    a->attention = data[3];
    if (data[3]) a->attention_context = spec[3].shape[3];
}

q3_status q3_expert_half_prepare(const q3_config *cfg, const q3_view *rows, const q3_view *experts,
                                 const q3_view *weights, const q3_view *out, int acc, void *stream,
                                 q3_expert_half_args *a, q3_tensor_spec *made, q3_error *err) {
    const q3_status s = q3_expert_half_check_views(cfg, rows, experts, weights, out, err);
    if (s != Q3_OK) return s;
    const int64_t n = q3_view_rows(rows);
    *a = (q3_expert_half_args){rows->data, rows->dtype, n, experts->data, weights->data, out ? out->data : NULL,
                               out ? out->dtype : rows->dtype, acc, stream};
    *made = (q3_tensor_spec){rows->dtype, 2, {n, cfg->hidden}};
    return Q3_OK;
}

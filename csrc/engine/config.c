/* Layer geometry: validation, weight names and shapes. */
#include <math.h>

#include "q3.h"

/* every weight of the layer, in elements; bounded by the limits (at most about 2^56) */
static int64_t q3_config_weight_elems(const q3_config *c) {
    const int64_t H = c->hidden, I = c->moe_inter, D = c->head_dim;
    const int64_t attention = ((int64_t)c->heads * D * 2 + (int64_t)c->kv_heads * D * 2) * H + 2 * D;
    return attention + 2 * H + (int64_t)c->experts * H + (int64_t)c->experts * 3 * I * H;
}

q3_status q3_config_check(const q3_config *c, q3_error *err) {
    const struct { const char *name; int64_t value; } positive[] = {
        {"hidden_size", c->hidden},          {"num_attention_heads", c->heads},
        {"num_key_value_heads", c->kv_heads}, {"head_dim", c->head_dim},
        {"num_experts", c->experts},         {"num_experts_per_tok", c->top_k},
        {"moe_intermediate_size", c->moe_inter}, {"max_position_embeddings", c->max_positions},
    };
    const int64_t limit[] = {Q3_MAX_HIDDEN, Q3_MAX_HEADS, Q3_MAX_HEADS, Q3_MAX_HEADS,
                             Q3_MAX_EXPERTS, Q3_MAX_EXPERTS, Q3_MAX_HIDDEN, Q3_MAX_POSITIONS};
    for (size_t i = 0; i < sizeof positive / sizeof positive[0]; i++) {
        if (positive[i].value <= 0)
            return q3_fail(err, Q3_ERR_VALUE, "%s: expected a positive integer, got %lld",
                           positive[i].name, (long long)positive[i].value);
        if (positive[i].value > limit[i])
            return q3_fail(err, Q3_ERR_VALUE, "%s: expected at most %lld, got %lld", positive[i].name,
                           (long long)limit[i], (long long)positive[i].value);
    }
    if (c->head_dim % 2)
        return q3_fail(err, Q3_ERR_VALUE,
                       "head_dim: expected an even number (RoPE rotates pairs of dims), got %d",
                       c->head_dim);
    if (c->heads % c->kv_heads)
        return q3_fail(err, Q3_ERR_VALUE,
                       "num_attention_heads: expected a multiple of num_key_value_heads (%d), got %d",
                       c->kv_heads, c->heads);
    if (c->top_k > c->experts)
        return q3_fail(err, Q3_ERR_VALUE,
                       "num_experts_per_tok: expected at most num_experts (%d), got %d",
                       c->experts, c->top_k);
    const int64_t bytes = q3_config_weight_elems(c) * 4;
    if (bytes > Q3_MAX_WEIGHT_BYTES)
        return q3_fail(err, Q3_ERR_VALUE, "weights: this geometry's weights take %lld bytes in fp32, expected at "
                       "most %lld", (long long)bytes, (long long)Q3_MAX_WEIGHT_BYTES);
    if (!(c->eps > 0.0f))
        return q3_fail(err, Q3_ERR_VALUE, "rms_norm_eps: expected a positive number, got %g",
                       (double)c->eps);
    if (!(c->rope_theta > 1.0) || !isfinite(c->rope_theta))
        return q3_fail(err, Q3_ERR_VALUE, "rope_theta: expected a finite number > 1, got %g", c->rope_theta);
    return q3_rope_check(c, err);
}

const char *q3_dense_weight_name(q3_dense_weight w) {
    static const char *names[Q3_W_DENSE_COUNT] = {
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
        "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
        "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate.weight",
    };
    return (unsigned)w < Q3_W_DENSE_COUNT ? names[w] : "?";
}

int q3_dense_weight_is_matrix(q3_dense_weight w) {
    return w == Q3_W_Q_PROJ || w == Q3_W_K_PROJ || w == Q3_W_V_PROJ || w == Q3_W_O_PROJ;
}

const char *q3_expert_weight_name(q3_expert_weight w) {
    static const char *names[Q3_X_COUNT] = {"gate_proj", "up_proj", "down_proj"};
    return (unsigned)w < Q3_X_COUNT ? names[w] : "?";
}

int q3_dense_weight_shape(const q3_config *c, q3_dense_weight w, int64_t d[2]) {
    const int64_t H = c->hidden, q = (int64_t)c->heads * c->head_dim,
                  kv = (int64_t)c->kv_heads * c->head_dim;
    switch (w) {
    case Q3_W_INPUT_NORM:
    case Q3_W_POST_NORM: d[0] = H; return 1;
    case Q3_W_Q_NORM:
    case Q3_W_K_NORM: d[0] = c->head_dim; return 1;
    case Q3_W_Q_PROJ: d[0] = q; d[1] = H; return 2;
    case Q3_W_K_PROJ:
    case Q3_W_V_PROJ: d[0] = kv; d[1] = H; return 2;
    case Q3_W_O_PROJ: d[0] = H; d[1] = q; return 2;
    case Q3_W_ROUTER: d[0] = c->experts; d[1] = H; return 2;
    default: return 0;
    }
}

void q3_expert_weight_shape(const q3_config *c, q3_expert_weight w, int64_t d[2]) {
    d[0] = w == Q3_X_DOWN ? c->hidden : c->moe_inter;
    d[1] = w == Q3_X_DOWN ? c->moe_inter : c->hidden;
}

const char *q3_fused_expert_name(q3_fused_expert f) {
    static const char *names[Q3_FUSED_COUNT] = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
    return (unsigned)f < Q3_FUSED_COUNT ? names[f] : "?";
}

void q3_fused_expert_shape(const q3_config *c, q3_fused_expert f, int scale, int64_t d[3]) {
    /* rows and columns of an expert's gate (and up) matrix, or of its scale's blocks */
    const int64_t I = scale ? (c->moe_inter + 127) / 128 : c->moe_inter, H = scale ? (c->hidden + 127) / 128 : c->hidden;
    d[0] = c->experts;
    d[1] = f == Q3_FUSED_GATE_UP ? 2 * I : H;
    d[2] = f == Q3_FUSED_GATE_UP ? H : I;
}

void q3_weight_init(int is_norm, float *mean, float *std) {
    *mean = is_norm ? 1.0f : 0.0f;
    *std = is_norm ? 0.1f : 0.02f;
}

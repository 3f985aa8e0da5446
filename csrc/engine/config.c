/* Layer geometry: validation, weight names and shapes. */
#include <math.h>
#include <stddef.h>

#include "q3.h"

/* every weight of the layer, in elements; bounded by the limits (at most about 2^56) */
static int64_t q3_config_weight_elems(const q3_config *c) {
    const int64_t H = c->hidden, I = c->moe_inter, D = c->head_dim;
    const int64_t attention = ((int64_t)c->heads * D * 2 + (int64_t)c->kv_heads * D * 2) * H + 2 * D;
    return attention + 2 * H + (int64_t)c->experts * H + (int64_t)c->experts * 3 * I * H;
}

/* each count's limit: in [1, max] (Q3_CF_* order; its name is its field's, below) */
static const int64_t count_max[Q3_CF_COUNT] = {Q3_MAX_HIDDEN, Q3_MAX_HEADS, Q3_MAX_HEADS, Q3_MAX_HEADS,
                                               Q3_MAX_EXPERTS, Q3_MAX_EXPERTS, Q3_MAX_HIDDEN, Q3_MAX_POSITIONS,
                                               Q3_MAX_POSITIONS};

#define AT(f) offsetof(q3_config_values, f)
/* a count None takes is a RoPE field (rope_original_max_position_embeddings) */
#define COUNT(name, i, none_ok) {name, Q3_FIELD_COUNT, none_ok, 0, none_ok, i, AT(counts[i])}
#define FIELD(name, type, at) {name, type, 0, 0, 0, -1, AT(at)}
#define ROPE(name, type, none_ok, positive, at) {name, type, none_ok, positive, 1, -1, AT(at)}
/* q3_config_field's table, the LayerConfig's names */
static const q3_config_field_info fields[Q3_CONFIG_FIELDS] = {
    COUNT("hidden_size", Q3_CF_HIDDEN, 0), COUNT("num_attention_heads", Q3_CF_HEADS, 0),
    COUNT("num_key_value_heads", Q3_CF_KV_HEADS, 0), COUNT("head_dim", Q3_CF_HEAD_DIM, 0),
    COUNT("num_experts", Q3_CF_EXPERTS, 0), COUNT("num_experts_per_tok", Q3_CF_TOP_K, 0),
    COUNT("moe_intermediate_size", Q3_CF_MOE_INTER, 0), COUNT("max_position_embeddings", Q3_CF_MAX_POSITIONS, 0),
    FIELD("rms_norm_eps", Q3_FIELD_NUMBER, eps), FIELD("rope_theta", Q3_FIELD_NUMBER, rope_theta),
    FIELD("norm_topk_prob", Q3_FIELD_FLAG, norm_topk), ROPE("rope_type", Q3_FIELD_ROPE_TYPE, 0, 0, rope.type),
    ROPE("rope_factor", Q3_FIELD_NUMBER, 0, 0, rope.factor),
    ROPE("rope_attention_factor", Q3_FIELD_NUMBER, 1, 1, rope.attention_factor),
    ROPE("rope_beta_fast", Q3_FIELD_NUMBER, 0, 0, rope.beta_fast),
    ROPE("rope_beta_slow", Q3_FIELD_NUMBER, 0, 0, rope.beta_slow),
    ROPE("rope_mscale", Q3_FIELD_NUMBER, 1, 0, rope.mscale),
    ROPE("rope_mscale_all_dim", Q3_FIELD_NUMBER, 1, 0, rope.mscale_all_dim),
    ROPE("rope_truncate", Q3_FIELD_FLAG, 0, 0, rope.truncate),
    COUNT("rope_original_max_position_embeddings", Q3_CF_ROPE_ORIGINAL_MAX, 1),
};

const q3_config_field_info *q3_config_field(int f) { return (unsigned)f < Q3_CONFIG_FIELDS ? &fields[f] : NULL; }

void q3_config_field_given(q3_config_values *v, int f, int given) {
    if ((unsigned)f >= Q3_CONFIG_FIELDS) return;
    if (fields[f].count == Q3_CF_ROPE_ORIGINAL_MAX) v->original_max_given = given;
    else if (!given && fields[f].type == Q3_FIELD_NUMBER) *(double *)((char *)v + fields[f].at) = 0.0;
}

int q3_config_field_unset(const q3_config_values *v, int f) {
    if ((unsigned)f >= Q3_CONFIG_FIELDS || !fields[f].none_ok) return 0;
    if (fields[f].count == Q3_CF_ROPE_ORIGINAL_MAX) return !v->original_max_given;
    return *(const double *)((const char *)v + fields[f].at) == 0.0;
}

const char *q3_config_count_name(int i) {
    for (int f = 0; (unsigned)i < Q3_CF_COUNT && f < Q3_CONFIG_FIELDS; f++)
        if (fields[f].count == i) return fields[f].name;
    return "?";
}
int64_t q3_config_count_max(int i) { return (unsigned)i < Q3_CF_COUNT ? count_max[i] : 0; }

/* count i of value v, named with prefix ("config." for a LayerConfig's field) */
static q3_status check_count(const char *prefix, int i, int64_t v, q3_error *err) {
    if (v <= 0) return q3_fail(err, Q3_ERR_VALUE, "%s%s: expected a positive integer, got %lld", prefix, q3_config_count_name(i),
                               (long long)v);
    if (v > count_max[i])
        return q3_fail(err, Q3_ERR_VALUE, "%s%s: expected at most %lld, got %lld", prefix, q3_config_count_name(i),
                       (long long)count_max[i], (long long)v);
    return Q3_OK;
}

/* what q3_config_check checks past the counts (each in its range: the products below fit) */
static q3_status check_geometry(const q3_config *c, q3_error *err);

q3_status q3_config_check(const q3_config *c, q3_error *err) {
    const int64_t v[Q3_CF_ROPE_ORIGINAL_MAX] = {c->hidden, c->heads, c->kv_heads, c->head_dim, c->experts, c->top_k,
                                                c->moe_inter, c->max_positions};
    for (int i = 0; i < Q3_CF_ROPE_ORIGINAL_MAX; i++) { /* original_max: q3_rope_check's, 0 meaning unset */
        q3_status s = check_count("", i, v[i], err);
        if (s != Q3_OK) return s;
    }
    return check_geometry(c, err);
}

q3_status q3_config_make(const q3_config_values *v, q3_config *out, q3_error *err) {
    for (int i = 0; i < Q3_CF_COUNT; i++) {
        const int unset = i == Q3_CF_ROPE_ORIGINAL_MAX && !v->original_max_given;
        q3_status s = unset ? Q3_OK : check_count("config.", i, v->counts[i], err);
        if (s != Q3_OK) return s;
    }
    const int64_t *n = v->counts; /* each now in [1, its limit]: the ints hold them */
    *out = (q3_config){.hidden = n[Q3_CF_HIDDEN], .heads = (int)n[Q3_CF_HEADS], .kv_heads = (int)n[Q3_CF_KV_HEADS],
                       .head_dim = (int)n[Q3_CF_HEAD_DIM], .experts = (int)n[Q3_CF_EXPERTS],
                       .top_k = (int)n[Q3_CF_TOP_K], .moe_inter = n[Q3_CF_MOE_INTER], .norm_topk = v->norm_topk,
                       .eps = (float)v->eps, .rope_theta = v->rope_theta, .max_positions = n[Q3_CF_MAX_POSITIONS],
                       .rope = v->rope};
    out->rope.original_max = v->original_max_given ? n[Q3_CF_ROPE_ORIGINAL_MAX] : 0;
    return check_geometry(out, err);
}

static q3_status check_geometry(const q3_config *c, q3_error *err) {
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

/* RoPE parameters: their checks, and the table the kernels rotate by (inv_freq [D/2] and
 * the scale of cos and sin), computed once per layer as transformers' rotary embedding
 * (modeling_rope_utils.py, 4.57 and 5.x) computes its inv_freq buffer and attention_scaling:
 *   default: inv_freq[i] = 1 / theta^(2i/D)                         (fp32 pow, fp32 division)
 *   linear:  the default inv_freq / factor                          (fp32)
 *   yarn:    ramp[i] = clamp((i - low) / (high - low), 0, 1), e = 1 - ramp,
 *            inv_freq = 1/(factor pos)(1 - e) + (1/pos) e, pos = theta^(2i/D)   (fp32)
 *            low, high from beta_fast, beta_slow and original_max (fp64, as Python does),
 *            scale from factor, mscale, mscale_all_dim (fp64) unless attention_factor is given.
 * Each fp32 step is one torch op there, rounded on its own: the products that feed a sum are
 * rounded through rounded_f32 here, since the build lets the compiler fuse a product into
 * the sum after it (-ffp-contract=fast), which would round once where torch rounds twice. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "q3.h"

static float rounded_f32(float x) {
    volatile float v = x;
    return v;
}
static double rounded_f64(double x) {
    volatile double v = x;
    return v;
}

/* ---- checks ----------------------------------------------------------------------- */

/* the variants by transformers' rope_type, in q3_rope_type's order */
static const char *const type_names[] = {"default", "linear", "yarn"};
#define N_TYPES ((int)(sizeof type_names / sizeof type_names[0]))

static const char *type_name(q3_rope_type t) { return (unsigned)t < (unsigned)N_TYPES ? type_names[t] : "default"; }
const char *q3_rope_type_name(q3_rope_type t) { return type_name(t); }

const char *q3_rope_type_list(char *buf, size_t size) {
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < N_TYPES && at < size; i++)
        at += (size_t)snprintf(buf + at, size - at, "%s'%s'", i == 0 ? "" : i == N_TYPES - 1 ? " or " : ", ",
                               type_names[i]);
    return buf;
}

q3_status q3_rope_type_parse(const char *name, q3_rope_type *t, q3_error *err) {
    for (int i = 0; name && i < N_TYPES; i++)
        if (!strcmp(name, type_names[i])) {
            *t = (q3_rope_type)i;
            return Q3_OK;
        }
    char list[64];
    return q3_fail(err, Q3_ERR_VALUE, "rope_type: expected %s, got '%s'", q3_rope_type_list(list, sizeof list),
                   name ? name : "(null)");
}

/* a field the variant does not read must hold its neutral value (else it would be ignored) */
static q3_status unused(const char *field, double got, double neutral, q3_rope_type t, q3_error *err) {
    if (got == neutral) return Q3_OK;
    return q3_fail(err, Q3_ERR_VALUE, "%s: the %s RoPE does not use it; expected %g, got %g", field, type_name(t),
                   neutral, got);
}

static q3_status check_numbers(const q3_rope_scaling *r, q3_error *err) {
    const struct { const char *name, *hf; double v; } nums[] = {
        {"rope_factor", "factor", r->factor},
        {"rope_attention_factor", "attention_factor", r->attention_factor},
        {"rope_beta_fast", "beta_fast", r->beta_fast},
        {"rope_beta_slow", "beta_slow", r->beta_slow},
        {"rope_mscale", "mscale", r->mscale},
        {"rope_mscale_all_dim", "mscale_all_dim", r->mscale_all_dim},
    };
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++)
        if (!isfinite(nums[i].v))
            return q3_fail(err, Q3_ERR_VALUE, "%s (rope_parameters['%s']): expected a finite number, got %g",
                           nums[i].name, nums[i].hf, nums[i].v);
    return Q3_OK;
}

static q3_status check_yarn(const q3_rope_scaling *r, q3_error *err) {
    if (r->original_max < 0 || r->original_max > Q3_MAX_POSITIONS)
        return q3_fail(err, Q3_ERR_VALUE, "rope_original_max_position_embeddings "
                       "(rope_parameters['original_max_position_embeddings']): expected a positive integer of at "
                       "most %lld, got %lld", (long long)Q3_MAX_POSITIONS, (long long)r->original_max);
    if (r->attention_factor < 0)
        return q3_fail(err, Q3_ERR_VALUE, "rope_attention_factor (rope_parameters['attention_factor']): expected a "
                       "number > 0, got %g", r->attention_factor);
    /* the correction range takes log(original_max / (beta * 2 pi)) */
    if (!(r->beta_fast > 0))
        return q3_fail(err, Q3_ERR_VALUE, "rope_beta_fast (rope_parameters['beta_fast']): expected a number > 0, got %g",
                       r->beta_fast);
    if (!(r->beta_slow > 0))
        return q3_fail(err, Q3_ERR_VALUE, "rope_beta_slow (rope_parameters['beta_slow']): expected a number > 0, got %g",
                       r->beta_slow);
    if (r->truncate != 0 && r->truncate != 1)
        return q3_fail(err, Q3_ERR_VALUE, "rope_truncate (rope_parameters['truncate']): expected 0 or 1, got %d",
                       r->truncate);
    return Q3_OK;
}

/* the fields of r the variant reads, in their domains; the others neutral */
static q3_status check_scaling(const q3_rope_scaling *r, q3_error *err) {
    if (r->type != Q3_ROPE_DEFAULT && r->type != Q3_ROPE_LINEAR && r->type != Q3_ROPE_YARN)
        return q3_fail(err, Q3_ERR_VALUE, "rope_type: expected default, linear or yarn (%d, %d or %d), got %d",
                       Q3_ROPE_DEFAULT, Q3_ROPE_LINEAR, Q3_ROPE_YARN, (int)r->type);
    q3_status s = check_numbers(r, err);
    if (s != Q3_OK) return s;
    const q3_rope_scaling n = Q3_ROPE_SCALING_DEFAULT;
    if (r->type == Q3_ROPE_DEFAULT) s = unused("rope_factor", r->factor, n.factor, r->type, err);
    else if (!(r->factor > 0))
        return q3_fail(err, Q3_ERR_VALUE, "rope_factor (rope_parameters['factor']): expected a number > 0 for the %s "
                       "RoPE, got %g", type_name(r->type), r->factor);
    if (r->type == Q3_ROPE_YARN) return s == Q3_OK ? check_yarn(r, err) : s;
    if (s == Q3_OK)
        s = unused("rope_original_max_position_embeddings", (double)r->original_max, (double)n.original_max, r->type,
                   err);
    if (s == Q3_OK) s = unused("rope_attention_factor", r->attention_factor, n.attention_factor, r->type, err);
    if (s == Q3_OK) s = unused("rope_beta_fast", r->beta_fast, n.beta_fast, r->type, err);
    if (s == Q3_OK) s = unused("rope_beta_slow", r->beta_slow, n.beta_slow, r->type, err);
    if (s == Q3_OK) s = unused("rope_mscale", r->mscale, n.mscale, r->type, err);
    if (s == Q3_OK) s = unused("rope_mscale_all_dim", r->mscale_all_dim, n.mscale_all_dim, r->type, err);
    if (s == Q3_OK) s = unused("rope_truncate", r->truncate, n.truncate, r->type, err);
    return s;
}

q3_status q3_rope_check(const q3_config *c, q3_error *err) {
    q3_status s = check_scaling(&c->rope, err);
    if (s != Q3_OK) return s;
    float inv_freq[Q3_MAX_HEADS / 2], scale;
    q3_rope_table(c, inv_freq, &scale);
    /* a factor far outside any model's can overflow fp32 (torch would compute the same inf) */
    for (int i = 0; i < c->head_dim / 2; i++)
        if (!isfinite(inv_freq[i]))
            return q3_fail(err, Q3_ERR_VALUE, "rope_factor (rope_parameters['factor']): the %s RoPE's inv_freq[%d] is "
                           "%g with factor %g and rope_theta %g; expected a finite table", type_name(c->rope.type), i,
                           (double)inv_freq[i], c->rope.factor, c->rope_theta);
    if (!isfinite(scale))
        return q3_fail(err, Q3_ERR_VALUE, "rope_attention_factor: the yarn RoPE's cos/sin scale is %g with factor %g, "
                       "mscale %g and mscale_all_dim %g; expected a finite number", (double)scale, c->rope.factor,
                       c->rope.mscale, c->rope.mscale_all_dim);
    return Q3_OK;
}

/* ---- the table ------------------------------------------------------------------------ */

/* theta^(2i/D) in fp32: torch's `base ** (arange(0, D, 2).float() / D)` with base a Python float */
static float pos_freq(float theta, int i, int D) { return powf(theta, (float)(2 * i) / (float)D); }

/* transformers' get_mscale: 0.1 * mscale * log(scale) + 1 (1 for scale <= 1), fp64 left to right */
static double yarn_mscale(double scale, double mscale) {
    if (scale <= 1.0) return 1.0;
    return rounded_f64(rounded_f64(0.1 * mscale) * log(scale)) + 1.0;
}

/* find_correction_dim: the dim whose wavelength turns `rotations` times over original_max */
static double correction_dim(double rotations, int D, double theta, int64_t original_max) {
    return ((double)D * log((double)original_max / (rotations * 2.0 * M_PI))) / (2.0 * log(theta));
}

static void yarn_table(const q3_config *c, float *inv_freq, float *scale) {
    const q3_rope_scaling *r = &c->rope;
    const int D = c->head_dim;
    const int64_t original_max = r->original_max ? r->original_max : c->max_positions;
    double low = correction_dim(r->beta_fast, D, c->rope_theta, original_max);
    double high = correction_dim(r->beta_slow, D, c->rope_theta, original_max);
    if (r->truncate) {
        low = floor(low);
        high = ceil(high);
    }
    low = low > 0 ? low : 0;
    high = high < D - 1 ? high : D - 1;
    if (low == high) high += 0.001; /* transformers' guard against a zero-width ramp */
    /* (arange(D/2) - low) / (high - low): each Python scalar cast to fp32 by the op */
    const float low_f = (float)low, width_f = (float)(high - low), factor_f = (float)r->factor;
    for (int i = 0; i < D / 2; i++) {
        const float p = pos_freq((float)c->rope_theta, i, D);
        const float extrapolation = 1.0f / p, interpolation = 1.0f / rounded_f32(factor_f * p);
        float ramp = ((float)i - low_f) / width_f;
        ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
        const float e = 1.0f - ramp; /* inv_freq_extrapolation_factor */
        inv_freq[i] = rounded_f32(interpolation * (1.0f - e)) + rounded_f32(extrapolation * e);
    }
    double attention = r->attention_factor;
    if (attention == 0.0)
        attention = r->mscale != 0.0 && r->mscale_all_dim != 0.0
                        ? yarn_mscale(r->factor, r->mscale) / yarn_mscale(r->factor, r->mscale_all_dim)
                        : yarn_mscale(r->factor, 1.0);
    *scale = (float)attention;
}

void q3_rope_table(const q3_config *c, float *inv_freq, float *scale) {
    const int D = c->head_dim;
    *scale = 1.0f;
    if (c->rope.type == Q3_ROPE_YARN) {
        yarn_table(c, inv_freq, scale);
        return;
    }
    const float factor = (float)c->rope.factor;
    for (int i = 0; i < D / 2; i++) {
        inv_freq[i] = 1.0f / pos_freq((float)c->rope_theta, i, D);
        if (c->rope.type == Q3_ROPE_LINEAR) inv_freq[i] /= factor;
    }
}

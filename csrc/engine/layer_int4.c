/* A GPTQ int4 layer's matrices (q3_int4_matrix, kernels/int4.h), made once at creation from the
 * pointers its weight table filled, and checked as the kernels will read them: the g_idx of
 * every input in [0, G) (a kernel indexes the scales and zeros by it), every scale finite. The
 * shapes were the glue's to check against the table (q3_weight_table); the values are here,
 * since a file decides them. A CUDA layer's tensors are on its device: each matrix's g_idx and
 * scales are copied to the host for the check (through the device backend), its structs stay
 * on the host (csrc/cuda copies the experts' to the device for the grouped decode kernels). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device_backend.h"
#include "layer_internal.h"

/* m [N, K] named `name` checked on its g_idx [K] and scales [G, N] as given in host memory
 * (m's own, or copies of a device layer's); m->group set when g_idx is k / group */
static q3_status check_matrix(q3_int4_matrix *m, int64_t N, int64_t K, int64_t group, const int32_t *g_idx,
                              const uint16_t *scales, const char *name, q3_error *err) {
    const int64_t G = m->groups;
    int plain = 1;
    for (int64_t k = 0; k < K; k++) {
        const int32_t g = g_idx[k];
        if (g < 0 || g >= G)
            return q3_fail(err, Q3_ERR_VALUE, "%s.g_idx: expected groups in [0, %lld), got %d at input %lld", name,
                           (long long)G, (int)g, (long long)k);
        plain &= g == k / group;
    }
    m->group = plain ? group : 0;
    for (int64_t i = 0; i < G * N; i++) {
        const float s = q3_f16_to_f32(scales[i]);
        if (!isfinite(s))
            return q3_fail(err, Q3_ERR_VALUE, "%s.scales: expected finite scales, got %s at [%lld, %lld]", name,
                           isnan(s) ? "NaN" : "Inf", (long long)(i / N), (long long)(i % N));
    }
    return Q3_OK;
}

/* host copies of a device layer's g_idx and scales, one matrix at a time (grown, never shrunk) */
typedef struct {
    int32_t *g_idx;
    uint16_t *scales;
    size_t g_idx_bytes, scales_bytes;
} host_copies;

/* *p (of *have bytes) grown to `bytes`; 0 without the memory */
static int grow(void **p, size_t *have, size_t bytes) {
    if (bytes <= *have) return 1;
    void *q = realloc(*p, bytes);
    if (!q) return 0;
    *p = q;
    *have = bytes;
    return 1;
}

/* m [N, K] checked where its tensors are: on the host as they are, on `device` copied back */
static q3_status check_on(q3_int4_matrix *m, int64_t N, int64_t K, int64_t group, int device, host_copies *hc,
                          const char *name, q3_error *err) {
    if (device < 0) return check_matrix(m, N, K, group, m->g_idx, m->scales, name, err);
    const q3_device_backend *b = q3_device();
    const size_t gb = (size_t)K * sizeof(int32_t), sb = (size_t)(m->groups * N) * sizeof(uint16_t);
    if (!b) return q3_fail(err, Q3_ERR_STATE, "%s: cannot check a matrix on cuda:%d: no device backend", name, device);
    if (!grow((void **)&hc->g_idx, &hc->g_idx_bytes, gb) || !grow((void **)&hc->scales, &hc->scales_bytes, sb))
        return q3_fail(err, Q3_ERR_NOMEM, "layer: out of memory");
    q3_error why;
    if (b->copy_to_host(hc->g_idx, m->g_idx, gb, device, &why) != Q3_OK ||
        b->copy_to_host(hc->scales, m->scales, sb, device, &why) != Q3_OK)
        return q3_fail(err, Q3_ERR_STATE, "%s: cannot read its g_idx and scales back from cuda:%d for their check: %s",
                       name, device, why.msg);
    return check_matrix(m, N, K, group, hc->g_idx, hc->scales, name, err);
}

static q3_int4_matrix matrix_of(const void *qweight, const void *scales, const void *qzeros, const void *g_idx,
                                int64_t K, int64_t group, int v2) {
    return (q3_int4_matrix){qweight, qzeros, scales, g_idx, K / group, group, v2 ? 0 : 1};
}

/* the matrices of the dense weights (none with gptq_dense_attention) and of the held experts */
static q3_status take_matrices(q3_layer *l, host_copies *hc, q3_error *err) {
    const q3_weights *w = &l->w;
    char name[Q3_WEIGHT_NAME_MAX + 16];
    int64_t dims[2];
    q3_status s = Q3_OK;
    for (int i = 0; i < Q3_W_DENSE_COUNT && !w->experts_only && !w->gptq_dense_attention && s == Q3_OK; i++) {
        if (!q3_dense_weight_is_matrix(i)) continue;
        q3_dense_weight_shape(&l->cfg, i, dims);
        q3_int4_matrix *m = &l->int4[q3_int4_index(i)];
        const int64_t group = q3_gptq_group(w->gptq_group, dims[1]);
        *m = matrix_of(w->dense[i], w->dense_scale[i], w->dense_qzeros[i], w->dense_g_idx[i], dims[1], group,
                       w->gptq_v2);
        const char *dense = q3_dense_weight_name(i); /* "self_attn.q_proj.weight": the module is before ".weight" */
        snprintf(name, sizeof name, "%.*s", (int)(strlen(dense) - 7), dense);
        s = check_on(m, dims[0], dims[1], group, w->device, hc, name, err);
    }
    for (int e = 0; e < l->cfg.experts && s == Q3_OK; e++)
        for (int x = 0; x < Q3_X_COUNT && l->held[e] && s == Q3_OK; x++) {
            q3_expert_weight_shape(&l->cfg, x, dims);
            q3_int4_matrix *m = &l->int4[q3_int4_expert_index(l, x, e)];
            const int64_t group = q3_gptq_group(w->gptq_group, dims[1]);
            *m = matrix_of(w->experts[x][e], w->expert_scales[x][e], w->expert_qzeros[x][e], w->expert_g_idx[x][e],
                           dims[1], group, w->gptq_v2);
            snprintf(name, sizeof name, "mlp.experts.%d.%s", e, q3_expert_weight_name(x));
            s = check_on(m, dims[0], dims[1], group, w->device, hc, name, err);
        }
    return s;
}

q3_status q3_layer_take_int4(q3_layer *l, q3_error *err) {
    l->int4 = calloc((size_t)(Q3_W_DENSE_COUNT + (int64_t)Q3_X_COUNT * l->cfg.experts), sizeof *l->int4);
    if (!l->int4) return q3_fail(err, Q3_ERR_NOMEM, "layer: out of memory");
    host_copies hc = {0};
    const q3_status s = take_matrices(l, &hc, err);
    free(hc.g_idx);
    free(hc.scales);
    return s;
}

/* one view's shape and dtype as q3_dequantize_int4_check expects them */
static q3_status want_view(const q3_view *v, const char *arg, q3_dtype dt, int ndim, const int64_t *shape,
                           q3_error *err) {
    int same = v->ndim == ndim && v->dtype == dt && v->contiguous && v->device < 0;
    for (int d = 0; same && d < ndim; d++) same = v->shape[d] == shape[d];
    if (same) return Q3_OK;
    char want[64], got[96];
    snprintf(want, sizeof want, ndim == 1 ? "[%lld]" : "[%lld, %lld]", (long long)shape[0],
             (long long)(ndim > 1 ? shape[1] : 0));
    int at = snprintf(got, sizeof got, "%s%s %s [", v->contiguous ? "" : "non-contiguous ", v->device < 0 ? "host" : "cuda",
                      q3_dtype_name(v->dtype));
    for (int d = 0; d < v->ndim && at < (int)sizeof got - 24; d++)
        at += snprintf(got + at, sizeof got - (size_t)at, d ? ", %lld" : "%lld", (long long)v->shape[d]);
    snprintf(got + at, sizeof got - (size_t)at, "]");
    return q3_fail(err, Q3_ERR_VALUE, "%s: expected a contiguous host %s tensor %s, got a %s", arg, q3_dtype_name(dt),
                   want, got);
}

/* the matrix of the views (shapes checked), group K / G where G divides K */
static q3_int4_matrix views_matrix(const q3_view *qweight, const q3_view *qzeros, const q3_view *scales,
                                   const q3_view *g_idx, int v2) {
    const int64_t K = qweight->shape[0] * 8, G = scales->shape[0];
    q3_int4_matrix m = matrix_of(qweight->data, scales->data, qzeros->data, g_idx->data, K, K % G ? K : K / G, v2);
    m.groups = G;
    return m;
}

q3_status q3_dequantize_int4_check(const q3_view *qweight, const q3_view *qzeros, const q3_view *scales,
                                   const q3_view *g_idx, q3_error *err) {
    if (qweight->ndim != 2 || scales->ndim != 2 || qweight->shape[1] % 8 || qweight->shape[0] < 1 ||
        scales->shape[0] < 1 || qweight->shape[0] > INT64_MAX / 8)
        return q3_fail(err, Q3_ERR_VALUE, "qweight, scales: expected [K/8, N] and [groups, N] with N a multiple of 8 "
                       "and K, groups >= 1, got %d-D and %d-D", qweight->ndim, scales->ndim);
    const int64_t K = qweight->shape[0] * 8, N = qweight->shape[1], G = scales->shape[0];
    const int64_t w_shape[2] = {K / 8, N}, s_shape[2] = {G, N}, z_shape[2] = {G, N / 8}, g_shape[1] = {K};
    q3_status s;
    if ((s = want_view(qweight, "qweight", Q3_I32, 2, w_shape, err)) != Q3_OK ||
        (s = want_view(scales, "scales", Q3_F16, 2, s_shape, err)) != Q3_OK ||
        (s = want_view(qzeros, "qzeros", Q3_I32, 2, z_shape, err)) != Q3_OK ||
        (s = want_view(g_idx, "g_idx", Q3_I32, 1, g_shape, err)) != Q3_OK)
        return s;
    q3_int4_matrix m = views_matrix(qweight, qzeros, scales, g_idx, 0);
    return check_matrix(&m, N, K, m.group, m.g_idx, m.scales, "the matrix", err);
}

void q3_dequantize_int4_views(float *dst, const q3_view *qweight, const q3_view *qzeros, const q3_view *scales,
                              const q3_view *g_idx, int v2) {
    const q3_int4_matrix m = views_matrix(qweight, qzeros, scales, g_idx, v2);
    q3_int4_dequant_rows(dst, &m, qweight->shape[1], qweight->shape[0] * 8, 0, qweight->shape[1]);
}

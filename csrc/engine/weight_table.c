/* The one table of a layer's tensors (q3.h's q3_weight_table): for each weight format, the
 * checkpoint names a layer reads, their shapes and storage, and where each pointer goes in
 * q3_weights; and the random draws DecoderLayer.random fills each with (q3_weight_fill_random).
 * A format is its rows here: the storage of its matrices and what stands beside each. */
#include <stdio.h>
#include <string.h>

#include "q3.h"

#include "../../kernels/int4.h"

/* what a format stores for a projection matrix: its own storage and name, and what stands
 * beside it */
typedef struct {
    const char *name;         /* q3_weight_format_name's */
    q3_weight_storage matrix; /* of q/k/v/o_proj and the experts' gate/up/down_proj */
    const char *matrix_suffix; /* replaces a dense name's ".weight": NULL keeps it */
    int sides;                 /* the tensors beside each matrix, in this order: */
    q3_weight_storage side[3];
    const char *side_suffix[3]; /* each one's name: the matrix's (dense name, ".weight" dropped where
                                 * matrix_suffix is set) + this */
    int fusable;               /* the experts may come fused as transformers 5.x holds them */
    q3_dense_weight dtype_of; /* the weight whose dtype a layer takes when given none */
} format_row;

static const format_row formats[] = {
    [Q3_WF_DENSE] = {"dense", Q3_WS_LAYER, NULL, 0, {0}, {NULL}, 1, Q3_W_Q_PROJ},
    [Q3_WF_FP8_BLOCK128] = {"fp8_e4m3_block128", Q3_WS_E4M3, NULL, 1, {Q3_WS_SCALE}, {"_scale_inv"}, 1,
                            Q3_W_INPUT_NORM},
    [Q3_WF_GPTQ_INT4] = {"gptq_int4", Q3_WS_QWEIGHT, ".qweight", 3, {Q3_WS_GSCALES, Q3_WS_QZEROS, Q3_WS_GIDX},
                         {".scales", ".qzeros", ".g_idx"}, 0, Q3_W_INPUT_NORM},
};
#define N_FORMATS ((int)(sizeof formats / sizeof formats[0]))

static const char *const storage_names[Q3_WS_COUNT] = {"layer", "e4m3", "scale", "qweight", "gscales", "qzeros",
                                                       "g_idx"};

const char *q3_weight_storage_name(q3_weight_storage s) {
    return (unsigned)s < (unsigned)Q3_WS_COUNT ? storage_names[s] : "?";
}

q3_dtype q3_weight_storage_dtype(q3_weight_storage s, q3_dtype dt, q3_dtype sdt) {
    switch (s) {
    case Q3_WS_E4M3: return Q3_E4M3;
    case Q3_WS_SCALE: return sdt;
    case Q3_WS_QWEIGHT:
    case Q3_WS_QZEROS:
    case Q3_WS_GIDX: return Q3_I32;
    case Q3_WS_GSCALES: return Q3_F16;
    default: return dt;
    }
}

int q3_weight_format_count(void) { return N_FORMATS; }

const char *q3_weight_format_name(q3_weight_format f) {
    return (unsigned)f < (unsigned)N_FORMATS ? formats[f].name : "?";
}

const char *q3_weight_format_list(char *buf, size_t size) {
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < N_FORMATS && at < size; i++)
        at += (size_t)snprintf(buf + at, size - at, "%s'%s'", i == 0 ? "" : i == N_FORMATS - 1 ? " or " : ", ",
                               formats[i].name);
    return buf;
}

q3_status q3_weight_format_parse(const char *name, q3_weight_format *f, q3_error *err) {
    for (int i = 0; name && i < N_FORMATS; i++)
        if (!strcmp(name, formats[i].name)) {
            *f = (q3_weight_format)i;
            return Q3_OK;
        }
    char list[128];
    return q3_fail(err, Q3_ERR_VALUE, "weight_format: expected None, %s, got '%s'",
                   q3_weight_format_list(list, sizeof list), name ? name : "(null)");
}

q3_weight_format q3_weight_format_of(q3_dtype q_proj) {
    /* the format whose matrices are stored in q_proj's dtype; any other dtype: dense */
    for (int i = 0; i < N_FORMATS; i++)
        if (formats[i].matrix == Q3_WS_E4M3 && q_proj == Q3_E4M3) return (q3_weight_format)i;
    return Q3_WF_DENSE;
}

q3_dense_weight q3_weight_format_dtype_source(q3_weight_format f) {
    return (unsigned)f < (unsigned)N_FORMATS ? formats[f].dtype_of : Q3_W_Q_PROJ;
}

/* the table under construction: entries [n] of at most max (out NULL: counted only) */
typedef struct {
    q3_weight_entry *out;
    int64_t n, max;
    const format_row *fmt;
    int64_t group; /* GPTQ: the weights' gptq_group (q3_gptq_group) */
} table;

static q3_weight_entry *add(table *t, q3_weight_storage storage, int rank, const int64_t *dims, const void **slot) {
    q3_weight_entry *e = t->out && t->n < t->max ? &t->out[t->n] : NULL;
    t->n++;
    if (!e) return NULL;
    memset(e, 0, sizeof *e);
    e->storage = storage;
    e->rank = rank;
    memcpy(e->dims, dims, (size_t)rank * sizeof *dims);
    e->slot = slot;
    e->of = -1;
    return e;
}

/* the name of a matrix in the table's format, from its dense name (".weight" replaced where
 * the format says) and a suffix */
static void matrix_name(char *out, size_t size, const format_row *f, const char *dense, const char *suffix) {
    size_t stem = strlen(dense);
    if (f->matrix_suffix && stem > 7 && !strcmp(dense + stem - 7, ".weight")) stem -= 7;
    snprintf(out, size, "%.*s%s", (int)stem, dense, suffix ? suffix : f->matrix_suffix ? f->matrix_suffix : "");
}

/* a GPTQ matrix [N, K]: qweight [K/8, N], then its scales [G, N], qzeros [G, N/8], g_idx [K] */
static void add_gptq(table *t, const char *name, const int64_t *dims, const void **slot, const void **sides[3],
                     uint64_t stream, int64_t first) {
    const int64_t N = dims[0], K = dims[1], G = K / q3_gptq_group(t->group, K);
    const int64_t shapes[4][2] = {{K / 8, N}, {G, N}, {G, N / 8}, {K, 0}};
    const int64_t at = t->n;
    for (int i = 0; i < 4; i++) {
        q3_weight_entry *e = add(t, i ? t->fmt->side[i - 1] : t->fmt->matrix, i == 3 ? 1 : 2, shapes[i],
                                 i ? sides[i - 1] : slot);
        if (!e) continue;
        matrix_name(e->name, sizeof e->name, t->fmt, name, i ? t->fmt->side_suffix[i - 1] : NULL);
        if (i) e->of = at;
        else {
            e->stream = stream;
            e->first = first;
            e->matrix_dims[0] = N;
            e->matrix_dims[1] = K;
        }
    }
}

/* a projection matrix (rank 2, or fused experts [E, rows, K] of `parts` matrices a row of
 * E) and, where the format has one, its scale right after it; the random draws of its
 * elements: stream `stream` from element `first`. sides: the slots of what stands beside it. */
static void add_matrix(table *t, const char *name, int rank, const int64_t *dims, int64_t parts, const void **slot,
                       const void **sides[3], uint64_t stream, int64_t first) {
    if (t->fmt->matrix == Q3_WS_QWEIGHT) { /* never fused (format_row.fusable) */
        add_gptq(t, name, dims, slot, sides, stream, first);
        return;
    }
    q3_weight_entry *m = add(t, t->fmt->matrix, rank, dims, slot);
    const int64_t rows = dims[rank - 2] / parts, K = dims[rank - 1];
    if (m) {
        snprintf(m->name, sizeof m->name, "%s", name);
        m->stream = stream;
        m->first = first;
        m->matrix_rows = rows;
    }
    if (!t->fmt->sides) return;
    int64_t sdims[3];
    memcpy(sdims, dims, (size_t)rank * sizeof *dims);
    sdims[rank - 2] = parts * ((rows + 127) / 128); /* each matrix's 128-row blocks, stacked */
    sdims[rank - 1] = (K + 127) / 128;
    q3_weight_entry *s = add(t, Q3_WS_SCALE, rank, sdims, sides[0]);
    if (s) {
        snprintf(s->name, sizeof s->name, "%s%s", name, t->fmt->side_suffix[0]);
        s->of = m ? t->n - 2 : -1;
    }
}

/* Q3_ERR_VALUE unless the GPTQ group size is 0, -1 or a positive multiple of 8 and every 4-bit
 * matrix [N, K] (the experts', and the attention's unless gptq_dense_attention) has N and K
 * multiples of 8 and K of the group */
static q3_status gptq_geometry(const q3_config *cfg, const q3_weights *w, q3_error *err) {
    if (w->gptq_group < -1 || (w->gptq_group > 0 && w->gptq_group % 8))
        return q3_fail(err, Q3_ERR_VALUE, "gptq group_size: expected -1 (one group) or a positive multiple of 8, got "
                       "%lld", (long long)w->gptq_group);
    const int64_t H = cfg->hidden, I = cfg->moe_inter, q = (int64_t)cfg->heads * cfg->head_dim,
                  kv = (int64_t)cfg->kv_heads * cfg->head_dim;
    const int64_t sizes[] = {H, I, q, kv};
    for (int i = 0; i < (w->gptq_dense_attention ? 2 : 4); i++)
        if (sizes[i] % 8 || (i != 3 && sizes[i] % q3_gptq_group(w->gptq_group, sizes[i])))
            return q3_fail(err, Q3_ERR_VALUE, "weight_format 'gptq_int4': every matrix's inputs must be a multiple "
                           "of the group (%lld) and its outputs of 8, got hidden %lld, moe_intermediate %lld, "
                           "q heads x head_dim %lld, kv heads x head_dim %lld",
                           (long long)q3_gptq_group(w->gptq_group, 128), (long long)H, (long long)I, (long long)q,
                           (long long)kv);
    return Q3_OK;
}

q3_status q3_weight_table(const q3_config *cfg, q3_weights *w, int fused, const void **expert_ptrs,
                          q3_weight_entry *out, int64_t max, int64_t *n, q3_error *err) {
    char list[128];
    if ((unsigned)w->format >= (unsigned)N_FORMATS)
        return q3_fail(err, Q3_ERR_VALUE, "weight_format: expected %s, got %d", q3_weight_format_list(list, sizeof list),
                       (int)w->format);
    if (w->gptq_dense_attention && w->format != Q3_WF_GPTQ_INT4)
        return q3_fail(err, Q3_ERR_VALUE, "gptq_dense_attention: a setting of weight_format 'gptq_int4', got it with "
                       "'%s'", formats[w->format].name);
    table t = {out, 0, max, &formats[w->format], 0};
    if (t.fmt->matrix == Q3_WS_QWEIGHT) {
        q3_status s = gptq_geometry(cfg, w, err);
        if (s != Q3_OK) return s;
        t.group = w->gptq_group;
    }
    if (!t.fmt->fusable) fused = 0; /* a GPTQ checkpoint holds each expert's own modules */
    for (int i = 0; i < Q3_W_DENSE_COUNT && !w->experts_only; i++) {
        int64_t dims[2];
        const int rank = q3_dense_weight_shape(cfg, (q3_dense_weight)i, dims);
        const char *name = q3_dense_weight_name((q3_dense_weight)i);
        if (q3_dense_weight_is_matrix((q3_dense_weight)i)) {
            const void **sides[3] = {&w->dense_scale[i], &w->dense_qzeros[i], &w->dense_g_idx[i]};
            table *at = &t, dense = t; /* a GPTQ layer's dense attention: the dense format's rows */
            if (t.fmt->matrix == Q3_WS_QWEIGHT && w->gptq_dense_attention) dense.fmt = &formats[Q3_WF_DENSE], at = &dense;
            add_matrix(at, name, 2, dims, 1, &w->dense[i], sides, (uint64_t)i, 0);
            t.n = at->n;
            continue;
        }
        q3_weight_entry *e = add(&t, Q3_WS_LAYER, rank, dims, &w->dense[i]);
        if (e) {
            snprintf(e->name, sizeof e->name, "%s", name);
            e->stream = (uint64_t)i;
            e->is_norm = rank == 1;
        }
    }
    const int64_t E = cfg->experts, H = cfg->hidden, I = cfg->moe_inter;
    if (fused) { /* gate and up of expert e: elements [e 2I H, + I H) and [+ I H, + I H) of stream 100 */
        const int64_t gate_up[3] = {E, 2 * I, H}, down[3] = {E, H, I};
        const void **gu_sides[3] = {&w->fused_scales[Q3_FUSED_GATE_UP], NULL, NULL},
                   **down_sides[3] = {&w->fused_scales[Q3_FUSED_DOWN], NULL, NULL};
        add_matrix(&t, q3_fused_expert_name(Q3_FUSED_GATE_UP), 3, gate_up, 2, &w->fused[Q3_FUSED_GATE_UP], gu_sides,
                   100, 0);
        add_matrix(&t, q3_fused_expert_name(Q3_FUSED_DOWN), 3, down, 1, &w->fused[Q3_FUSED_DOWN], down_sides, 101, 0);
    } else { /* expert e's matrices are the draws of its part of the fused tensors */
        for (int e = 0; e < E; e++)
            for (int x = 0; x < Q3_X_COUNT && (!w->held || w->held[e]); x++) {
                char name[Q3_WEIGHT_NAME_MAX];
                int64_t dims[2];
                snprintf(name, sizeof name, "mlp.experts.%d.%s.weight", e, q3_expert_weight_name((q3_expert_weight)x));
                q3_expert_weight_shape(cfg, (q3_expert_weight)x, dims);
                const int64_t first = x == Q3_X_DOWN ? e * H * I : e * 2 * I * H + (x == Q3_X_UP ? I * H : 0);
                const void **slot = expert_ptrs ? &expert_ptrs[x * E + e] : NULL;
                const void **sides[3] = {NULL, NULL, NULL};
                for (int k = 0; k < 3 && slot; k++) sides[k] = slot + (size_t)(k + 1) * Q3_X_COUNT * E;
                add_matrix(&t, name, 2, dims, 1, slot, sides, x == Q3_X_DOWN ? 101 : 100, first);
            }
        for (int x = 0; x < Q3_X_COUNT && expert_ptrs; x++) {
            const void *const *side[3];
            for (int k = 0; k < 3; k++) side[k] = t.fmt->sides > k ? expert_ptrs + (size_t)((k + 1) * Q3_X_COUNT + x) * E : NULL;
            w->experts[x] = expert_ptrs + (size_t)x * E;
            w->expert_scales[x] = side[0];
            w->expert_qzeros[x] = side[1];
            w->expert_g_idx[x] = side[2];
        }
    }
    *n = t.n;
    if (out && t.n > max)
        return q3_fail(err, Q3_ERR_VALUE, "weight table: %lld entries, room for %lld", (long long)t.n,
                       (long long)max);
    return Q3_OK;
}

q3_status q3_held_from_ids(const int64_t *ids, int64_t n, int E, uint8_t *held, q3_error *err) {
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= E)
            return q3_fail(err, Q3_ERR_VALUE, "experts[%lld]: expected an expert id in [0, %d) (num_experts), got %lld",
                           (long long)i, E, (long long)ids[i]);
        if (held[ids[i]])
            return q3_fail(err, Q3_ERR_VALUE, "experts[%lld]: expert %lld appears twice", (long long)i,
                           (long long)ids[i]);
        held[ids[i]] = 1;
    }
    return Q3_OK;
}

int64_t q3_weight_entry_numel(const q3_weight_entry *e) {
    int64_t n;
    return q3_numel(e->rank, e->dims, &n) ? n : -1;
}

q3_status q3_weight_fill_random(const q3_weight_entry *e, void *data, q3_dtype dtype, void *const *side, uint64_t seed,
                                int64_t gptq_group, int gptq_v2, q3_error *err) {
    float mean, std;
    q3_weight_init(e->is_norm, &mean, &std);
    const int64_t n = q3_weight_entry_numel(e);
    if (e->storage == Q3_WS_LAYER) {
        q3_fill_random_from(data, dtype, n, seed, e->stream, e->first, mean, std);
        return Q3_OK;
    }
    if (e->storage == Q3_WS_QWEIGHT) { /* the dense draws of the matrix, quantized by RTN */
        const int64_t N = e->matrix_dims[0], K = e->matrix_dims[1];
        float *w = q3_alloc((size_t)(N * K) * sizeof *w);
        if (!w) return q3_fail(err, Q3_ERR_NOMEM, "%s: out of memory for its %lld fp32 draws", e->name,
                               (long long)(N * K));
        q3_fill_random_from(w, Q3_F32, N * K, seed, e->stream, e->first, mean, std);
        q3_int4_quantize_rtn(w, N, K, q3_gptq_group(gptq_group, K), gptq_v2 ? 0 : 1, data, side[1], side[0],
                             side[2]);
        q3_free(w);
        return Q3_OK;
    }
    if (e->storage != Q3_WS_E4M3 || n <= 0) return Q3_OK; /* beside a matrix: drawn with it */
    /* each matrix [rows, K] of the tensor quantized on its own, from its elements of the stream */
    const int64_t K = e->dims[e->rank - 1], rows = e->matrix_rows, count = n / (rows * K);
    const int64_t blocks = ((rows + 127) / 128) * ((K + 127) / 128);
    float *scale = side[0];
    for (int64_t i = 0; i < count; i++)
        q3_fill_random_fp8((uint8_t *)data + i * rows * K, scale + i * blocks, rows, K, seed, e->stream,
                           e->first + i * rows * K, mean, std);
    return Q3_OK;
}

q3_status q3_weight_table_new(const q3_config *cfg, q3_weights *w, int fused, const void **expert_ptrs,
                              q3_weight_entry **out, int64_t *n, q3_error *err) {
    *out = NULL;
    size_t bytes;
    q3_status s = q3_weight_table(cfg, w, fused, NULL, NULL, 0, n, err);
    if (s != Q3_OK) return s;
    if (!q3_mul_size((size_t)*n, sizeof **out, &bytes) || !(*out = q3_alloc(bytes)))
        return q3_fail(err, Q3_ERR_NOMEM, "weight table: out of memory for %lld entries", (long long)*n);
    memset(*out, 0, bytes);
    s = q3_weight_table(cfg, w, fused, expert_ptrs, *out, *n, n, err);
    if (s != Q3_OK) {
        q3_free(*out);
        *out = NULL;
    }
    return s;
}

q3_status q3_weight_table_layout(const q3_weight_entry *table, int64_t n, q3_dtype dt, q3_dtype scale_dt,
                                 int64_t *offsets, int64_t *bytes, q3_error *err) {
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        const q3_weight_entry *e = &table[i];
        int64_t size;
        if (!q3_numel(e->rank, e->dims, &size) ||
            !q3_mul_i64(size, (int64_t)q3_dtype_size(q3_weight_storage_dtype(e->storage, dt, scale_dt)), &size))
            return q3_fail(err, Q3_ERR_VALUE, "weight table: %s's size overflows int64", e->name);
        offsets[i] = at; /* a multiple of 64: the end of the one before, rounded up */
        if (!q3_add_i64(at, size, &at) || !q3_add_i64(at, (64 - at % 64) % 64, &at))
            return q3_fail(err, Q3_ERR_VALUE, "weight table: the layer's tensors together overflow int64 bytes");
    }
    *bytes = at;
    return Q3_OK;
}

q3_status q3_weight_table_fill_random(const q3_weight_entry *table, int64_t n, void *const *data, q3_dtype dt,
                                      uint64_t seed, int64_t gptq_group, int gptq_v2, q3_error *err) {
    q3_status s = Q3_OK;
    /* a matrix's side tensors (scale; GPTQ scales, qzeros, g_idx) are the entries after it,
     * filled with it; an entry beside a matrix fills nothing */
    for (int64_t i = 0; s == Q3_OK && i < n; i++)
        if (table[i].of < 0)
            s = q3_weight_fill_random(&table[i], data[i], q3_weight_storage_dtype(table[i].storage, dt, Q3_F32),
                                      i + 1 < n ? &data[i + 1] : NULL, seed, gptq_group, gptq_v2, err);
    return s;
}

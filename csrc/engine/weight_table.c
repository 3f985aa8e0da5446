/* The one table of a layer's tensors (q3.h's q3_weight_table): for each weight format, the
 * checkpoint names a layer reads, their shapes and storage, and where each pointer goes in
 * q3_weights; and the random draws DecoderLayer.random fills each with (q3_weight_fill_random).
 * A format is its rows here: the storage of its matrices and what stands beside each. */
#include <stdio.h>
#include <string.h>

#include "q3.h"

/* what a format stores for a projection matrix: its own storage, and its scale beside it */
typedef struct {
    const char *name;         /* q3_weight_format_name's */
    q3_weight_storage matrix; /* of q/k/v/o_proj and the experts' gate/up/down_proj */
    const char *scale_suffix; /* the name of its scale: the matrix's + this; NULL: none */
    q3_dense_weight dtype_of; /* the weight whose dtype a layer takes when given none */
} format_row;

static const format_row formats[] = {
    [Q3_WF_DENSE] = {"dense", Q3_WS_LAYER, NULL, Q3_W_Q_PROJ},
    [Q3_WF_FP8_BLOCK128] = {"fp8_e4m3_block128", Q3_WS_E4M3, "_scale_inv", Q3_W_INPUT_NORM},
};
#define N_FORMATS ((int)(sizeof formats / sizeof formats[0]))

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

/* a projection matrix (rank 2, or fused experts [E, rows, K] of `parts` matrices a row of
 * E) and, where the format has one, its scale right after it; the random draws of its
 * elements: stream `stream` from element `first` */
static void add_matrix(table *t, const char *name, int rank, const int64_t *dims, int64_t parts, const void **slot,
                       const void **scale_slot, uint64_t stream, int64_t first) {
    q3_weight_entry *m = add(t, t->fmt->matrix, rank, dims, slot);
    const int64_t rows = dims[rank - 2] / parts, K = dims[rank - 1];
    if (m) {
        snprintf(m->name, sizeof m->name, "%s", name);
        m->stream = stream;
        m->first = first;
        m->matrix_rows = rows;
    }
    if (!t->fmt->scale_suffix) return;
    int64_t sdims[3];
    memcpy(sdims, dims, (size_t)rank * sizeof *dims);
    sdims[rank - 2] = parts * ((rows + 127) / 128); /* each matrix's 128-row blocks, stacked */
    sdims[rank - 1] = (K + 127) / 128;
    q3_weight_entry *s = add(t, Q3_WS_SCALE, rank, sdims, scale_slot);
    if (s) {
        snprintf(s->name, sizeof s->name, "%s%s", name, t->fmt->scale_suffix);
        s->of = m ? t->n - 2 : -1;
    }
}

q3_status q3_weight_table(const q3_config *cfg, q3_weights *w, int fused, const void **expert_ptrs,
                          q3_weight_entry *out, int64_t max, int64_t *n, q3_error *err) {
    char list[128];
    if ((unsigned)w->format >= (unsigned)N_FORMATS)
        return q3_fail(err, Q3_ERR_VALUE, "weight_format: expected %s, got %d", q3_weight_format_list(list, sizeof list),
                       (int)w->format);
    table t = {out, 0, max, &formats[w->format]};
    const int scaled = t.fmt->scale_suffix != NULL;
    for (int i = 0; i < Q3_W_DENSE_COUNT && !w->experts_only; i++) {
        int64_t dims[2];
        const int rank = q3_dense_weight_shape(cfg, (q3_dense_weight)i, dims);
        const char *name = q3_dense_weight_name((q3_dense_weight)i);
        if (q3_dense_weight_is_matrix((q3_dense_weight)i)) {
            add_matrix(&t, name, 2, dims, 1, &w->dense[i], &w->dense_scale[i], (uint64_t)i, 0);
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
        add_matrix(&t, q3_fused_expert_name(Q3_FUSED_GATE_UP), 3, gate_up, 2, &w->fused[Q3_FUSED_GATE_UP],
                   &w->fused_scales[Q3_FUSED_GATE_UP], 100, 0);
        add_matrix(&t, q3_fused_expert_name(Q3_FUSED_DOWN), 3, down, 1, &w->fused[Q3_FUSED_DOWN],
                   &w->fused_scales[Q3_FUSED_DOWN], 101, 0);
    } else { /* expert e's matrices are the draws of its part of the fused tensors */
        for (int e = 0; e < E; e++)
            for (int x = 0; x < Q3_X_COUNT && (!w->held || w->held[e]); x++) {
                char name[Q3_WEIGHT_NAME_MAX];
                int64_t dims[2];
                snprintf(name, sizeof name, "mlp.experts.%d.%s.weight", e, q3_expert_weight_name((q3_expert_weight)x));
                q3_expert_weight_shape(cfg, (q3_expert_weight)x, dims);
                const int64_t first = x == Q3_X_DOWN ? e * H * I : e * 2 * I * H + (x == Q3_X_UP ? I * H : 0);
                const void **slot = expert_ptrs ? &expert_ptrs[x * E + e] : NULL;
                add_matrix(&t, name, 2, dims, 1, slot, expert_ptrs ? slot + Q3_X_COUNT * E : NULL,
                           x == Q3_X_DOWN ? 101 : 100, first);
            }
        for (int x = 0; x < Q3_X_COUNT && expert_ptrs; x++) {
            w->experts[x] = expert_ptrs + (size_t)x * E;
            w->expert_scales[x] = scaled ? expert_ptrs + (size_t)(Q3_X_COUNT + x) * E : NULL;
        }
    }
    *n = t.n;
    if (out && t.n > max)
        return q3_fail(err, Q3_ERR_VALUE, "weight table: %lld entries, room for %lld", (long long)t.n,
                       (long long)max);
    return Q3_OK;
}

int64_t q3_weight_entry_numel(const q3_weight_entry *e) {
    int64_t n;
    return q3_numel(e->rank, e->dims, &n) ? n : -1;
}

void q3_weight_fill_random(const q3_weight_entry *e, void *data, q3_dtype dtype, float *scale, uint64_t seed) {
    float mean, std;
    q3_weight_init(e->is_norm, &mean, &std);
    const int64_t n = q3_weight_entry_numel(e);
    if (e->storage == Q3_WS_LAYER) {
        q3_fill_random_from(data, dtype, n, seed, e->stream, e->first, mean, std);
        return;
    }
    if (e->storage != Q3_WS_E4M3 || n <= 0) return; /* a scale: drawn with its matrix */
    /* each matrix [rows, K] of the tensor quantized on its own, from its elements of the stream */
    const int64_t K = e->dims[e->rank - 1], rows = e->matrix_rows, count = n / (rows * K);
    const int64_t blocks = ((rows + 127) / 128) * ((K + 127) / 128);
    for (int64_t i = 0; i < count; i++)
        q3_fill_random_fp8((uint8_t *)data + i * rows * K, scale + i * blocks, rows, K, seed, e->stream,
                           e->first + i * rows * K, mean, std);
}

/* A layer made from a caller's tensors by name (q3_layer_load): the weight format and the
 * layer's dtype read from the tensors where the caller names neither, the engine's table of
 * the tensors the layer reads (weight_table.c), and each tensor taken as its storage says:
 * borrowed where the kernels can read it as it is, else copied once, now (converted to the
 * dtype its storage asks, or uploaded to the layer's device: q3_weight_view_use decides). The
 * layer keeps what it borrowed and owns its copies until q3_layer_destroy. With copy_weights
 * (a host layer) nothing is borrowed: every tensor is copied into one block the layer owns,
 * laid out as q3_weight_table_layout says, so that a checkpoint's mapping (4 KiB pages of the
 * page cache) or a caller's small tensors are read from huge pages. The caller (the glue) only
 * imports a tensor by name; every decision and check is here. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device_backend.h"
#include "layer_object.h"

/* a tensor of the table as the layer reads it: its name, the pointer, whether it is a copy */
typedef struct {
    char name[Q3_WEIGHT_NAME_MAX];
    const void *ptr;
    int converted;
} weight_record;

struct q3_weight_holdings {
    void (*release)(q3_view *v); /* the importer's, for the borrowed views */
    q3_view *views;              /* [n_views] borrowed: the kernels read them as they are */
    int64_t n_views;
    void **copies;               /* [n_copies] the layer's own: host (q3_alloc) or device memory */
    int64_t n_copies;
    int device;                  /* where the copies live */
    weight_record *records;      /* [n_records] in the table's order */
    int64_t n_records;
};

void q3_weight_holdings_free(q3_weight_holdings *h) {
    if (!h) return;
    for (int64_t i = 0; i < h->n_views; i++) h->release(&h->views[i]);
    for (int64_t i = 0; i < h->n_copies; i++) {
        if (h->device < 0) q3_free(h->copies[i]);
        else if (q3_device()) q3_device()->free(h->copies[i]);
    }
    free(h->views);
    free(h->copies);
    free(h->records);
    free(h);
}

/* the load under way: the caller's source and arguments, the table, what is held so far */
typedef struct {
    const q3_weight_source *src;
    const q3_layer_load_args *a;
    q3_weights w;
    q3_weight_entry *table;
    int64_t n;
    const void **expert_ptrs; /* [Q3_EXPERT_PTR_ARRAYS * Q3_X_COUNT * E]: the table's slots */
    q3_weight_holdings *h;
    char *block;              /* copy_weights: the one block (h->copies[0]), entry i at block + at[i] */
    int64_t *at;              /* [n] */
} load;

/* src's import of `name` (present) into *v; Q3_ERR_CALLER when the importer failed (its own
 * error stands) */
static q3_status import(const load *ld, const char *name, const char *arg, int allow, q3_view *v, q3_error *err) {
    memset(v, 0, sizeof *v);
    if (ld->src->import(ld->src->ctx, name, arg, ld->a->device, allow, v) == 0) return Q3_OK;
    err->status = Q3_ERR_CALLER;
    snprintf(err->msg, sizeof err->msg, "%s: the caller's import failed", arg);
    return Q3_ERR_CALLER;
}

/* the dtype of tensor `name` imported as `allow` lets */
static q3_status dtype_of(const load *ld, const char *name, int allow, q3_dtype *dt, q3_error *err) {
    if (!ld->src->has(ld->src->ctx, name)) return q3_fail(err, Q3_ERR_VALUE, "weights: missing '%s'", name);
    char arg[Q3_WEIGHT_NAME_MAX + 16];
    snprintf(arg, sizeof arg, "weights['%s']", name);
    q3_view v;
    const q3_status s = import(ld, name, arg, allow, &v, err);
    if (s != Q3_OK) return s;
    *dt = v.dtype;
    ld->src->release(&v);
    return Q3_OK;
}

/* The format (the caller's, else the one self_attn.q_proj.weight's dtype shows) and the
 * layer's dtype (the caller's, else the dtype of the format's weight for it: q_proj's, or in
 * the FP8 format input_layernorm's, which the norms and the router keep) into ld->w. */
static q3_status format_and_dtype(load *ld, q3_error *err) {
    const int allow_host = Q3_VIEW_HOST;
    q3_status s = Q3_OK;
    if (ld->a->format) {
        ld->w.format = *ld->a->format;
    } else {
        q3_dtype q_dt;
        s = dtype_of(ld, q3_dense_weight_name(Q3_W_Q_PROJ), allow_host | Q3_VIEW_E4M3, &q_dt, err);
        ld->w.format = q3_weight_format_of(q_dt);
    }
    if (s == Q3_OK && ld->a->dtype) ld->w.dtype = *ld->a->dtype;
    else if (s == Q3_OK)
        s = dtype_of(ld, q3_dense_weight_name(q3_weight_format_dtype_source(ld->w.format)), allow_host, &ld->w.dtype,
                     err);
    if (s == Q3_OK && !q3_dtype_is_float(ld->w.dtype))
        return q3_fail(err, Q3_ERR_TYPE, "dtype: expected float32, bfloat16 or float16, got %s",
                       q3_dtype_name(ld->w.dtype));
    return s;
}

/* Q3_OK when scale entry e is given; else Q3_ERR_VALUE naming its matrix */
static q3_status scale_given(const load *ld, const q3_weight_entry *e, q3_error *err) {
    if (ld->src->has(ld->src->ctx, e->name)) return Q3_OK;
    return q3_fail(err, Q3_ERR_VALUE, "weights['%s']: an FP8 weight without its scale: missing '%s'",
                   e->of >= 0 ? ld->table[e->of].name : "?", e->name);
}

/* The table for the weights' format and the caller's experts into ld (its slots in ld->w and
 * ld->expert_ptrs), and the scale dtype: that of the table's first scale (self_attn.q_proj's,
 * or an expert-only layer's first held expert's), fp32 where the format has none. */
static q3_status build_table(load *ld, const q3_config *cfg, q3_error *err) {
    const int fused = ld->src->has(ld->src->ctx, q3_fused_expert_name(Q3_FUSED_GATE_UP));
    const size_t slots = (size_t)Q3_EXPERT_PTR_ARRAYS * Q3_X_COUNT * (size_t)cfg->experts;
    q3_status s = q3_weight_table(cfg, &ld->w, fused, NULL, NULL, 0, &ld->n, err);
    if (s != Q3_OK) return s;
    ld->table = calloc((size_t)ld->n, sizeof *ld->table);
    ld->expert_ptrs = calloc(slots, sizeof *ld->expert_ptrs);
    ld->h->views = calloc((size_t)ld->n, sizeof *ld->h->views);
    ld->h->copies = calloc((size_t)ld->n, sizeof *ld->h->copies);
    ld->h->records = calloc((size_t)ld->n, sizeof *ld->h->records);
    if (!ld->table || !ld->expert_ptrs || !ld->h->views || !ld->h->copies || !ld->h->records)
        return q3_fail(err, Q3_ERR_NOMEM, "weights: out of memory for the table of %lld tensors", (long long)ld->n);
    s = q3_weight_table(cfg, &ld->w, fused, ld->expert_ptrs, ld->table, ld->n, &ld->n, err);
    ld->w.scale_dtype = Q3_F32;
    for (int64_t i = 0; s == Q3_OK && i < ld->n; i++)
        if (ld->table[i].storage == Q3_WS_SCALE) {
            s = scale_given(ld, &ld->table[i], err);
            return s == Q3_OK ? dtype_of(ld, ld->table[i].name, Q3_VIEW_HOST, &ld->w.scale_dtype, err) : s;
        }
    return s;
}

/* A CUDA layer holding a subset of the experts uploads only its experts, and a fused host
 * tensor holds every one: refused (a fused tensor already on the device is borrowed whole). */
static q3_status fused_on_device(const load *ld, const q3_weight_entry *e, const q3_view *v, int experts,
                                 q3_error *err) {
    const int fused = !strcmp(e->name, q3_fused_expert_name(Q3_FUSED_GATE_UP)) ||
                      !strcmp(e->name, q3_fused_expert_name(Q3_FUSED_DOWN));
    if (!fused || !ld->a->held || ld->a->device < 0 || v->device >= 0) return Q3_OK;
    return q3_fail(err, Q3_ERR_VALUE, "%s: a CUDA layer holding a subset of the experts takes host experts per "
                   "expert (mlp.experts.{e}.*.weight, only the held ones uploaded), got the fused host tensor of all "
                   "%d", e->name, experts);
}

/* bytes at src (on src_device) copied once to the layer's device into *out */
static q3_status upload(const load *ld, const char *arg, const void *src, int src_device, size_t bytes, void **out,
                        q3_error *err) {
    const q3_device_backend *d = q3_device();
    if (!d) return q3_fail(err, Q3_ERR_STATE, "%s: the CUDA backend is not loaded", arg);
    q3_error why;
    if (d->upload(out, ld->a->device, src, src_device, bytes, &why) == Q3_OK) return Q3_OK;
    return q3_fail(err, Q3_ERR_NOMEM, "%s: cannot copy %zu bytes to %scuda:%d: %s", arg, bytes,
                   src_device >= 0 ? "an aligned block on " : "", ld->a->device, why.msg);
}

/* Table entry e (stored as dt) taken into *ptr: borrowed, uploaded or converted as
 * q3_weight_view_use decides; a copy is the layer's from now on. */
static q3_status take(load *ld, const q3_weight_entry *e, q3_dtype dt, int experts, const void **ptr, int *copied,
                      q3_error *err) {
    char arg[Q3_WEIGHT_NAME_MAX + 16];
    snprintf(arg, sizeof arg, "weights['%s']", e->name);
    if (!ld->src->has(ld->src->ctx, e->name)) return q3_fail(err, Q3_ERR_VALUE, "weights: missing '%s'", e->name);
    const int allow = Q3_VIEW_HOST | (dt == Q3_E4M3 ? Q3_VIEW_E4M3 : dt == Q3_I32 ? Q3_VIEW_I32
                                      : dt == Q3_F16 ? Q3_VIEW_F16 : 0);
    q3_view *v = &ld->h->views[ld->h->n_views];
    q3_status s = import(ld, e->name, arg, allow, v, err);
    if (s != Q3_OK) return s;
    const q3_device_backend *d = q3_device();
    q3_weight_use use = Q3_WEIGHT_BORROW;
    s = q3_view_check_shape(v, arg, e->rank, e->dims, err);
    if (s == Q3_OK) s = fused_on_device(ld, e, v, experts, err);
    if (s == Q3_OK) s = q3_weight_view_use(v, dt, ld->a->device, d ? d->weight_align : 16, arg, &use, err);
    if (s == Q3_OK && use == Q3_WEIGHT_BORROW && !ld->block) {
        ld->h->n_views++;
        *ptr = v->data;
        return Q3_OK;
    }
    const size_t bytes = (size_t)q3_weight_entry_numel(e) * q3_dtype_size(dt);
    void *copy = NULL;
    if (s == Q3_OK && use == Q3_WEIGHT_UPLOAD) { /* to the layer's device as it is */
        s = upload(ld, arg, v->data, v->device, bytes, &copy, err);
    } else if (s == Q3_OK && !(copy = ld->block ? ld->block + ld->at[e - ld->table] : q3_alloc(bytes))) {
        s = q3_fail(err, Q3_ERR_NOMEM, "%s: out of memory for its copy of %zu bytes", arg, bytes);
    } else if (s == Q3_OK) { /* on the host (copy_weights: into the layer's block), without the caller's lock */
        void *token = ld->src->unlock ? ld->src->unlock(ld->src->ctx) : NULL;
        if (use == Q3_WEIGHT_BORROW) memcpy(copy, v->data, bytes); /* copy_weights: contiguous, of dt */
        else q3_copy_strided(copy, dt, v->data, v->dtype, e->rank, v->shape, v->strides);
        if (ld->src->relock) ld->src->relock(ld->src->ctx, token);
        if (ld->a->device >= 0) { /* a host weight for a CUDA layer: uploaded once, now */
            void *host = copy;
            s = upload(ld, arg, host, -1, bytes, &copy, err);
            q3_free(host);
        }
    }
    ld->src->release(v);
    if (s != Q3_OK) return s;
    if (!ld->block) ld->h->copies[ld->h->n_copies++] = copy; /* the block is copies[0] */
    *ptr = copy;
    *copied = 1;
    return Q3_OK;
}

/* copy_weights: the block every entry of the table is copied into (the layer's first copy) */
static q3_status make_block(load *ld, q3_error *err) {
    int64_t bytes;
    if (!(ld->at = calloc((size_t)ld->n, sizeof *ld->at)))
        return q3_fail(err, Q3_ERR_NOMEM, "copy_weights: out of memory for the layout of %lld tensors", (long long)ld->n);
    q3_status s = q3_weight_table_layout(ld->table, ld->n, ld->w.dtype, ld->w.scale_dtype, ld->at, &bytes, err);
    if (s == Q3_OK && !(ld->block = q3_alloc((size_t)bytes))) /* (an absurd size too: q3_alloc's NULL) */
        s = q3_fail(err, Q3_ERR_NOMEM, "copy_weights: out of memory for the layer's block of %lld bytes",
                    (long long)bytes);
    if (s == Q3_OK) ld->h->copies[ld->h->n_copies++] = ld->block;
    return s;
}

q3_status q3_layer_load(q3_layer **out, const q3_config *cfg, const q3_layer_load_args *a, const q3_weight_source *src,
                        q3_error *err) {
    *out = NULL;
    if (a->experts_only && (a->device >= 0 || !a->dtype || !a->format))
        return q3_fail(err, Q3_ERR_VALUE, "experts_only: an expert-only layer is a host layer (device=-1) given its "
                       "dtype and weight_format (it has no q_proj to read them from), got device=%d, dtype=%s, "
                       "weight_format=%s", a->device, a->dtype ? q3_dtype_name(*a->dtype) : "None",
                       a->format ? q3_weight_format_name(*a->format) : "None");
    if (a->copy_weights && a->device >= 0)
        return q3_fail(err, Q3_ERR_VALUE, "copy_weights: a host layer's option (device=-1: a CUDA layer's weights "
                       "are copied to its device anyway), got device=%d", a->device);
    if (a->device >= 0 && !q3_device())
        return q3_fail(err, Q3_ERR_STATE, "device=%d: the CUDA backend is not loaded", a->device);
    q3_status s = Q3_OK;
    load ld = {.src = src, .a = a, .h = calloc(1, sizeof *ld.h)};
    if (!ld.h) return q3_fail(err, Q3_ERR_NOMEM, "layer: out of memory");
    *ld.h = (q3_weight_holdings){.release = src->release, .device = a->device};
    ld.w = (q3_weights){.device = a->device, .held = a->held, .experts_only = a->experts_only,
                        .gptq_group = a->gptq_group, .gptq_v2 = a->gptq_v2,
                        .gptq_dense_attention = a->gptq_dense_attention};
    s = format_and_dtype(&ld, err);
    if (s == Q3_OK) s = build_table(&ld, cfg, err);
    if (s == Q3_OK && a->copy_weights) s = make_block(&ld, err);
    for (int64_t i = 0; s == Q3_OK && i < ld.n; i++) {
        const q3_weight_entry *e = &ld.table[i];
        weight_record *r = &ld.h->records[ld.h->n_records];
        if (e->storage == Q3_WS_SCALE) s = scale_given(&ld, e, err);
        if (s == Q3_OK)
            s = take(&ld, e, q3_weight_storage_dtype(e->storage, ld.w.dtype, ld.w.scale_dtype), cfg->experts, &r->ptr,
                     &r->converted, err);
        if (s != Q3_OK) break;
        snprintf(r->name, sizeof r->name, "%s", e->name);
        *e->slot = r->ptr;
        ld.h->n_records++;
    }
    if (s == Q3_OK) s = q3_layer_create(out, cfg, &ld.w, err); /* copies the pointer arrays and the mask */
    free(ld.table);
    free(ld.expert_ptrs);
    free(ld.at);
    if (s != Q3_OK) {
        q3_weight_holdings_free(ld.h);
        return s;
    }
    (*out)->holdings = ld.h;
    return Q3_OK;
}

int64_t q3_layer_weight_count(const q3_layer *l) { return l->holdings ? l->holdings->n_records : 0; }

const char *q3_layer_weight(const q3_layer *l, int64_t i, const void **ptr, int *converted) {
    const weight_record *r = &l->holdings->records[i];
    *ptr = r->ptr;
    *converted = r->converted;
    return r->name;
}

q3_dtype q3_layer_scale_dtype(const q3_layer *l) { return l->w.scale_dtype; }

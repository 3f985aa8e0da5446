/* The engine's table of a layer's tensors (weight_table), random weights and inputs in extension
 * memory (random_weights, random_tensor) and the dequantization of an FP8 or GPTQ matrix
 * (dequantize_fp8, dequantize_int4): qwen3layer._C module functions. */
#include "py_glue.h"

/* The engine's weight table (*table, q3_free'd by the caller; *n entries) of the layer of config
 * cfg_obj with the experts of experts_obj held (None: every one; else w->held, the caller's to
 * PyMem_Free), the rest as w says; fused < 0: fused where every expert is held. 0, or -1. */
static int table_of(PyObject *cfg_obj, PyObject *experts_obj, q3_weights *w, int fused, q3_weight_entry **table,
                    int64_t *n) {
    q3_config c;
    uint8_t *held = NULL;
    q3_error err;
    if (q3_parse_config(cfg_obj, &c) < 0 || (experts_obj != Py_None && q3py_held_experts(experts_obj, c.experts, &held) < 0))
        return -1;
    w->held = held;
    return q3py_status(q3_weight_table_new(&c, w, fused < 0 ? !held : fused, NULL, table, n, &err), &err);
}

/* weight_table(config, ...): the engine's table as [(name, shape, storage, of)]: storage 'layer',
 * 'e4m3', 'scale', 'qweight', 'gscales', 'qzeros' or 'g_idx' (q3_weight_storage_name), of the
 * index of the matrix an entry stands beside (else -1) */
static PyObject *weight_table(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"config", "weight_format", "experts", "fused", "experts_only", "gptq_group",
                            "gptq_dense_attention", NULL};
    PyObject *cfg_obj, *experts_obj = Py_None, *out = NULL;
    q3_weights w = {.format = Q3_WF_DENSE};
    int fused = 0;
    long long gptq_group = 0;
    q3_weight_entry *table = NULL;
    int64_t n = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O&Opp$Lp:weight_table", names, &cfg_obj, q3py_weight_format,
                                     &w.format, &experts_obj, &fused, &w.experts_only, &gptq_group,
                                     &w.gptq_dense_attention))
        return NULL;
    w.gptq_group = gptq_group;
    if (table_of(cfg_obj, experts_obj, &w, fused, &table, &n) == 0) out = PyList_New((Py_ssize_t)n);
    for (int64_t i = 0; out && i < n; i++) {
        const q3_weight_entry *e = &table[i];
        PyObject *row = Py_BuildValue("(sNsL)", e->name, q3py_int64s(e->dims, e->rank, 0),
                                      q3_weight_storage_name(e->storage), (long long)e->of); /* N: the shape's taken */
        if (!row) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, row);
    }
    q3_free(table);
    PyMem_Free((void *)w.held);
    return out;
}

/* Every tensor of the engine's weight table for the layer into a new dict by name, views of one
 * block (q3_weight_table_layout: huge pages for all), then drawn as the table says
 * (q3_weight_table_fill_random: the stream layout is the engine's; a quantized matrix with what
 * stands beside it). NULL with an exception. */
static PyObject *random_table(q3_module_state *st, const q3_weight_entry *table, int64_t n, q3_dtype dt,
                              uint64_t seed, const q3_weights *w) {
    void **data = PyMem_Calloc((size_t)n + 1, sizeof *data + sizeof(int64_t)); /* and the n + 1 offsets after */
    int64_t *at = data ? (int64_t *)(data + n + 1) : NULL, words, strides[Q3_MAX_DIM];
    q3_error err;
    q3_status s = data ? q3_weight_table_layout(table, n, dt, Q3_F32, at, &at[n], &err) : q3_fail(&err, Q3_ERR_NOMEM, "no memory");
    q3py_tensor_object *block = s == Q3_OK ? q3py_tensor_new(st, Q3_I32, 1, (words = at[n] / 4 + 1, &words)) : NULL;
    PyObject *d = block ? PyDict_New() : NULL;
    for (int64_t i = 0; d && i < n; i++) {
        const q3_weight_entry *e = &table[i];
        const q3_dtype sdt = q3_weight_storage_dtype(e->storage, dt, Q3_F32);
        q3_contiguous_strides(e->rank, e->dims, q3_dtype_size(sdt), strides); /* fits: the layout did */
        PyObject *t = (PyObject *)q3py_tensor_view(st, (PyObject *)block, data[i] = (char *)block->data + at[i], sdt,
                                                   e->rank, e->dims, strides);
        if (!t || PyDict_SetItemString(d, e->name, t) < 0) Py_CLEAR(d);
        Py_XDECREF(t);
    }
    if (d) Q3PY_NOGIL(s = q3_weight_table_fill_random(table, n, data, dt, seed, w->gptq_group, w->gptq_v2, &err));
    if (q3py_status(s, &err) < 0) Py_CLEAR(d);
    Py_XDECREF(block);
    PyMem_Free(data);
    return d;
}

static PyObject *random_weights(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"config", "seed", "dtype", "weight_format", "experts", "gptq_group", "gptq_v2",
                            "gptq_dense_attention", NULL};
    PyObject *cfg_obj, *experts_obj = Py_None;
    unsigned long long seed;
    q3_dtype dt;
    q3_weight_format wf = Q3_WF_DENSE; /* weight_format=None */
    long long gptq_group = 0;
    int gptq_v2 = 0, dense_attention = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OKO&|O&O$Lpp:random_weights", names, &cfg_obj, &seed, q3py_dtype, &dt,
                                     q3py_weight_format, &wf, &experts_obj, &gptq_group, &gptq_v2, &dense_attention))
        return NULL;
    /* every expert: fused as transformers 5.x holds them; a subset: per expert, the held ones */
    q3_weights w = {.dtype = dt, .format = wf, .gptq_group = gptq_group, .gptq_v2 = gptq_v2,
                    .gptq_dense_attention = dense_attention};
    q3_weight_entry *table = NULL;
    int64_t n;
    PyObject *d = NULL;
    if (table_of(cfg_obj, experts_obj, &w, -1, &table, &n) == 0) d = random_table(q3py_state(m), table, n, dt, seed, &w);
    q3_free(table);
    PyMem_Free((void *)w.held);
    return d;
}

static PyObject *random_tensor(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"shape", "seed", "dtype", "std", NULL};
    q3py_shape shape = {.min_ndim = 1};
    unsigned long long seed;
    q3_dtype dt;
    float std = 1.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&KO&|f:random_tensor", names, q3py_shape_arg, &shape, &seed,
                                     q3py_dtype, &dt, &std))
        return NULL;
    q3py_tensor_object *t = q3py_tensor_new(q3py_state(m), dt, shape.ndim, shape.dims);
    if (!t) return NULL;
    int64_t n;
    q3_numel(shape.ndim, shape.dims, &n); /* fits: the tensor was made */
    Q3PY_NOGIL(q3_fill_random(t->data, dt, n, seed, 0, 0.0f, std));
    return (PyObject *)t;
}

/* dequantize_fp8(weight, scale_inv, parts=1): the fp32 weights of a host FP8 weight, its shapes
 * checked by the engine (q3_dequantize_fp8_check: weight [.., parts n, K] float8_e4m3fn,
 * scale_inv [.., parts ceil(n/128), ceil(K/128)] fp32 or bf16, both contiguous) */
static PyObject *dequantize_fp8(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"weight", "scale_inv", "parts", NULL};
    q3py_arg_view v[2] = {{.arg = "weight", .allow = Q3_VIEW_HOST | Q3_VIEW_E4M3},
                          {.arg = "scale_inv", .allow = Q3_VIEW_HOST}};
    const q3_view *w = &v[0].view, *s = &v[1].view;
    int parts = 1;
    q3_error err;
    q3py_tensor_object *t = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|i:dequantize_fp8", names, &v[0].obj, &v[1].obj, &parts)) return NULL;
    if (q3py_views_acquire(v, 2, -1, NULL) == 0 && q3py_status(q3_dequantize_fp8_check(w, s, parts, &err), &err) == 0 &&
        (t = q3py_tensor_new(q3py_state(m), Q3_F32, w->ndim, w->shape)))
        Q3PY_NOGIL(q3_dequantize_fp8_views(t->data, w, s, parts));
    q3py_views_release(v, 2);
    return (PyObject *)t;
}

/* dequantize_int4(qweight, qzeros, scales, g_idx, gptq_v2=False): the fp32 W [N, K] of a host
 * GPTQ matrix, checked by the engine (q3_dequantize_int4_check) */
static PyObject *dequantize_int4(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"qweight", "qzeros", "scales", "g_idx", "gptq_v2", NULL};
    const int host_i32 = Q3_VIEW_HOST | Q3_VIEW_I32;
    q3py_arg_view v[4] = {{.arg = "qweight", .allow = host_i32}, {.arg = "qzeros", .allow = host_i32},
                          {.arg = "scales", .allow = Q3_VIEW_HOST | Q3_VIEW_F16}, {.arg = "g_idx", .allow = host_i32}};
    int v2 = 0;
    q3_error err;
    q3py_tensor_object *t = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|p:dequantize_int4", names, &v[0].obj, &v[1].obj, &v[2].obj,
                                     &v[3].obj, &v2))
        return NULL;
    if (q3py_views_acquire(v, 4, -1, NULL) == 0 &&
        q3py_status(q3_dequantize_int4_check(&v[0].view, &v[1].view, &v[2].view, &v[3].view, &err), &err) == 0 &&
        (t = q3py_tensor_new(q3py_state(m), Q3_F32, 2, (int64_t[2]){v[0].view.shape[1], 8 * v[0].view.shape[0]})))
        Q3PY_NOGIL(q3_dequantize_int4_views(t->data, &v[0].view, &v[1].view, &v[2].view, &v[3].view, v2));
    q3py_views_release(v, 4);
    return (PyObject *)t;
}

PyMethodDef q3_random_methods[] = {
    {"weight_table", (PyCFunction)(void (*)(void))weight_table, METH_VARARGS | METH_KEYWORDS,
     "weight_table(config, weight_format=None, experts=None, fused=False, experts_only=False, *, gptq_group=0, "
     "gptq_dense_attention=False)\n--\n\n"
     "The engine's table of the tensors a layer reads, in order: [(name, shape, storage, of)], storage 'layer' (the "
     "layer's dtype), 'e4m3', 'scale' (the scale dtype), 'qweight', 'gscales', 'qzeros' or 'g_idx' (GPTQ int4; "
     "gptq_group 0: 128, -1: one group a matrix; gptq_dense_attention: q/k/v/o_proj in the layer's dtype); of: the index of the matrix an entry stands beside, else -1. "
     "fused: the experts as transformers 5.x fuses them, else per expert (experts: the held ones)."},
    {"random_tensor", (PyCFunction)(void (*)(void))random_tensor, METH_VARARGS | METH_KEYWORDS,
     "random_tensor(shape, seed, dtype, std=1.0)\n--\n\nA Tensor of N(0, std^2) samples in extension memory."},
    {"random_weights", (PyCFunction)(void (*)(void))random_weights, METH_VARARGS | METH_KEYWORDS,
     "random_weights(config, seed, dtype, weight_format=None, experts=None, *, gptq_group=0, gptq_v2=False, "
     "gptq_dense_attention=False)\n--\n\n"
     "Dict of random weights, views of one block of extension memory (fused expert names; with experts=, a list of"
     " expert ids, those experts' per-expert tensors only, each equal to its part of the fused ones), "
     "deterministic in seed. weight_format 'fp8_e4m3_block128': the projection matrices as float8_e4m3fn with fp32"
     " *_scale_inv block scales, quantized from the dense draws of the same seed; 'gptq_int4': the same draws "
     "quantized by RTN into the GPTQ tensors (per expert; gptq_group 0: 128, -1: one group a matrix; gptq_v2: "
     "zeros stored as they are; gptq_dense_attention: q/k/v/o_proj left dense, the dense draws)."},
    {"dequantize_int4", (PyCFunction)(void (*)(void))dequantize_int4, METH_VARARGS | METH_KEYWORDS,
     "dequantize_int4(qweight, qzeros, scales, g_idx, gptq_v2=False)\n--\n\nThe float32 weight [N, K] of a host GPTQ "
     "matrix (qweight int32 [K/8, N], qzeros int32 [groups, N/8], scales float16 [groups, N], g_idx int32 [K]): "
     "scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]), a zero the stored value + 1 unless gptq_v2."},
    {"dequantize_fp8", (PyCFunction)(void (*)(void))dequantize_fp8, METH_VARARGS | METH_KEYWORDS,
     "dequantize_fp8(weight, scale_inv, parts=1)\n--\n\nfp32 Tensor of a block-scaled float8_e4m3fn weight "
     "[.., parts*n, K] (parts > 1: stacked matrices with their own blocks, e.g. a fused gate_up_proj: 2)."},
    {NULL},
};

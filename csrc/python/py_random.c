/* Random weights and inputs in extension memory (random_weights, random_tensor) and the
 * dequantization of an FP8 matrix (dequantize_fp8): qwen3layer._C module functions.
 *
 * random_weights in the FP8 format holds the projection matrices as the fine-grained FP8
 * checkpoints do (kernels/fp8.h), experts fused as in transformers 5.x: gate_up_proj
 * [E, 2I, H] e4m3 with gate_up_proj_scale_inv [E, 2 ceil(I/128), ceil(H/128)] fp32 (the
 * gate's blocks, then the up's), down_proj [E, H, I] with [E, ceil(H/128), ceil(I/128)];
 * q/k/v/o_proj.weight [N, K] with .weight_scale_inv [ceil(N/128), ceil(K/128)]. */
#include <string.h>

#include "py_glue.h"

static q3_module_state *state_of(PyObject *m) { return (q3_module_state *)PyModule_GetState(m); }

static int put(PyObject *dict, const char *name, q3py_tensor_object *t) {
    const int rc = PyDict_SetItemString(dict, name, (PyObject *)t);
    Py_DECREF(t);
    return rc;
}

/* weights[name] of `shape`: elements [first, first + its size) of the stream */
static int put_random(q3_module_state *st, PyObject *dict, const char *name, q3_dtype dt, int ndim,
                      const int64_t *shape, uint64_t seed, uint64_t stream, int64_t first, int is_norm) {
    q3py_tensor_object *t = q3py_tensor_new(st, dt, ndim, shape);
    if (!t) return -1;
    int64_t n;
    q3_numel(ndim, shape, &n); /* fits: the tensor was made */
    float mean, std;
    q3_weight_init(is_norm, &mean, &std);
    Py_BEGIN_ALLOW_THREADS
    q3_fill_random_from(t->data, dt, n, seed, stream, first, mean, std);
    Py_END_ALLOW_THREADS
    return put(dict, name, t);
}

/* weights[name] [M, parts * n, K] e4m3 and weights[name + "_scale_inv"] [M, parts * ceil(n/128),
 * ceil(K/128)] fp32 (rank 2 without M): M x parts matrices [n, K], each the quantized draws
 * of the dense tensor's elements under the same (seed, stream), from element `first` on */
static int put_random_fp8(q3_module_state *st, PyObject *dict, const char *name, int rank, int64_t M, int parts,
                          int64_t n, int64_t K, uint64_t seed, uint64_t stream, int64_t first) {
    const int64_t dims[2] = {n, K};
    int64_t blocks[2]; /* of one matrix [n, K] */
    q3_fp8_scale_shape(dims, blocks);
    const int64_t shape[3] = {M, parts * n, K}, sshape[3] = {M, parts * blocks[0], blocks[1]};
    q3py_tensor_object *w = q3py_tensor_new(st, Q3_E4M3, rank, shape + 3 - rank);
    if (!w) return -1;
    q3py_tensor_object *s = q3py_tensor_new(st, Q3_F32, rank, sshape + 3 - rank);
    if (!s) {
        Py_DECREF(w);
        return -1;
    }
    float mean, std;
    q3_weight_init(0, &mean, &std);
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < M * parts; i++)
        q3_fill_random_fp8((uint8_t *)w->data + i * n * K, (float *)s->data + i * blocks[0] * blocks[1], n, K, seed, stream,
                           first + i * n * K, mean, std);
    Py_END_ALLOW_THREADS
    char scale_name[128];
    snprintf(scale_name, sizeof scale_name, "%s_scale_inv", name);
    if (put(dict, name, w) < 0) {
        Py_DECREF(s);
        return -1;
    }
    return put(dict, scale_name, s);
}

/* expert e's three matrices by name (mlp.experts.{e}.{gate,up,down}_proj.weight, and FP8
 * scales), each the draws of its part of the fused tensors: gate and up of expert e are
 * elements [e 2I H, + I H) and [+ I H, + I H) of stream 100, down [e H I, + H I) of 101 */
static int put_random_expert(q3_module_state *st, PyObject *d, const q3_config *c, int e, q3_dtype dt, int fp8,
                             uint64_t seed) {
    const int64_t H = c->hidden, I = c->moe_inter;
    for (int x = 0; x < Q3_X_COUNT; x++) {
        char name[96];
        snprintf(name, sizeof name, "mlp.experts.%d.%s.weight", e, q3_expert_weight_name(x));
        int64_t dims[2];
        q3_expert_weight_shape(c, x, dims);
        const uint64_t stream = x == Q3_X_DOWN ? 101 : 100;
        const int64_t first = x == Q3_X_DOWN ? e * H * I : e * 2 * I * H + (x == Q3_X_UP ? I * H : 0);
        if ((fp8 ? put_random_fp8(st, d, name, 2, 1, 1, dims[0], dims[1], seed, stream, first)
                 : put_random(st, d, name, dt, 2, dims, seed, stream, first, 0)) < 0)
            return -1;
    }
    return 0;
}

static PyObject *random_weights(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"config", "seed", "dtype", "weight_format", "experts", NULL};
    PyObject *cfg_obj, *experts_obj = Py_None;
    unsigned long long seed;
    q3_dtype dt;
    q3_weight_format wf = Q3_WF_DENSE; /* weight_format=None */
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OKO&|O&O:random_weights", names, &cfg_obj, &seed, q3py_dtype, &dt,
                                     q3py_weight_format, &wf, &experts_obj))
        return NULL;
    q3_config c;
    if (q3_parse_config(cfg_obj, &c) < 0) return NULL;
    uint8_t *held = NULL;
    if (experts_obj != Py_None && q3py_held_experts(experts_obj, c.experts, &held) < 0) return NULL;
    const int fp8 = wf == Q3_WF_FP8_BLOCK128;
    q3_module_state *st = state_of(m);
    PyObject *d = PyDict_New();
    if (!d) {
        PyMem_Free(held);
        return NULL;
    }
    for (int i = 0; i < Q3_W_DENSE_COUNT; i++) {
        int64_t dims[2];
        const int rank = q3_dense_weight_shape(&c, i, dims);
        const char *name = q3_dense_weight_name(i);
        const int rc = fp8 && q3_dense_weight_is_matrix(i)
                           ? put_random_fp8(st, d, name, 2, 1, 1, dims[0], dims[1], seed, (uint64_t)i, 0)
                           : put_random(st, d, name, dt, rank, dims, seed, (uint64_t)i, 0, rank == 1);
        if (rc < 0) goto fail;
    }
    if (held) { /* a subset: per-expert tensors of the held experts only */
        for (int e = 0; e < c.experts; e++)
            if (held[e] && put_random_expert(st, d, &c, e, dt, fp8, seed) < 0) goto fail;
        PyMem_Free(held);
        return d;
    }
    const int64_t E = c.experts, H = c.hidden, I = c.moe_inter;
    if (fp8) {
        /* gate and up of expert e: elements [e 2I H, + I H) and [+ I H, + I H) of stream 100,
         * as in the dense fused tensor */
        if (put_random_fp8(st, d, "mlp.experts.gate_up_proj", 3, E, 2, I, H, seed, 100, 0) < 0 ||
            put_random_fp8(st, d, "mlp.experts.down_proj", 3, E, 1, H, I, seed, 101, 0) < 0)
            goto fail;
        return d;
    }
    const int64_t gu[3] = {E, 2 * I, H}, dn[3] = {E, H, I};
    if (put_random(st, d, "mlp.experts.gate_up_proj", dt, 3, gu, seed, 100, 0, 0) < 0 ||
        put_random(st, d, "mlp.experts.down_proj", dt, 3, dn, seed, 101, 0, 0) < 0)
        goto fail;
    return d;
fail:
    PyMem_Free(held);
    Py_DECREF(d);
    return NULL;
}

static PyObject *random_tensor(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"shape", "seed", "dtype", "std", NULL};
    PyObject *shape_obj, *dtype_obj;
    unsigned long long seed;
    float std = 1.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OKO|f:random_tensor", names, &shape_obj, &seed, &dtype_obj,
                                     &std))
        return NULL;
    q3_dtype dt;
    if (q3_parse_dtype(dtype_obj, "dtype", &dt) < 0) return NULL;
    PyObject *seq = PySequence_Fast(shape_obj, "shape: expected a sequence of ints");
    if (!seq) return NULL;
    const Py_ssize_t ndim = PySequence_Fast_GET_SIZE(seq);
    int64_t shape[Q3_MAX_DIM];
    int ok = ndim >= 1 && ndim <= Q3_MAX_DIM;
    for (Py_ssize_t d = 0; ok && d < ndim; d++) {
        shape[d] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, d));
        ok = shape[d] >= 0 && !PyErr_Occurred();
    }
    Py_DECREF(seq);
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "shape: expected 1 to %d non-negative ints", Q3_MAX_DIM);
        return NULL;
    }
    q3py_tensor_object *t = q3py_tensor_new(state_of(m), dt, (int)ndim, shape);
    if (!t) return NULL;
    int64_t n;
    q3_numel((int)ndim, shape, &n); /* fits: the tensor was made */
    Py_BEGIN_ALLOW_THREADS
    q3_fill_random(t->data, dt, n, seed, 0, 0.0f, std);
    Py_END_ALLOW_THREADS
    return (PyObject *)t;
}

/* dequantize_fp8(weight, scale_inv, parts=1): weight [.., parts n, K] float8_e4m3fn (host,
 * contiguous), scale_inv [.., parts ceil(n/128), ceil(K/128)] fp32 or bf16: each matrix of the
 * leading dims is `parts` matrices [n, K] stacked, each with its own blocks (a fused
 * gate_up_proj: parts = 2). Returns the fp32 weights, same shape, by q3_fp8_dequant_rows. */
static PyObject *dequantize_fp8(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"weight", "scale_inv", "parts", NULL};
    PyObject *w_obj, *s_obj;
    int parts = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|i:dequantize_fp8", names, &w_obj, &s_obj, &parts)) return NULL;
    q3_view w, s;
    if (q3_view_acquire_on(w_obj, "weight", &w, -1, Q3_VIEW_HOST | Q3_VIEW_E4M3, NULL) < 0) return NULL;
    if (q3_view_acquire_on(s_obj, "scale_inv", &s, -1, Q3_VIEW_HOST, NULL) < 0) {
        q3_view_release(&w);
        return NULL;
    }
    PyObject *out = NULL;
    char ws[96], ss[96];
    q3_format_shape(ws, sizeof ws, w.ndim, w.shape);
    q3_format_shape(ss, sizeof ss, s.ndim, s.shape);
    if (w.dtype != Q3_E4M3 || !w.contiguous || !s.contiguous || w.ndim < 2 || s.ndim != w.ndim) {
        PyErr_Format(PyExc_ValueError, "dequantize_fp8: expected a contiguous float8_e4m3fn weight of rank >= 2 "
                     "and a contiguous scale_inv of the same rank, got %s %s and %s %s", q3_dtype_name(w.dtype), ws,
                     q3_dtype_name(s.dtype), ss);
        goto done;
    }
    const int r = w.ndim;
    const int64_t rows = w.shape[r - 2], K = w.shape[r - 1];
    if (parts < 1 || rows % parts) {
        PyErr_Format(PyExc_ValueError, "parts: expected a positive divisor of the weight's rows (%lld), got %d",
                     (long long)rows, parts);
        goto done;
    }
    const int64_t n = rows / parts, dims[2] = {n, K};
    int64_t blocks[2]; /* of one matrix [n, K] */
    q3_fp8_scale_shape(dims, blocks);
    int ok = s.shape[r - 2] == parts * blocks[0] && s.shape[r - 1] == blocks[1];
    int64_t M = 1;
    for (int d = 0; d < r - 2; d++) {
        ok = ok && s.shape[d] == w.shape[d];
        M *= w.shape[d];
    }
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "scale_inv: expected the block shape of weight %s in %d part(s), got %s", ws,
                     parts, ss);
        goto done;
    }
    q3py_tensor_object *t = q3py_tensor_new(state_of(m), Q3_F32, r, w.shape);
    if (!t) goto done;
    Py_BEGIN_ALLOW_THREADS
    q3_dequantize_fp8(t->data, w.data, s.data, s.dtype, M * parts, n, K);
    Py_END_ALLOW_THREADS
    out = (PyObject *)t;
done:
    q3_view_release(&s);
    q3_view_release(&w);
    return out;
}

PyMethodDef q3_random_methods[] = {
    {"random_tensor", (PyCFunction)(void (*)(void))random_tensor, METH_VARARGS | METH_KEYWORDS,
     "random_tensor(shape, seed, dtype, std=1.0)\n--\n\nA Tensor of N(0, std^2) samples in extension memory."},
    {"random_weights", (PyCFunction)(void (*)(void))random_weights, METH_VARARGS | METH_KEYWORDS,
     "random_weights(config, seed, dtype, weight_format=None, experts=None)\n--\n\nDict of random weights in "
     "extension memory (fused expert names; with experts=, a list of expert ids, those experts' per-expert tensors "
     "only, each equal to its part of the fused ones), deterministic in seed. weight_format 'fp8_e4m3_block128': the projection matrices "
     "as float8_e4m3fn with fp32 *_scale_inv block scales, quantized from the dense draws of the same seed."},
    {"dequantize_fp8", (PyCFunction)(void (*)(void))dequantize_fp8, METH_VARARGS | METH_KEYWORDS,
     "dequantize_fp8(weight, scale_inv, parts=1)\n--\n\nfp32 Tensor of a block-scaled float8_e4m3fn weight "
     "[.., parts*n, K] (parts > 1: stacked matrices with their own blocks, e.g. a fused gate_up_proj: 2)."},
    {NULL},
};

/* q3_config from a qwen3layer.LayerConfig (its attributes, checked here for type and range
 * as far as the C field they go into needs, then by q3_config_check), and the module
 * functions rope_table(config), the RoPE table the engine builds a layer with, and
 * weight_table(config, ...) and weight_formats(), the engine's table of a layer's tensors. */
#include <math.h>
#include <string.h>

#include "py_glue.h"

/* config.<name>: an int in [1, max] */
static int get_int(PyObject *cfg, const char *name, int64_t max, int64_t *out) {
    PyObject *v = PyObject_GetAttrString(cfg, name);
    if (!v) return -1;
    int rc = 0;
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        PyErr_Format(PyExc_TypeError, "config.%s: expected an int, got %.100s", name, Py_TYPE(v)->tp_name);
        rc = -1;
    } else {
        int overflow = 0;
        *out = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (*out == -1 && PyErr_Occurred()) rc = -1;
        else if (overflow > 0 || *out > max) {
            PyErr_Format(PyExc_ValueError, "config.%s: expected at most %lld, got %S", name, (long long)max, v);
            rc = -1;
        } else if (overflow < 0 || *out <= 0) {
            PyErr_Format(PyExc_ValueError, "config.%s: expected a positive integer, got %S", name, v);
            rc = -1;
        }
    }
    Py_DECREF(v);
    return rc;
}

/* config.<name>: a real number (an int or a float, not a bool) */
static int get_float(PyObject *cfg, const char *name, double *out) {
    PyObject *v = PyObject_GetAttrString(cfg, name);
    if (!v) return -1;
    *out = PyBool_Check(v) ? -1.0 : PyFloat_AsDouble(v);
    if (PyBool_Check(v) || (*out == -1.0 && PyErr_Occurred())) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "config.%s: expected a number, got %.100s", name, Py_TYPE(v)->tp_name);
        Py_DECREF(v);
        return -1;
    }
    Py_DECREF(v);
    return 0;
}

/* config.<name>: a number, or None for `none` */
static int get_optional_float(PyObject *cfg, const char *name, double none, double *out) {
    PyObject *v = PyObject_GetAttrString(cfg, name);
    if (!v) return -1;
    const int is_none = v == Py_None;
    Py_DECREF(v);
    if (is_none) {
        *out = none;
        return 0;
    }
    return get_float(cfg, name, out);
}

static int get_bool(PyObject *cfg, const char *name, int *out) {
    PyObject *v = PyObject_GetAttrString(cfg, name);
    if (!v) return -1;
    *out = PyObject_IsTrue(v);
    Py_DECREF(v);
    return *out < 0 ? -1 : 0;
}

/* the RoPE variants the engine computes, by transformers' rope_type */
static const struct { const char *name; q3_rope_type type; } types[] = {
    {"default", Q3_ROPE_DEFAULT}, {"linear", Q3_ROPE_LINEAR}, {"yarn", Q3_ROPE_YARN}};

/* config.rope_type: the name of a variant the engine computes */
static int get_rope_type(PyObject *cfg, q3_rope_type *out) {    PyObject *v = PyObject_GetAttrString(cfg, "rope_type");
    if (!v) return -1;
    const char *name = PyUnicode_Check(v) ? PyUnicode_AsUTF8(v) : NULL;
    for (size_t i = 0; name && i < sizeof types / sizeof types[0]; i++)
        if (!strcmp(name, types[i].name)) {
            *out = types[i].type;
            Py_DECREF(v);
            return 0;
        }
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "config.rope_type: expected 'default', 'linear' or 'yarn', got %R", v);
    Py_DECREF(v);
    return -1;
}

/* the RoPE fields; None where the engine takes 0 for "unset" (q3_rope_scaling) */
static int get_rope(PyObject *cfg, q3_rope_scaling *r) {
    *r = Q3_ROPE_SCALING_DEFAULT;
    if (get_rope_type(cfg, &r->type) || get_float(cfg, "rope_factor", &r->factor) ||
        get_optional_float(cfg, "rope_attention_factor", 0.0, &r->attention_factor) ||
        get_float(cfg, "rope_beta_fast", &r->beta_fast) || get_float(cfg, "rope_beta_slow", &r->beta_slow) ||
        get_optional_float(cfg, "rope_mscale", 0.0, &r->mscale) ||
        get_optional_float(cfg, "rope_mscale_all_dim", 0.0, &r->mscale_all_dim) ||
        get_bool(cfg, "rope_truncate", &r->truncate))
        return -1;
    /* 0 is the engine's "derive it from factor and mscale": a given 0 would read so */
    PyObject *af = PyObject_GetAttrString(cfg, "rope_attention_factor");
    if (!af) return -1;
    const int zero = af != Py_None && !(r->attention_factor > 0) && !isnan(r->attention_factor);
    if (zero) PyErr_Format(PyExc_ValueError, "config.rope_attention_factor: expected a number > 0 or None, got %R", af);
    Py_DECREF(af);
    if (zero) return -1;
    PyObject *om = PyObject_GetAttrString(cfg, "rope_original_max_position_embeddings");
    if (!om) return -1;
    const int none = om == Py_None;
    Py_DECREF(om);
    return none ? 0 : get_int(cfg, "rope_original_max_position_embeddings", Q3_MAX_POSITIONS, &r->original_max);
}

int q3_parse_config(PyObject *cfg, q3_config *c) {
    int64_t hidden, heads, kvh, hd, E, k, I, maxpos;
    double eps, theta;
    /* the engine's limits (q3.h) checked here already: the counts become C ints */
    if (get_int(cfg, "hidden_size", Q3_MAX_HIDDEN, &hidden) ||
        get_int(cfg, "num_attention_heads", Q3_MAX_HEADS, &heads) ||
        get_int(cfg, "num_key_value_heads", Q3_MAX_HEADS, &kvh) || get_int(cfg, "head_dim", Q3_MAX_HEADS, &hd) ||
        get_int(cfg, "num_experts", Q3_MAX_EXPERTS, &E) || get_int(cfg, "num_experts_per_tok", Q3_MAX_EXPERTS, &k) ||
        get_int(cfg, "moe_intermediate_size", Q3_MAX_HIDDEN, &I) ||
        get_int(cfg, "max_position_embeddings", Q3_MAX_POSITIONS, &maxpos) ||
        get_float(cfg, "rms_norm_eps", &eps) || get_float(cfg, "rope_theta", &theta))
        return -1;
    int norm_topk;
    q3_rope_scaling rope;
    if (get_bool(cfg, "norm_topk_prob", &norm_topk) || get_rope(cfg, &rope)) return -1;
    *c = (q3_config){.hidden = hidden, .heads = (int)heads, .kv_heads = (int)kvh, .head_dim = (int)hd,
                     .experts = (int)E, .top_k = (int)k, .moe_inter = I, .norm_topk = norm_topk,
                     .eps = (float)eps, .rope_theta = theta, .max_positions = maxpos, .rope = rope};
    q3_error err;
    if (q3_config_check(c, &err) != Q3_OK) {
        q3_raise(NULL, &err);
        return -1;
    }
    return 0;
}

PyObject *q3py_rope_table(PyObject *m, PyObject *cfg) {
    (void)m;
    q3_config c;
    if (q3_parse_config(cfg, &c) < 0) return NULL;
    const int half = c.head_dim / 2;
    float *inv_freq = PyMem_Malloc((size_t)half * sizeof *inv_freq), scale;
    if (!inv_freq) return PyErr_NoMemory();
    q3_rope_table(&c, inv_freq, &scale);
    PyObject *table = PyTuple_New(half);
    for (int i = 0; table && i < half; i++) {
        PyObject *f = PyFloat_FromDouble((double)inv_freq[i]);
        if (!f) Py_CLEAR(table);
        else PyTuple_SET_ITEM(table, i, f);
    }
    PyMem_Free(inv_freq);
    if (!table) return NULL;
    return Py_BuildValue("(Nd)", table, (double)scale);
}

int q3py_weight_format(PyObject *obj, void *out) {
    if (obj == Py_None) return 1;
    const char *f = PyUnicode_Check(obj) ? PyUnicode_AsUTF8(obj) : NULL;
    q3_error err;
    if (f && q3_weight_format_parse(f, out, &err) == Q3_OK) return 1; /* the engine's table of formats */
    char list[128];
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "weight_format: expected None, %s, got %R", q3_weight_format_list(list, sizeof list),
                 obj);
    return 0;
}

/* the value of an optional field: 0 ("unset" to the engine) is None */
static PyObject *optional(double v, int is_int) {
    if (v == 0.0) Py_RETURN_NONE;
    return is_int ? PyLong_FromLongLong((long long)v) : PyFloat_FromDouble(v);
}

/* rope_defaults(): the RoPE fields of a LayerConfig at the engine's Q3_ROPE_SCALING_DEFAULT,
 * the values a variant that does not read a field leaves in it */
PyObject *q3py_rope_defaults(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    const q3_rope_scaling d = Q3_ROPE_SCALING_DEFAULT;
    const char *type = "?";
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (types[i].type == d.type) type = types[i].name;
    return Py_BuildValue("{sssdsNsNsdsdsNsNsO}", "rope_type", type, "rope_factor", d.factor,
                         "rope_original_max_position_embeddings", optional((double)d.original_max, 1),
                         "rope_attention_factor", optional(d.attention_factor, 0), "rope_beta_fast", d.beta_fast,
                         "rope_beta_slow", d.beta_slow, "rope_mscale", optional(d.mscale, 0), "rope_mscale_all_dim",
                         optional(d.mscale_all_dim, 0), "rope_truncate", d.truncate ? Py_True : Py_False);
}

/* the engine's weight table (q3_weight_table) as [(name, shape, storage, of)]: storage
 * 'layer', 'e4m3' or 'scale', of the index of a scale's matrix (else -1) */
PyObject *q3py_weight_table(PyObject *m, PyObject *args, PyObject *kw) {
    (void)m;
    static char *names[] = {"config", "weight_format", "experts", "fused", "experts_only", NULL};
    static const char *storage[] = {"layer", "e4m3", "scale"};
    PyObject *cfg_obj, *experts_obj = Py_None;
    q3_weight_format wf = Q3_WF_DENSE;
    int fused = 0, experts_only = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O&Opp:weight_table", names, &cfg_obj, q3py_weight_format, &wf,
                                     &experts_obj, &fused, &experts_only))
        return NULL;
    q3_config c;
    uint8_t *held = NULL;
    if (q3_parse_config(cfg_obj, &c) < 0 || (experts_obj != Py_None && q3py_held_experts(experts_obj, c.experts, &held) < 0))
        return NULL;
    q3_weights w = {.format = wf, .held = held, .experts_only = experts_only};
    q3_weight_entry *table = NULL;
    int64_t n = 0;
    q3_error err;
    PyObject *out = NULL;
    if (q3_weight_table(&c, &w, fused, NULL, NULL, 0, &n, &err) != Q3_OK ||
        !(table = PyMem_Calloc((size_t)n + 1, sizeof *table)) ||
        q3_weight_table(&c, &w, fused, NULL, table, n, &n, &err) != Q3_OK) {
        if (table) q3_raise(NULL, &err);
        else if (!PyErr_Occurred()) PyErr_NoMemory();
    } else {
        out = PyList_New((Py_ssize_t)n);
    }
    for (int64_t i = 0; out && i < n; i++) {
        const q3_weight_entry *e = &table[i];
        PyObject *shape = PyTuple_New(e->rank);
        for (int d = 0; shape && d < e->rank; d++) {
            PyObject *v = PyLong_FromLongLong(e->dims[d]);
            if (!v) Py_CLEAR(shape);
            else PyTuple_SET_ITEM(shape, d, v);
        }
        PyObject *row = shape ? Py_BuildValue("(sOsL)", e->name, shape, storage[e->storage], (long long)e->of) : NULL;
        Py_XDECREF(shape);
        if (!row) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, row);
    }
    PyMem_Free(table);
    PyMem_Free(held);
    return out;
}

PyObject *q3py_weight_formats(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    PyObject *out = PyTuple_New(q3_weight_format_count());
    for (int i = 0; out && i < q3_weight_format_count(); i++) {
        PyObject *name = PyUnicode_FromString(q3_weight_format_name((q3_weight_format)i));
        if (!name) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, i, name);
    }
    return out;
}

/* q3_config from a qwen3layer.LayerConfig: its attributes converted (as the engine's table of
 * them says, q3_config_field) and handed to q3_config_make, which checks them; and the module
 * functions rope_table(config) and rope_defaults(), the RoPE table the engine builds a layer with
 * and the RoPE fields it leaves unused. */
#include <math.h>

#include "py_glue.h"

/* attribute value v of field d (v not None; the engine's table says how it converts: q3.h,
 * q3_config_field) into *dst; 0, or -1 with the exception */
static int convert(PyObject *v, const q3_config_field_info *d, void *dst) {
    const char *name = d->name;
    if (d->type == Q3_FIELD_FLAG) return (*(int *)dst = PyObject_IsTrue(v)) < 0 ? -1 : 0;
    if (d->type == Q3_FIELD_ROPE_TYPE) {
        const char *s = PyUnicode_Check(v) ? PyUnicode_AsUTF8(v) : NULL;
        if (s && q3_rope_type_parse(s, dst, NULL) == Q3_OK) return 0; /* the engine's names */
        char list[64];
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "config.rope_type: expected %s, got %R", q3_rope_type_list(list, sizeof list),
                     v);
        return -1;
    }
    if (d->type == Q3_FIELD_COUNT) {
        int overflow = 0;
        if (!PyLong_Check(v) || PyBool_Check(v)) {
            PyErr_Format(PyExc_TypeError, "config.%s: expected an int, got %.100s", name, Py_TYPE(v)->tp_name);
            return -1;
        }
        *(int64_t *)dst = PyLong_AsLongLongAndOverflow(v, &overflow); /* past int64: q3_config_make's message */
        if (overflow > 0)
            PyErr_Format(PyExc_ValueError, "config.%s: expected at most %lld, got %S", name,
                         (long long)q3_config_count_max(d->count), v);
        else if (overflow < 0)
            PyErr_Format(PyExc_ValueError, "config.%s: expected a positive integer, got %S", name, v);
        return PyErr_Occurred() ? -1 : 0;
    }
    const double x = PyBool_Check(v) ? -1.0 : PyFloat_AsDouble(v);
    if (PyBool_Check(v) || (x == -1.0 && PyErr_Occurred())) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "config.%s: expected a number, got %.100s", name, Py_TYPE(v)->tp_name);
        return -1;
    }
    if (d->positive && !(x > 0) && !isnan(x)) { /* 0.0 would read as None: refused here, nan the engine names */
        PyErr_Format(PyExc_ValueError, "config.%s: expected a number > 0 or None, got %R", name, v);
        return -1;
    }
    *(double *)dst = x;
    return 0;
}

int q3_parse_config(PyObject *cfg, q3_config *c) {
    q3_config_values v = {.rope = Q3_ROPE_SCALING_DEFAULT};
    for (int f = 0; f < Q3_CONFIG_FIELDS; f++) {
        const q3_config_field_info *d = q3_config_field(f);
        PyObject *attr = PyObject_GetAttrString(cfg, d->name);
        const int none = attr == Py_None && d->none_ok;
        const int rc = !attr ? -1 : none ? 0 : convert(attr, d, (char *)&v + d->at);
        q3_config_field_given(&v, f, !none);
        Py_XDECREF(attr);
        if (rc < 0) return -1;
    }
    q3_error err;
    return q3py_status(q3_config_make(&v, c, &err), &err);
}

PyObject *q3py_rope_table(PyObject *m, PyObject *cfg) {
    q3_config c;
    if (q3_parse_config(cfg, &c) < 0) return NULL;
    const int half = c.head_dim / 2;
    float inv_freq[Q3_MAX_HEADS / 2], scale; /* head_dim <= Q3_MAX_HEADS: 8 KiB */
    q3_rope_table(&c, inv_freq, &scale);
    PyObject *table = PyTuple_New(half);
    for (int i = 0; table && i < half; i++) {
        PyObject *f = PyFloat_FromDouble((double)inv_freq[i]);
        if (!f) Py_CLEAR(table);
        else PyTuple_SET_ITEM(table, i, f);
    }
    return table ? Py_BuildValue("(Nd)", table, (double)scale) : NULL;
}

/* rope_defaults(): the RoPE fields of a LayerConfig (the engine's table's) at the engine's
 * Q3_ROPE_SCALING_DEFAULT, the values a variant that does not read a field leaves in it:
 * converted back, the engine's "unset" as None */
PyObject *q3py_rope_defaults(PyObject *m, PyObject *unused) {
    const q3_config_values v = {.rope = Q3_ROPE_SCALING_DEFAULT};
    PyObject *out = PyDict_New();
    for (int f = 0; out && f < Q3_CONFIG_FIELDS; f++) {
        const q3_config_field_info *d = q3_config_field(f);
        const char *at = (const char *)&v + d->at;
        if (!d->rope) continue;
        PyObject *x = q3_config_field_unset(&v, f) ? Py_NewRef(Py_None)
                      : d->type == Q3_FIELD_ROPE_TYPE ? PyUnicode_FromString(q3_rope_type_name(*(const q3_rope_type *)at))
                      : d->type == Q3_FIELD_FLAG      ? PyBool_FromLong(*(const int *)at)
                      : d->type == Q3_FIELD_COUNT     ? PyLong_FromLongLong(*(const int64_t *)at)
                                                      : PyFloat_FromDouble(*(const double *)at);
        if (!x || PyDict_SetItemString(out, d->name, x) < 0) Py_CLEAR(out);
        Py_XDECREF(x);
    }
    return out;
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

int q3py_held_experts(PyObject *obj, int E, uint8_t **held) {
    int64_t n;
    int64_t *ids = q3py_index_list(obj, "experts", &n);
    q3_error err;
    if (ids && !(*held = PyMem_Calloc((size_t)E, 1))) PyErr_NoMemory();
    else if (ids && q3py_status(q3_held_from_ids(ids, n, E, *held, &err), &err) < 0) PyMem_Free(*held);
    const int failed = !ids || PyErr_Occurred();
    PyMem_Free(ids);
    if (failed) *held = NULL;
    return failed ? -1 : 0;
}

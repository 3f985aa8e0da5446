/* q3_config from a qwen3layer.LayerConfig: its attributes converted (by the table below) and
 * handed to q3_config_make, which checks them; and the module functions rope_table(config), the
 * RoPE table the engine builds a layer with, and weight_table(config, ...) and weight_formats(),
 * the engine's table of a layer's tensors. */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "py_glue.h"

/* How an attribute converts: COUNT an int (not a bool) into an int64 count, checked by the
 * engine; NUMBER a real (an int or a float, not a bool); *_OR_NONE also None: an unset count, or
 * 0.0, the engine's "unset" for a number (so a given POSITIVE_OR_NONE number must not read so:
 * refused here unless > 0, or nan, which the engine names); FLAG any object's truth; ROPE_TYPE a
 * variant's name. */
typedef enum { COUNT, COUNT_OR_NONE, NUMBER, NUMBER_OR_NONE, POSITIVE_OR_NONE, FLAG, ROPE_TYPE } field_kind;

#define AT(f) offsetof(q3_config_values, f)
#define COUNT_FIELD(i, kind) {NULL, kind, AT(counts[i]), i}
/* the attributes in the order they are read (a count's name is the engine's) */
static const struct {
    const char *name;
    field_kind kind;
    size_t at; /* in q3_config_values */
    int count; /* a count's Q3_CF_* index */
} fields[] = {
    COUNT_FIELD(Q3_CF_HIDDEN, COUNT), COUNT_FIELD(Q3_CF_HEADS, COUNT), COUNT_FIELD(Q3_CF_KV_HEADS, COUNT),
    COUNT_FIELD(Q3_CF_HEAD_DIM, COUNT), COUNT_FIELD(Q3_CF_EXPERTS, COUNT), COUNT_FIELD(Q3_CF_TOP_K, COUNT),
    COUNT_FIELD(Q3_CF_MOE_INTER, COUNT), COUNT_FIELD(Q3_CF_MAX_POSITIONS, COUNT),
    {"rms_norm_eps", NUMBER, AT(eps), 0}, {"rope_theta", NUMBER, AT(rope_theta), 0},
    {"norm_topk_prob", FLAG, AT(norm_topk), 0}, {"rope_type", ROPE_TYPE, AT(rope.type), 0},
    {"rope_factor", NUMBER, AT(rope.factor), 0},
    {"rope_attention_factor", POSITIVE_OR_NONE, AT(rope.attention_factor), 0},
    {"rope_beta_fast", NUMBER, AT(rope.beta_fast), 0}, {"rope_beta_slow", NUMBER, AT(rope.beta_slow), 0},
    {"rope_mscale", NUMBER_OR_NONE, AT(rope.mscale), 0},
    {"rope_mscale_all_dim", NUMBER_OR_NONE, AT(rope.mscale_all_dim), 0},
    {"rope_truncate", FLAG, AT(rope.truncate), 0}, COUNT_FIELD(Q3_CF_ROPE_ORIGINAL_MAX, COUNT_OR_NONE),
};

/* attribute value v of field f into *dst (v not None); 0, or -1 with the exception */
static int convert(PyObject *v, int f, const char *name, void *dst) {
    const field_kind kind = fields[f].kind;
    if (kind == FLAG) return (*(int *)dst = PyObject_IsTrue(v)) < 0 ? -1 : 0;
    if (kind == ROPE_TYPE) {
        const char *s = PyUnicode_Check(v) ? PyUnicode_AsUTF8(v) : NULL;
        if (s && q3_rope_type_parse(s, dst, NULL) == Q3_OK) return 0; /* the engine's names */
        char list[64];
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "config.rope_type: expected %s, got %R", q3_rope_type_list(list, sizeof list),
                     v);
        return -1;
    }
    if (kind == COUNT || kind == COUNT_OR_NONE) {
        int overflow = 0;
        if (!PyLong_Check(v) || PyBool_Check(v)) {
            PyErr_Format(PyExc_TypeError, "config.%s: expected an int, got %.100s", name, Py_TYPE(v)->tp_name);
            return -1;
        }
        *(int64_t *)dst = PyLong_AsLongLongAndOverflow(v, &overflow); /* past int64: q3_config_make's message */
        if (overflow > 0)
            PyErr_Format(PyExc_ValueError, "config.%s: expected at most %lld, got %S", name,
                         (long long)q3_config_count_max(fields[f].count), v);
        else if (overflow < 0)
            PyErr_Format(PyExc_ValueError, "config.%s: expected a positive integer, got %S", name, v);
        return PyErr_Occurred() ? -1 : 0;
    }
    const double d = PyBool_Check(v) ? -1.0 : PyFloat_AsDouble(v);
    if (PyBool_Check(v) || (d == -1.0 && PyErr_Occurred())) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "config.%s: expected a number, got %.100s", name, Py_TYPE(v)->tp_name);
        return -1;
    }
    if (kind == POSITIVE_OR_NONE && !(d > 0) && !isnan(d)) {
        PyErr_Format(PyExc_ValueError, "config.%s: expected a number > 0 or None, got %R", name, v);
        return -1;
    }
    *(double *)dst = d;
    return 0;
}

int q3_parse_config(PyObject *cfg, q3_config *c) {
    q3_config_values v = {.rope = Q3_ROPE_SCALING_DEFAULT};
    for (int f = 0; f < (int)(sizeof fields / sizeof fields[0]); f++) {
        const char *name = fields[f].name ? fields[f].name : q3_config_count_name(fields[f].count);
        PyObject *attr = PyObject_GetAttrString(cfg, name);
        if (!attr) return -1;
        const field_kind kind = fields[f].kind;
        const int none =
            attr == Py_None && (kind == COUNT_OR_NONE || kind == NUMBER_OR_NONE || kind == POSITIVE_OR_NONE);
        const int rc = none ? 0 : convert(attr, f, name, (char *)&v + fields[f].at);
        if (kind == COUNT_OR_NONE) v.original_max_given = !none;
        else if (none) *(double *)((char *)&v + fields[f].at) = 0.0;
        Py_DECREF(attr);
        if (rc < 0) return -1;
    }
    q3_error err;
    if (q3_config_make(&v, c, &err) != Q3_OK) {
        q3_raise(NULL, &err);
        return -1;
    }
    return 0;
}

PyObject *q3py_rope_table(PyObject *m, PyObject *cfg) {
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

/* rope_defaults(): the RoPE fields of a LayerConfig (the table's, from rope_type on) at the
 * engine's Q3_ROPE_SCALING_DEFAULT, the values a variant that does not read a field leaves in
 * it: converted back, the engine's "unset" as None */
PyObject *q3py_rope_defaults(PyObject *m, PyObject *unused) {
    const q3_config_values v = {.rope = Q3_ROPE_SCALING_DEFAULT};
    PyObject *out = PyDict_New();
    for (int f = 0, rope = 0; out && f < (int)(sizeof fields / sizeof fields[0]); f++) {
        const char *at = (const char *)&v + fields[f].at;
        const field_kind kind = fields[f].kind;
        const double d = kind == NUMBER || kind == NUMBER_OR_NONE || kind == POSITIVE_OR_NONE ? *(const double *)at : 0;
        if (!(rope |= kind == ROPE_TYPE)) continue;
        PyObject *x = kind == ROPE_TYPE ? PyUnicode_FromString(q3_rope_type_name(*(const q3_rope_type *)at))
                      : kind == FLAG    ? PyBool_FromLong(*(const int *)at)
                      : kind == COUNT_OR_NONE ? (v.rope.original_max ? PyLong_FromLongLong(v.rope.original_max)
                                                                      : Py_NewRef(Py_None))
                      : kind == NUMBER || d != 0.0 ? PyFloat_FromDouble(d) : Py_NewRef(Py_None);
        const char *name = fields[f].name ? fields[f].name : q3_config_count_name(fields[f].count);
        if (!x || PyDict_SetItemString(out, name, x) < 0) Py_CLEAR(out);
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

/* the engine's weight table (q3_weight_table) as [(name, shape, storage, of)]: storage
 * 'layer', 'e4m3', 'scale', 'qweight', 'gscales', 'qzeros' or 'g_idx' (q3_weight_storage_name),
 * of the index of the matrix an entry stands beside (else -1) */
PyObject *q3py_weight_table(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"config", "weight_format", "experts", "fused", "experts_only", "gptq_group",
                            "gptq_dense_attention", NULL};
    PyObject *cfg_obj, *experts_obj = Py_None;
    q3_weight_format wf = Q3_WF_DENSE;
    int fused = 0, experts_only = 0, dense_attention = 0;
    long long gptq_group = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O&Opp$Lp:weight_table", names, &cfg_obj, q3py_weight_format, &wf,
                                     &experts_obj, &fused, &experts_only, &gptq_group, &dense_attention))
        return NULL;
    q3_config c;
    uint8_t *held = NULL;
    if (q3_parse_config(cfg_obj, &c) < 0 || (experts_obj != Py_None && q3py_held_experts(experts_obj, c.experts, &held) < 0))
        return NULL;
    q3_weights w = {.format = wf, .held = held, .experts_only = experts_only, .gptq_group = gptq_group,
                    .gptq_dense_attention = dense_attention};
    q3_weight_entry *table;
    int64_t n = 0;
    q3_error err;
    PyObject *out = q3py_status(q3_weight_table_new(&c, &w, fused, NULL, &table, &n, &err), &err) < 0
                        ? NULL : PyList_New((Py_ssize_t)n);
    for (int64_t i = 0; out && i < n; i++) {
        const q3_weight_entry *e = &table[i];
        PyObject *row = Py_BuildValue("(sNsL)", e->name, q3py_int64s(e->dims, e->rank, 0),
                                      q3_weight_storage_name(e->storage), (long long)e->of); /* N: the shape's taken */
        if (!row) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, row);
    }
    q3_free(table);
    PyMem_Free(held);
    return out;
}

PyObject *q3py_weight_formats(PyObject *m, PyObject *unused) {
    PyObject *out = PyTuple_New(q3_weight_format_count());
    for (int i = 0; out && i < q3_weight_format_count(); i++) {
        PyObject *name = PyUnicode_FromString(q3_weight_format_name((q3_weight_format)i));
        if (!name) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, i, name);
    }
    return out;
}

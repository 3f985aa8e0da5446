/* _C.still_held: the drop-in's per-call test that what a patched layer's C layer reads of the
 * transformers layer it replaced is still what it was (qwen3layer.torch.held.HeldWeights.held).
 * Written as Python maps it cost several times as much; what is left is mostly torch's methods
 * (~3 us for a layer's 11 parameters in a decode run, Zen 4, 2026-12-06). It knows nothing of
 * torch: it reads data_ptr(), dtype, is_contiguous() and _version by name and compares them with
 * the values taken when the layer was patched. */
#include "py_glue.h"

/* 1 when obj.name (called when `call`) equals want (identity when `same`), 0 when not, -1 on an error */
static int attr_is(PyObject *obj, PyObject *name, int call, PyObject *want, int same) {
    PyObject *now = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
    if (!now) return -1;
    const int eq = same ? now == want : PyObject_RichCompareBool(now, want, Py_EQ);
    Py_DECREF(now);
    return eq;
}

#define WATCH_PARTS 9

/* watch: (dicts, keys, objects, tensors, data_ptrs, dtypes, contiguous, copied, versions), tuples:
 * dicts[i].get(keys[i]) is objects[i] (each submodule and parameter where it was: a dict
 * subclass is read as dict.get reads it, without its overrides); tensors[i].data_ptr() ==
 * data_ptrs[i], .dtype is dtypes[i], .is_contiguous() is contiguous[i]; copied[i]._version ==
 * versions[i]. True when every one holds; an exception a tensor's method raises is raised. */
static PyObject *still_held(PyObject *m, PyObject *watch) {
    PyObject *const *names = q3py_state(m)->held_names;  /* data_ptr, dtype, is_contiguous, _version */
    if (!PyTuple_Check(watch) || PyTuple_GET_SIZE(watch) != WATCH_PARTS)
        return PyErr_Format(PyExc_TypeError, "still_held: expected a tuple of %d tuples, got %R", WATCH_PARTS, watch);
    PyObject *part[WATCH_PARTS];
    for (int i = 0; i < WATCH_PARTS; i++) {
        part[i] = PyTuple_GET_ITEM(watch, i);
        if (!PyTuple_Check(part[i]))
            return PyErr_Format(PyExc_TypeError, "still_held: part %d: expected a tuple, got %s", i,
                                Py_TYPE(part[i])->tp_name);
    }
    const Py_ssize_t held = PyTuple_GET_SIZE(part[0]), tensors = PyTuple_GET_SIZE(part[3]),
                     copied = PyTuple_GET_SIZE(part[7]);
    if (PyTuple_GET_SIZE(part[1]) != held || PyTuple_GET_SIZE(part[2]) != held ||
        PyTuple_GET_SIZE(part[4]) != tensors || PyTuple_GET_SIZE(part[5]) != tensors ||
        PyTuple_GET_SIZE(part[6]) != tensors || PyTuple_GET_SIZE(part[8]) != copied)
        return PyErr_Format(PyExc_ValueError, "still_held: parts of unequal lengths in %R", watch);
    for (Py_ssize_t i = 0; i < held; i++) {
        PyObject *d = PyTuple_GET_ITEM(part[0], i);
        if (!PyDict_Check(d))
            return PyErr_Format(PyExc_TypeError, "still_held: dicts[%zd]: expected a dict, got %s", i,
                                Py_TYPE(d)->tp_name);
        PyObject *now = PyDict_GetItemWithError(d, PyTuple_GET_ITEM(part[1], i));  /* borrowed */
        if (!now && PyErr_Occurred()) return NULL;
        if (now != PyTuple_GET_ITEM(part[2], i)) Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < tensors; i++) {
        PyObject *t = PyTuple_GET_ITEM(part[3], i);
        int eq = attr_is(t, names[0], 1, PyTuple_GET_ITEM(part[4], i), 0);
        if (eq > 0) eq = attr_is(t, names[1], 0, PyTuple_GET_ITEM(part[5], i), 1);
        if (eq > 0) eq = attr_is(t, names[2], 1, PyTuple_GET_ITEM(part[6], i), 1);
        if (eq < 0) return NULL;
        if (!eq) Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < copied; i++) {
        const int eq = attr_is(PyTuple_GET_ITEM(part[7], i), names[3], 0, PyTuple_GET_ITEM(part[8], i), 0);
        if (eq < 0) return NULL;
        if (!eq) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

int q3py_held_init(q3_module_state *st) {
    static const char *const names[4] = {"data_ptr", "dtype", "is_contiguous", "_version"};
    for (int i = 0; i < 4; i++)
        if (!(st->held_names[i] = PyUnicode_InternFromString(names[i]))) return -1;
    return 0;
}

PyMethodDef q3_held_methods[] = {
    {"still_held", still_held, METH_O,
     "still_held(watch)\n--\n\nwatch: (dicts, keys, objects, tensors, data_ptrs, dtypes, contiguous, copied, "
     "versions), tuples. True when dicts[i].get(keys[i]) is objects[i], tensors[i].data_ptr() == data_ptrs[i], "
     ".dtype is dtypes[i] and .is_contiguous() is contiguous[i], and copied[i]._version == versions[i], for every i."},
    {NULL},
};

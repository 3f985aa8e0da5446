/* _C.still_held: the drop-in's per-call test that what a patched layer's C layer reads of the
 * transformers layer it replaced is still what it was (qwen3layer.torch.held.HeldWeights.held).
 * It knows nothing of torch: the caller hands it the readers, torch's own descriptors of the
 * tensor base class (data_ptr, dtype, is_contiguous, _version), which it calls directly, as
 * the attribute look-up would find them but without the look-up (~2.0 -> ~1.8 us for a layer's
 * 11 parameters read again and again; ~3 us in a decode run, where the tensors are cold: torch's
 * methods and the memory they read are what is left; Zen 4, 2026-12-06). */
#include "py_glue.h"

/* 1 when reader(t) (a method descriptor called on t alone, or a getset descriptor read on t,
 * each checking t's class) equals want (identity when `same`), 0 when not, -1 on an error */
static int read_is(PyObject *reader, PyObject *t, PyObject *want, int same) {
    descrgetfunc get = Py_TYPE(reader)->tp_descr_get;
    PyObject *now = Py_TYPE(reader)->tp_descr_set && get ? get(reader, t, (PyObject *)Py_TYPE(t))
                                                         : PyObject_Vectorcall(reader, &t, 1, NULL);
    if (!now) return -1;
    const int eq = same ? now == want : PyObject_RichCompareBool(now, want, Py_EQ);
    Py_DECREF(now);
    return eq;
}

#define WATCH_PARTS 10

/* watch: (dicts, keys, objects, tensors, data_ptrs, dtypes, contiguous, copied, versions,
 * readers), tuples: dicts[i].get(keys[i]) is objects[i] (each submodule and parameter where it
 * was: a dict subclass is read as dict.get reads it, without its overrides); with readers the
 * tensor class's (data_ptr, dtype, is_contiguous, _version) descriptors, tensors[i].data_ptr()
 * == data_ptrs[i], .dtype is dtypes[i], .is_contiguous() is contiguous[i]; copied[i]._version
 * == versions[i]. True when every one holds; an exception a reader raises is raised. */
static PyObject *still_held(PyObject *m, PyObject *watch) {
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
        PyTuple_GET_SIZE(part[6]) != tensors || PyTuple_GET_SIZE(part[8]) != copied || PyTuple_GET_SIZE(part[9]) != 4)
        return PyErr_Format(PyExc_ValueError, "still_held: parts of unequal lengths (or not 4 readers) in %R", watch);
    PyObject *const *reader = &PyTuple_GET_ITEM(part[9], 0);  /* data_ptr, dtype, is_contiguous, _version */
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
        int eq = read_is(reader[0], t, PyTuple_GET_ITEM(part[4], i), 0);
        if (eq > 0) eq = read_is(reader[1], t, PyTuple_GET_ITEM(part[5], i), 1);
        if (eq > 0) eq = read_is(reader[2], t, PyTuple_GET_ITEM(part[6], i), 1);
        if (eq < 0) return NULL;
        if (!eq) Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < copied; i++) {
        const int eq = read_is(reader[3], PyTuple_GET_ITEM(part[7], i), PyTuple_GET_ITEM(part[8], i), 0);
        if (eq < 0) return NULL;
        if (!eq) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

PyMethodDef q3_held_methods[] = {
    {"still_held", still_held, METH_O,
     "still_held(watch)\n--\n\nwatch: (dicts, keys, objects, tensors, data_ptrs, dtypes, contiguous, copied, "
     "versions, readers), tuples, readers the tensor class's (data_ptr, dtype, is_contiguous, _version). True when "
     "dicts[i].get(keys[i]) is objects[i], tensors[i].data_ptr() == data_ptrs[i], .dtype is dtypes[i] and "
     ".is_contiguous() is contiguous[i], and copied[i]._version == versions[i], for every i."},
    {NULL},
};

/* The glue's shared conversions (py_convert.h): engine statuses to exceptions, dtype and MoE
 * path names. */
#include <string.h>

#include "py_glue.h"

PyObject *q3_raise(q3_module_state *st, const q3_error *err) {
    PyObject *type = PyExc_RuntimeError;
    switch (err->status) {
    case Q3_ERR_VALUE: type = PyExc_ValueError; break;
    case Q3_ERR_TYPE: type = PyExc_TypeError; break;
    case Q3_ERR_INDEX: type = PyExc_IndexError; break;
    case Q3_ERR_CACHE_FULL: type = st ? st->cache_full_error : PyExc_RuntimeError; break;
    case Q3_ERR_NOMEM: type = PyExc_MemoryError; break;
    default: break;
    }
    PyErr_SetString(type, err->msg);
    return NULL;
}

const char *q3_dtype_name(q3_dtype dt) {
    return dt == Q3_BF16 ? "bfloat16" : dt == Q3_E4M3 ? "float8_e4m3fn" : dt == Q3_I32 ? "int32" : "float32";
}

int q3_parse_dtype(PyObject *obj, const char *arg, q3_dtype *out) {
    const char *s = PyUnicode_Check(obj) ? PyUnicode_AsUTF8(obj) : NULL;
    if (s && (!strcmp(s, "float32") || !strcmp(s, "fp32"))) *out = Q3_F32;
    else if (s && (!strcmp(s, "bfloat16") || !strcmp(s, "bf16"))) *out = Q3_BF16;
    else {
        PyObject *r = PyObject_Repr(obj);
        PyErr_Format(PyExc_TypeError, "%s: expected 'float32' or 'bfloat16', got %S", arg, r);
        Py_XDECREF(r);
        return -1;
    }
    return 0;
}


const char *const q3_moe_path_names[Q3_MOE_PATHS] = {"per_expert_wmma", "per_expert_cublas", "grouped_wmma",
                                                     "grouped_cublas"};

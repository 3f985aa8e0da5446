/* _C.expert_counts: tokens per expert of one layer call, for qwen3layer.routing. The chosen
 * experts (a LayerTrace's experts, int32 [..., top_k], or any int32 tensor with __dlpack__)
 * are borrowed through DLPack; the checks, the copy of a CUDA tensor to the host (once its
 * device finished) and the counting are the engine's (csrc/engine/routing.c). */
#include "py_glue.h"

static PyObject *expert_counts(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"experts", "num_experts", NULL};
    PyObject *obj;
    int E;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oi:expert_counts", names, &obj, &E)) return NULL;
    /* the CUDA device obj is on, else -1 (host memory, or anything else: the import then says why) */
    int type, id;
    const int device = q3py_dlpack_device(obj, "experts", &type, &id) == 0 && type == Q3_DL_CUDA ? id : -1;
    PyErr_Clear();
    q3_error err;
    q3_view v;
    if (q3py_status(q3_count_experts_check(E, device, &err), &err) < 0 ||
        q3_view_acquire_on(obj, "experts", &v, device, Q3_VIEW_HOST | Q3_VIEW_I32, NULL) < 0)
        return NULL;
    int64_t *counts = PyMem_Malloc((size_t)E * sizeof *counts);
    q3_status s = Q3_OK;
    if (counts) Q3PY_NOGIL(s = q3_count_experts(&v, E, counts, &err));
    q3_view_release(&v);
    PyObject *result = !counts || q3py_status(s, &err) < 0 ? NULL : q3py_int64s(counts, E, 1);
    if (!counts) PyErr_NoMemory();
    PyMem_Free(counts);
    return result;
}

PyMethodDef q3_routing_methods[] = {
    {"expert_counts", (PyCFunction)(void (*)(void))expert_counts, METH_VARARGS | METH_KEYWORDS,
     "expert_counts(experts, num_experts)\n--\n\nTokens per expert: a list of num_experts ints, how many "
     "entries of the int32 tensor experts ([..., top_k], host or CUDA) name each expert."},
    {NULL},
};

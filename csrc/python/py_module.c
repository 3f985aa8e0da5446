/* The module qwen3layer._C: multi-phase init, heap types in the module state, exceptions,
 * and the module-level functions (build_info, check_config, probes; random_weights and
 * random_tensor are in py_random.c, copy_tensor and buffer_view in py_tensor.c). */
#include "py_glue.h"

#ifndef Q3_VERSION
#define Q3_VERSION "0.0.0"
#endif

q3_module_state *q3_state_of_type(PyTypeObject *type) {
    PyObject *m = PyType_GetModuleByDef(type, &q3_module_def);
    return m ? (q3_module_state *)PyModule_GetState(m) : NULL;
}

/* the strings names [n] as a list (a tuple where as_tuple); NULL with the exception */
static PyObject *strings(const char **names, int n, int as_tuple) {
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *s = PyUnicode_FromString(names[i]);
        if (!s) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, s);
    }
    if (!as_tuple || !list) return list;
    PyObject *tuple = PyList_AsTuple(list);
    Py_DECREF(list);
    return tuple;
}

static PyObject *build_info(PyObject *m, PyObject *unused) {
    const char *paths[8];
    PyObject *available = strings(paths, q3_cpu_paths(paths, 8), 0);
    if (!available) return NULL;
    return Py_BuildValue("{s:s,s:[s],s:s,s:N,s:i,s:s,s:i}", "version", Q3_VERSION, "backends", "cpu",
                         "cpu_path", q3_cpu_path(), "cpu_paths", available, "threads", q3_max_threads(),
                         "compiler", q3_build_compiler(), "default_chunk", Q3_DEFAULT_CHUNK);
}

static PyObject *set_cpu_path(PyObject *m, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    q3_error err;
    return q3py_status(q3_cpu_select(name, &err), &err) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *probe_read(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"bytes", "repeats", NULL};
    unsigned long long bytes = 1ull << 30;
    int repeats = 3;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|Ki:probe_read_bandwidth", names, &bytes, &repeats)) return NULL;
    double gbs;
    Q3PY_NOGIL(gbs = q3_probe_read_gbs((size_t)bytes, repeats < 1 ? 1 : repeats));
    return gbs == 0.0 ? PyErr_NoMemory() : PyFloat_FromDouble(gbs);
}

static PyObject *probe_fma(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"seconds", NULL};
    double seconds = 0.5;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|d:probe_fma_peak", names, &seconds)) return NULL;
    double gflops;
    Q3PY_NOGIL(gflops = q3_probe_fma_gflops(seconds));
    return PyFloat_FromDouble(gflops);
}

/* weight_formats(): the engine's formats' names, 0 .. q3_weight_format_count() - 1 */
static PyObject *weight_formats(PyObject *m, PyObject *unused) {
    const char *names[16];
    int n = 0;
    for (; n < q3_weight_format_count() && n < 16; n++) names[n] = q3_weight_format_name((q3_weight_format)n);
    return strings(names, n, 1);
}

static PyObject *check_config(PyObject *m, PyObject *cfg) {
    q3_config c;
    return q3_parse_config(cfg, &c) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyMethodDef module_methods[] = {
    {"build_info", build_info, METH_NOARGS, "build_info()\n--\n\nWhat this build contains."},
    {"set_cpu_path", set_cpu_path, METH_O,
     "set_cpu_path(name)\n--\n\nUse the CPU kernels of level `name` (one of build_info()['cpu_paths']) "
     "for the calls that start from now on."},
    {"probe_read_bandwidth", (PyCFunction)(void (*)(void))probe_read, METH_VARARGS | METH_KEYWORDS,
     "probe_read_bandwidth(bytes=1073741824, repeats=3)\n--\n\n"
     "Best GB/s of reading a buffer (1 GiB by default) with every thread."},
    {"probe_fma_peak", (PyCFunction)(void (*)(void))probe_fma, METH_VARARGS | METH_KEYWORDS,
     "probe_fma_peak(seconds=0.5)\n--\n\nfp32 multiply-add peak of every thread, GFLOP/s, active CPU path."},
    {"copy_tensor", q3py_copy_tensor, METH_VARARGS,
     "copy_tensor(tensor, device)\n--\n\nA contiguous copy on device (-1: host) of an extension Tensor, or of a host "
     "tensor of another producer (torch, numpy; float32, bfloat16, float8_e4m3fn or int32)."},
    {"check_config", check_config, METH_O, "check_config(config)\n--\n\nRaise if the geometry is impossible."},
    {"weight_formats", weight_formats, METH_NOARGS,
     "weight_formats()\n--\n\nThe names of the weight formats, the table's rows."},
    {"rope_defaults", q3py_rope_defaults, METH_NOARGS,
     "rope_defaults()\n--\n\nThe RoPE fields of a LayerConfig when unused: the engine's default scaling."},
    {"rope_table", q3py_rope_table, METH_O,
     "rope_table(config)\n--\n\n(inv_freq, scale): the RoPE table a layer of this config rotates by, fp32 values."},
    {"combine_rows", (PyCFunction)(void (*)(void))q3py_combine_rows, METH_VARARGS | METH_KEYWORDS,
     "combine_rows(resid, parts, rows, out=None, *, device=-1, stream=None)\n--\n\nresid [R, hidden] fp32 += "
     "parts[i] [n, hidden] (fp32 or bf16) at row rows[i] (int32 [n]) in turn, then out [R, hidden] (fp32 or bf16) "
     "<- resid: the combine of rows whose experts ran elsewhere. device=d: every tensor on CUDA device d, queued on "
     "stream (a row named twice is refused there)."},
    {"take_rows", (PyCFunction)(void (*)(void))q3py_take_rows, METH_VARARGS | METH_KEYWORDS,
     "take_rows(src, rows, out=None, *, device=-1, stream=None)\n--\n\nout [n, hidden] <- src [R, hidden] row "
     "rows[i] (int32 [n]), of src's dtype (fp32 or bf16): the rows whose experts run elsewhere. device=d: every "
     "tensor on CUDA device d, queued on stream. Returns out (a new Tensor when None)."},
    {"buffer_view", q3py_buffer_view, METH_VARARGS,
     "buffer_view(obj, offset, shape, dtype)\n--\n\nA Tensor over bytes of a buffer-protocol object (kept alive)."},
    {NULL},
};

static int module_exec(PyObject *m) {
    q3_module_state *st = q3py_state(m);
    q3_error err; /* the CPU kernels' level and k block from the environment: else no import */
    if (q3_cpu_configure_from_env(&err) != Q3_OK) {
        PyErr_SetString(PyExc_ImportError, err.msg);
        return -1;
    }
    /* the types, made and added in this order, and where the state keeps each */
    PyType_Spec *const specs[] = {&q3py_tensor_spec, &q3py_cache_spec, &q3py_layer_spec, &q3py_graph_spec,
                                  &q3py_passes_spec};
    PyTypeObject **const types[] = {&st->tensor_type, &st->cache_type, &st->layer_type, &st->graph_type,
                                    &st->passes_type};
    PyMethodDef *const functions[] = {q3_cuda_methods, q3_random_methods, q3_routing_methods, q3_held_methods};
    for (int i = 0; i < 5; i++)
        if (!(*types[i] = (PyTypeObject *)PyType_FromModuleAndSpec(m, specs[i], NULL))) return -1;
    st->cache_full_error = PyErr_NewExceptionWithDoc("qwen3layer.CacheFullError", "The tokens of a call do not fit in "
                                                     "the KV cache; the cache is left unchanged.", PyExc_RuntimeError, NULL);
    if (!st->cache_full_error) return -1;
    for (int i = 0; i < 4; i++)
        if (PyModule_AddFunctions(m, functions[i]) < 0) return -1;
    /* the engine's table for qwen3layer._testing (csrc/cuda/engine_api.h), one engine a process */
    PyObject *api = PyCapsule_New((void *)q3_engine_api_get(), Q3_ENGINE_API_CAPSULE, NULL);
    const int added = api ? PyModule_AddObjectRef(m, "_engine_api", api) : -1;
    Py_XDECREF(api);
    if (added < 0) return -1;
    for (int i = 0; i < 5; i++)
        if (PyModule_AddType(m, *types[i]) < 0) return -1;
    return PyModule_AddObjectRef(m, "CacheFullError", st->cache_full_error);
}

/* visits (visit given) or clears (visit NULL) the state's references */
static int state_refs(PyObject *m, visitproc visit, void *arg) {
    q3_module_state *st = q3py_state(m);
    PyObject **const refs[] = {(PyObject **)&st->tensor_type, (PyObject **)&st->cache_type,
                               (PyObject **)&st->layer_type, (PyObject **)&st->graph_type,
                               (PyObject **)&st->passes_type, &st->cache_full_error};
    for (size_t i = 0; i < sizeof refs / sizeof refs[0]; i++) {
        if (visit) Py_VISIT(*refs[i]);
        else Py_CLEAR(*refs[i]);
    }
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) { return state_refs(m, visit, arg); }
static int module_clear(PyObject *m) { return state_refs(m, NULL, NULL); }
static void module_free(void *m) { module_clear((PyObject *)m); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyModuleDef q3_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "qwen3layer._C",
    .m_doc = "The qwen3layer engine: one Qwen3-MoE decoder layer in C.",
    .m_size = sizeof(q3_module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&q3_module_def); }

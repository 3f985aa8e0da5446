/* The module qwen3layer._testing: the kernel check harness (csrc/check) and the entries that
 * exist only for tests and benchmarks, out of the extension users load. At import it takes
 * the engine's function table from qwen3layer._C (its _engine_api capsule) and binds the
 * harness to it, so every call here runs on _C's engine: the CUDA library q3.cuda.emulate()
 * or load() opened, the CPU path set_cpu_path chose. The FP8 entries are py_testing_fp8.c's. */
#include "../check/q3_check.h"
#include "../python/py_convert.h"
#include "py_testing.h"

/* cuda_check(device=0, only=None) -> [(case, max_err, tol, schedules, agree, kernel)] */
static PyObject *cuda_check(PyObject *m, PyObject *args) {
    (void)m;
    int device = 0, n = 0;
    const char *only = NULL;
    if (!PyArg_ParseTuple(args, "|iz:cuda_check", &device, &only)) return NULL;
    enum { MAX_CASES = 1024 };
    q3_check_result *results = PyMem_Calloc(MAX_CASES, sizeof *results);
    if (!results) return PyErr_NoMemory();
    q3_error err;
    q3_status s;
    Py_BEGIN_ALLOW_THREADS
    s = q3_cuda_check(device, only, results, MAX_CASES, &n, &err);
    Py_END_ALLOW_THREADS
    PyObject *list = s == Q3_OK ? PyList_New(n) : q3_raise(NULL, &err);
    for (int i = 0; list && i < n; i++) {
        PyObject *row = Py_BuildValue("(sddiOs)", results[i].name, results[i].max_err, results[i].tol,
                                      results[i].schedules, results[i].agree ? Py_True : Py_False, results[i].kernel);
        if (!row) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, row);
    }
    PyMem_Free(results);
    return list;
}

/* milliseconds per call of a CUDA device copy or matmul (kernels/cuda/ops_cuda.h) */
static PyObject *cuda_time(PyObject *m, PyObject *args, PyObject *kw) {
    (void)m;
    static char *names[] = {"what", "bytes", "T", "N", "K", "dtype", "repeats", NULL};
    const char *what;
    unsigned long long bytes = 0;
    long long T = 1, N = 1, K = 1;
    PyObject *dtype_obj = NULL;
    int repeats = 20;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|KLLLOi:cuda_time", names, &what, &bytes, &T, &N, &K, &dtype_obj,
                                     &repeats))
        return NULL;
    q3_dtype dt = Q3_BF16;
    if (dtype_obj && q3_parse_dtype(dtype_obj, "dtype", &dt) < 0) return NULL;
    float ms = 0.0f;
    q3_error err;
    q3_status s;
    Py_BEGIN_ALLOW_THREADS
    s = q3_check_time(what, (size_t)bytes, T, N, K, dt, repeats, &ms, &err);
    Py_END_ALLOW_THREADS
    return s == Q3_OK ? PyFloat_FromDouble(ms) : q3_raise(NULL, &err);
}

static PyObject *cuda_schedules(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    return PyLong_FromLong(q3_cuda_schedules());
}

static PyObject *cuda_set_schedule(PyObject *m, PyObject *args) {
    (void)m;
    int schedule;
    unsigned long long seed = 0;
    if (!PyArg_ParseTuple(args, "i|K:cuda_set_schedule", &schedule, &seed)) return NULL;
    q3_error err;
    if (q3_cuda_set_schedule(schedule, seed, &err) != Q3_OK) return q3_raise(NULL, &err);
    Py_RETURN_NONE;
}

static PyMethodDef testing_methods[] = {
    {"cuda_check", cuda_check, METH_VARARGS,
     "cuda_check(device=0, only=None)\n--\n\n[(case, max_err, tol, schedules, agree, kernel)]: every CUDA kernel "
     "against its CPU twin, under each thread schedule of the backend (agree: bitwise equal results across them; "
     "kernel: the launcher(s) the case exercises); only: the cases of these launchers alone (','-separated)."},
    {"cuda_time", (PyCFunction)(void (*)(void))cuda_time, METH_VARARGS | METH_KEYWORDS,
     "cuda_time(what, bytes=0, T=1, N=1, K=1, dtype='bfloat16', repeats=20)\n--\n\n"
     "ms per call, CUDA events: what='copy' (device to device) or 'matmul'."},
    {"cuda_schedules", cuda_schedules, METH_NOARGS,
     "cuda_schedules()\n--\n\nThread schedules of the open backend: 1 on a GPU, 3 on the SIMT executor."},
    {"cuda_set_schedule", cuda_set_schedule, METH_VARARGS,
     "cuda_set_schedule(schedule, seed=0)\n--\n\nThe SIMT executor's thread order for the launches that follow: "
     "0 forward, 1 reverse, 2 a shuffle seeded by seed."},
    {NULL},
};

/* binds the harness to _C's engine (importing _C first), then adds the entries */
static int testing_exec(PyObject *m) {
    const q3_engine_api *api = PyCapsule_Import(Q3_ENGINE_API_CAPSULE, 0);
    if (!api) return -1;
    q3_error err;
    if (q3_check_link(api, &err) != Q3_OK) {
        PyErr_Format(PyExc_ImportError, "qwen3layer._testing: %s (rebuild both extensions together)", err.msg);
        return -1;
    }
    return PyModule_AddFunctions(m, testing_methods) < 0 || PyModule_AddFunctions(m, q3py_fp8_methods) < 0 ? -1 : 0;
}

static PyModuleDef_Slot testing_slots[] = {
    {Py_mod_exec, testing_exec},
    {0, NULL},
};

static PyModuleDef testing_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "qwen3layer._testing",
    .m_doc = "The kernel check harness and the test-only entries of qwen3layer, bound to qwen3layer._C's engine.",
    .m_size = 0,
    .m_slots = testing_slots,
};

PyMODINIT_FUNC PyInit__testing(void) { return PyModuleDef_Init(&testing_def); }

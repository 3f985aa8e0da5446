/* What every glue file of both modules (qwen3layer._C, csrc/python; qwen3layer._testing,
 * csrc/testing) parses and raises the same way: engine statuses to exceptions, dtype names.
 * Needs only Python.h and the engine's public headers, so _testing compiles py_convert.c too. */
#ifndef Q3_PY_CONVERT_H
#define Q3_PY_CONVERT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../cuda/q3_cuda.h"

typedef struct q3_module_state q3_module_state;

/* Raises the Python exception for an engine failure; returns NULL. st gives the
 * module's CacheFullError (NULL only where the engine cannot report a full cache). */
PyObject *q3_raise(q3_module_state *st, const q3_error *err);
/* dtype <-> "float32" / "bfloat16" ("float8_e4m3fn" named, never parsed: weights only);
 * q3_parse_dtype raises TypeError naming `arg` */
const char *q3_dtype_name(q3_dtype dt);
int q3_parse_dtype(PyObject *obj, const char *arg, q3_dtype *out);
/* the prefill MoE paths' names (Q3_MOE_* order), as cuda_moe_path takes them */
extern const char *const q3_moe_path_names[Q3_MOE_PATHS];

#endif

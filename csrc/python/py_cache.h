/* KVCache glue shared by py_cache.c (the object, its views and attributes) and
 * py_cache_ops.c (its operations and method table). The checks are the engine's
 * (q3_cache_call, q3_cache_view_of); this glue converts arguments and runs the calls. */
#ifndef Q3_PY_CACHE_H
#define Q3_PY_CACHE_H

#include "py_glue.h"

/* 0, or -1 with RuntimeError while a layer call runs on the cache, or one run pass by pass
 * (py_pass_run.c) is open on it */
int q3py_cache_check_idle(q3py_cache_object *o);
/* the KVCache of engine cache c, taken over (destroyed now when the object cannot be made) */
q3py_cache_object *q3py_cache_wrap(q3_module_state *st, q3_cache *c);
/* Engine call r on o's cache (q3_cache_call): refused while the cache is not idle; else made
 * with the cache busy and the GIL released. 0, or -1 with the engine's error raised. */
int q3py_cache_run(q3py_cache_object *o, q3_cache_call_args *r);
/* keys(seq=0), values(seq=0): one sequence's view; all_keys(tokens=None), all_values(tokens=None):
 * every sequence's (py_cache.c) */
PyObject *q3py_cache_view(q3py_cache_object *o, PyObject *args, PyObject *kw, int values, int all);
/* KVCache's methods with their docstrings (py_cache_ops.c) */
extern PyMethodDef q3py_cache_methods[];

#endif

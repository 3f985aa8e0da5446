/* KVCache glue shared by py_cache.c (the object, its views and simple calls) and
 * py_cache_ops.c (the operations for generation). The checks are the engine's
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
/* the same, None or NULL */
PyObject *q3py_cache_run_none(q3py_cache_object *o, q3_cache_call_args *r);

/* KVCache methods (py_cache_ops.c); their docstrings are in py_cache.c's table */
PyObject *q3py_cache_reorder(q3py_cache_object *o, PyObject *args, PyObject *kw);
PyObject *q3py_cache_select(q3py_cache_object *o, PyObject *args, PyObject *kw);
PyObject *q3py_cache_repeat_interleave(q3py_cache_object *o, PyObject *args, PyObject *kw);
PyObject *q3py_cache_copy(q3py_cache_object *o, PyObject *args, PyObject *kw);
PyObject *q3py_cache_copy_noargs(q3py_cache_object *o, PyObject *unused); /* __copy__ and __deepcopy__ */
PyObject *q3py_cache_copy_prefix(q3py_cache_object *o, PyObject *args, PyObject *kw);
PyObject *q3py_cache_accept(q3py_cache_object *o, PyObject *args, PyObject *kw);
PyObject *q3py_cache_tree_inputs(q3py_cache_object *o, PyObject *args, PyObject *kw);

#endif

/* KVCache glue shared by py_cache.c (the object, its views and simple calls) and
 * py_cache_ops.c (the operations for generation). */
#ifndef Q3_PY_CACHE_H
#define Q3_PY_CACHE_H

#include "py_glue.h"

/* 0, or -1 with RuntimeError while a layer call runs on the cache, or one run pass by pass
 * (py_pass_run.c) is open on it */
int q3py_cache_check_idle(q3py_cache_object *o);
/* after a growth: the views taken before it keep the old blocks (their owner takes them over),
 * or, none living, the blocks are freed now; 0, or -1 with an exception */
int q3py_cache_retire_views(q3py_cache_object *o, q3_cache_blocks *old);
/* None, or NULL with the engine's error raised */
PyObject *q3_status_or_none(q3_status s, const q3_error *err);

/* KVCache methods (py_cache_ops.c); their docstrings are in py_cache.c's table */
PyObject *q3py_cache_reorder(q3py_cache_object *o, PyObject *args, PyObject *kw);
PyObject *q3py_cache_select(q3py_cache_object *o, PyObject *args, PyObject *kw);
PyObject *q3py_cache_repeat_interleave(q3py_cache_object *o, PyObject *args, PyObject *kw);
PyObject *q3py_cache_crop(q3py_cache_object *o, PyObject *args, PyObject *kw);
PyObject *q3py_cache_copy(q3py_cache_object *o, PyObject *args, PyObject *kw);
PyObject *q3py_cache_copy_noargs(q3py_cache_object *o, PyObject *unused);
PyObject *q3py_cache_deepcopy(q3py_cache_object *o, PyObject *memo);
PyObject *q3py_cache_copy_prefix(q3py_cache_object *o, PyObject *args, PyObject *kw);
PyObject *q3py_cache_grow(q3py_cache_object *o, PyObject *args, PyObject *kw);

#endif

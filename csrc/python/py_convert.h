/* What every glue file of both modules (qwen3layer._C, csrc/python; qwen3layer._testing,
 * csrc/testing) parses and raises the same way: engine statuses to exceptions, and the
 * arguments many calls take (dtype, stream, a sequence index), each parsed in
 * one place. Needs only Python.h and the engine's public headers, so _testing compiles
 * py_convert.c too. The q3py_* converters fit PyArg_Parse's "O&": 1 with *out set, or 0 with
 * the exception raised (it names the argument, what was expected and what came). */
#ifndef Q3_PY_CONVERT_H
#define Q3_PY_CONVERT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../cuda/q3_cuda.h"

typedef struct q3_module_state q3_module_state;

/* Raises the Python exception for an engine failure; returns NULL. st gives the
 * module's CacheFullError (NULL only where the engine cannot report a full cache). */
PyObject *q3_raise(q3_module_state *st, const q3_error *err);
/* 0 for Q3_OK; else the exception for err raised (CacheFullError as RuntimeError) and -1 */
int q3py_status(q3_status s, const q3_error *err);
/* "float32" / "bfloat16" -> dtype (q3_dtype_name, kernels/dtype.h, the other way; float8_e4m3fn
 * is never parsed: weights only); raises TypeError naming `arg` */
int q3_parse_dtype(PyObject *obj, const char *arg, q3_dtype *out);
/* "dtype": 'float32' or 'bfloat16' -> q3_dtype *out */
int q3py_dtype(PyObject *obj, void *out);
/* the same, None leaving *out as it was (the caller's default) */
int q3py_dtype_or_none(PyObject *obj, void *out);
/* "stream": a cudaStream_t as int, or None (NULL: the default stream) -> void **out */
int q3py_stream(PyObject *obj, void *out);
/* the same for an object on `device` (-1: the cpu, where only None is taken; ValueError
 * "stream: expected None for <cpu_object>"); 0 or -1 */
int q3py_stream_on(PyObject *obj, int device, const char *cpu_object, void **out);
/* "seq" of a layer call: an int (a bool is not one here) that fits a C int -> *seq, whose range
 * [0, batch) the engine checks with the call (IndexError here only past a C int); 0, or -1 with
 * TypeError / IndexError */
int q3py_seq(PyObject *obj, int batch, int *seq);
/* "shape": a sequence of min_ndim (the caller's, 0 or 1) to Q3_MAX_DIM non-negative ints of
 * int64 -> q3py_shape *out (TypeError for a non-sequence or a non-int, ValueError naming the
 * range otherwise) */
typedef struct {
    int min_ndim;
    int ndim;
    int64_t dims[Q3_MAX_DIM];
} q3py_shape;
int q3py_shape_arg(PyObject *obj, void *out);
/* An int argument (or an object with __index__: numpy's ints) as the engine takes it (the
 * engine checks its range): 1 with *out; 0 for None where Q3PY_NONE_OK; -1 with TypeError
 * "<arg>: expected an int[ or None], got <type>" (a bool is one only where Q3PY_BOOL_OK). Past int64: OverflowError, or ValueError
 * "<arg>: <too_big>, got <value>" where too_big is given. */
enum { Q3PY_NONE_OK = 1, Q3PY_BOOL_OK = 2 };
int q3py_int64(PyObject *obj, const char *arg, int flags, const char *too_big, int64_t *out);
/* "chunk_size": None -> 0 (the engine's default chunk), else a positive int; 0 or -1 */
int q3py_chunk(PyObject *obj, int64_t *chunk);
/* "attention_limit": None -> dflt, else a non-negative int of bytes (past int64: no limit); 0
 * or -1 */
int q3py_attention_limit(PyObject *obj, int64_t dflt, int64_t *limit);
/* "device" (NULL: not given, the host) -1 or a CUDA device index, and "stream" for it; 0 or -1 */
int q3py_place(PyObject *device_obj, PyObject *stream_obj, int *device, void **stream);
/* An index argument named arg: a 1-D sequence of ints (list, tuple, range, a torch or numpy
 * integer array) as a PyMem_Malloc'd int64 array of *n (the engine checks each entry's range);
 * NULL with an exception naming arg (or arg[i]) */
int64_t *q3py_index_list(PyObject *obj, const char *arg, int64_t *n);
/* the ints v [n] as a tuple (a list where as_list); NULL with the exception */
PyObject *q3py_int64s(const int64_t *v, Py_ssize_t n, int as_list);

#endif

/* Declarations shared by the files of qwen3layer._testing's glue (csrc/testing). */
#ifndef Q3_PY_TESTING_H
#define Q3_PY_TESTING_H

#include "../python/py_convert.h"

/* the FP8 kernels' and the dense matmul's entries (py_testing_fp8.c) */
extern PyMethodDef q3py_fp8_methods[];

#endif

/* Engine access to the CUDA launchers (csrc/cuda_backend.c) and their self-check against
 * the CPU twins (csrc/cuda_check.c). */
#ifndef Q3_ENGINE_CUDA_BACKEND_H
#define Q3_ENGINE_CUDA_BACKEND_H

#include "../kernels/cuda/ops_cuda.h"
#include "q3.h"

/* the table, or NULL before q3_cuda_open succeeded */
const q3_cuda_ops *q3_cuda(void);
/* use `table` as the CUDA backend (once per process, instead of opening the library) */
q3_status q3_cuda_install(const q3_cuda_ops *table, q3_error *err);

#endif

/* The CUDA launchers' table (kernels/cuda/ops_cuda.h) for the CUDA host side and the layers
 * above it (backend.c opens it and installs the engine's device backend). */
#ifndef Q3_CUDA_BACKEND_H
#define Q3_CUDA_BACKEND_H

#include "../../kernels/cuda/ops_cuda.h"
#include "q3_cuda.h"

/* the table, or NULL before q3_cuda_open succeeded */
const q3_cuda_ops *q3_cuda(void);

#endif

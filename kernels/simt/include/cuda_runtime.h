// The SIMT executor's <cuda_runtime.h> (kernels/simt/include comes first on the executor's
// include path): CUDA's own header for the runtime API's types and declarations, whose
// functions kernels/simt/runtime_api.cpp defines, then the executor's device environment
// (kernels/simt/simt.h). The CUDA toolkit's headers are needed, its libraries are not.
#ifndef Q3_SIMT_CUDA_RUNTIME_H
#define Q3_SIMT_CUDA_RUNTIME_H

// plain host functions: CUDA's header leaves these alone when they are defined first
#undef __host__ // where <cuda_bf16.h> came first
#undef __device__
#undef __global__
#define __host__
#define __device__
#define __global__

#include_next <cuda_runtime.h>

#undef __launch_bounds__
#define __launch_bounds__(...)

#include "../simt.h"

#endif

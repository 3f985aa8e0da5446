/* Engine access to the CUDA launchers (csrc/cuda_backend.c) and their self-check against
 * the CPU twins (csrc/cuda_check.c). */
#ifndef Q3_ENGINE_CUDA_BACKEND_H
#define Q3_ENGINE_CUDA_BACKEND_H

#include "../kernels/cuda/ops_cuda.h"
#include "q3.h"

/* the table, or NULL before q3_cuda_open succeeded */
const q3_cuda_ops *q3_cuda(void);
/* The CPU twin of qk_rope_kv: rmsnorm, rope and kv_write in turn (host pointers). */
void q3_qk_rope_kv_host(float *q, float *k, const float *v, const void *q_norm, const void *k_norm, q3_dtype w_dt,
                        const int64_t *pos, const q3_attn_seq *seqs, int n_seqs, const q3_attn_shape *shape,
                        float eps, float theta);

/* use `table` as the CUDA backend (once per process, instead of opening the library) */
q3_status q3_cuda_install(const q3_cuda_ops *table, q3_error *err);

#endif

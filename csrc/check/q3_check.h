/* The check harness's public API: the CUDA kernels against their CPU twins, and an emulated
 * CUDA device for tests on machines without a GPU. It ships in the extension so that a user
 * with a GPU can prove the kernels where they run (qwen3layer.cuda.check_kernels()). */
#ifndef Q3_CHECK_PUBLIC_H
#define Q3_CHECK_PUBLIC_H

#include "../engine/q3.h"

/* For tests without a GPU (emulated_device.c): one emulated device whose memory is host
 * memory and whose kernels are the CPU twins. Instead of the library, once per process. */
q3_status q3_cuda_emulate(q3_error *err);

/* Each CUDA kernel against its CPU twin on random inputs (kernel_check.c): one result
 * per case; max_err is max |cuda - cpu| / max |cpu|. */
typedef struct {
    char name[48];
    double max_err;
    double tol;
} q3_check_result;
q3_status q3_cuda_check(int device, q3_check_result *out, int max, int *n, q3_error *err);

#endif

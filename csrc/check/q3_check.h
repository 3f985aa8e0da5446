/* The check harness's public API: the CUDA kernels against their CPU twins, on a GPU or on
 * the SIMT executor (libq3simt.so). It ships in the extension so that a user with a GPU can
 * prove the kernels where they run (qwen3layer.cuda.check_kernels()). */
#ifndef Q3_CHECK_PUBLIC_H
#define Q3_CHECK_PUBLIC_H

#include "../cuda/q3_cuda.h"

/* Each CUDA kernel against its CPU twin on random inputs (kernel_check.c): one result
 * per case; max_err is max |cuda - cpu| / max |cpu| (the worst over the schedules). On the
 * SIMT executor every case runs under each of its thread schedules (q3_cuda_schedules) and
 * `agree` says whether the results were bitwise equal across them (a race shows as not);
 * on a GPU, schedules is 1. The cuBLAS setting is left as it was found. */
typedef struct {
    char name[64];   /* the case: its kernel and shape */
    char kernel[48]; /* the launcher(s) it exercises, as named in kernels/cuda/ops_cuda.h
                        ("attention", "moe_gate_up+moe_down+moe_combine", ...) */
    double max_err;
    double tol;
    int schedules;
    int agree;
} q3_check_result;
q3_status q3_cuda_check(int device, q3_check_result *out, int max, int *n, q3_error *err);

#endif

/* The engine's function table for a second extension module in the same process
 * (qwen3layer._testing: the kernel check harness and the test entries). The glue of _C hands
 * out the table in a PyCapsule (Q3_ENGINE_API_CAPSULE, as numpy hands out its C API), so that
 * the harness drives the one engine instance that _C holds: the CPU path set_cpu_path chose
 * and the CUDA library q3.cuda.emulate() or load() opened. A client checks `size` and
 * `version` before its first call. Only pointers to the engine's own functions: what a
 * client needs that has no state (the inline helpers of the kernels' headers) it compiles itself. */
#ifndef Q3_CUDA_ENGINE_API_H
#define Q3_CUDA_ENGINE_API_H

#include "../engine/cpu_dispatch.h"
#include "backend.h"

#define Q3_ENGINE_API_VERSION 2

struct q3_engine_api {
    size_t size; /* sizeof(q3_engine_api) of the engine that made it */
    int version; /* Q3_ENGINE_API_VERSION */
    /* csrc/engine: status.c, cpu_dispatch.c, rope_table.c */
    q3_status (*vfail)(q3_error *err, q3_status status, const char *fmt, va_list ap);
    const q3_cpu_ops *(*cpu_ops_active)(void);
    int (*max_threads)(void);
    void (*rope_table)(const q3_config *cfg, float *inv_freq, float *scale);
    /* csrc/cuda: backend.c */
    const q3_cuda_ops *(*cuda)(void);
    int (*cuda_schedules)(void);
    q3_status (*cuda_set_schedule)(int schedule, uint64_t seed, q3_error *err);
};

#endif

/* The engine's function table (engine_api.h), one static instance for the process. */
#include "engine_api.h"

static const q3_engine_api table = {
    .size = sizeof(q3_engine_api),
    .version = Q3_ENGINE_API_VERSION,
    .vfail = q3_vfail,
    .cpu_ops_active = q3_cpu_ops_active,
    .max_threads = q3_max_threads,
    .rope_table = q3_rope_table,
    .cuda = q3_cuda,
    .cuda_schedules = q3_cuda_schedules,
    .cuda_set_schedule = q3_cuda_set_schedule,
};

const q3_engine_api *q3_engine_api_get(void) { return &table; }

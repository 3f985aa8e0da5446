/* The check harness's link to the engine: in qwen3layer._testing the harness calls the engine
 * functions it names (q3_fail, q3_cuda, q3_cpu_ops_active, ...) as in _C, and these
 * definitions forward each to the table that _C exports (csrc/cuda/engine_api.h), so the
 * harness runs on _C's one engine: its CPU path, its open CUDA library, its schedules. No
 * engine source is compiled into _testing (tests/tools/test_symbols.py checks that none is
 * missing). q3_check_link runs once, at import, before any other call. */
#include <stdio.h>

#include "../cuda/engine_api.h"
#include "q3_check.h"

static const q3_engine_api *api;

q3_status q3_check_link(const q3_engine_api *table, q3_error *err) {
    if (!table || table->size < sizeof *table || table->version != Q3_ENGINE_API_VERSION) {
        if (err) {
            err->status = Q3_ERR_STATE;
            snprintf(err->msg, sizeof err->msg, "engine API: expected version %d of %zu bytes, got version %d of %zu",
                     Q3_ENGINE_API_VERSION, sizeof *table, table ? table->version : -1, table ? table->size : 0);
        }
        return Q3_ERR_STATE;
    }
    api = table;
    return Q3_OK;
}

q3_status q3_fail(q3_error *err, q3_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    api->vfail(err, status, fmt, ap);
    va_end(ap);
    return status;
}

const q3_cpu_ops *q3_cpu_ops_active(void) { return api->cpu_ops_active(); }
int q3_max_threads(void) { return api->max_threads(); }
void q3_rope_table(const q3_config *cfg, float *inv_freq, float *scale) { api->rope_table(cfg, inv_freq, scale); }
const q3_cuda_ops *q3_cuda(void) { return api->cuda(); }
int q3_cuda_schedules(void) { return api->cuda_schedules(); }
q3_status q3_cuda_set_schedule(int schedule, uint64_t seed, q3_error *err) {
    return api->cuda_set_schedule(schedule, seed, err);
}

/* Per-stage timing of the CPU forward (layer.profile): a monotonic clock read at each stage
 * boundary while profiling is on, accumulated per stage. The stages are those of the cost
 * model (qwen3layer/analysis/costs.py), in the order the forward runs them. */
#ifndef Q3_ENGINE_PROFILE_H
#define Q3_ENGINE_PROFILE_H

#include <time.h>

typedef enum {
    Q3_STAGE_IO,           /* input to fp32, output back to the caller's dtype */
    Q3_STAGE_INPUT_NORM,
    Q3_STAGE_QKV_PROJ,
    Q3_STAGE_QK_NORM_ROPE,
    Q3_STAGE_KV_WRITE,
    Q3_STAGE_ATTENTION,
    Q3_STAGE_O_PROJ,
    Q3_STAGE_POST_NORM,
    Q3_STAGE_ROUTER,
    Q3_STAGE_TOP_K,        /* softmax, top-k, grouping by expert */
    Q3_STAGE_EXPERTS,      /* gather, gate, up, SiLU * up, down, weighted combine */
    Q3_STAGE_COUNT
} q3_stage;

typedef struct {
    int enabled;
    double last;                       /* the previous boundary */
    double seconds[Q3_STAGE_COUNT];    /* accumulated since enabling */
} q3_profile;

static inline double q3_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* charges the time since the previous boundary to `stage` */
static inline void q3_profile_mark(q3_profile *p, q3_stage stage) {
    if (!p || !p->enabled) return;
    const double t = q3_now();
    p->seconds[stage] += t - p->last;
    p->last = t;
}

static inline void q3_profile_start(q3_profile *p) {
    if (p && p->enabled) p->last = q3_now();
}

#endif

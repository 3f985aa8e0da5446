/* RMSNorm, one row per iteration; rows split across threads. And, in the portable variant
 * only, the twin of kernels/cuda/rmsnorm.cu's add_rmsnorm, the residual add fused in front of
 * it (twins.h). x, out [rows, n]. */
#include <math.h>

#include "ops.h"
#include "team.h"
#include "twins.h"

static void rmsnorm_row(float *out, const float *x, const void *w, q3_dtype w_dt,
                        int64_t n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    if (w_dt == Q3_BF16) {
        const uint16_t *wb = (const uint16_t *)w;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) out[i] = q3_bf16_to_f32(wb[i]) * (x[i] * r);
    } else if (w_dt == Q3_F16) {
        const uint16_t *wh = (const uint16_t *)w;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) out[i] = q3_f16_to_f32(wh[i]) * (x[i] * r);
    } else {
        const float *wf = (const float *)w;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) out[i] = wf[i] * (x[i] * r);
    }
}

void Q3_CPU_FN(q3_rmsnorm)(float *out, const float *x, const void *w, q3_dtype w_dt,
                    int64_t rows, int64_t n, float eps) {
    if (!q3_team(rows * n > 8192, 0)) { /* inline (team.h) */
        for (int64_t r = 0; r < rows; r++) rmsnorm_row(out + r * n, x + r * n, w, w_dt, n, eps);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) rmsnorm_row(out + r * n, x + r * n, w, w_dt, n, eps);
}

#if Q3_CPU_TWINS
void q3_add_rmsnorm_host(float *out, float *x, const float *r, const void *w, q3_dtype w_dt, int64_t rows,
                         int64_t n, float eps) {
    for (int64_t i = 0; i < rows * n; i++) x[i] += r[i];
    q3_rmsnorm_cpu_portable(out, x, w, w_dt, rows, n, eps);
}
#endif

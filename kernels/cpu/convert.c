/* fp32 <-> storage dtype (fp32, bf16, fp16) conversion, contiguous, threaded over elements. */
#include "ops.h"
#include "team.h"

void Q3_CPU_FN(q3_to_f32)(float *dst, const void *src, q3_dtype src_dt, int64_t n) {
    if (src_dt == Q3_F32) {
        if ((const void *)dst != src) memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
    const int team = q3_team(n > (1 << 16), 0); /* else inline (team.h) */
    if (src_dt == Q3_F16 && team) {
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; i++) dst[i] = q3_f16_to_f32(s[i]);
    } else if (src_dt == Q3_F16) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = q3_f16_to_f32(s[i]);
    } else if (team) {
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; i++) dst[i] = q3_bf16_to_f32(s[i]);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = q3_bf16_to_f32(s[i]);
    }
}

void Q3_CPU_FN(q3_from_f32)(void *dst, q3_dtype dst_dt, const float *src, int64_t n) {
    if (dst_dt == Q3_F32) {
        if (dst != (const void *)src) memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    const int team = q3_team(n > (1 << 16), 0); /* else inline (team.h) */
    if (dst_dt == Q3_F16 && team) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) d[i] = q3_f32_to_f16(src[i]);
    } else if (dst_dt == Q3_F16) {
        for (int64_t i = 0; i < n; i++) d[i] = q3_f32_to_f16(src[i]);
    } else if (team) {
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; i++) d[i] = q3_f32_to_bf16(src[i]);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = q3_f32_to_bf16(src[i]);
    }
}

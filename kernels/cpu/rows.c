/* Gather rows into an expert's group, scatter-add weighted rows back. Rows of one call to
 * scatter_add are distinct (a token picks an expert at most once), so rows run in parallel. */
#include "ops.h"
#include "team.h"

void Q3_CPU_FN(q3_gather_rows)(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t H) {
    if (!q3_team(n * H > (1 << 16), 0)) { /* inline (team.h) */
        for (int64_t i = 0; i < n; i++) memcpy(dst + i * H, src + (int64_t)rows[i] * H, (size_t)H * sizeof(float));
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) memcpy(dst + i * H, src + (int64_t)rows[i] * H, (size_t)H * sizeof(float));
}

/* dst[rows[i]] += scale[i] src[i] */
static inline void scatter_add_row(float *dst, const float *src, const int32_t *rows, const float *scale, int64_t i,
                                   int64_t H) {
    float *d = dst + (int64_t)rows[i] * H;
    const float *s = src + i * H;
    const float a = scale[i];
#pragma omp simd
    for (int64_t j = 0; j < H; j++) d[j] += a * s[j];
}

void Q3_CPU_FN(q3_scatter_add_rows)(float *dst, const float *src, const int32_t *rows,
                             const float *scale, int64_t n, int64_t H) {
    if (!q3_team(n * H > (1 << 16), 0)) { /* inline (team.h) */
        for (int64_t i = 0; i < n; i++) scatter_add_row(dst, src, rows, scale, i, H);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) scatter_add_row(dst, src, rows, scale, i, H);
}

void Q3_CPU_FN(q3_take_rows)(void *dst, const void *src, q3_dtype dt, const int32_t *rows, int64_t n, int64_t H) {
    const size_t row = (size_t)H * q3_dtype_size(dt);
    if (!q3_team(n * H > (1 << 16), 0)) { /* inline (team.h) */
        for (int64_t i = 0; i < n; i++) memcpy((char *)dst + (size_t)i * row, (const char *)src + (size_t)rows[i] * row, row);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) memcpy((char *)dst + (size_t)i * row, (const char *)src + (size_t)rows[i] * row, row);
}

/* in turn, not in parallel: a row named twice adds its parts in order */
void Q3_CPU_FN(q3_add_rows)(float *dst, const void *src, q3_dtype src_dt, const int32_t *rows, int64_t n, int64_t H) {
    for (int64_t i = 0; i < n; i++) {
        float *d = dst + (int64_t)rows[i] * H;
        if (src_dt == Q3_F32) {
            const float *s = (const float *)src + i * H;
#pragma omp simd
            for (int64_t j = 0; j < H; j++) d[j] += s[j];
        } else if (src_dt == Q3_F16) {
            const uint16_t *s = (const uint16_t *)src + i * H;
#pragma omp simd
            for (int64_t j = 0; j < H; j++) d[j] += q3_f16_to_f32(s[j]);
        } else {
            const uint16_t *s = (const uint16_t *)src + i * H;
            for (int64_t j = 0; j < H; j++) d[j] += q3_bf16_to_f32(s[j]);
        }
    }
}

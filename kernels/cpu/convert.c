/* fp32 <-> storage dtype (fp32, bf16, fp16) conversion, contiguous, threaded over elements in
 * chunks (every element converted alone: the same bits on any thread count). */
#include "ops.h"
#include "team.h"
#include "widen.h"

#define CHUNK 4096 /* elements a thread takes at a time */

/* dst [i0, i1) <- src [i0, i1), bf16 or fp16 to fp32 */
static void to_f32_range(float *dst, const uint16_t *src, q3_dtype dt, int64_t i0, int64_t i1) {
    if (dt == Q3_BF16) {
        q3_bf16_row(dst + i0, src + i0, i1 - i0);
        return;
    }
#pragma omp simd
    for (int64_t i = i0; i < i1; i++) dst[i] = q3_f16_to_f32(src[i]);
}

/* dst [i0, i1) <- src [i0, i1), fp32 to bf16 or fp16 (to nearest even) */
static void from_f32_range(uint16_t *dst, q3_dtype dt, const float *src, int64_t i0, int64_t i1) {
    if (dt == Q3_BF16) {
#pragma omp simd
        for (int64_t i = i0; i < i1; i++) dst[i] = q3_f32_to_bf16(src[i]);
        return;
    }
    for (int64_t i = i0; i < i1; i++) dst[i] = q3_f32_to_f16(src[i]);
}

void Q3_CPU_FN(q3_to_f32)(float *dst, const void *src, q3_dtype src_dt, int64_t n) {
    if (src_dt == Q3_F32) {
        if ((const void *)dst != src) memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
    if (!q3_team(n > (1 << 16), 0)) { /* inline (team.h) */
        to_f32_range(dst, s, src_dt, 0, n);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < (n + CHUNK - 1) / CHUNK; c++)
        to_f32_range(dst, s, src_dt, c * CHUNK, n - c * CHUNK < CHUNK ? n : (c + 1) * CHUNK);
}

void Q3_CPU_FN(q3_from_f32)(void *dst, q3_dtype dst_dt, const float *src, int64_t n) {
    if (dst_dt == Q3_F32) {
        if (dst != (const void *)src) memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    if (!q3_team(n > (1 << 16), 0)) { /* inline (team.h) */
        from_f32_range(d, dst_dt, src, 0, n);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < (n + CHUNK - 1) / CHUNK; c++)
        from_f32_range(d, dst_dt, src, c * CHUNK, n - c * CHUNK < CHUNK ? n : (c + 1) * CHUNK);
}

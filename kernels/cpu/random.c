/* Counter-based normal samples (kernels/random.h: q3_normal_key, q3_normal_at), written as
 * fp32, bf16 or fp16 by every thread. */
#include "ops.h"

void Q3_CPU_FN(q3_fill_normal)(void *dst, q3_dtype dt, int64_t n, uint64_t seed, uint64_t stream, uint64_t first,
                        float mean, float std) {
    const uint64_t key = q3_normal_key(seed, stream);
    if (dt == Q3_BF16) {
        uint16_t *d = (uint16_t *)dst;
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
        for (int64_t i = 0; i < n; i++) d[i] = q3_f32_to_bf16(mean + std * q3_normal_at(key, first + (uint64_t)i));
    } else if (dt == Q3_F16) {
        uint16_t *d = (uint16_t *)dst;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
        for (int64_t i = 0; i < n; i++) d[i] = q3_f32_to_f16(mean + std * q3_normal_at(key, first + (uint64_t)i));
    } else {
        float *d = (float *)dst;
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
        for (int64_t i = 0; i < n; i++) d[i] = mean + std * q3_normal_at(key, first + (uint64_t)i);
    }
}

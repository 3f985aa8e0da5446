/* Counter-based generator: a 64-bit mix of (key, index) gives four 16-bit uniforms whose
 * sum, centred and scaled, approximates a standard normal. Integer-only until the last
 * step, so the loop vectorises. */
#include "ops.h"

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* sum of four U[0, 1) has mean 2 and variance 1/3 */
static inline float approx_normal(uint64_t key, uint64_t i) {
    const uint64_t r = mix64(key + 0x9e3779b97f4a7c15ull * (i + 1));
    const uint32_t s = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) +
                       (uint32_t)((r >> 32) & 0xffff) + (uint32_t)(r >> 48);
    return ((float)s * (1.0f / 65536.0f) - 2.0f) * 1.7320508075688772f;
}

void Q3_CPU_FN(q3_fill_normal)(void *dst, q3_dtype dt, int64_t n, uint64_t seed, uint64_t stream,
                        float mean, float std) {
    const uint64_t key = mix64(seed * 0x632be59bd9b4e019ull + mix64(stream + 1));
    if (dt == Q3_BF16) {
        uint16_t *d = (uint16_t *)dst;
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
        for (int64_t i = 0; i < n; i++) d[i] = q3_f32_to_bf16(mean + std * approx_normal(key, (uint64_t)i));
    } else {
        float *d = (float *)dst;
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
        for (int64_t i = 0; i < n; i++) d[i] = mean + std * approx_normal(key, (uint64_t)i);
    }
}

/* KV-cache append with conversion to the cache's storage dtype. */
#include "ops.h"

void Q3_CPU_FN(q3_kv_write)(void *cache, q3_dtype dt, const float *src, int64_t src_stride,
                     int64_t L, int kv_heads, int D, int64_t capacity, int64_t start) {
    for (int h = 0; h < kv_heads; h++) {
        for (int64_t t = 0; t < L; t++) {
            const float *s = src + t * src_stride + (int64_t)h * D;
            const int64_t off = ((int64_t)h * capacity + start + t) * D;
            if (dt == Q3_BF16) {
                uint16_t *d = (uint16_t *)cache + off;
#pragma omp simd
                for (int i = 0; i < D; i++) d[i] = q3_f32_to_bf16(s[i]);
            } else if (dt == Q3_F16) {
                uint16_t *d = (uint16_t *)cache + off;
                for (int i = 0; i < D; i++) d[i] = q3_f32_to_f16(s[i]);
            } else {
                memcpy((float *)cache + off, s, (size_t)D * sizeof(float));
            }
        }
    }
}

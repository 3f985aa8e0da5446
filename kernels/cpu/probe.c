/* Machine probes (kernels/probe.h) in GNU C vector types as wide as the variant's
 * registers (zmm, ymm, or 16 bytes for the portable baseline). */
#include "ops.h"
#include "vec.h"

#define VBYTES Q3_VBYTES
#define LANES Q3_LANES
typedef uint64_t vu64 __attribute__((vector_size(VBYTES)));
typedef q3_vf vf32;

uint64_t Q3_CPU_FN(q3_probe_read)(const void *buf, size_t bytes) {
    const vu64 *p = (const vu64 *)buf;
    const size_t n = bytes / VBYTES;
    uint64_t sum = 0;
#pragma omp parallel reduction(^ : sum)
    {
        vu64 a = {0}, b = {0}, c = {0}, d = {0};
        /* each thread streams its own contiguous quarter-split range: 4 loads in flight */
#pragma omp for schedule(static)
        for (size_t i = 0; i < n / 4; i++) {
            a ^= p[4 * i];
            b ^= p[4 * i + 1];
            c ^= p[4 * i + 2];
            d ^= p[4 * i + 3];
        }
        const vu64 x = a ^ b ^ c ^ d;
        for (int j = 0; j < VBYTES / 8; j++) sum ^= x[j];
    }
    return sum;
}

int64_t Q3_CPU_FN(q3_probe_fma)(int64_t iters, float *sink) {
    int64_t total = 0;
    float keep = 0.0f;
#pragma omp parallel reduction(+ : total, keep)
    {
        /* 12 independent chains hide the FMA latency on two FMA ports */
        vf32 acc[12];
        const vf32 m = (vf32){0} + 0.999999f, c = (vf32){0} + 1e-7f;
        for (int j = 0; j < 12; j++) acc[j] = (vf32){0} + (float)j;
        for (int64_t i = 0; i < iters; i++)
            for (int j = 0; j < 12; j++) acc[j] = acc[j] * m + c;
        for (int j = 0; j < 12; j++) keep += acc[j][j % LANES];
        total += iters * 12 * LANES;
    }
    *sink = keep;
    return total;
}

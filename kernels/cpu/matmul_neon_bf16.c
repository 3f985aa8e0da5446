/* The neon_bf16 level's matmul (csrc/engine/cpu_dispatch.c): on aarch64 CPUs with the ARMv8.6
 * BF16 extension (Neoverse V2: Grace, Graviton4; Cortex-X925: GB10), a bf16-weight product
 * given the bf16 scratch xb runs on BFDOT: x rounded to bf16 once per call, as transformers
 * holds it in bf16 and as the avx512bf16 level's vdpbf16ps does; each lane of an accumulator
 * takes two products a step, 8 inputs a 128-bit load, fp32 sums. Every other product (fp32
 * weights, no xb: the router, which keeps x exact) is the generic kernel's. Compiled in the
 * neon_bf16 variant only (aarch64, -march=armv8.6-a+bf16: kernels/cpu/isa.h), whose other ops
 * are the neon variant's code built for that target: the level is offered where getauxval's
 * HWCAP2_BF16 says the CPU has it.
 *   y [T, N] (=, or +=) x [T, K] * W^T, W [N, K] bf16 */
#include "ops.h"

#if defined(__aarch64__) && Q3_ISA_BFDOT && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)

#include <arm_neon.h>

/* sum_k a[k] b[k] over K bf16 pairs: 8 a load, two accumulators, the tail converted to fp32 */
static float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t K) {
    float32x4_t s0 = vdupq_n_f32(0.0f), s1 = vdupq_n_f32(0.0f);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        s0 = vbfdotq_f32(s0, vld1q_bf16((const bfloat16_t *)(a + k)), vld1q_bf16((const bfloat16_t *)(b + k)));
        s1 = vbfdotq_f32(s1, vld1q_bf16((const bfloat16_t *)(a + k + 8)), vld1q_bf16((const bfloat16_t *)(b + k + 8)));
    }
    for (; k + 8 <= K; k += 8)
        s0 = vbfdotq_f32(s0, vld1q_bf16((const bfloat16_t *)(a + k)), vld1q_bf16((const bfloat16_t *)(b + k)));
    float s = vaddvq_f32(vaddq_f32(s0, s1));
    for (; k < K; k++) s += q3_bf16_to_f32(a[k]) * q3_bf16_to_f32(b[k]);
    return s;
}

void q3_matmul_bfdot_cpu_neon_bf16(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N,
                             int64_t K, int accumulate, uint16_t *xb) {
    if (w_dt != Q3_BF16 || !xb || T <= 0 || N <= 0 || K <= 0) {
        q3_matmul_cpu_neon_bf16(y, x, w, w_dt, T, N, K, accumulate, xb);
        return;
    }
    for (int64_t i = 0; i < T * K; i++) xb[i] = q3_f32_to_bf16(x[i]); /* T x K fits the scratch */
    const uint16_t *wb = (const uint16_t *)w;
#pragma omp parallel for schedule(static) if (T * N * K > (1 << 18))
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wn = wb + n * K;
        for (int64_t t = 0; t < T; t++) {
            const float s = dot_bf16(xb + t * K, wn, K);
            y[t * N + n] = accumulate ? y[t * N + n] + s : s;
        }
    }
}

#endif

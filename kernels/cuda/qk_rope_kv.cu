// QK-norm, RoPE and the KV-cache append in one kernel (twin: kernels/cpu/qk_rope_kv.c:
// rmsnorm, rope and kv_write in turn). One warp per head of one token row: q heads are
// normalised and rotated in place; k heads are normalised, rotated and written to the cache;
// v heads are written to the cache. The head is staged in shared memory so RoPE can pair dims d and d + D/2 for any
// head_dim. Row r is token t = r % L of sequence s = r / L, at cache position n_past + t
// (seqs: the device array the attention kernel reads too).
#include <math.h>

#include "../attention.h"
#include "common.cuh"
#include "ops_cuda.h"

#define WARPS 8
#define MAX_D 256
static_assert(MAX_D >= Q3_CUDA_MAX_HEAD_DIM, "the CUDA layer takes head dims up to Q3_CUDA_MAX_HEAD_DIM");

// The rotation's table, by value: the kernel parameter space holds it (constant bank reads,
// no global load, nothing to upload or free, and a captured graph keeps its copy).
// inv_freq [D / 2] of the engine's q3_rope_table; scale multiplies cos and sin.
struct rope_table {
    float inv_freq[MAX_D / 2];
    float scale;
};

// sin and cos of the fp32 angle a, |a| <= 2^40 (Q3_MAX_POSITIONS): sincosf itself would be
// right but carries a Payne-Hanek path for |a| > 105615 that keeps a stack frame (local
// memory) in the kernel. Instead a is reduced by n = rint(a / 2pi) turns in double with 2pi
// as HI + LO: a - n * HI is exact (a >= pi is a multiple of 2^-22, n * HI of 2^-50, and the
// difference is under 4 = 2^52 * 2^-50: 52 bits), the second fma leaves n * 2^-107 < 2^-69 of
// 2pi unaccounted. The reduced angle, under pi plus an ulp, goes in half-turns to sincospif,
// whose own reduction is exact: about 2e-7 absolute from the float rounding of r / pi, as
// far from the true sin and cos as sincosf's ulp.
#define TWO_PI_HI 6.283185307179586232  /* 2pi rounded to double (below it) */
#define TWO_PI_LO 2.4492935982947064e-16  /* 2pi - TWO_PI_HI */
__device__ __forceinline__ void rope_sincos(float a, float *sn, float *cs) {
    const double x = (double)a, n = rint(x * (1.0 / TWO_PI_HI));
    const double r = fma(-n, TWO_PI_LO, fma(-n, TWO_PI_HI, x));
    sincospif((float)(r * (1.0 / 3.14159265358979323846)), sn, cs);
}

__global__ void qk_rope_kv_kernel(float *q, float *k, const float *v, const void *q_norm, const void *k_norm,
                                  q3_dtype w_dt, const int64_t *pos, const q3_attn_seq *seqs, q3_attn_shape sh,
                                  float eps, const rope_table rope) {
    Q3_SHARED(float[WARPS][MAX_D], head);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t r = blockIdx.x;
    const int Hq = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim, half = D / 2;
    const int h = blockIdx.y * WARPS + warp; // q heads, then k heads, then v heads
    if (h >= Hq + 2 * Hkv) return;
    const int64_t s = r / sh.L, t = r % sh.L;
    const q3_attn_seq sq = seqs[s];
    float *vec = h < Hq ? q + (r * Hq + h) * D : k + (r * Hkv + (h - Hq)) * D;
    if (h >= Hq + Hkv) { // v: straight to the cache
        const int kv = h - Hq - Hkv;
        const float *src = v + (r * Hkv + kv) * D;
        for (int i = lane; i < D; i += 32)
            q3_store((void *)sq.v, sh.kv_dtype, ((int64_t)kv * sh.capacity + sq.n_past + t) * D + i, src[i]);
        return;
    }
    float ss = 0.0f;
    for (int i = lane; i < D; i += 32) ss += vec[i] * vec[i];
    const float inv = rsqrtf(q3_warp_sum(ss) / (float)D + eps);
    const void *w = h < Hq ? q_norm : k_norm;
    for (int i = lane; i < D; i += 32) head[warp][i] = q3_load(w, w_dt, i) * (vec[i] * inv);
    if (!Q3_MUTANT(9)) __syncwarp();
    const float p = (float)pos[r];
    for (int i = lane; i < half; i += 32) {
        float sn, cs;
        // the CPU's angle and scaling, bit for bit: (float)pos * inv_freq[i], cos(a) * scale
        rope_sincos(p * rope.inv_freq[i], &sn, &cs);
        cs *= rope.scale;
        sn *= rope.scale;
        const float lo = head[warp][i], hi = head[warp][i + half];
        const float out_lo = lo * cs - hi * sn, out_hi = hi * cs + lo * sn;
        if (h < Hq) {
            vec[i] = out_lo;
            vec[i + half] = out_hi;
        } else {
            const int64_t base = ((int64_t)(h - Hq) * sh.capacity + sq.n_past + t) * D;
            q3_store((void *)sq.k, sh.kv_dtype, base + i, out_lo);
            q3_store((void *)sq.k, sh.kv_dtype, base + i + half, out_hi);
        }
    }
}

// q [R, Hq, D] in place; k [R, Hkv, D] and v [R, Hkv, D] into the cache rows of seqs;
// R = n_seqs * shape->L rows, pos [R] and seqs on the device; inv_freq [D / 2] on the host
// (copied into the launch's parameters)
extern "C" int q3_qk_rope_kv_cuda(float *q, float *k, const float *v, const void *q_norm, const void *k_norm,
                                  q3_dtype w_dt, const int64_t *pos, const q3_attn_seq *seqs, int n_seqs,
                                  const q3_attn_shape *shape, float eps, const float *inv_freq, float scale,
                                  void *stream) {
    if (shape->head_dim > MAX_D || shape->head_dim % 2) return (int)cudaErrorInvalidValue;
    const int64_t rows = (int64_t)n_seqs * shape->L;
    if (rows == 0) return 0;
    rope_table rope = {};
    for (int i = 0; i < shape->head_dim / 2; i++) rope.inv_freq[i] = inv_freq[i];
    rope.scale = scale;
    const int heads = shape->heads + 2 * shape->kv_heads;
    const dim3 grid((unsigned)rows, (unsigned)((heads + WARPS - 1) / WARPS));
    Q3_LAUNCH(qk_rope_kv_kernel, grid, WARPS * 32, 0, (cudaStream_t)stream)(q, k, v, q_norm, k_norm, w_dt, pos, seqs, *shape,
                                                                      eps, rope);
    return q3_launch_status();
}

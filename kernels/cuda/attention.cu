// Causal GQA attention over the KV cache, online softmax (twin: kernels/cpu/attention.c).
// One block per (sequence, KV head, query token); its warps are the G = Hq / Hkv query
// heads of that KV head, so each K/V row fetched into shared memory serves all of them.
// Keys go in tiles of KEY_TILE: each lane scores one key per step, then the warp rescales
// and adds the tile's values, one head dim per lane group. (Split-KV for long decodes and
// tensor-core tiles for prefill come next; this is the correct baseline the twin checks.)
#include <math.h>

#include "../attention.h"
#include "common.cuh"

#define KEY_TILE 32
#define MAX_D 256

__global__ void attention_kernel(float *out, const float *q, const q3_attn_seq *seqs, q3_attn_shape sh) {
    const int G = sh.heads / sh.kv_heads, D = sh.head_dim;
    const int64_t L = sh.L;
    const int t = (int)(blockIdx.x % L), h = (int)((blockIdx.x / L) % sh.kv_heads), s = (int)(blockIdx.x / (L * sh.kv_heads));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    extern __shared__ float smem[]; // k tile [KEY_TILE][D], v tile [KEY_TILE][D]
    float *kt = smem, *vt = smem + KEY_TILE * D;
    const q3_attn_seq sq = seqs[s];
    const int64_t head_off = (int64_t)h * sh.capacity * D;
    const int64_t n_keys = sq.n_past + t + 1;
    const int64_t row = ((int64_t)s * L + t) * sh.heads + (int64_t)h * G + warp; // this warp's query head
    const float *qr = q + row * D;
    float m = -INFINITY, l = 0.0f, acc[MAX_D / 32];
    for (int i = 0; i < MAX_D / 32; i++) acc[i] = 0.0f;
    for (int64_t j0 = 0; j0 < n_keys; j0 += KEY_TILE) {
        const int nj = (int)(n_keys - j0 < KEY_TILE ? n_keys - j0 : KEY_TILE);
        __syncthreads();
        for (int e = threadIdx.x; e < nj * D; e += blockDim.x) {
            kt[e] = q3_load(sq.k, sh.kv_dtype, head_off + j0 * D + e);
            vt[e] = q3_load(sq.v, sh.kv_dtype, head_off + j0 * D + e);
        }
        __syncthreads();
        if (warp >= G) continue;
        float sc = -INFINITY;
        if (lane < nj) {
            float d = 0.0f;
            for (int i = 0; i < D; i++) d += qr[i] * kt[lane * D + i];
            sc = d * sh.scale;
        }
        const float mt = fmaxf(m, q3_warp_max(sc));
        const float p = lane < nj ? expf(sc - mt) : 0.0f;
        const float corr = expf(m - mt);
        l = l * corr + q3_warp_sum(p);
        m = mt;
        for (int i = 0; i < (D + 31) / 32; i++) {
            const int dim = i * 32 + lane;
            float a = acc[i] * corr;
            for (int j = 0; j < nj; j++) a += __shfl_sync(0xffffffffu, p, j) * (dim < D ? vt[j * D + dim] : 0.0f);
            acc[i] = a;
        }
    }
    if (warp >= G) return;
    for (int i = 0; i < (D + 31) / 32; i++) {
        const int dim = i * 32 + lane;
        if (dim < D) out[row * D + dim] = acc[i] / l;
    }
}

// out, q [n_seqs, L, Hq, D]; seqs: a device array of n_seqs entries
extern "C" int q3_attention_cuda(float *out, const float *q, const q3_attn_seq *seqs, int n_seqs,
                                 const q3_attn_shape *shape, void *stream) {
    const int G = shape->heads / shape->kv_heads;
    if (shape->head_dim > MAX_D || G > 32) return (int)cudaErrorInvalidValue;
    const unsigned blocks = (unsigned)((int64_t)n_seqs * shape->kv_heads * shape->L);
    if (blocks == 0) return 0;
    const size_t smem = 2 * KEY_TILE * (size_t)shape->head_dim * sizeof(float);
    attention_kernel<<<blocks, G * 32, smem, (cudaStream_t)stream>>>(out, q, seqs, *shape);
    return q3_launch_status();
}

// Causal GQA attention over the KV cache, online softmax (twin: kernels/cpu/attention.c).
// One block per (sequence, KV head, query token, slice of keys); its warps are the
// G = Hq / Hkv query heads of that KV head, so each K/V row fetched into shared memory serves
// all of them. Keys go in tiles of KEY_TILE: each lane scores one key per step, then the warp
// rescales and adds the tile's values, one head dim per lane and step of 32.
// Split-KV: a decode over a long context has few (token, KV head) pairs, so its keys are cut
// into slices run by separate blocks, each writing its (max, sum, accumulator) partial; a
// second kernel merges the slices of each query head. Prefill runs unsplit, and on tensor
// cores (attention_tc.cu) where the shape allows.
#include <math.h>

#include "../attention.h"
#include "common.cuh"
#include "ops_cuda.h"

#define KEY_TILE 32
#define MAX_D 256

// partial layout: [item = (s, t, query head)][slice][D + 2]: acc[D], then m, l
__global__ void attention_kernel(float *out, float *partial, const float *q, const q3_attn_seq *seqs,
                                 q3_attn_shape sh, int splits) {
    const int G = sh.heads / sh.kv_heads, D = sh.head_dim;
    const int64_t L = sh.L;
    const int t = (int)(blockIdx.x % L), h = (int)((blockIdx.x / L) % sh.kv_heads), s = (int)(blockIdx.x / (L * sh.kv_heads));
    const int slice = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    Q3_DYNAMIC_SHARED(float, smem); // k tile [KEY_TILE][D], v tile [KEY_TILE][D]
    float *kt = smem, *vt = smem + KEY_TILE * D;
    const q3_attn_seq sq = seqs[s];
    const int64_t head_off = (int64_t)h * sh.capacity * D;
    const int64_t n_keys = sq.n_past + t + 1 + Q3_MUTANT(2);
    // keys [lo, n_keys): after the sequence's padding, or only itself for a padding token
    const int64_t lo = n_keys - 1 >= sq.start ? sq.start : n_keys - 1;
    const int64_t per = (n_keys - lo + splits - 1) / splits;
    const int64_t k_begin = lo + slice * per, k_end = k_begin + per < n_keys ? k_begin + per : n_keys;
    const int64_t row = ((int64_t)s * L + t) * sh.heads + (int64_t)h * G + warp; // this warp's query head
    const float *qr = q + row * D;
    float m = -INFINITY, l = 0.0f, acc[MAX_D / 32];
    for (int i = 0; i < MAX_D / 32; i++) acc[i] = 0.0f;
    for (int64_t j0 = k_begin; j0 < k_end; j0 += KEY_TILE) {
        const int nj = (int)(k_end - j0 < KEY_TILE ? k_end - j0 : KEY_TILE);
        __syncthreads();
        for (int e = threadIdx.x; e < nj * D; e += blockDim.x) {
            kt[e] = q3_load(sq.k, sh.kv_dtype, head_off + j0 * D + e);
            vt[e] = q3_load(sq.v, sh.kv_dtype, head_off + j0 * D + e);
        }
        if (!Q3_MUTANT(1)) __syncthreads();
        if (warp >= G) continue;
        float sc = -INFINITY;
        if (lane < nj) {
            float d = 0.0f;
            for (int i = 0; i < D; i++) d += qr[i] * kt[lane * D + i];
            sc = d * sh.scale;
            if (Q3_MUTANT(7)) __syncthreads();
        }
        const float mt = fmaxf(m, q3_warp_max(sc));
        const float p = lane < nj ? expf(sc - mt) : 0.0f;
        const float corr = m == -INFINITY ? 0.0f : expf(m - mt);
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
    if (splits == 1) {
        for (int i = 0; i < (D + 31) / 32; i++) {
            const int dim = i * 32 + lane;
            if (dim < D) out[row * D + dim] = acc[i] / l;
        }
        return;
    }
    float *part = partial + (row * splits + slice) * (D + 2);
    for (int i = 0; i < (D + 31) / 32; i++) {
        const int dim = i * 32 + lane;
        if (dim < D) part[dim] = acc[i];
    }
    if (lane == 0) {
        part[D] = m;
        part[D + 1] = l;
    }
}

// out[row] = merge of the row's slices: one warp per query head row
__global__ void combine_kernel(float *out, const float *partial, int64_t rows, int D, int splits) {
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float *p = partial + row * splits * (D + 2);
    float m = -INFINITY;
    for (int j = 0; j < splits; j++) m = fmaxf(m, p[j * (D + 2) + D]);
    float l = 0.0f;
    for (int j = 0; j < splits; j++) {
        const float mj = p[j * (D + 2) + D];
        l += mj == -INFINITY ? 0.0f : p[j * (D + 2) + D + 1] * expf(mj - m);
    }
    for (int dim = lane; dim < D; dim += 32) {
        float a = 0.0f;
        for (int j = 0; j < splits; j++) {
            const float mj = p[j * (D + 2) + D];
            if (mj != -INFINITY) a += p[j * (D + 2) + dim] * expf(mj - m);
        }
        out[row * D + dim] = a / l;
    }
}

extern "C" int q3_attention_tc_fits(const q3_attn_shape *sh);
extern "C" int q3_attention_tc_cuda(float *out, const float *q, const q3_attn_seq *seqs, int n_seqs,
                                    const q3_attn_shape *sh, void *stream);

// out, q [n_seqs, L, Hq, D]; seqs: a device array of n_seqs entries. Calls of more tokens
// per sequence than split-KV takes go to tensor cores where the shape fits (attention_tc.cu).
extern "C" int q3_attention_cuda(float *out, const float *q, const q3_attn_seq *seqs, int n_seqs,
                                 const q3_attn_shape *shape, float *partial, void *stream) {
    const int G = shape->heads / shape->kv_heads;
    if (shape->head_dim > MAX_D || G > 32) return (int)cudaErrorInvalidValue;
    if (shape->L > Q3_SPLIT_MAX_TOKENS && q3_attention_tc_fits(shape))
        return q3_attention_tc_cuda(out, q, seqs, n_seqs, shape, stream);
    const unsigned items = (unsigned)((int64_t)n_seqs * shape->kv_heads * shape->L);
    if (items == 0) return 0;
    int splits = 1;
    if (partial && shape->L <= Q3_SPLIT_MAX_TOKENS && shape->max_keys > 2 * Q3_SPLIT_MIN_KEYS) {
        const int64_t want = shape->max_keys / Q3_SPLIT_MIN_KEYS;
        splits = (int)(want < Q3_SPLIT_MAX ? want : Q3_SPLIT_MAX);
    }
    cudaStream_t s = (cudaStream_t)stream;
    const size_t smem = 2 * KEY_TILE * (size_t)(Q3_MUTANT(8) ? MAX_D : shape->head_dim) * sizeof(float);
    Q3_LAUNCH(attention_kernel, dim3(items, (unsigned)splits), G * 32, smem, s)(out, partial, q, seqs, *shape, splits);
    if (splits > 1) {
        const int64_t rows = (int64_t)n_seqs * shape->L * shape->heads;
        Q3_LAUNCH(combine_kernel, (unsigned)((rows + 7) / 8), 256, 0, s)(out, partial, rows, shape->head_dim, splits);
    }
    return q3_launch_status();
}

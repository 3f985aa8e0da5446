// The attention probabilities a layer call hands out on request (kernels/attention.h's
// q3_attention_probs_fn; the oracle is the CPU kernel kernels/cpu/attention_probs.c). Off the
// layer's own path: only calls that ask for the maps launch it, so it is written for
// clarity, in fp32 throughout as the attention kernels' softmax.
//
// One block per output row (sequence s, query head h, new token t), the row of `context`
// floats it owns. The query at cache row i = n_past + t sees the keys of [lo, i] not hidden
// (lo the sequence's first key; a query before it, i < first_key, only itself), and of the
// call's tokens (rows from tree_first on) those its row of the call's tree keeps. A hidden
// key, or one the tree leaves out, is not scored: its -inf gives it probability 0. Three
// passes over the row, the row itself holding the intermediate values, so that no memory
// grows with the context (40960 keys at the real geometry; shared memory holds only the
// reductions' 2 x 32 floats):
//   1. scores: each warp scores groups of 32 consecutive keys, one key at a time, its lanes
//      splitting the key's D dims (dim lane + 32 c, q's dims in registers) and summing by
//      shuffles; lane kk keeps key kk's score, so the group's 32 scores go to the row in one
//      coalesced store. Then the block's max.
//   2. row[j] = exp(row[j] - max) over [lo, i], each thread a stride of the row; the block's sum.
//   3. the whole row: p / sum inside [lo, i], 0 outside (the future, the padding, columns
//      past a shorter sequence), coalesced.
// A key row is D contiguous elements: the 32 lanes' loads of dims lane + 32 c are one
// coalesced 64-byte (bf16, fp16) or 128-byte (fp32) access. The block reductions' barriers order
// each pass's writes of the row before the next pass reads them (other threads' columns).
#include <math.h>

#include "../attention.h"
#include "common.cuh"
#include "ops_cuda.h"

#define PROBS_THREADS 256 // 8 warps: a block-loop iteration covers 8 x 32 = 256 keys in pass 1
#define PROBS_WARPS (PROBS_THREADS / 32)
#define MAX_DIMS_PER_LANE (Q3_CUDA_MAX_HEAD_DIM / 32) // q's dims a lane holds: lane + 32 c

// max over the block (blockDim.x = PROBS_THREADS); every thread gets the result
__device__ __forceinline__ float block_max(float v) {
    Q3_SHARED(float[PROBS_WARPS], part);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = q3_warp_max(v);
    __syncthreads(); // part may still be read by a previous call's threads
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < PROBS_WARPS ? part[lane] : -INFINITY;
    return q3_warp_max(v);
}

// probs [n_seqs, Hq, out_tokens, context]; q [n_seqs, L, Hq, D]; seqs [n_seqs] (device);
// grid: one block per (s, h, t), item = (s * Hq + h) * L + t
__global__ void __launch_bounds__(PROBS_THREADS)
    attention_probs_kernel(float *probs, const float *q, const q3_attn_seq *seqs, q3_attn_shape sh, int64_t t0,
                           int64_t out_tokens, int64_t context) {
    const int Hq = sh.heads, D = sh.head_dim, G = Hq / sh.kv_heads;
    const int64_t L = sh.L, item = blockIdx.x;
    const int64_t t = item % L;
    const int h = (int)(item / L % Hq), s = (int)(item / L / Hq);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const q3_attn_seq sq = seqs[s];
    const int64_t i = sq.n_past + t;                         // the query's cache row
    const int64_t lo = i >= sq.first_key ? sq.first_key : i; // else it sees itself alone
    const uint8_t *hidden = lo < i ? sq.hidden : NULL;       // [capacity] or NULL: none hidden
    // the query's row of the call's tree [tree_tokens] (NULL: causal, or itself alone)
    const uint8_t *tree = sq.tree && lo < i ? sq.tree + (i - sq.tree_first) * sq.tree_tokens : NULL;
    // query head h reads KV head h / G (the planted defect: h % Hkv, the wrong one when G > 1)
    const int kvh = Q3_MUTANT(12) ? h % sh.kv_heads : h / G;
    const size_t es = q3_dtype_size(sh.kv_dtype);
    const bool f16 = sh.kv_dtype == Q3_F16;
    const char *k = (const char *)sq.k + (size_t)kvh * sh.capacity * D * es; // [capacity, D]
    const float *qr = q + ((int64_t)s * L + t) * Hq * D + (int64_t)h * D;    // [D]
    float *row = probs + (((int64_t)s * Hq + h) * out_tokens + t0 + t) * context; // [context]

    float qv[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int c = 0; c < MAX_DIMS_PER_LANE; c++) qv[c] = lane + 32 * c < D ? qr[lane + 32 * c] : 0.0f;

    // pass 1: the scaled scores of keys [lo, i] into the row; this thread's max of them
    float m = -INFINITY;
    for (int64_t j0 = lo + 32 * (int64_t)warp; j0 <= i; j0 += 32 * PROBS_WARPS) {
        const int nk = i - j0 + 1 < 32 ? (int)(i - j0 + 1) : 32; // the same for the whole warp
        float sc = -INFINITY;
        // the group's keys off the query's tree, bit kk for key j0 + kk (a lane a key)
        const unsigned off = tree ? __ballot_sync(0xffffffffu, lane < nk && j0 + lane >= sq.tree_first &&
                                                                   !tree[j0 + lane - sq.tree_first])
                                  : 0u;
#pragma unroll 1
        for (int kk = 0; kk < nk; kk++) {
            if (hidden && hidden[j0 + kk]) continue; // the whole warp: sc stays -inf for lane kk
            if ((off >> kk) & 1u) continue;          // likewise a key the tree leaves out
            const int64_t base = (j0 + kk) * D;
            float acc = 0.0f;
            // an fp16 key widened by kernels/dtype.h's formula, not q3_load's cvt (the same
            // values): with the cvt, sm_90's ptxas spilled a register here (benchmarks/sass_check.py)
#pragma unroll
            for (int c = 0; c < MAX_DIMS_PER_LANE; c++) {
                const int64_t i = base + lane + 32 * c;
                if (lane + 32 * c < D)
                    acc = fmaf(qv[c], f16 ? q3_f16_to_f32(((const uint16_t *)k)[i]) : q3_load(k, sh.kv_dtype, i), acc);
            }
            acc = q3_warp_sum(acc) * sh.scale;
            if (lane == kk) sc = acc;
        }
        if (lane < nk) {
            row[j0 + lane] = sc;
            m = fmaxf(m, sc);
        }
    }
    m = block_max(m);

    // pass 2: exp(score - max) in place; the block's sum
    float sum = 0.0f;
    for (int64_t j = lo + threadIdx.x; j <= i; j += PROBS_THREADS) {
        const float p = expf(row[j] - m);
        row[j] = p;
        sum += p;
    }
    const float inv = 1.0f / q3_block_sum(sum);

    // pass 3: normalised inside [lo, i], zero elsewhere
    for (int64_t j = threadIdx.x; j < context; j += PROBS_THREADS) row[j] = j >= lo && j <= i ? row[j] * inv : 0.0f;
}

// probs, q, seqs: device memory, as q3_attention_probs_fn (kernels/attention.h), whose
// preconditions the caller keeps (context >= n_past + L for every sequence: checked where
// the lengths are known, on the host); the sizes checked here are those the launch needs.
extern "C" int q3_attention_probs_cuda(float *probs, const float *q, const q3_attn_seq *seqs, int n_seqs,
                                       const q3_attn_shape *shape, int64_t t0, int64_t out_tokens, int64_t context,
                                       void *stream) {
    const int D = shape->head_dim;
    if (n_seqs < 0 || shape->L < 0 || shape->kv_heads < 1 || shape->heads % shape->kv_heads || D < 1 ||
        D > Q3_CUDA_MAX_HEAD_DIM || t0 < 0 || t0 + shape->L > out_tokens || context < shape->L)
        return (int)cudaErrorInvalidValue;
    const int64_t items = (int64_t)n_seqs * shape->heads * shape->L;
    if (items == 0) return 0;
    if (items > 0x7fffffff) return (int)cudaErrorInvalidValue; // gridDim.x's limit
    Q3_LAUNCH(attention_probs_kernel, (unsigned)items, PROBS_THREADS, 0, (cudaStream_t)stream)(probs, q, seqs, *shape,
                                                                                               t0, out_tokens, context);
    return q3_launch_status();
}

// Router softmax + top-k + renormalisation, one warp per token (twin: kernels/cpu/router.c).
//
// Selection is k rounds of a warp-wide argmax, so nothing is an array indexed at run time
// (the insertion list of the CPU's kept sel[32]/val[32] in local memory). Lane l owns experts
// l, l + 32, ...; their probabilities are recomputed from the logits each round (E / 32 loads
// a lane, L1 hits after the first round) rather than held, so any E runs without shared memory.
//
// The order is the one of kernels/router.h: descending probability, then ascending expert
// index. Round j picks the first expert, in that order, below round j-1's pick (p, e):
// eligible are experts of probability < p, or == p and index > e. A lane scans its experts in
// ascending index and keeps a strictly greater one, so of equal ones it keeps the lowest;
// the butterfly keeps, of two candidates, the greater probability or at equal probability the
// lower index. Every lane ends each round holding the same pick; lane j keeps round j's. A
// NaN probability (from a NaN or infinite logit) ranks as -1, below every number, the NaN
// experts among themselves by index, so k distinct experts in [0, E) are chosen whatever the
// logits (the MoE kernels index with them); the CPU's choice among NaNs is not matched.
#include "common.cuh"

#define MAX_K 32
#define ROUTER_WARPS 4 // tokens a block; benchmarks/sass_check.py records the block of 128

// the rank of probability p: itself, or -1 for a NaN
__device__ __forceinline__ float rank_of(float p) { return p == p ? p : -1.0f; }

__global__ void __launch_bounds__(ROUTER_WARPS * 32)
    router_kernel(int32_t *idx, float *weight, const float *logits, int64_t T, int E, int k, int normalize) {
    const int lane = threadIdx.x & 31;
    const int64_t t = (int64_t)blockIdx.x * ROUTER_WARPS + (threadIdx.x >> 5);
    if (t >= T) return; // a whole warp: t is the same in all its lanes
    const float *lg = logits + t * E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, lg[e]);
    mx = q3_warp_max(mx);
    float part = 0.0f;
    for (int e = lane; e < E; e += 32) part += expf(lg[e] - mx);
    const float sum = q3_warp_sum(part);
    float prev_r = INFINITY, tot = 0.0f, mine_w = 0.0f;
    int prev_e = -1, mine_e = 0; // lane j keeps round j's pick: one coalesced store of k at the end
    for (int j = 0; j < k; j++) {
        float best_r = -INFINITY;
        int best_e = E; // none yet: ranks past every expert
        for (int e = lane; e < E; e += 32) {
            const float r = rank_of(expf(lg[e] - mx));
            const bool below = r < prev_r || (r == prev_r && e > prev_e);
            if (below && r > best_r) {
                best_r = r;
                best_e = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float other_r = __shfl_xor_sync(0xffffffffu, best_r, o);
            const int other_e = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (other_r > best_r || (other_r == best_r && other_e < best_e)) {
                best_r = other_r;
                best_e = other_e;
            }
        }
        prev_r = best_r;
        prev_e = best_e;
        // every lane: the same pick, so the same weight and the same running total, in the
        // CPU's order (the sum of the weights j = 0 .. k-1 in turn)
        const float w = expf(lg[best_e] - mx) / sum;
        tot += w;
        if (lane == j) {
            mine_e = best_e;
            mine_w = w;
        }
    }
    if (lane < k) {
        idx[t * k + lane] = mine_e;
        weight[t * k + lane] = normalize ? mine_w / tot : mine_w;
    }
}

extern "C" int q3_router_topk_cuda(int32_t *idx, float *weight, const float *logits, int64_t T, int E, int k,
                                   int normalize, void *stream) {
    if (k > MAX_K || k > E) return (int)cudaErrorInvalidValue;
    if (T == 0) return 0;
    Q3_LAUNCH(router_kernel, (unsigned)((T + ROUTER_WARPS - 1) / ROUTER_WARPS), ROUTER_WARPS * 32, 0,
              (cudaStream_t)stream)(idx, weight, logits, T, E, k, normalize);
    return q3_launch_status();
}

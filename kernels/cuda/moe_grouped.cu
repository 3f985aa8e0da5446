// The routed experts of a decode step without the host (twins: q3_moe_route_host,
// q3_moe_gate_up_host, q3_moe_down_host, q3_moe_combine_host in csrc/check/twins.c).
// moe_route groups the (token, expert) pairs by expert on the device; the expert kernels
// then run one block column per *possible* active expert (max_active, a host number) and
// the blocks past active[0] return at once, so the grids depend only on host arguments and
// the whole sequence can be captured in a CUDA graph: no host sync, no allocation.
// Expert weights come as device arrays of E device pointers.
#include "moe_active.cuh"
#include "row_dots.cuh"

#define ROUTE_THREADS 256
#define ROUTE_MAX_EXPERTS 12288 // one int32 of shared memory per expert, within the default 48 KiB
#define COMBINE_THREADS 256
#define COMBINE_MAX_K 32

// Stable counting sort of the P = T * k pairs by expert, in one block (moe_group's order:
// within an expert, pairs in ascending pair index, so tokens ascending). All threads count;
// then warp 0 scans the counts and places the pairs in order, 32 per step.
__global__ void moe_route_kernel(int64_t *offsets, int32_t *rows, float *weights, int32_t *active, int32_t *slot,
                                 const int32_t *idx, const float *w, int64_t P, int k, int E) {
    Q3_DYNAMIC_SHARED(int32_t, fill); // [E]: pairs per expert, then each expert's next free slot
    for (int e = threadIdx.x; e < E; e += blockDim.x) fill[e] = 0;
    __syncthreads();
    for (int64_t p = threadIdx.x; p < P; p += blockDim.x) atomicAdd(&fill[idx[p]], 1);
    __syncthreads();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    const unsigned below = (1u << lane) - 1u; // the lanes before this one

    // exclusive scans over the experts of the pair counts and of "chosen at least once";
    // lane l owns experts [e0, e1), a contiguous run, so both come out in expert order
    const int per = (E + 31) / 32, e0 = min(E, lane * per), e1 = min(E, e0 + per);
    int pairs = 0, chosen = 0;
    for (int e = e0; e < e1; e++) {
        pairs += fill[e];
        chosen += fill[e] > 0;
    }
    int pairs_to = pairs, chosen_to = chosen; // inclusive warp scans
    for (int o = 1; o < 32; o <<= 1) {
        const int p = __shfl_up_sync(0xffffffffu, pairs_to, o + Q3_MUTANT(3));
        const int c = __shfl_up_sync(0xffffffffu, chosen_to, o);
        if (lane >= o) {
            pairs_to += p;
            chosen_to += c;
        }
    }
    if (lane == 31) {
        offsets[E] = pairs_to;
        active[0] = chosen_to;
    }
    int next = pairs_to - pairs, next_active = chosen_to - chosen;
    for (int e = e0; e < e1; e++) {
        const int n = fill[e];
        offsets[e] = next;
        fill[e] = next;
        if (n > 0) active[1 + next_active++] = e;
        next += n;
    }
    __syncwarp();

    // the pairs in order, 32 a step: a pair's slot is its expert's next free slot plus the
    // lanes before it in this step that chose the same expert; the lowest such lane then
    // advances the expert's next free slot past the step's pairs
    for (int64_t p0 = 0; p0 < P; p0 += 32) {
        const int64_t p = p0 + lane;
        const int e = p < P ? idx[p] : -1;
        const unsigned same = __match_any_sync(Q3_MUTANT(6) ? 0x0000ffffu : 0xffffffffu, e);
        if (p < P) {
            const int s = fill[e] + __popc(same & below);
            rows[s] = (int32_t)(p / k);
            weights[s] = w[p];
            slot[p] = s;
        }
        __syncwarp();
        if (p < P && !(same & below)) fill[e] += __popc(same);
        __syncwarp();
    }
}

// offsets [E + 1], rows, weights, slot [T * k], active [E + 1] <- idx, w [T, k]; 0 <= idx < E
extern "C" int q3_moe_route_cuda(int64_t *offsets, int32_t *rows, float *weights, int32_t *active, int32_t *slot,
                                 const int32_t *idx, const float *w, int64_t T, int k, int E, void *stream) {
    if (T < 0 || k < 0 || E < 1 || E > ROUTE_MAX_EXPERTS || T * k > INT32_MAX) return (int)cudaErrorInvalidValue;
    Q3_LAUNCH(moe_route_kernel, 1, ROUTE_THREADS, (size_t)E * sizeof(int32_t), (cudaStream_t)stream)(
        offsets, rows, weights, active, slot, idx, w, T * k, k, E);
    return q3_launch_status();
}

// act [s, i] = silu(x[rows[s]] . G_e[i]) * (x[rows[s]] . U_e[i]) for the slots s of the
// block column's expert e; one warp per weight row i, the group's tokens TOKENS_PER_WARP at
// a time, each activation load serving the gate and the up row (later chunks re-read the two
// weight rows from L1/L2: a decode step's expert has a few tokens, T * k / E on average)
__global__ void moe_gate_up_kernel(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                                   const int32_t *active, const void *const *gate, const void *const *up,
                                   q3_dtype w_dt, int64_t I, int64_t K) {
    int64_t first, n;
    const int e = active_expert(offsets, active, blockIdx.x, &first, &n);
    const int64_t i = (int64_t)blockIdx.y * GROUP_WARPS + (threadIdx.x >> 5);
    if (e < 0 || i >= I) return;
    const int lane = threadIdx.x & 31;
    const void *ws[2] = {gate[e], up[e]};
    for (int64_t c0 = 0; c0 < n; c0 += TOKENS_PER_WARP) {
        const int nt = n - c0 < TOKENS_PER_WARP ? (int)(n - c0) : TOKENS_PER_WARP;
        const float *xr[TOKENS_PER_WARP]; // the chunk's token rows of x
#pragma unroll
        for (int t = 0; t < TOKENS_PER_WARP; t++) xr[t] = t < nt ? x + (int64_t)rows[first + c0 + t] * K : x;
        float acc[2][TOKENS_PER_WARP] = {{0}};
        row_dots<TOKENS_PER_WARP, 2>(acc, x, xr, ws, w_dt, i, K, nt, lane);
#pragma unroll
        for (int t = 0; t < TOKENS_PER_WARP; t++) {
            if (t >= nt) break;
            const float gs = q3_warp_sum(acc[0][t]), us = q3_warp_sum(acc[1][t]);
            if (lane == 0) act[(first + c0 + t) * I + i] = gs / (1.0f + expf(-gs)) * us;
        }
    }
}

// y [s, i] = act [s] . D_e[i] for the slots s of the block column's expert e: its act rows
// are contiguous, act + first * K
__global__ void moe_down_kernel(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                                const void *const *down, q3_dtype w_dt, int64_t N, int64_t K) {
    int64_t first, n;
    const int e = active_expert(offsets, active, blockIdx.x, &first, &n);
    const int64_t i = (int64_t)blockIdx.y * GROUP_WARPS + (threadIdx.x >> 5);
    if (e < 0 || i >= N) return;
    const int lane = threadIdx.x & 31;
    const void *ws[1] = {down[e]};
    for (int64_t c0 = 0; c0 < n; c0 += TOKENS_PER_WARP) {
        const int nt = n - c0 < TOKENS_PER_WARP ? (int)(n - c0) : TOKENS_PER_WARP;
        float acc[1][TOKENS_PER_WARP] = {{0}};
        row_dots<TOKENS_PER_WARP, 1>(acc, act + (first + c0) * K, NULL, ws, w_dt, i, K, nt, lane);
#pragma unroll
        for (int t = 0; t < TOKENS_PER_WARP; t++) {
            if (t >= nt) break;
            const float s = q3_warp_sum(acc[0][t]);
            if (lane == 0) y[(first + c0 + t) * N + i] = s;
        }
    }
}

// act [T * k, I] by slot <- x [T, K]; max_active >= active[0] (min(E, T * k) always is)
extern "C" int q3_moe_gate_up_cuda(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                                   const int32_t *active, const void *const *gate, const void *const *up,
                                   q3_dtype w_dt, int max_active, int64_t I, int64_t K, void *stream) {
    if (max_active <= 0 || I == 0) return 0;
    dim3 grid;
    const int bad = expert_grid(&grid, max_active, I);
    if (bad) return bad;
    Q3_LAUNCH(moe_gate_up_kernel, grid, GROUP_WARPS * 32, 0, (cudaStream_t)stream)(act, x, rows, offsets, active, gate, up,
                                                                             w_dt, I, K);
    return q3_launch_status();
}

// y [T * k, N] by slot <- act [T * k, K]
extern "C" int q3_moe_down_cuda(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                                const void *const *down, q3_dtype w_dt, int max_active, int64_t N, int64_t K,
                                void *stream) {
    if (max_active <= 0 || N == 0) return 0;
    dim3 grid;
    const int bad = expert_grid(&grid, max_active, N);
    if (bad) return bad;
    Q3_LAUNCH(moe_down_kernel, grid, GROUP_WARPS * 32, 0, (cudaStream_t)stream)(y, act, offsets, active, down, w_dt, N, K);
    return q3_launch_status();
}

// x [t] += weights[s] * y [s] over token t's k slots in ascending slot order (the twin's
// order: expert by expert); block (t, c) does token t's elements c * blockDim.x + ...
// Each block sorts the token's slots itself (k <= 32, cheaper than a separate pass).
__global__ void moe_combine_kernel(float *x, const float *y, const float *weights, const int32_t *slot, int k,
                                   int64_t H) {
    Q3_SHARED(int32_t[COMBINE_MAX_K], order);
    Q3_SHARED(float[COMBINE_MAX_K], scale);
    const int64_t t = blockIdx.x;
    if (threadIdx.x == 0) {
        for (int j = 0; j < k; j++) { // insertion sort, stable
            const int32_t s = slot[t * k + j];
            int p = j;
            for (; p > 0 && order[p - 1] > s; p--) order[p] = order[p - 1];
            order[p] = s;
        }
        for (int j = 0; j < k; j++) scale[j] = weights[order[j]];
    }
    __syncthreads();
    float *xr = x + t * H;
    for (int64_t i = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; i < H; i += (int64_t)gridDim.y * blockDim.x) {
        float v = xr[i];
        for (int j = 0; j < k; j++) v += scale[j] * y[(int64_t)order[j] * H + i];
        xr[i] = v;
    }
}

// x [T, H] += the weighted expert outputs y [T * k, H] (by slot) of each token
extern "C" int q3_moe_combine_cuda(float *x, const float *y, const float *weights, const int32_t *slot, int64_t T,
                                   int k, int64_t H, void *stream) {
    if (k < 0 || k > COMBINE_MAX_K || T > INT32_MAX) return (int)cudaErrorInvalidValue;
    if (T == 0 || k == 0 || H == 0) return 0;
    const int64_t chunks = (H + COMBINE_THREADS - 1) / COMBINE_THREADS;
    const dim3 grid((unsigned)T, (unsigned)(chunks < 65535 ? chunks : 65535));
    Q3_LAUNCH(moe_combine_kernel, grid, COMBINE_THREADS, 0, (cudaStream_t)stream)(x, y, weights, slot, k, H);
    return q3_launch_status();
}

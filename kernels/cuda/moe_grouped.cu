// The routed experts of a decode step without the host (twins: kernels/cpu/moe_grouped.c,
// q3_moe_route_host, q3_moe_gate_up_host, q3_moe_down_host, q3_moe_combine_host, the _fp8 and
// _int4 pairs).
// moe_route groups the (token, expert) pairs by expert on the device; the expert kernels
// then run one block column per *possible* active expert (max_active, a host number) and
// the blocks past active[0] return at once, so the grids depend only on host arguments and
// the whole sequence can be captured in a CUDA graph: no host sync, no allocation.
// Expert weights come as device arrays of E device pointers: dense (bf16, fp16 or fp32) matrices
// [rows, K], or FP8 ones (kernels/fp8.h: e4m3 bytes [rows, K] and E more pointers to their
// scale_inv [ceil(rows/128), ceil(K/128)] of dtype sdt). The gate/up and down kernels are one
// source for both, templated on the weight-row reader (dense_rows or fp8_rows, below). 4-bit
// GPTQ experts (kernels/int4.h) have kernels of their own on int4.cuh's tile, and come as
// device arrays of E q3_int4_matrix (below, with the reason).
#include "fp8.cuh"
#include "int4.cuh"

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

// ---- the weight-row readers: all that differs between dense and FP8 experts ----
// A reader is the expert kernels' weight argument: per matrix j (gate and up for gate/up;
// down, and an unused second, for down), the device array of its E experts' device pointers.
// expert_rows<NW> takes one expert's NW pointers, once a block; expert_row_dots then dots its
// rows with the tokens' activations (row_dots.cuh, fp8.cuh: acc as there). Written without a
// loop over j and passed by value: with either, nvcc kept the fallback loop's dtype test
// inside the loop, and the kernels no longer compiled to the code of the two hand copies
// they replace (the same registers and instructions, checked on the PTX and the SASS).

// dense experts: bf16, fp16 or fp32 matrices [rows, K] (16-byte loads of 8 halves where K % 8 == 0)
struct dense_rows {
    const void *const *w[2]; // [E] device pointers to [rows, K] of dt, per matrix
    q3_dtype dt;
};
template <int NW> struct dense_expert {
    const void *w[NW]; // [rows, K] of dt
    q3_dtype dt;
};
template <int NW> __device__ __forceinline__ dense_expert<NW> expert_rows(const dense_rows &r, int e) {
    static_assert(NW == 1 || NW == 2, "one matrix (down) or two (gate, up)");
    dense_expert<NW> x;
    x.w[0] = r.w[0][e];
    if (NW == 2) x.w[NW - 1] = r.w[1][e];
    x.dt = r.dt;
    return x;
}
template <int NT, int NW>
__device__ __forceinline__ void expert_row_dots(float (*acc)[NT], const dense_expert<NW> w, const float *x,
                                                const float *const *xr, int64_t row, int64_t K, int nt, int lane) {
    row_dots<NT, NW>(acc, x, xr, w.w, w.dt, row, K, nt, lane);
}

// FP8 experts: e4m3 bytes [rows, K] and their block scales (16-byte loads of 16 e4m3 where
// K % 16 == 0 and the rows are 16-byte aligned)
struct fp8_rows {
    const uint8_t *const *w[2];  // [E] device pointers to the bytes [rows, K], per matrix
    const void *const *scale[2]; // [E] device pointers to their scale_inv [ceil(rows/128), ceil(K/128)]
    q3_dtype sdt;                // of the scales: fp32 or bf16
};
template <int NW> struct fp8_expert {
    const uint8_t *w[NW];  // [rows, K] e4m3
    const void *scale[NW]; // [ceil(rows/128), ceil(K/128)] of sdt
    q3_dtype sdt;
};
template <int NW> __device__ __forceinline__ fp8_expert<NW> expert_rows(const fp8_rows &r, int e) {
    static_assert(NW == 1 || NW == 2, "one matrix (down) or two (gate, up)");
    fp8_expert<NW> x;
    x.w[0] = r.w[0][e];
    if (NW == 2) x.w[NW - 1] = r.w[1][e];
    x.scale[0] = r.scale[0][e];
    if (NW == 2) x.scale[NW - 1] = r.scale[1][e];
    x.sdt = r.sdt;
    return x;
}
template <int NT, int NW>
__device__ __forceinline__ void expert_row_dots(float (*acc)[NT], const fp8_expert<NW> w, const float *x,
                                                const float *const *xr, int64_t row, int64_t K, int nt, int lane) {
    fp8_row_dots<NT, NW>(acc, x, xr, w.w, w.scale, w.sdt, row, K, nt, lane);
}

// ---- the expert kernels, one source for either reader R ----
#define GROUP_WARPS 8 // weight rows (warps) per block of the expert kernels

// block column a's expert (the a-th active one) and its slots [*first, *first + *n); -1
// when fewer than a + 1 experts are active
__device__ __forceinline__ int active_expert(const int64_t *offsets, const int32_t *active, int a, int64_t *first,
                                             int64_t *n) {
    if (a >= active[0]) return -1;
    const int e = active[1 + a];
    *first = offsets[e];
    *n = offsets[e + 1] - *first;
    return e;
}

// act [s, i] = silu(x[rows[s]] . G_e[i]) * (x[rows[s]] . U_e[i]) for the slots s of the
// block column's expert e; one warp per weight row i, the group's tokens TOKENS_PER_WARP at
// a time, each activation load serving the gate and the up row (later chunks re-read the two
// weight rows from L1/L2: a decode step's expert has a few tokens, T * k / E on average)
template <class R>
__global__ void moe_gate_up_kernel(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                                   const int32_t *active, R gate_up, int64_t I, int64_t K) {
    int64_t first, n;
    const int e = active_expert(offsets, active, blockIdx.x, &first, &n);
    const int64_t i = (int64_t)blockIdx.y * GROUP_WARPS + (threadIdx.x >> 5);
    if (e < 0 || i >= I) return;
    const int lane = threadIdx.x & 31;
    const auto w = expert_rows<2>(gate_up, e);
    for (int64_t c0 = 0; c0 < n; c0 += TOKENS_PER_WARP) {
        const int nt = n - c0 < TOKENS_PER_WARP ? (int)(n - c0) : TOKENS_PER_WARP;
        const float *xr[TOKENS_PER_WARP]; // the chunk's token rows of x
#pragma unroll
        for (int t = 0; t < TOKENS_PER_WARP; t++) xr[t] = t < nt ? x + (int64_t)rows[first + c0 + t] * K : x;
        float acc[2][TOKENS_PER_WARP] = {{0}};
        expert_row_dots(acc, w, x, xr, i, K, nt, lane);
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
template <class R>
__global__ void moe_down_kernel(float *y, const float *act, const int64_t *offsets, const int32_t *active, R down,
                                int64_t N, int64_t K) {
    int64_t first, n;
    const int e = active_expert(offsets, active, blockIdx.x, &first, &n);
    const int64_t i = (int64_t)blockIdx.y * GROUP_WARPS + (threadIdx.x >> 5);
    if (e < 0 || i >= N) return;
    const int lane = threadIdx.x & 31;
    const auto w = expert_rows<1>(down, e);
    for (int64_t c0 = 0; c0 < n; c0 += TOKENS_PER_WARP) {
        const int nt = n - c0 < TOKENS_PER_WARP ? (int)(n - c0) : TOKENS_PER_WARP;
        float acc[1][TOKENS_PER_WARP] = {{0}};
        expert_row_dots(acc, w, act + (first + c0) * K, NULL, i, K, nt, lane);
#pragma unroll
        for (int t = 0; t < TOKENS_PER_WARP; t++) {
            if (t >= nt) break;
            const float s = q3_warp_sum(acc[0][t]);
            if (lane == 0) y[(first + c0 + t) * N + i] = s;
        }
    }
}

// the grid of the expert kernels: max_active block columns by the weight rows, per_block a
// block (GROUP_WARPS warps of a row each, or an int4 tile's INT4_COLS); grid->x = 0 when there
// is nothing to launch (no possible expert, or no rows)
static inline int expert_grid(dim3 *grid, int max_active, int64_t rows, int per_block) {
    *grid = dim3(0);
    if (max_active <= 0 || rows == 0) return 0;
    const int64_t row_blocks = (rows + per_block - 1) / per_block;
    if (row_blocks > 65535) return (int)cudaErrorInvalidValue;
    *grid = dim3((unsigned)max_active, (unsigned)row_blocks);
    return 0;
}

// The launchers: one instance of each kernel per reader, launched by its own name (the
// executor's reports and sass_check name them so). gate/up: act [T * k, I] by slot <- x
// [T, K]; max_active >= active[0] (min(E, T * k) always is). down: y [T * k, N] by slot <-
// act [T * k, K].
extern "C" int q3_moe_gate_up_cuda(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                                   const int32_t *active, const void *const *gate, const void *const *up,
                                   q3_dtype w_dt, int max_active, int64_t I, int64_t K, void *stream) {
    dim3 grid;
    const int bad = expert_grid(&grid, max_active, I, GROUP_WARPS);
    if (bad || !grid.x) return bad;
    const dense_rows r = {{gate, up}, w_dt};
    Q3_LAUNCH(moe_gate_up_kernel<dense_rows>, grid, GROUP_WARPS * 32, 0, stream)(act, x, rows, offsets, active, r, I,
                                                                                 K);
    return q3_launch_status();
}

extern "C" int q3_moe_down_cuda(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                                const void *const *down, q3_dtype w_dt, int max_active, int64_t N, int64_t K,
                                void *stream) {
    dim3 grid;
    const int bad = expert_grid(&grid, max_active, N, GROUP_WARPS);
    if (bad || !grid.x) return bad;
    const dense_rows r = {{down, NULL}, w_dt};
    Q3_LAUNCH(moe_down_kernel<dense_rows>, grid, GROUP_WARPS * 32, 0, stream)(y, act, offsets, active, r, N, K);
    return q3_launch_status();
}

extern "C" int q3_moe_gate_up_fp8_cuda(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                                       const int32_t *active, const uint8_t *const *gate, const uint8_t *const *up,
                                       const void *const *gate_scale, const void *const *up_scale, q3_dtype sdt,
                                       int max_active, int64_t I, int64_t K, void *stream) {
    dim3 grid;
    const int bad = expert_grid(&grid, max_active, I, GROUP_WARPS);
    if (bad || !grid.x) return bad;
    const fp8_rows r = {{gate, up}, {gate_scale, up_scale}, sdt};
    Q3_LAUNCH(moe_gate_up_kernel<fp8_rows>, grid, GROUP_WARPS * 32, 0, stream)(act, x, rows, offsets, active, r, I, K);
    return q3_launch_status();
}

extern "C" int q3_moe_down_fp8_cuda(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                                    const uint8_t *const *down, const void *const *down_scale, q3_dtype sdt,
                                    int max_active, int64_t N, int64_t K, void *stream) {
    dim3 grid;
    const int bad = expert_grid(&grid, max_active, N, GROUP_WARPS);
    if (bad || !grid.x) return bad;
    const fp8_rows r = {{down, NULL}, {down_scale, NULL}, sdt};
    Q3_LAUNCH(moe_down_kernel<fp8_rows>, grid, GROUP_WARPS * 32, 0, stream)(y, act, offsets, active, r, N, K);
    return q3_launch_status();
}

// ---- 4-bit GPTQ experts: a tile of INT4_COLS outputs a block, not a row a warp ----
// An output's weights run down a column of qweight [K/8, N] (4 bytes a word row), so a warp a
// weight row, as above, would read a line for every 4 bytes: these kernels take int4.cuh's tile
// (a block 32 outputs, K split over its lanes, every word read once for 8 slots) in the same
// grid (block column a: the a-th active expert; blockIdx.y: a tile of outputs). The experts of
// a matrix come as a device array of E q3_int4_matrix (their tensors on the device): each its
// own group, as layer_int4.c decides it per matrix (0 where its g_idx is not k / group).

// what a block of the int4 expert kernels works on: expert e (-1: none, the block column past
// the active ones), its slots [first, first + n), the tile's first output n0, and this
// thread's share of the tile's sums: slot t of each chunk, output i
struct int4_expert_block {
    int e, t;
    int64_t first, n, n0, i;
};
__device__ __forceinline__ int4_expert_block int4_expert(const int64_t *offsets, const int32_t *active) {
    int4_expert_block b;
    b.e = active_expert(offsets, active, blockIdx.x, &b.first, &b.n);
    b.n0 = (int64_t)blockIdx.y * INT4_COLS;
    b.i = b.n0 + threadIdx.x % INT4_COLS;
    b.t = threadIdx.x / INT4_COLS;
    return b;
}

// act [s, i] = silu(x[rows[s]] . G_e[i]) * (x[rows[s]] . U_e[i]) for the slots s of the block
// column's expert e, INT4_TOKENS slots at a time: the gate's tile, then the up's (the same
// activation rows, from L1)
__global__ void __launch_bounds__(INT4_THREADS, 2)
    moe_gate_up_int4_kernel(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                            const int32_t *active, const q3_int4_matrix *gate, const q3_int4_matrix *up, int64_t I,
                            int64_t K) {
    Q3_SHARED(int4_partials, part);
    const int4_expert_block b = int4_expert(offsets, active);
    if (b.e < 0) return;
    const q3_int4_matrix g = gate[b.e], u = up[b.e];
    for (int64_t c0 = 0; c0 < b.n; c0 += INT4_TOKENS) {
        const int nt = b.n - c0 < INT4_TOKENS ? (int)(b.n - c0) : INT4_TOKENS;
        const float *xr[INT4_TOKENS]; // the chunk's token rows of x
#pragma unroll
        for (int j = 0; j < INT4_TOKENS; j++) xr[j] = j < nt ? x + (int64_t)rows[b.first + c0 + j] * K : x;
        const float gs = int4_tile_dots(g, x, xr, nt, I, K, b.n0, part);
        if (!Q3_MUTANT(17)) __syncthreads(); // every thread has read the gate's sums before up's land
        const float us = int4_tile_dots(u, x, xr, nt, I, K, b.n0, part);
        __syncthreads();
        if (b.t < nt && b.i < I) act[(b.first + c0 + b.t) * I + b.i] = gs / (1.0f + expf(-gs)) * us;
    }
}

// y [s, i] = act [s] . D_e[i] for the slots s of the block column's expert e (its act rows
// contiguous, act + first * K)
__global__ void __launch_bounds__(INT4_THREADS, 2)
    moe_down_int4_kernel(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                         const q3_int4_matrix *down, int64_t N, int64_t K) {
    Q3_SHARED(int4_partials, part);
    const int4_expert_block b = int4_expert(offsets, active);
    if (b.e < 0) return;
    const q3_int4_matrix d = down[Q3_MUTANT(18) ? (int)blockIdx.x : b.e];
    for (int64_t c0 = 0; c0 < b.n; c0 += INT4_TOKENS) {
        const int nt = b.n - c0 < INT4_TOKENS ? (int)(b.n - c0) : INT4_TOKENS;
        const float s = int4_tile_dots(d, act + (b.first + c0) * K, NULL, nt, N, K, b.n0, part);
        __syncthreads();
        if (b.t < nt && b.i < N) y[(b.first + c0 + b.t) * N + b.i] = s;
    }
}

// as moe_gate_up and moe_down: gate, up [E] of [I, K], down [E] of [N, K] (K, I, N multiples of 8)
extern "C" int q3_moe_gate_up_int4_cuda(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                                        const int32_t *active, const q3_int4_matrix *gate, const q3_int4_matrix *up,
                                        int max_active, int64_t I, int64_t K, void *stream) {
    if (I % Q3_INT4_PACK || K % Q3_INT4_PACK) return (int)cudaErrorInvalidValue;
    dim3 grid;
    const int bad = expert_grid(&grid, max_active, I, INT4_COLS);
    if (bad || !grid.x) return bad;
    Q3_LAUNCH(moe_gate_up_int4_kernel, grid, INT4_THREADS, 0, stream)(act, x, rows, offsets, active, gate, up, I, K);
    return q3_launch_status();
}

extern "C" int q3_moe_down_int4_cuda(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                                     const q3_int4_matrix *down, int max_active, int64_t N, int64_t K, void *stream) {
    if (N % Q3_INT4_PACK || K % Q3_INT4_PACK) return (int)cudaErrorInvalidValue;
    dim3 grid;
    const int bad = expert_grid(&grid, max_active, N, INT4_COLS);
    if (bad || !grid.x) return bad;
    Q3_LAUNCH(moe_down_int4_kernel, grid, INT4_THREADS, 0, stream)(y, act, offsets, active, down, N, K);
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

// The routed experts of a prefill on tensor cores (twins: q3_moe_gate_up_tc_host,
// q3_moe_down_tc_host, q3_moe_combine_csr_host in kernels/cpu/moe_prefill.c). The host has grouped
// the (token, expert) pairs by expert into slots and cut each expert's run of slots into
// tiles of at most 64 (q3_moe_tile), so one launch per projection covers a batch of
// experts: block (c, t) computes output columns c * 64 .. + 64 for the slots of tile t with
// the WMMA tile of wmma_tile.cuh, its expert's weights found through a device table of
// pointers. The activations stay fp32 in memory and are rounded to bf16 as they are staged
// (no bf16 copy of x). Double buffered: the next k slice is read into registers while the
// tensor cores work on the current one, and two shared buffers need one barrier a step
// (the staging helpers are wmma_tile.cuh's, shared with matmul_tc.cu).
#include "ops_cuda.h"
#include "wmma_tile.cuh"

#define MAX_GRID_Y 65535
#define COMBINE_THREADS 256

// One tile's block of output columns n0 .. +64: out [first + r, n] for r < tile.rows, n < N
// (row stride N) from A rows a + (rows ? rows[first + r] : first + r) * K and the tile's
// expert's bf16 [N, K] from w_table; GATED: also from up_table, out = silu(A W^T) * (A U^T).
template <bool GATED>
__device__ __forceinline__ void tile_product(float *out, const float *a, const int32_t *rows, q3_moe_tile tile,
                                             const void *const *w_table, const void *const *up_table, int64_t N,
                                             int64_t K, bool a_vec) {
    Q3_SHARED(staged_slice[2], as);
    Q3_SHARED(staged_slice[2], ws);
    Q3_SHARED(staged_slice[GATED ? 2 : 1], us);
    Q3_SHARED(float[WMMA_THREADS / 32][16][16], stash);
    const int64_t n0 = (int64_t)blockIdx.x * WMMA_TILE;
    const int wr = wmma_warp_row(), wc = wmma_warp_col();
    const bool live = wr < tile.rows && n0 + wc < N; // the warp has outputs: else it only stages
    const float *src[A_VECS];
#pragma unroll
    for (int i = 0; i < A_VECS; i++) {
        const int r = threadIdx.x / A_PER_ROW + A_STRIDE * i;
        src[i] = r < tile.rows ? a + (int64_t)(rows ? rows[tile.first + r] : tile.first + r) * K : NULL;
    }
    const uint16_t *w = (const uint16_t *)w_table[tile.expert];
    const uint16_t *u = GATED ? (const uint16_t *)up_table[tile.expert] : w;
    const bool w_vec = (((uintptr_t)w | (uintptr_t)u) & 15u) == 0;
    const int64_t a_col = threadIdx.x % A_PER_ROW * 4;

    wmma_acc acc[2][2], acc_up[2][2];
    wmma_zero(acc);
    if (GATED) wmma_zero(acc_up);
    float4 av[A_VECS];
    uint4 wv[W_VECS], uv[W_VECS];
    if (K > 0) {
        fetch_a(av, src, a_col, a_vec);
        fetch_w(wv, w, n0, N, K, 0, w_vec);
        if (GATED) fetch_w(uv, u, n0, N, K, 0, w_vec);
    }
    // step b: registers -> buffer b & 1, barrier, read step b + 1 into registers, multiply
    // buffer b & 1. That buffer was last read in step b - 2, which every warp finished
    // before the barrier of step b - 1: one barrier a step is enough.
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += WMMA_KSTEP, b++) {
        stage_a(as[b & 1], av);
        stage_w(ws[b & 1], wv);
        if (GATED) stage_w(us[b & 1], uv);
        __syncthreads();
        if (k0 + WMMA_KSTEP < K) {
            fetch_a(av, src, k0 + WMMA_KSTEP + a_col, a_vec);
            fetch_w(wv, w, n0, N, K, k0 + WMMA_KSTEP, w_vec);
            if (GATED) fetch_w(uv, u, n0, N, K, k0 + WMMA_KSTEP, w_vec);
        }
        if (live) {
            wmma_slice_mma(acc, as[b & 1], ws[b & 1], wr, wc);
            if (GATED) wmma_slice_mma(acc_up, as[b & 1], us[b & 1], wr, wc);
        }
    }
    __syncthreads(); // the buffers are free for this block's next tile
    if (!live) return;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (GATED) { // the fragments of acc and acc_up hold the same elements in the same order
#pragma unroll
                for (int e = 0; e < acc[i][j].num_elements; e++) {
                    const float g = acc[i][j].x[e];
                    acc[i][j].x[e] = g / (1.0f + expf(-g)) * acc_up[i][j].x[e];
                }
            }
            const int64_t r = wr + 16 * i, n = n0 + wc + 16 * j;
            wmma_store(out + (tile.first + r) * N + n, N, tile.rows - r, N - n, acc[i][j], stash[threadIdx.x >> 5], 0);
        }
}

// block (c, y): column block c of tiles y, y + gridDim.y, ... (gridDim.y is capped)
template <bool GATED>
__global__ void __launch_bounds__(WMMA_THREADS)
    moe_tiles_kernel(float *out, const float *a, const int32_t *rows, const q3_moe_tile *tiles, int n_tiles,
                     const void *const *w_table, const void *const *up_table, int64_t N, int64_t K, int a_vec) {
    for (int t = blockIdx.y; t < n_tiles; t += gridDim.y)
        tile_product<GATED>(out, a, rows, tiles[t], w_table, up_table, N, K, a_vec != 0);
}

// the grid of the tile kernels: the 64-column blocks of N by the tiles (capped)
static dim3 tile_grid(int n_tiles, int64_t N) {
    return dim3((unsigned)((N + WMMA_TILE - 1) / WMMA_TILE), (unsigned)(n_tiles < MAX_GRID_Y ? n_tiles : MAX_GRID_Y));
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

// act [slots, I] <- x [T, K] through rows [slots]; gate, up: E device pointers to bf16 [I, K]
extern "C" int q3_moe_gate_up_tc_cuda(float *act, const float *x, const int32_t *rows, const q3_moe_tile *tiles,
                                      int n_tiles, const void *const *gate, const void *const *up, int64_t I,
                                      int64_t K, void *stream) {
    if (I % 16 || K % WMMA_KSTEP || I < 0 || K < 0 || (I + WMMA_TILE - 1) / WMMA_TILE > INT32_MAX)
        return (int)cudaErrorInvalidValue;
    if (n_tiles <= 0 || I == 0) return 0;
    Q3_LAUNCH(moe_tiles_kernel<true>, tile_grid(n_tiles, I), WMMA_THREADS, 0, (cudaStream_t)stream)(
        act, x, rows, tiles, n_tiles, gate, up, I, K, aligned16(x));
    return q3_launch_status();
}

// y [slots, N] <- act [slots, K]; down: E device pointers to bf16 [N, K]
extern "C" int q3_moe_down_tc_cuda(float *y, const float *act, const q3_moe_tile *tiles, int n_tiles,
                                   const void *const *down, int64_t N, int64_t K, void *stream) {
    if (N % 16 || K % WMMA_KSTEP || N < 0 || K < 0 || (N + WMMA_TILE - 1) / WMMA_TILE > INT32_MAX)
        return (int)cudaErrorInvalidValue;
    if (n_tiles <= 0 || N == 0) return 0;
    Q3_LAUNCH(moe_tiles_kernel<false>, tile_grid(n_tiles, N), WMMA_THREADS, 0, (cudaStream_t)stream)(
        y, act, nullptr, tiles, n_tiles, down, nullptr, N, K, aligned16(act));
    return q3_launch_status();
}

// x [tokens[i]] += weights[slot[j]] * y [slot[j]] for j = ptr[i] .. ptr[i + 1] - 1, in that
// order; block (i, c) does token i's columns c * blockDim.x + ..., striding by the grid
__global__ void moe_combine_csr_kernel(float *x, const float *y, const float *weights, const int32_t *tokens,
                                       const int32_t *ptr, const int32_t *slot, int64_t H) {
    const int i = blockIdx.x, j0 = ptr[i], j1 = ptr[i + 1];
    float *xr = x + (int64_t)tokens[i] * H;
    for (int64_t c = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; c < H; c += (int64_t)gridDim.y * blockDim.x) {
        float v = xr[c];
        for (int j = j0; j < j1; j++) {
            const int32_t s = slot[j];
            v += weights[s] * y[(int64_t)s * H + c];
        }
        xr[c] = v;
    }
}

// x [T, H] += the weighted expert outputs y [slots, H] of n distinct tokens
extern "C" int q3_moe_combine_csr_cuda(float *x, const float *y, const float *weights, const int32_t *tokens,
                                       const int32_t *ptr, const int32_t *slot, int n, int64_t H, void *stream) {
    if (H < 0) return (int)cudaErrorInvalidValue;
    if (n <= 0 || H == 0) return 0;
    const int64_t chunks = (H + COMBINE_THREADS - 1) / COMBINE_THREADS;
    const dim3 grid((unsigned)n, (unsigned)(chunks < MAX_GRID_Y ? chunks : MAX_GRID_Y));
    Q3_LAUNCH(moe_combine_csr_kernel, grid, COMBINE_THREADS, 0, (cudaStream_t)stream)(x, y, weights, tokens, ptr, slot, H);
    return q3_launch_status();
}

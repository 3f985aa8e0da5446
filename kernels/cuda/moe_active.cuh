// The grouped decode expert kernels' view of moe_route's output (moe_grouped.cu for dense
// weights, moe_grouped_fp8.cu for FP8 ones): block column a serves the a-th active expert,
// and the blocks past active[0] return at once (the grid depends on host numbers only).
#ifndef Q3_KERNELS_CUDA_MOE_ACTIVE_CUH
#define Q3_KERNELS_CUDA_MOE_ACTIVE_CUH

#include "common.cuh"

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

// the grid of the expert kernels: max_active block columns by the weight rows in warps
static inline int expert_grid(dim3 *grid, int max_active, int64_t rows) {
    const int64_t row_blocks = (rows + GROUP_WARPS - 1) / GROUP_WARPS;
    if (row_blocks > 65535) return (int)cudaErrorInvalidValue;
    *grid = dim3((unsigned)max_active, (unsigned)row_blocks);
    return 0;
}

#endif

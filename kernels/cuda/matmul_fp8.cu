// FP8 weights (kernels/fp8.h: e4m3 bytes, one fp32 or bf16 scale per 128 x 128 block) on the
// device: the decode GEMV that converts them in registers, and the dequantization to bf16
// that feeds the tensor-core paths of prefill (twins: q3_matmul_fp8_host, the CPU's matmul_fp8,
// and q3_fp8_dequant_host, both in kernels/cpu/matmul_fp8.c).
//
// matmul_fp8: y [T, N] (+)= x [T, K] W^T, fp32 accumulation, with matmul.cu's structure: one
// warp per weight row, GEMV_WARPS rows a block, the tokens of a block column at once (NT = 8
// for T <= 8, else 16), the column blocks of one row group consecutive in the grid so that a
// decode batch reads each weight byte from HBM once (the other columns find it in L2). The
// inner loop is fp8.cuh's fp8_row_dots: 16-byte loads of 16 e4m3 a lane.
//
// The traffic, per H200 SM (~16 bytes of HBM a cycle, 128 fp32 lanes): a 16-byte weight load
// is 16 weights, ~4 ALU ops each to convert and multiply-add at T = 1 (bytes -> fp32 bits,
// the 2^120 multiply, the FMA; the scale one multiply per 16): ~64 lane-ops per 16 bytes,
// half the SM's 128 a cycle, so HBM stays the bound at batch 1. Each further token adds one
// FMA a weight and 64 bytes of activations (L1) per 16-byte weight load: at T = 8 the FMAs
// alone are 128 lane-ops per 16 bytes, and the kernel turns ALU- and L1-bound, as matmul.cu
// does for bf16 past T = 4..8. Accumulators: NT registers, the 16 converted weights 16 more.
//
// fp8_dequant: dst [N, K] bf16 = round(e4m3(w) * scale) for the tensor cores of prefill (a
// product of 4 + 8 (bf16 scale) or 24 (fp32) significant bits, rounded to bf16's 8: the
// weights the tensor cores see are those of a bf16 checkpoint dequantized from the FP8 one).
// A thread converts 16 consecutive bytes (one 16-byte load when K % 16 == 0 and w is 16-byte
// aligned, then two 16-byte stores), consecutive threads consecutive groups: full lines.
#include "fp8.cuh"

#define FP8_GEMV_WARPS 8
#define FP8_DEQUANT_THREADS 256

// block b * cols + c (cols = ceil(T / NT)): weight row b * FP8_GEMV_WARPS + warp, tokens
// c * NT .. + NT
template <int NT>
__global__ void __launch_bounds__(FP8_GEMV_WARPS * 32, 2)
    gemv_fp8_kernel(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t T,
                    int64_t N, int64_t K, int accumulate) {
    const int lane = threadIdx.x & 31;
    const int64_t cols = (T + NT - 1) / NT;
    const int64_t row = (int64_t)blockIdx.x / cols * FP8_GEMV_WARPS + (threadIdx.x >> 5);
    const int64_t t0 = (int64_t)blockIdx.x % cols * NT;
    if (row >= N) return;
    const int nt = T - t0 < NT ? (int)(T - t0) : NT;
    const uint8_t *ws[1] = {w};
    const void *ss[1] = {scale};
    float acc[1][NT] = {{0}};
    fp8_row_dots<NT, 1, FP8_BLOCK / 16 + Q3_MUTANT(11)>(acc, x + t0 * K, NULL, ws, ss, sdt, row, K, nt, lane);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t >= nt) break;
        const float s = q3_warp_sum(acc[0][t]);
        if (lane == 0) {
            float *dst = y + (t0 + t) * N + row;
            *dst = accumulate ? *dst + s : s;
        }
    }
}

// groups of FP8_GEMV_WARPS weight rows, each as ceil(T / nt) consecutive blocks of nt tokens;
// 0 where the count passes what a grid takes (the launch then fails)
static unsigned gemv_fp8_grid(int64_t rows, int64_t T, int nt) {
    const int64_t blocks = (rows + FP8_GEMV_WARPS - 1) / FP8_GEMV_WARPS * ((T + nt - 1) / nt);
    return blocks <= INT32_MAX ? (unsigned)blocks : 0u;
}

extern "C" int q3_matmul_fp8_cuda(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt,
                                  int64_t T, int64_t N, int64_t K, int accumulate, void *stream) {
    if (T == 0 || N == 0) return 0;
    const cudaStream_t s = (cudaStream_t)stream;
    if (T <= 8)
        Q3_LAUNCH(gemv_fp8_kernel<8>, gemv_fp8_grid(N, T, 8), FP8_GEMV_WARPS * 32, 0, s)(y, x, w, scale, sdt, T, N,
                                                                                        K, accumulate);
    else
        Q3_LAUNCH(gemv_fp8_kernel<16>, gemv_fp8_grid(N, T, 16), FP8_GEMV_WARPS * 32, 0, s)(y, x, w, scale, sdt, T,
                                                                                          N, K, accumulate);
    return q3_launch_status();
}

// thread g converts bytes [16 g, 16 g + 16) of the row-major [N, K] matrix (the last group of
// the matrix may be partial); vec: K % 16 == 0 and w, dst 16-byte aligned, so a group lies in
// one row and one 128-column block
__global__ void fp8_dequant_kernel(uint16_t *dst, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t N,
                                   int64_t K, bool vec) {
    const int64_t kb = (K + FP8_BLOCK - 1) / FP8_BLOCK, total = N * K;
    const int64_t i0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 16;
    if (i0 >= total) return;
    if (vec) {
        const int64_t r = i0 / K, c = i0 % K;
        const float sc = fp8_scale(scale, sdt, r / FP8_BLOCK * kb + c / FP8_BLOCK);
        const uint4 pk = *(const uint4 *)(w + i0);
        const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
        uint32_t out[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const uint32_t u = words[i / 2] >> (16 * (i % 2));
            const uint16_t lo = q3_to_bf16_bits(fp8_to_f32((uint8_t)u) * sc);
            const uint16_t hi = q3_to_bf16_bits(fp8_to_f32((uint8_t)(u >> 8)) * sc);
            out[i] = (uint32_t)lo | (uint32_t)hi << 16;
        }
        uint4 *d = (uint4 *)(dst + i0);
        d[0] = make_uint4(out[0], out[1], out[2], out[3]);
        d[1] = make_uint4(out[4], out[5], out[6], out[7]);
    } else {
        for (int64_t i = i0; i < i0 + 16 && i < total; i++) {
            const int64_t r = i / K, c = i % K;
            dst[i] = q3_to_bf16_bits(fp8_to_f32(w[i]) * fp8_scale(scale, sdt, r / FP8_BLOCK * kb + c / FP8_BLOCK));
        }
    }
}

extern "C" int q3_fp8_dequant_cuda(uint16_t *dst, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t N,
                                   int64_t K, void *stream) {
    if (N == 0 || K == 0) return 0;
    const int64_t groups = (N * K + 15) / 16, blocks = (groups + FP8_DEQUANT_THREADS - 1) / FP8_DEQUANT_THREADS;
    if (blocks > INT32_MAX) return (int)cudaErrorInvalidValue;
    const bool vec = K % 16 == 0 && ((uintptr_t)w & 15u) == 0 && ((uintptr_t)dst & 15u) == 0;
    Q3_LAUNCH(fp8_dequant_kernel, (unsigned)blocks, FP8_DEQUANT_THREADS, 0, (cudaStream_t)stream)(dst, w, scale, sdt,
                                                                                                 N, K, vec);
    return q3_launch_status();
}

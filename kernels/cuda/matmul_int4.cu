// 4-bit GPTQ weights (kernels/int4.h) on the device: the decode GEMV that decodes the nibbles
// in registers, and the dequantization to bf16 that feeds the tensor-core paths of prefill
// (twins: q3_matmul_int4_host, the CPU's matmul_int4, and q3_int4_dequant_host, both in
// kernels/cpu/matmul_int4.c). The matrix comes as a q3_int4_matrix in host memory whose
// tensors are on the device, passed to the kernels by value.
//
// matmul_int4: y [T, N] (+)= x [T, K] W^T, fp32 accumulation, a block a tile of int4.cuh: 32
// adjacent outputs by INT4_TOKENS = 8 tokens, K split over the block's 32 lane quads, each
// word read once for the tile's tokens. The token tiles of one column tile are consecutive in
// the grid, so that a decode batch past 8 tokens finds the words of its second tile in L2.
// Traffic, per H200 SM (~16 bytes of HBM a cycle; 128 fp32 lanes, 64 integer lanes a cycle): a
// 16-byte weight load is 32 weights, 2 integer ops each to decode (a shift, an and-or: 64, a
// cycle of the integer lanes) and at T = 1 an FMA each and the x sums (~40 fp32 ops): about a
// cycle per 16 bytes, as HBM delivers them, so the decode may bind as much as HBM at batch 1
// (an estimate: no GPU measured it). Each further token adds 32 FMAs and 32 bytes of
// activations (L1) per 16-byte weight load, the decode shared.
//
// int4_dequant: dst [N, K] bf16 = round(s (q - z)) (s (q - z) is exact in fp32: an fp16
// scale times an integer of at most 5 bits; one rounding, to bf16's 8 significant bits). The
// layout turns: word (r, n) is dst[n, 8r .. 8r + 7]. Thread i takes output n = i % N and word
// rows 2p, 2p + 1 (p = i / N): consecutive threads read consecutive words of a row (whole
// lines) and each writes 32 contiguous bytes of its dst row (a whole sector; two 16-byte
// stores when dst is 16-byte aligned).
#include "int4.cuh"

#define INT4_DEQUANT_THREADS 256

// block b * cols + c (cols = ceil(T / INT4_TOKENS)): outputs (b) * INT4_COLS .. + 31, tokens
// c * INT4_TOKENS .. + 7
__global__ void __launch_bounds__(INT4_THREADS, 2)
    gemv_int4_kernel(float *y, const float *x, const q3_int4_matrix w, int64_t T, int64_t N, int64_t K,
                     int accumulate) {
    Q3_SHARED(int4_partials, part);
    const int64_t cols = (T + INT4_TOKENS - 1) / INT4_TOKENS;
    const int64_t n0 = (int64_t)blockIdx.x / cols * INT4_COLS, t0 = (int64_t)blockIdx.x % cols * INT4_TOKENS;
    const int nt = T - t0 < INT4_TOKENS ? (int)(T - t0) : INT4_TOKENS;
    const float s = int4_tile_dots<!Q3_MUTANT(19)>(w, x + t0 * K, NULL, nt, N, K, n0, part);
    const int t = threadIdx.x / INT4_COLS;
    const int64_t n = n0 + threadIdx.x % INT4_COLS;
    if (t < nt && n < N) {
        float *dst = y + (t0 + t) * N + n;
        *dst = accumulate && !Q3_MUTANT(15) ? *dst + s : s;
    }
}

extern "C" int q3_matmul_int4_cuda(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N,
                                   int64_t K, int accumulate, void *stream) {
    if (T < 0 || N < 0 || K < 0 || N % Q3_INT4_PACK || K % Q3_INT4_PACK) return (int)cudaErrorInvalidValue;
    if (T == 0 || N == 0) return 0;
    const int64_t blocks = (N + INT4_COLS - 1) / INT4_COLS * ((T + INT4_TOKENS - 1) / INT4_TOKENS);
    if (blocks > INT32_MAX) return (int)cudaErrorInvalidValue;
    Q3_LAUNCH(gemv_int4_kernel, (unsigned)blocks, INT4_THREADS, 0, stream)(y, x, *w, T, N, K, accumulate);
    return q3_launch_status();
}

// thread i: output n = i % N, word rows 2p and 2p + 1 (p = i / N; the last alone where K/8 is
// odd) into dst[n, 16p .. 16p + 15]; vec: dst 16-byte aligned (then so is every 8 inputs' run,
// K % 8 == 0)
__global__ void int4_dequant_kernel(uint16_t *dst, const q3_int4_matrix w, int64_t N, int64_t K, bool vec) {
    const int64_t R = K / Q3_INT4_PACK, i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (R + 1) / 2 * N) return;
    const int64_t n = i % N, group = w.group > 0 && w.group % Q3_INT4_PACK == 0 ? w.group : 0;
    for (int64_t r = i / N * 2; r < i / N * 2 + 2 && r < R; r++) {
        const uint32_t word = (uint32_t)w.qweight[r * N + n];
        uint32_t out[4]; // 8 bf16, input order
#pragma unroll
        for (int j = 0; j < Q3_INT4_PACK; j++) {
            const int64_t k = Q3_INT4_PACK * r + j;
            const int64_t g = group ? k / group : Q3_MUTANT(14) ? k * w.groups / K : w.g_idx[k];
            const int q = (int)((word >> (4 * j)) & 0xfu), z = int4_zero(w, N, g, n ^ Q3_MUTANT(16));
            const uint32_t b = q3_to_bf16_bits(int4_f16(w.scales[g * N + n]) * (float)(q - z));
            out[j / 2] = j % 2 ? out[j / 2] | b << 16 : b;
        }
        uint16_t *d = dst + n * K + Q3_INT4_PACK * r;
        if (vec) *(uint4 *)d = make_uint4(out[0], out[1], out[2], out[3]);
        else
            for (int j = 0; j < Q3_INT4_PACK; j++) d[j] = (uint16_t)(out[j / 2] >> (16 * (j % 2)));
    }
}

extern "C" int q3_int4_dequant_cuda(uint16_t *dst, const q3_int4_matrix *w, int64_t N, int64_t K, void *stream) {
    if (N < 0 || K < 0 || N % Q3_INT4_PACK || K % Q3_INT4_PACK) return (int)cudaErrorInvalidValue;
    if (N == 0 || K == 0) return 0;
    const int64_t threads = (K / Q3_INT4_PACK + 1) / 2 * N;
    const int64_t blocks = (threads + INT4_DEQUANT_THREADS - 1) / INT4_DEQUANT_THREADS;
    if (blocks > INT32_MAX) return (int)cudaErrorInvalidValue;
    const bool vec = ((uintptr_t)dst & 15u) == 0;
    Q3_LAUNCH(int4_dequant_kernel, (unsigned)blocks, INT4_DEQUANT_THREADS, 0, stream)(dst, *w, N, K, vec);
    return q3_launch_status();
}

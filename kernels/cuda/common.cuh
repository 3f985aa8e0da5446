// Helpers shared by the CUDA kernels: element loads by dtype, warp and block reductions,
// and the launch check every launcher ends with. Device code only; C-style.
//
// The same sources build for a GPU (nvcc) and for the SIMT executor that runs them on the CPU
// (g++ -DQ3_SIMT with kernels/simt/include first on the include path, whose cuda_runtime.h
// and mma.h are the executor's). What differs is spelled once here: a launch is
// Q3_LAUNCH(kernel, grid, block, shared bytes, stream)(arguments), a static shared variable
// Q3_SHARED(type, name), dynamic shared memory Q3_DYNAMIC_SHARED(type, name).
#ifndef Q3_KERNELS_CUDA_COMMON_CUH
#define Q3_KERNELS_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#ifndef Q3_SIMT
#include <cuda_fp16.h> // __half2float: nvcc's build only (the executor converts with kernels/dtype.h)
#endif

#include "../dtype.h"

#ifndef Q3_SIMT // the one switch: the executor's cuda_runtime.h defines these for the CPU
template <class T> using q3_shared_t = T; // lets Q3_SHARED take array types: q3_shared_t<float[32]>
#define Q3_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, (cudaStream_t)(stream)>>>
#define Q3_SHARED(T, name) __shared__ __align__(32) q3_shared_t<T> name
#define Q3_DYNAMIC_SHARED(T, name) extern __shared__ __align__(16) T name[]
#endif

// Planted defects (benchmarks/simt_check.py --mutants, tests/executor/test_simt_mutants.py): a build
// with -DQ3_MUTANT_ID=n turns on defect n, written in a kernel as an expression such as
// `if (!Q3_MUTANT(n)) __syncthreads();` for its number n, to show that the SIMT executor reports it. Every
// other build, nvcc's and the executor's alike, sees the constant 0 and compiles it away.
#ifdef Q3_MUTANT_ID
#define Q3_MUTANT(n) (Q3_MUTANT_ID == (n))
#else
#define Q3_MUTANT(n) 0
#endif

// fp16 bits h as fp32, exactly: kernels/dtype.h's q3_f16_to_f32 on the SIMT executor, and on a
// GPU the hardware's conversion (__half2float: one instruction of the same values, exact,
// subnormals included; a NaN stays a NaN). The formula's dozen integer operations cost the
// decode kernels registers on sm_90 (ptxas -v: gate_up_kernel<16> 80 -> 86, moe_gate_up_kernel
// <dense_rows> 80 -> 95), a resident block less an SM; the conversion, none.
__device__ __forceinline__ float q3_f16_bits_to_f32(uint16_t h) {
#ifdef __CUDA_ARCH__
    return __half2float(__ushort_as_half(h));
#else
    return q3_f16_to_f32(h);
#endif
}

// element i of a tensor of dtype dt (float32, bfloat16 or float16), as fp32: bf16 and fp16
// widened exactly
__device__ __forceinline__ float q3_load(const void *p, q3_dtype dt, int64_t i) {
    if (dt == Q3_BF16) return __uint_as_float((uint32_t)((const uint16_t *)p)[i] << 16);
    if (dt == Q3_F16) return q3_f16_bits_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

__device__ __forceinline__ uint16_t q3_to_bf16_bits(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// v stored as element i of a tensor of dtype dt: bf16 and fp16 rounded to nearest even (fp16
// as kernels/dtype.h's q3_f32_to_f16: overflow to inf, NaN kept)
__device__ __forceinline__ void q3_store(void *p, q3_dtype dt, int64_t i, float v) {
    if (dt == Q3_BF16) ((uint16_t *)p)[i] = q3_to_bf16_bits(v);
    else if (dt == Q3_F16) ((uint16_t *)p)[i] = q3_f32_to_f16(v);
    else ((float *)p)[i] = v;
}

__device__ __forceinline__ float q3_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float q3_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// sum over a block of up to 1024 threads; every thread gets the result
__device__ __forceinline__ float q3_block_sum(float v) {
    Q3_SHARED(float[32], part);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = q3_warp_sum(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? part[lane] : 0.0f;
    return q3_warp_sum(v);
}

// what a launcher returns: the launch's error, if any
static inline int q3_launch_status(void) { return (int)cudaGetLastError(); }

#endif

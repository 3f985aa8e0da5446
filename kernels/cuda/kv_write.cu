// KV-cache append with conversion to the cache dtype (twin: kernels/cpu/kv_write.c).
#include "common.cuh"

__global__ void kv_write_kernel(void *cache, q3_dtype dt, const float *src, int64_t src_stride, int kv_heads, int D,
                                int64_t capacity, int64_t start) {
    const int64_t t = blockIdx.x;
    for (int j = threadIdx.x; j < kv_heads * D; j += blockDim.x) {
        const int h = j / D, i = j % D;
        q3_store(cache, dt, ((int64_t)h * capacity + start + t) * D + i, src[t * src_stride + j]);
    }
}

// cache [kv_heads, capacity, D] rows [start, start + L) <- src [L, kv_heads, D] (row stride src_stride)
extern "C" int q3_kv_write_cuda(void *cache, q3_dtype dt, const float *src, int64_t src_stride, int64_t L,
                                int kv_heads, int D, int64_t capacity, int64_t start, void *stream) {
    if (L == 0) return 0;
    kv_write_kernel<<<(unsigned)L, 128, 0, (cudaStream_t)stream>>>(cache, dt, src, src_stride, kv_heads, D, capacity,
                                                                    start);
    return q3_launch_status();
}

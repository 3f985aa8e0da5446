// RoPE in place, half-split pairing, fp32 angles as transformers (twin: kernels/cpu/rope.c).
#include "common.cuh"

__global__ void rope_kernel(float *x, const int64_t *pos, int heads, int D, float theta) {
    const int64_t r = blockIdx.x;
    const int half = D / 2;
    for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
        const int h = j / half, i = j % half;
        const float inv = 1.0f / powf(theta, (float)(2 * i) / (float)D);
        const float a = (float)pos[r] * inv;
        float s, c;
        sincosf(a, &s, &c);
        float *v = x + (r * heads + h) * D;
        const float lo = v[i], hi = v[i + half];
        v[i] = lo * c - hi * s;
        v[i + half] = hi * c + lo * s;
    }
}

// x [rows, heads, D]; pos [rows] on the device
extern "C" int q3_rope_cuda(float *x, const int64_t *pos, int64_t rows, int heads, int D, float theta, void *stream) {
    if (rows == 0) return 0;
    rope_kernel<<<(unsigned)rows, 128, 0, (cudaStream_t)stream>>>(x, pos, heads, D, theta);
    return q3_launch_status();
}

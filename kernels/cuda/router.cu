// Router softmax + top-k + renormalisation, one thread per token (twin: kernels/cpu/router.c).
// Ties go to the lower expert index (the rule in kernels/router.h): the same strict-> insertion
// as the CPU's, over experts in ascending index.
#include "common.cuh"

#define MAX_K 32

__global__ void router_kernel(int32_t *idx, float *weight, const float *logits, int64_t T, int E, int k, int normalize) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float *lg = logits + t * E;
    float mx = lg[0];
    for (int e = 1; e < E; e++) mx = fmaxf(mx, lg[e]);
    float sum = 0.0f;
    for (int e = 0; e < E; e++) sum += expf(lg[e] - mx);
    int sel[MAX_K];
    float val[MAX_K];
    int n = 0;
    for (int e = 0; e < E; e++) {
        const float pe = expf(lg[e] - mx);
        if (n == k && !(pe > val[k - 1])) continue;
        int p = n < k ? n++ : k - 1;
        while (p > 0 && pe > val[p - 1]) {
            sel[p] = sel[p - 1];
            val[p] = val[p - 1];
            p--;
        }
        sel[p] = e;
        val[p] = pe;
    }
    float tot = 0.0f;
    for (int j = 0; j < k; j++) tot += val[j] / sum;
    for (int j = 0; j < k; j++) {
        idx[t * k + j] = sel[j];
        weight[t * k + j] = normalize ? (val[j] / sum) / tot : val[j] / sum;
    }
}

extern "C" int q3_router_topk_cuda(int32_t *idx, float *weight, const float *logits, int64_t T, int E, int k,
                                   int normalize, void *stream) {
    if (k > MAX_K) return (int)cudaErrorInvalidValue;
    if (T == 0) return 0;
    Q3_LAUNCH(router_kernel, (unsigned)((T + 127) / 128), 128, 0, (cudaStream_t)stream)(idx, weight, logits, T, E, k, normalize);
    return q3_launch_status();
}

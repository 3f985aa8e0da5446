/* Projections on FP8 weights (q3_weights' fp8_e4m3_block128 format) on a CUDA device, for
 * passes.c: decode-sized products stream the e4m3 bytes through the FP8 GEMV (kernels/cuda/
 * matmul_fp8.cu), which converts them in registers; larger ones, in a bf16 layer whose shape
 * the tensor cores take, first dequantize the whole matrix to bf16 in the workspace (wbf16,
 * one matrix at a time: each product queued after the dequantization it reads and before the
 * next one, on the same stream) and run the dense tensor-core path on it. An fp32 layer keeps
 * the GEMV at every size: the tensor cores would round its activations and weights to bf16,
 * which its dense counterpart never does either. */
#include "device_state.h"

int q3_gpu_project_fp8(const q3_layer *l, q3_gpu_run *run, int tensor_cores, int cublas, float *y, const float *x,
                       q3_matrix m, int64_t T, int64_t N, int64_t K, int accumulate) {
    const q3_cuda_ops *g = run->g;
    uint16_t *wb = run->ws->wbf16;
    if (tensor_cores && wb && l->w.dtype == Q3_BF16 && N % 16 == 0 && K % 32 == 0) {
        const int code = g->fp8_dequant(wb, m.w, m.scale, l->w.scale_dtype, N, K, run->stream);
        if (code) return code;
        return (cublas ? g->matmul_tc : g->matmul_wmma)(y, x, wb, T, N, K, accumulate, run->ws->dev.xb, run->stream);
    }
    return g->matmul_fp8(y, x, m.w, m.scale, l->w.scale_dtype, T, N, K, accumulate, run->stream);
}

/* the largest FP8 matrix of the layer, in elements: the size of wbf16 */
int64_t q3_gpu_fp8_largest_matrix(const q3_config *cf) {
    const int64_t H = cf->hidden, I = cf->moe_inter, QD = (int64_t)cf->heads * cf->head_dim;
    const int64_t KVD = (int64_t)cf->kv_heads * cf->head_dim;
    int64_t most = QD * H;
    if (KVD * H > most) most = KVD * H;
    if (I * H > most) most = I * H;
    return most;
}

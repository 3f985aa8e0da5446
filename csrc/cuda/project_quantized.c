/* Projections on quantized weights on a CUDA device, for passes.c and moe_prefill.c: FP8
 * (q3_weights' fp8_e4m3_block128: e4m3 bytes and block scales) and 4-bit GPTQ (gptq_int4:
 * q3_matrix's q4, a q3_int4_matrix in host memory whose tensors are on the device). Decode-
 * sized products stream the quantized weights through the format's GEMV (kernels/cuda/
 * matmul_fp8.cu, matmul_int4.cu), which decodes them in registers; larger ones, in a bf16
 * layer whose shape the tensor cores take, first dequantize the whole matrix to bf16 in the
 * workspace (wbf16, one matrix at a time: each product queued after the dequantization it
 * reads and before the next one, on the same stream) and run the dense tensor-core path on
 * it. An fp32 layer keeps the GEMV at every size: the tensor cores would round its
 * activations and weights to bf16, which its dense counterpart never does either. A GPTQ
 * layer's dense attention (gptq_dense_attention: q4 NULL) is not quantized and never comes
 * here. */
#include "device_state.h"

/* m as bf16 [N, K] into wb, by its format's dequantization; a CUDA code */
static int dequantize(const q3_layer *l, const q3_cuda_ops *g, uint16_t *wb, q3_matrix m, int64_t N, int64_t K,
                      void *stream) {
    if (m.q4) return g->int4_dequant(wb, m.q4, N, K, stream);
    return g->fp8_dequant(wb, m.w, m.scale, l->w.scale_dtype, N, K, stream);
}

int q3_gpu_project_quantized(const q3_layer *l, q3_gpu_run *run, int tensor_cores, int cublas, float *y,
                             const float *x, q3_matrix m, int64_t T, int64_t N, int64_t K, int accumulate) {
    const q3_cuda_ops *g = run->g;
    uint16_t *wb = run->ws->wbf16;
    if (tensor_cores && wb && l->w.dtype == Q3_BF16 && N % 16 == 0 && K % 32 == 0) {
        const int code = dequantize(l, g, wb, m, N, K, run->stream);
        if (code) return code;
        return (cublas ? g->matmul_tc : g->matmul_wmma)(y, x, wb, T, N, K, accumulate, run->ws->dev.xb, run->stream);
    }
    if (m.q4) return g->matmul_int4(y, x, m.q4, T, N, K, accumulate, run->stream);
    return g->matmul_fp8(y, x, m.w, m.scale, l->w.scale_dtype, T, N, K, accumulate, run->stream);
}

/* the largest quantized matrix of the layer, in elements: the size of wbf16 (a GPTQ layer's
 * dense attention is not dequantized: its experts' alone) */
int64_t q3_gpu_quantized_largest_matrix(const q3_layer *l) {
    const q3_config *cf = &l->cfg;
    const int64_t H = cf->hidden, I = cf->moe_inter, QD = (int64_t)cf->heads * cf->head_dim;
    const int64_t KVD = (int64_t)cf->kv_heads * cf->head_dim;
    int64_t most = I * H;
    if (l->w.gptq_dense_attention) return most;
    if (QD * H > most) most = QD * H;
    if (KVD * H > most) most = KVD * H;
    return most;
}

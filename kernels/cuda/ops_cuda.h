/* The CUDA kernels' launchers, as a table the engine fills with dlsym from libq3cuda.so
 * (built from the .cu files of kernels/cuda/ only where nvcc is found). Each launcher takes the same
 * arguments as its CPU twin (kernels/<op>.h) plus a cudaStream_t as void *, queues its work
 * there, and returns the CUDA error code of the launch (0 = success); device pointers only.
 * The runtime helpers keep every CUDA call inside the library: the engine never links cudart. */
#ifndef Q3_KERNELS_CUDA_OPS_H
#define Q3_KERNELS_CUDA_OPS_H

#include <stddef.h>

#include "../attention.h"
#include "../dtype.h"
#include "../int4.h"
#include "../moe_group.h"

#ifdef __cplusplus
extern "C" {
#endif

#define Q3_BLAS_REFUSED (-2)

typedef struct {
    /* runtime */
    int (*device_count)(int *count);
    int (*set_device)(int device);
    int (*malloc_device)(void **p, size_t bytes);
    int (*free_device)(void *p);
    int (*copy)(void *dst, const void *src, size_t bytes, int to_device); /* synchronous */
    /* queued on the stream; host memory may be pageable (then the call returns once it is read) */
    int (*copy_async)(void *dst, const void *src, size_t bytes, int to_device, void *stream);
    int (*memset_async)(void *p, int value, size_t bytes, void *stream);
    /* device to device, queued on the stream (capturable) */
    int (*copy_device_async)(void *dst, const void *src, size_t bytes, void *stream);
    /* `rows` rows of `width` bytes, device to device: row r from src + r * src_pitch to
     * dst + r * dst_pitch (pitches >= width), queued on the stream (capturable); the KV cache's
     * operations move a sequence's heads with one call (csrc/engine/cache_ops.c) */
    int (*copy_2d_device_async)(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width,
                                size_t rows, void *stream);
    int (*stream_synchronize)(void *stream);
    int (*synchronize)(void);
    const char *(*error_string)(int code);
    /* events, for per-stage timing: elapsed_ms once `end` has completed */
    int (*event_create)(void **event);
    int (*event_destroy)(void *event);
    int (*event_record)(void *event, void *stream);
    int (*event_elapsed_ms)(float *ms, void *start, void *end);
    /* cuBLAS for matmul_tc, opened at run time (path NULL: the usual names): 0 when usable;
     * blas_enable switches it (for comparisons; on < 0 only reads) and returns whether it is on */
    int (*blas_open)(const char *path);
    int (*blas_enable)(int on);
    /* cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx) where cuBLAS is on and has it: y[g]
     * [T[g], N] = xb[g] [T[g], K] w[g]^T (bf16 in, fp32 out) for g < groups; y, xb, w device
     * arrays of pointers (read when the call runs on the stream), T a host array; -1 when
     * unavailable, Q3_BLAS_REFUSED when cuBLAS refused it (nothing queued; then unavailable) */
    int (*blas_grouped_available)(void);
    int (*blas_gemm_grouped)(float *const *y, const uint16_t *const *xb, const uint16_t *const *w, const int *T,
                             int groups, int64_t N, int64_t K, void *stream);
    /* timings with CUDA events, milliseconds per call over `repeats` after a warm-up:
     * a device-to-device copy of `bytes`; the matmul on fresh device buffers [T, K] x [N, K]^T */
    int (*time_copy)(size_t bytes, int repeats, float *ms);
    int (*time_matmul)(int64_t T, int64_t N, int64_t K, q3_dtype w_dt, int repeats, float *ms);
    /* CUDA graphs: a stream of the library's own to capture on (capture needs a stream other
     * than the legacy default one); capture in thread-local mode; capture_end instantiates the
     * captured work and returns the executable graph (cudaGraphExec_t) in *graph */
    int (*stream_create)(void **stream);
    int (*stream_destroy)(void *stream);
    int (*capture_begin)(void *stream);
    int (*capture_end)(void *stream, void **graph);
    int (*graph_launch)(void *graph, void *stream);
    int (*graph_destroy)(void *graph);
    /* kernels: the CPU twin's arguments, then the stream */
    int (*rmsnorm)(float *out, const float *x, const void *w, q3_dtype w_dt, int64_t rows, int64_t n,
                   float eps, void *stream);
    /* the residual add and the norm after it: x [rows, n] += r; out = rmsnorm(x) (out may alias r) */
    int (*add_rmsnorm)(float *out, float *x, const float *r, const void *w, q3_dtype w_dt, int64_t rows,
                       int64_t n, float eps, void *stream);
    int (*matmul)(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N, int64_t K,
                  int accumulate, void *stream);
    /* act [T, I] = silu(x gate^T) * (x up^T), both [I, K]: matmul, matmul and swiglu in one pass */
    int (*gate_up)(float *act, const float *x, const void *gate, const void *up, q3_dtype w_dt, int64_t T,
                   int64_t I, int64_t K, void *stream);
    /* tensor cores, bf16 weights, x rounded to bf16 in xb [T * K]; N % 16 == 0, K % 32 == 0 */
    int (*matmul_tc)(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K, int accumulate,
                     uint16_t *xb, void *stream);
    /* the same on the WMMA kernel only, never cuBLAS: for work captured in a CUDA graph */
    int (*matmul_wmma)(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K, int accumulate,
                       uint16_t *xb, void *stream);
    /* QK-norm + RoPE of q [R, Hq, D] and k [R, Hkv, D] (q in place), k and v [R, Hkv, D] into
     * the cache rows of seqs (device array): rmsnorm, rope and kv_write fused; R = n_seqs * L.
     * inv_freq [D / 2] and scale: the RoPE table (kernels/rope.h), inv_freq in host memory,
     * passed by value in the launch */
    int (*qk_rope_kv)(float *q, float *k, const float *v, const void *q_norm, const void *k_norm, q3_dtype w_dt,
                      const int64_t *pos, const q3_attn_seq *seqs, int n_seqs, const q3_attn_shape *shape,
                      float eps, const float *inv_freq, float scale, void *stream);
    /* partial: device scratch of q3_attention_cuda_partial_floats(n_seqs * L, shape) floats
     * for split-KV (NULL: one block per query token and KV head) */
    int (*attention)(float *out, const float *q, const q3_attn_seq *seqs, int n_seqs, const q3_attn_shape *shape,
                     float *partial, void *stream);
    /* the attention probabilities for introspection (kernels/attention.h's q3_attention_probs_fn;
     * seqs a device array), on request only */
    int (*attention_probs)(float *probs, const float *q, const q3_attn_seq *seqs, int n_seqs,
                           const q3_attn_shape *shape, int64_t t0, int64_t out_tokens, int64_t context,
                           void *stream);
    int (*router_topk)(int32_t *idx, float *weight, const float *logits, int64_t T, int E, int k, int normalize,
                       void *stream);
    /* ---- decode without the host (CUDA-graph capturable); twins in kernels/cpu/twins.h ---- */
    /* a decode step's bookkeeping from device-resident lengths: for s < n_seqs,
     * seqs[s].n_past = lengths[s]; pos[s] = first_pos + lengths[s] - seqs[s].start (0 while inside the
     * padding); then lengths[s] += 1 */
    int (*decode_prepare)(q3_attn_seq *seqs, int64_t *pos, int64_t *lengths, int n_seqs, void *stream);
    /* expert grouping on the device: moe_group's offsets [E + 1], rows and weights [T * k]
     * (kernels/moe_group.h, same stable order), plus active [E + 1]: active[0] = how many
     * experts were chosen at least once, active[1 ..] those experts ascending; and slot [T * k]:
     * the grouped slot of pair (t, j) */
    int (*moe_route)(int64_t *offsets, int32_t *rows, float *weights, int32_t *active, int32_t *slot,
                     const int32_t *idx, const float *w, int64_t T, int k, int E, void *stream);
    /* for each active expert e and each slot s of its group: act [s, :I] = silu(x[rows[s]] G_e^T)
     * * (x[rows[s]] U_e^T); x [T, K]; gate, up: device arrays of E device pointers to [I, K];
     * max_active >= active[0] sizes the grid (min(E, T * k)) */
    int (*moe_gate_up)(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                       const int32_t *active, const void *const *gate, const void *const *up, q3_dtype w_dt,
                       int max_active, int64_t I, int64_t K, void *stream);
    /* for each active expert e and each slot s of its group: y [s, :N] = act [s, :K] D_e^T;
     * down: E device pointers to [N, K] */
    int (*moe_down)(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                    const void *const *down, q3_dtype w_dt, int max_active, int64_t N, int64_t K, void *stream);
    /* x [t, :H] += weights[s] * y [s, :H] for the k slots s = slot[t * k + j] of token t, added
     * one at a time in ascending slot order (= expert order, as scatter_add_rows per expert) */
    int (*moe_combine)(float *x, const float *y, const float *weights, const int32_t *slot, int64_t T, int k,
                       int64_t H, void *stream);
    /* ---- prefill MoE: experts grouped on the host, one launch per batch of experts ---- */
    /* act [s, :I] = silu(x[rows[s]] G_e^T) * (x[rows[s]] U_e^T) for the slots s of each tile
     * (device array of n_tiles), on tensor cores: x rounded to bf16 as they read it; gate, up:
     * device tables of E device pointers to bf16 [I, K]; I % 16 == 0, K % 32 == 0 */
    int (*moe_gate_up_tc)(float *act, const float *x, const int32_t *rows, const q3_moe_tile *tiles, int n_tiles,
                          const void *const *gate, const void *const *up, int64_t I, int64_t K, void *stream);
    /* y [s, :N] = act [s, :K] D_e^T for the slots s of each tile, act rounded to bf16;
     * down: E device pointers to bf16 [N, K]; N % 16 == 0, K % 32 == 0 */
    int (*moe_down_tc)(float *y, const float *act, const q3_moe_tile *tiles, int n_tiles, const void *const *down,
                       int64_t N, int64_t K, void *stream);
    /* for i < n: x [tokens[i], :H] += weights[slot[j]] * y [slot[j], :H] for j = ptr[i] ..
     * ptr[i + 1] - 1, added one at a time in that order (tokens distinct) */
    int (*moe_combine_csr)(float *x, const float *y, const float *weights, const int32_t *tokens,
                           const int32_t *ptr, const int32_t *slot, int n, int64_t H, void *stream);
    /* ---- FP8 weights (kernels/fp8.h: e4m3 bytes w [N, K], scale_inv [ceil(N/128), ceil(K/128)]
     * of sdt, fp32 or bf16); twins: the CPU's matmul_fp8 and kernels/cpu/twins.h ---- */
    /* y [T, N] (+)= x [T, K] W^T, converted in registers (the decode GEMV; any T) */
    int (*matmul_fp8)(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t T,
                      int64_t N, int64_t K, int accumulate, void *stream);
    /* dst [N, K] bf16 = round_bf16(e4m3(w) * scale): weights for the tensor-core paths */
    int (*fp8_dequant)(uint16_t *dst, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t N, int64_t K,
                       void *stream);
    /* moe_gate_up and moe_down over FP8 experts: gate, up, down device arrays of E device
     * pointers to the bytes, gate_scale, up_scale, down_scale of E to their scale_inv */
    int (*moe_gate_up_fp8)(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                           const int32_t *active, const uint8_t *const *gate, const uint8_t *const *up,
                           const void *const *gate_scale, const void *const *up_scale, q3_dtype sdt, int max_active,
                           int64_t I, int64_t K, void *stream);
    int (*moe_down_fp8)(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                        const uint8_t *const *down, const void *const *down_scale, q3_dtype sdt, int max_active,
                        int64_t N, int64_t K, void *stream);
    /* ---- 4-bit GPTQ weights (kernels/int4.h); twins: the CPU's matmul_int4 and
     * kernels/cpu/twins.h. A matrix is a q3_int4_matrix whose tensors are on the device: w in
     * host memory for one matrix (passed to the kernel by value), a device array of E for
     * experts. Its group is honoured where g_idx[k] == k / group and group % 8 == 0 (each
     * group's scale and zero once), else g_idx is read input by input (group 0: desc_act).
     * N, K multiples of 8 (else cudaErrorInvalidValue) ---- */
    /* y [T, N] (+)= x [T, K] W^T, the nibbles decoded in registers (the decode GEMV; any T) */
    int (*matmul_int4)(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                       int accumulate, void *stream);
    /* dst [N, K] bf16 = round_bf16(s (q - z)): weights for the tensor-core paths */
    int (*int4_dequant)(uint16_t *dst, const q3_int4_matrix *w, int64_t N, int64_t K, void *stream);
    /* moe_gate_up and moe_down over GPTQ experts: gate, up device arrays of E matrices [I, K],
     * down of E [N, K] (a device array of structs, not of pointers per tensor: one table a
     * matrix, and each expert's own group) */
    int (*moe_gate_up_int4)(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                            const int32_t *active, const q3_int4_matrix *gate, const q3_int4_matrix *up,
                            int max_active, int64_t I, int64_t K, void *stream);
    int (*moe_down_int4)(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                         const q3_int4_matrix *down, int max_active, int64_t N, int64_t K, void *stream);
    int (*swiglu)(float *act, const float *gate, const float *up, int64_t n, void *stream);
    int (*gather_rows)(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t H, void *stream);
    int (*scatter_add_rows)(float *dst, const float *src, const int32_t *rows, const float *scale, int64_t n,
                            int64_t H, void *stream);
    /* rows of a layer split over the GPU and the host (qwen3layer/placement/hybrid.py) */
    int (*take_rows)(void *dst, const void *src, q3_dtype dt, const int32_t *rows, int64_t n, int64_t H, void *stream);
    int (*add_rows)(float *dst, const void *src, q3_dtype src_dt, const int32_t *rows, int64_t n, int64_t H,
                    void *stream);
    int (*to_f32)(float *dst, const void *src, q3_dtype src_dt, int64_t n, void *stream);
    int (*from_f32)(void *dst, q3_dtype dst_dt, const float *src, int64_t n, void *stream);
} q3_cuda_ops;

/* The CUDA backend's limits on the attention geometry (attention.cu, qk_rope_kv.cu): a layer
 * outside them is refused when it is created (csrc/cuda/layer.c), the CPU takes any. */
#define Q3_CUDA_MAX_HEAD_DIM 256
#define Q3_CUDA_MAX_GROUP 32 /* query heads per KV head: one warp each in attention.cu */

/* Split-KV attention: calls of at most Q3_SPLIT_MAX_TOKENS tokens per sequence are split
 * into up to Q3_SPLIT_MAX slices of at least Q3_SPLIT_MIN_KEYS keys each. */
#define Q3_SPLIT_MAX_TOKENS 16
#define Q3_SPLIT_MAX 32
#define Q3_SPLIT_MIN_KEYS 256
/* scratch floats for the partials of `tokens` query tokens (all sequences of a call) */
static inline int64_t q3_attention_cuda_partial_floats(int64_t tokens, const q3_attn_shape *s) {
    return tokens * s->heads * Q3_SPLIT_MAX * (s->head_dim + 2);
}

/* the one symbol the engine looks up: fills the table, returns 0 */
int q3_cuda_ops_get(q3_cuda_ops *ops);

#ifdef __cplusplus
}
#endif

#endif

/* The prefill MoE's grouped cuBLAS path (q3_cuda.h's Q3_MOE_GROUPED_CUBLAS): the batches of
 * experts of moe_prefill.c's plan, handed in, each as three cuBLAS grouped GEMMs (cublasGemmGroupedBatchedEx
 * through kernels/cuda/blas.cu, where the found cuBLAS has it) between the gather, the SiLU *
 * up and the combine kernels. All buffers are the workspace's: xe, gate, up, ye [R, .] and
 * xb (bf16) hold a batch's at most R slots, in expert order. */
#include <stdlib.h>

#include "moe_prefill.h"

/* the pointer tables of the grouped cuBLAS path, made once per CUDA state; a CUDA code */
static int blas_tables(q3_gpu_run *run, int E) {
    q3_cuda_state *st = run->st;
    if (st->blas_ptrs_dev) return 0;
    st->blas_ptrs = malloc((size_t)9 * E * sizeof *st->blas_ptrs);
    st->blas_rows = malloc((size_t)E * sizeof *st->blas_rows);
    if (!st->blas_ptrs || !st->blas_rows) return 2; /* cudaErrorMemoryAllocation */
    return run->g->malloc_device((void **)&st->blas_ptrs_dev, (size_t)9 * E * sizeof(void *));
}

/* per batch of experts of the plan: its slots' rows of h gathered and rounded
 * to bf16, then gate and up as two cuBLAS grouped GEMMs (a group per expert of the batch: rows
 * [off[e] - slot_lo, + n_e) of the batch's buffers), SiLU * up, rounded to bf16, down as a
 * third, and the combine of the grouped WMMA path. The pointer table of a batch: for gate, up
 * and down in turn, the weights', inputs' and outputs' pointers of its G experts, uploaded on
 * the stream before the GEMMs that read it. */
void q3_gpu_moe_grouped_cublas(q3_layer *l, q3_gpu_run *run, const q3_moe_plan *plan) {
    const q3_config *cf = &l->cfg;
    const q3_cuda_ops *g = run->g;
    q3_cuda_state *st = run->st;
    q3_workspace *d = &run->ws->dev;
    void *sm = run->stream;
    const int64_t H = cf->hidden, I = cf->moe_inter;
    const int E = cf->experts;
    Q3_GPU(run, blas_tables(run, E), "cuBLAS grouped GEMM tables");
    if (run->code) return;
    const void **host = st->blas_ptrs;
    void **dev = st->blas_ptrs_dev;
    for (int i = 0; i < plan->n_batches && !run->code; i++) {
        const q3_moe_batch *b = &plan->batches[i];
        const int64_t n = b->slot_hi - b->slot_lo;
        if (n == 0) continue;
        int G = 0;
        for (int e = 0; e < E; e++) {
            const int64_t first = st->offsets[e] - b->slot_lo, rows = st->offsets[e + 1] - st->offsets[e];
            if (rows == 0 || first < 0 || first >= n) continue;
            st->blas_rows[G] = (int)rows;
            const void *row[9] = {l->w.experts[Q3_X_GATE][e], d->xb + first * H, d->gate + first * I,
                                  l->w.experts[Q3_X_UP][e], d->xb + first * H, d->up + first * I,
                                  l->w.experts[Q3_X_DOWN][e], d->xb + first * I, d->ye + first * H};
            for (int t = 0; t < 9; t++) host[(size_t)t * E + G] = row[t];
            G++;
        }
        /* the table as uploaded: the 9 arrays (stride E so far) packed to G entries each, in
         * place (array t moves down to t G, never over an entry not yet moved) */
        for (int t = 1; t < 9; t++)
            for (int j = 0; j < G; j++) host[(size_t)t * G + j] = host[(size_t)t * E + j];
        const int32_t *tokens = plan->dev + b->tokens, *ptr = tokens + b->n_tokens, *slot = ptr + b->n_tokens + 1;
        float *const *y = (float *const *)dev;
        const uint16_t *const *wt = (const uint16_t *const *)dev, *const *xt = (const uint16_t *const *)dev;
        Q3_GPU(run, g->gather_rows(d->xe, d->h, d->pair_row + b->slot_lo, n, H, sm), "gather");
        Q3_GPU(run, g->from_f32(d->xb, Q3_BF16, d->xe, n * H, sm), "round to bf16");
        Q3_GPU(run, g->copy_async(dev, host, (size_t)9 * G * sizeof(void *), 1, sm), "copy GEMM pointers");
        Q3_GPU(run, g->blas_gemm_grouped(y + 2 * G, xt + G, wt, st->blas_rows, G, I, H, sm), "gate (cuBLAS grouped)");
        Q3_GPU(run, g->blas_gemm_grouped(y + 5 * G, xt + 4 * G, wt + 3 * G, st->blas_rows, G, I, H, sm),
               "up (cuBLAS grouped)");
        Q3_GPU(run, g->swiglu(d->gate, d->gate, d->up, n * I, sm), "swiglu");
        Q3_GPU(run, g->from_f32(d->xb, Q3_BF16, d->gate, n * I, sm), "round to bf16");
        Q3_GPU(run, g->blas_gemm_grouped(y + 8 * G, xt + 7 * G, wt + 6 * G, st->blas_rows, G, H, I, sm),
               "down (cuBLAS grouped)");
        Q3_GPU(run, g->moe_combine_csr(d->x, d->ye, d->pair_w + b->slot_lo, tokens, ptr, slot, b->n_tokens, H, sm),
               "moe_combine_csr");
    }
}

/* The prefill MoE on a CUDA device (moe_prefill.c): one entry for passes.c, behind it the
 * plan of the grouped paths, each path, and the measured choice between them. The grouped
 * cuBLAS path is moe_cublas.c's, handed the plan made here. */
#ifndef Q3_CUDA_MOE_PREFILL_H
#define Q3_CUDA_MOE_PREFILL_H

#include "device_state.h"

/* x += the weighted experts of h for a pass whose (token, expert) pairs are grouped on the
 * host (st->offsets, st->pair_row, st->pair_w) and queued for upload (dev.pair_row,
 * dev.pair_w): on the path the layer forces, else the one measured fastest for the pass's
 * size class, measured now if the class is new. A prefill pass only: measuring synchronises
 * the stream, so it never runs inside a graph capture. */
void q3_gpu_moe_prefill(q3_layer *l, const q3_pass *p, q3_gpu_run *run);

/* A pass's plan as made and queued for upload: its batches (st->batches, on the host) and the
 * plan's int32s on the device (ws->moe_plan: each batch's tiles and token lists) */
typedef struct {
    int n_batches;
    const q3_moe_batch *batches;
    const int32_t *dev;
} q3_moe_plan;

/* the grouped cuBLAS path over a pass's plan (moe_cublas.c) */
void q3_gpu_moe_grouped_cublas(q3_layer *l, q3_gpu_run *run, const q3_moe_plan *plan);

#endif

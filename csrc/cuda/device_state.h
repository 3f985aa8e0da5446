/* A CUDA layer's device state (device_state.c): its device workspace, its host staging, the
 * prefill MoE's measured choices and test hooks, and the run of passes that works in them.
 * The passes are passes.h's, the prefill MoE moe_prefill.h's. */
#ifndef Q3_CUDA_DEVICE_STATE_H
#define Q3_CUDA_DEVICE_STATE_H

#include "../engine/layer_object.h"
#include "backend.h"

/* Decode-sized passes (one token per sequence, at most this many sequences) keep every
 * decision on the device: positions from device-resident lengths, experts grouped by a
 * kernel, no cuBLAS. Nothing in them waits for the host, so a CUDA graph can hold them. */
#define Q3_DECODE_MAX_ROWS Q3_GRAPH_MAX_BATCH

static inline int q3_gpu_is_decode(const q3_pass *p) { return p->L == 1 && p->n_seqs <= Q3_DECODE_MAX_ROWS; }

/* Device memory for passes of up to `rows` rows, `seqs` sequences and `split_rows` query rows
 * of split-KV attention: one allocation. */
typedef struct {
    q3_workspace dev;      /* carved like the host workspace */
    int64_t split_rows;    /* rows of partial */
    float *partial;        /* [split_rows] split-KV partials (kernels/cuda/ops_cuda.h) */
    int64_t *lengths;      /* [seqs] decode: tokens held by each sequence of the pass */
    int32_t *active;       /* [E + 1] decode: experts chosen in the pass (count first) */
    int32_t *pair_slot;    /* [Rd * k] decode: grouped slot of each (token, choice) */
    float *pair_act;       /* [Rd * k, I] decode: SiLU(gate) * up of each slot */
    float *pair_y;         /* [Rd * k, H] decode: expert output of each slot */
    const void **experts;  /* [Q3_X_COUNT][E] device copies of the expert pointer tables */
    q3_int4_matrix *int4_experts; /* GPTQ layers: [Q3_X_COUNT][E] device copy of the experts'
                                   * matrices (l->int4's), the grouped decode kernels' tables; else NULL */
    int32_t *moe_plan;     /* [q3_moe_plan_ints] prefill: tiles and per-token slots (below) */
    uint16_t *wbf16;       /* FP8 and GPTQ layers with rows >= 16: one matrix dequantized to bf16
                            * [q3_gpu_quantized_largest_matrix] for the tensor cores
                            * (project_quantized.c); else NULL */
} q3_gpu_ws;               /* rows, seqs, block and bytes: in dev; Rd = min(rows, Q3_DECODE_MAX_ROWS) */

/* The query rows of split-KV attention a pass of `rows` rows over `seqs` sequences may have:
 * it runs for passes of at most Q3_SPLIT_MAX_TOKENS tokens per sequence (attention.cu). A
 * dimension of the workspace of its own: from the largest rows and the most sequences of
 * different calls (a long one-sequence prefill, a wide decode) it would be far larger than
 * any call needs, and its rows are the workspace's widest (heads * Q3_SPLIT_MAX * (D + 2)
 * floats: ~1 MiB at the real geometry). */
static inline int64_t q3_gpu_split_rows(int64_t rows, int seqs) {
    const int64_t most = (int64_t)seqs * Q3_SPLIT_MAX_TOKENS;
    return rows < most ? rows : most;
}

q3_status q3_gpu_ws_alloc(q3_gpu_ws *ws, const q3_layer *l, int64_t rows, int seqs, int64_t split_rows,
                          q3_error *err);
void q3_gpu_ws_free(q3_gpu_ws *ws);

/* The storage of the grouped prefill MoE's plan (moe_prefill.c makes it on the host per
 * pass): the experts in batches of at most R slots (the rows of the act and output buffers);
 * per batch, its tiles of up to Q3_MOE_TILE_ROWS slots and, for each token it touches, that
 * token's slots in expert order (tokens, ptr, slot: kernels/cuda/ops_cuda.h's
 * moe_combine_csr). Int32s: the tiles (4 each, at most R k / 64 + E of them) first, then the
 * batches' token lists. */
static inline int64_t q3_moe_plan_tiles(int64_t R, int k, int E) { return R * k / Q3_MOE_TILE_ROWS + E + 1; }
static inline int64_t q3_moe_plan_ints(int64_t R, int k, int E) {
    return 4 * q3_moe_plan_tiles(R, k, E) + 3 * R * k + 2 * (int64_t)E + 2;
}

typedef struct {
    int64_t slot_lo, slot_hi; /* the batch's slots */
    int tile_lo, n_tiles;     /* its tiles, from tile_lo */
    int64_t tokens;           /* offset of its token list in the plan; ptr and slot follow */
    int n_tokens;
} q3_moe_batch;

/* The prefill MoE's paths (q3_cuda.h's Q3_MOE_*): unless the layer forces one, moe_prefill.c
 * times each path the pass can take on the first pass of a size class (rows in
 * [2^(c-1), 2^c) for class c) and keeps the fastest for the class. */
typedef struct {
    int chosen;             /* 1 + the path kept, 0 while the class is unmeasured */
    float ms[Q3_MOE_PATHS]; /* each path's time on the measured pass; < 0: not a candidate */
} q3_moe_choice;

/* The layer's settings of the choice, for comparisons and tests (q3_layer_cuda_moe_path,
 * q3_layer_cuda_moe_inject_times); zeroed: measured, on the events' times. */
typedef struct {
    int forced;             /* 1 + the path every prefill pass takes; 0: the measured one */
    int injected;           /* whether ms stands in for the events' times (the SIMT executor's mean nothing) */
    float ms[Q3_MOE_PATHS];
} q3_moe_hooks;

/* A CUDA layer's state: its device memory and host staging, grown (never shrunk) for larger
 * calls (q3_layer_cuda_reserve makes a new one, carrying over moe_choice and moe_hooks). One
 * made by the hooks' setters before any call holds no workspace yet (ws zeroed). */
struct q3_cuda_state {
    q3_gpu_ws ws;
    void *events[2 * Q3_STAGE_COUNT + 2]; /* profiling: one per stage boundary of a pass */
    int stage_of[2 * Q3_STAGE_COUNT + 2]; /* the stage each event ends */
    int n_events;
    /* host staging */
    int64_t *pos;         /* [rows] */
    q3_attn_seq *seq_ptr; /* [seqs] */
    int64_t *lengths;     /* [seqs] */
    int32_t *topk_idx;    /* [rows, k] */
    float *topk_w;        /* [rows, k] */
    int64_t *offsets;     /* [E + 2]: an expert half's choices group a skipped entry as expert E */
    int32_t *pair_row;    /* [rows * k] */
    float *pair_w;        /* [rows * k] */
    int32_t *moe_plan;    /* [q3_moe_plan_ints] */
    q3_moe_batch *batches; /* [E] */
    int32_t *token_index; /* [rows] zero between uses: 1 + a token's place in its batch's list */
    int32_t *token_fill;  /* [rows] */
    /* device staging of a pass's hidden flags (passes.c's stage_positions): each sequence's
     * with hidden tokens, [n_past + L] after the last's; made on first need (a layer never
     * given a token mask holds none), grown only */
    uint8_t *hidden;      /* [hidden_bytes] device memory */
    size_t hidden_bytes;
    /* the same for a tree call's trees (stage_positions): the pass's sequences' [T, T] each,
     * in the call's order; made on first need, grown only */
    uint8_t *tree;        /* [tree_bytes] device memory */
    size_t tree_bytes;
    /* the prefill MoE path of each size class, the layer's hooks, and the two events that
     * time the candidates */
    q3_moe_choice moe_choice[Q3_MOE_SIZE_CLASSES];
    q3_moe_hooks moe_hooks;
    void *moe_events[2];
    /* the grouped cuBLAS path's matrix pointers, made on first use: 3 GEMMs x (w, x, y) x E,
     * on the host and on the device, and each expert's rows in a batch [E] */
    const void **blas_ptrs;
    void **blas_ptrs_dev;
    int *blas_rows;
};

/* a staging buffer of the state (*buf of *have bytes: st->hidden, st->tree) grown to `bytes`
 * at least (never shrunk), on the run's stream, whose work still reading the old staging is
 * waited for before it is freed; a CUDA code */
int q3_gpu_staging_reserve(const q3_cuda_ops *g, uint8_t **buf, size_t *have, size_t bytes, void *stream);

/* Device workspace and host staging for passes of `rows` rows and `seqs` sequences (grown
 * only); the release of all of it; the device workspace held now. */
q3_status q3_layer_cuda_reserve(q3_layer *layer, int64_t rows, int seqs, q3_error *err);
void q3_layer_cuda_release(q3_layer *layer);
size_t q3_layer_cuda_workspace_bytes(const q3_layer *layer);

/* One run of passes: the first failing call and its name; events while profiling. */
typedef struct {
    const q3_cuda_ops *g;
    void *stream;
    int code;
    const char *what;
    q3_profile *prof;   /* NULL unless profiling */
    q3_cuda_state *st;  /* events (profiling only) */
    q3_gpu_ws *ws;
} q3_gpu_run;

#define Q3_GPU(run, call, label)                      \
    do {                                              \
        if (!(run)->code) {                           \
            (run)->code = (call);                     \
            if ((run)->code) (run)->what = label;     \
        }                                             \
    } while (0)

/* records the boundary that ends `stage` (stage < 0: the start of a pass) */
void q3_gpu_mark(q3_gpu_run *run, int stage);
/* after a pass while profiling: waits for it, charges each interval to its stage */
void q3_gpu_collect(q3_gpu_run *run);

/* whether m is stored quantized: an FP8 layer's matrices, a GPTQ layer's 4-bit ones (not
 * its dense attention) */
static inline int q3_gpu_quantized(const q3_layer *l, q3_matrix m) {
    return m.q4 || l->w.format == Q3_WF_FP8_BLOCK128;
}

/* y [T, N] (+)= x [T, K] m^T for a quantized matrix m, FP8 or GPTQ (project_quantized.c): with
 * tensor_cores (a product the dense layer would send to them) dequantized into ws->wbf16 and
 * multiplied there (cuBLAS when cublas, else the WMMA kernel), else the format's GEMV; a CUDA
 * code */
int q3_gpu_project_quantized(const q3_layer *l, q3_gpu_run *run, int tensor_cores, int cublas, float *y,
                             const float *x, q3_matrix m, int64_t T, int64_t N, int64_t K, int accumulate);
int64_t q3_gpu_quantized_largest_matrix(const q3_layer *l);

#endif

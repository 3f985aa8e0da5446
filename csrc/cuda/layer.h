/* The CUDA side of the engine, shared by the forward driver (layer.c), the passes (passes.c)
 * and decode graphs (decode_graph.c). */
#ifndef Q3_CUDA_LAYER_H
#define Q3_CUDA_LAYER_H

#include "../engine/layer_internal.h"
#include "backend.h"

/* q3_device_backend's layer entries (csrc/engine/device_backend.h): the forward of a layer
 * whose weights live on a CUDA device, after the engine checked the call; the release of its
 * state; the device workspace it holds now; whether the kernels take the layer's geometry */
q3_status q3_layer_forward_cuda(q3_layer *layer, q3_cache *cache, const q3_forward_args *a, q3_error *err);
void q3_layer_cuda_release(q3_layer *layer);
size_t q3_layer_cuda_workspace_bytes(const q3_layer *layer);
q3_status q3_layer_cuda_config_check(const q3_config *cfg, q3_error *err);
/* the layer's halves (layer_halves.c): q3_layer_attention_half and q3_layer_expert_half of a
 * CUDA layer, after the engine's checks */
q3_status q3_layer_attention_half_cuda(q3_layer *layer, q3_cache *cache, const q3_forward_args *a,
                                       const q3_attention_half_out *out, q3_error *err);
q3_status q3_layer_expert_half_cuda(q3_layer *layer, const q3_expert_half_args *a, q3_error *err);

/* The passes of a checked call chunk by chunk (layer.c): the whole layer (half NULL), or its
 * attention half, each pass stopped after the router and its rows written to half's outputs
 * (q3_gpu_attention_half_write, layer_halves.c). The device state grown for passes of `rows`
 * rows and `seqs` sequences first (q3_layer_cuda_reserve: Q3_OK, or the failure). */
q3_status q3_layer_cuda_passes(q3_layer *layer, q3_cache *cache, const q3_forward_args *a,
                               const q3_attention_half_out *half, q3_error *err);
q3_status q3_layer_cuda_reserve(q3_layer *layer, int64_t rows, int seqs, q3_error *err);

/* Decode-sized passes (one token per sequence, at most this many sequences) keep every
 * decision on the device: positions from device-resident lengths, experts grouped by a
 * kernel, no cuBLAS. Nothing in them waits for the host, so a CUDA graph can hold them. */
#define Q3_DECODE_MAX_ROWS Q3_GRAPH_MAX_BATCH

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
    int32_t *moe_plan;     /* [q3_moe_plan_ints] prefill: tiles and per-token slots (below) */
    uint16_t *wbf16;       /* FP8 layers with rows >= 16: one matrix dequantized to bf16
                            * [q3_gpu_fp8_largest_matrix] for the tensor cores (project_fp8.c); else NULL */
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

/* A decode pass's starting state: sequences seqs [n]'s lengths and cache rows, staged in the
 * host arrays lengths [n] and rows [n] (which must outlive nothing: copies from pageable
 * memory are staged before they return) and queued for upload into ws; a CUDA code. */
int q3_gpu_upload_decode_state(const q3_cuda_ops *g, q3_gpu_ws *ws, const q3_cache *c, const int32_t *seqs, int n,
                               int64_t *lengths, q3_attn_seq *rows, void *stream);

/* The grouped prefill MoE's plan, made on the host per pass: the experts in batches of at
 * most R slots (the rows of the act and output buffers); per batch, its tiles of up to
 * Q3_MOE_TILE_ROWS slots and, for each token it touches, that token's slots in expert order
 * (tokens, ptr, slot: kernels/cuda/ops_cuda.h's moe_combine_csr). Int32s: the tiles (4
 * each, at most R k / 64 + E of them) first, then the batches' token lists. */
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

/* The prefill MoE's paths (q3_cuda.h's Q3_MOE_*, passes.c): unless one is forced
 * (q3_cuda_moe_path), moe_paths.c times each path the pass can take on the first pass of a
 * size class (rows in [2^(c-1), 2^c) for class c) and keeps the fastest for the class. */
typedef struct {
    int chosen;             /* 1 + the path kept, 0 while the class is unmeasured */
    float ms[Q3_MOE_PATHS]; /* each path's time on the measured pass; < 0: not a candidate */
} q3_moe_choice;

/* A CUDA layer's state: its device memory and host staging, grown (never shrunk) for larger calls. */
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
    /* the prefill MoE path of each size class, and the two events that time the candidates;
     * a resize (reserve) makes a new state, so a class is measured again after one */
    q3_moe_choice moe_choice[Q3_MOE_SIZE_CLASSES];
    void *moe_events[2];
    /* the grouped cuBLAS path's matrix pointers, made on first use: 3 GEMMs x (w, x, y) x E,
     * on the host and on the device, and each expert's rows in a batch [E] */
    const void **blas_ptrs;
    void **blas_ptrs_dev;
    int *blas_rows;
};

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
/* after a pass while profiling (layer.c): waits for it, charges each interval to its stage */
void q3_gpu_collect(q3_gpu_run *run);
/* a pass's rows of the attention half's outputs, from dev.x (resid), dev.h (normed) and the
 * router's choices, device to device on the run's stream */
void q3_gpu_attention_half_write(const q3_layer *l, const q3_pass *p, const q3_attention_half_out *half,
                                 q3_gpu_run *run);

/* One pass over the rows in ws->dev.x. A decode pass (p->L == 1, n_seqs <= Q3_DECODE_MAX_ROWS)
 * reads its positions from ws->lengths (which it advances) and ws->dev.attn_seqs' cache
 * pointers and padding, both uploaded beforehand; max_keys bounds the keys any query sees
 * (a graph passes the capacity). Other passes stage positions from the cache's host lengths
 * and group experts on the host (one stream synchronisation). */
void q3_gpu_attention_pass(q3_layer *l, q3_cache *c, const q3_pass *p, int64_t max_keys, q3_gpu_run *run);
/* the MoE stage: the router's (post norm: x += h, h = norm(x); logits, top-k into dev.topk_idx
 * and dev.topk_w, the call's router insides), then the experts' (x += the weighted experts of
 * h); a forward pass is q3_gpu_attention_pass, q3_gpu_route_pass, q3_gpu_experts_pass, and
 * q3_gpu_moe_pass the last two */
void q3_gpu_route_pass(q3_layer *l, const q3_pass *p, q3_gpu_run *run);
void q3_gpu_experts_pass(q3_layer *l, const q3_pass *p, q3_gpu_run *run);
void q3_gpu_moe_pass(q3_layer *l, const q3_pass *p, q3_gpu_run *run);
/* The expert half's experts on the p->L rows of dev.h into dev.x: on_device, grouped on the
 * device from dev.topk_idx and dev.topk_w (a decode pass's way; every entry an expert held);
 * else grouped on the host from st->topk_idx and st->topk_w already staged there, an entry
 * E marking an expert held elsewhere, skipped, on the prefill path forced or chosen */
void q3_gpu_experts_rows(q3_layer *l, const q3_pass *p, q3_gpu_run *run, int on_device);

/* The prefill MoE's plan (passes.c): the experts in batches of at most R slots, their tiles
 * and token lists in st->moe_plan; returns the batches and sets *used to the int32s to upload.
 * The grouped cuBLAS path over it (moe_cublas.c). */
int q3_gpu_moe_plan_batches(q3_cuda_state *st, int64_t R, int k, int E, int64_t *used);
void q3_gpu_moe_grouped_cublas(q3_layer *l, const q3_pass *p, q3_gpu_run *run);
/* The prefill MoE's experts once the pairs are grouped and uploaded (passes.c): runs
 * `path` (one of the Q3_MOE_* paths; one the shape cannot take runs per expert) */
void q3_gpu_moe_run_path(q3_layer *l, const q3_pass *p, q3_gpu_run *run, int path);
/* whether the pass can take `path`, and the path it takes (moe_paths.c): the forced one, or
 * its size class's, timed among the candidates on the class's first pass (the pass's x is
 * saved and restored around each; the candidates' outputs are discarded). A prefill pass
 * only: it synchronises the stream, so it never runs inside a graph capture. */
int q3_gpu_moe_path_fits(const q3_layer *l, const q3_cuda_ops *g, int path);
int q3_gpu_moe_choose(q3_layer *l, const q3_pass *p, q3_gpu_run *run);
int q3_moe_size_class(int64_t rows);

/* y [T, N] (+)= x [T, K] m^T for an FP8 matrix m (project_fp8.c): with tensor_cores (a product
 * the dense layer would send to them) dequantized into ws->wbf16 and multiplied there (cuBLAS
 * when cublas, else the WMMA kernel), else the FP8 GEMV; a CUDA code */
int q3_gpu_project_fp8(const q3_layer *l, q3_gpu_run *run, int tensor_cores, int cublas, float *y, const float *x,
                       q3_matrix m, int64_t T, int64_t N, int64_t K, int accumulate);
int64_t q3_gpu_fp8_largest_matrix(const q3_config *cf);

static inline int q3_gpu_is_decode(const q3_pass *p) { return p->L == 1 && p->n_seqs <= Q3_DECODE_MAX_ROWS; }

#endif

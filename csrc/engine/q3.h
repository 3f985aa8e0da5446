/* The qwen3layer engine: one Qwen3-MoE decoder layer in C, with no Python in it.
 *
 * Objects: q3_config (geometry), q3_layer (borrowed weights + workspace), q3_cache
 * (KV cache, cache.h). Every entry point returns a q3_status and, on failure,
 * fills a q3_error with a message naming the argument, the expected and the received
 * value. Nothing here exits or aborts; a call that fails leaves the cache as it was. */
#ifndef Q3_ENGINE_H
#define Q3_ENGINE_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "../../kernels/dtype.h"
#include "dlpack_abi.h"

typedef enum {
    Q3_OK = 0,
    Q3_ERR_VALUE,      /* bad shape, size or config value */
    Q3_ERR_TYPE,       /* unsupported dtype */
    Q3_ERR_INDEX,      /* sequence index out of range */
    Q3_ERR_CACHE_FULL, /* the tokens do not fit in the cache */
    Q3_ERR_NOMEM,      /* allocation failed */
    Q3_ERR_STATE,      /* object used in a state that forbids the call */
    Q3_ERR_INTERRUPTED, /* the caller's interrupt poll stopped the call (q3_forward_args) */
    Q3_ERR_CALLER       /* a callback of the caller failed; the error is the caller's own (q3_weight_source) */
} q3_status;

typedef struct {
    q3_status status;
    char msg[512];
} q3_error;

/* Records status and a printf-style message in err (if not NULL); returns status. */
q3_status q3_fail(q3_error *err, q3_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* the same with the arguments in a va_list (the engine API table's, csrc/cuda/engine_api.h) */
q3_status q3_vfail(q3_error *err, q3_status status, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));

/* ---- sizes from outside ---------------------------------------------------------- */

/* Every size product and sum formed from a caller's, a file's or a config's numbers goes
 * through these: 1 and the result in *out when it fits, 0 when it overflows (then *out is
 * unspecified). Negative operands are the caller's to reject first. */
static inline int q3_mul_i64(int64_t a, int64_t b, int64_t *out) { return !__builtin_mul_overflow(a, b, out); }
static inline int q3_add_i64(int64_t a, int64_t b, int64_t *out) { return !__builtin_add_overflow(a, b, out); }
static inline int q3_mul_size(size_t a, size_t b, size_t *out) { return !__builtin_mul_overflow(a, b, out); }
static inline int q3_add_size(size_t a, size_t b, size_t *out) { return !__builtin_add_overflow(a, b, out); }
/* the element count of a shape: 0 for a negative dim or an overflow */
static inline int q3_numel(int ndim, const int64_t *shape, int64_t *out) {
    *out = 1;
    for (int d = 0; d < ndim; d++)
        if (shape[d] < 0 || !q3_mul_i64(*out, shape[d], out)) return 0;
    return 1;
}

/* The largest geometry the engine takes: with these, every product it forms (weights,
 * cache, workspace per row) fits in int64 and every count fits the int it is held in. Far
 * above any published model (Qwen3-235B-A22B: 4096, 64, 4, 128, 128, 8, 1536, 40960). */
#define Q3_MAX_HIDDEN (1 << 20)       /* hidden_size, moe_intermediate_size */
#define Q3_MAX_HEADS (1 << 12)        /* num_attention_heads, num_key_value_heads, head_dim */
#define Q3_MAX_EXPERTS (1 << 12)      /* num_experts (num_experts_per_tok <= num_experts) */
#define Q3_MAX_POSITIONS ((int64_t)1 << 40) /* max_position_embeddings */
/* a layer's weights in elements: at most 2^56 with every size at its limit; the engine
 * refuses more than this many bytes of weights in all, far past any memory */
#define Q3_MAX_WEIGHT_BYTES ((int64_t)1 << 50)

/* RoPE variants of transformers' modeling_rope_utils the engine computes (static ones only:
 * the same inv_freq at every sequence length) */
typedef enum {
    Q3_ROPE_DEFAULT = 0, /* inv_freq[i] = theta^(-2i/D) */
    Q3_ROPE_LINEAR = 1,  /* the default inv_freq / factor */
    Q3_ROPE_YARN = 2,    /* YaRN: a ramp between inv_freq / factor and inv_freq, cos and sin scaled */
} q3_rope_type;

/* The scaling parameters of a RoPE variant, as transformers names them (rope_parameters /
 * rope_scaling) and with its defaults already resolved by the caller where the two transformers
 * versions agree. Zeroes mean "unset" where transformers reads a falsy value so. */
typedef struct {
    q3_rope_type type;
    double factor;              /* linear, yarn: > 0; default: 1 */
    int64_t original_max;       /* yarn: original_max_position_embeddings; 0: max_position_embeddings */
    double attention_factor;    /* yarn: the cos/sin scale, > 0; 0: from factor, mscale, mscale_all_dim */
    double beta_fast, beta_slow; /* yarn: > 0 (transformers' defaults 32 and 1) */
    double mscale, mscale_all_dim; /* yarn: 0 = unset (used only when both are set) */
    int truncate;               /* yarn: the correction range floored / ceiled (transformers' default 1) */
} q3_rope_scaling;
/* the values a variant that does not read a field must leave in it (the default RoPE: all) */
#define Q3_ROPE_SCALING_DEFAULT ((q3_rope_scaling){Q3_ROPE_DEFAULT, 1.0, 0, 0.0, 32.0, 1.0, 0.0, 0.0, 1})

typedef struct {
    int64_t hidden;        /* hidden_size */
    int heads;             /* num_attention_heads (query heads) */
    int kv_heads;          /* num_key_value_heads */
    int head_dim;          /* head_dim: not necessarily hidden / heads */
    int experts;           /* num_experts */
    int top_k;             /* num_experts_per_tok */
    int64_t moe_inter;     /* moe_intermediate_size */
    int norm_topk;         /* norm_topk_prob */
    float eps;             /* rms_norm_eps */
    double rope_theta;     /* rope_theta */
    int64_t max_positions; /* max_position_embeddings */
    q3_rope_scaling rope;  /* rope_parameters' variant and numbers (Q3_ROPE_SCALING_DEFAULT: none) */
} q3_config;

/* Rejects impossible geometry: non-positive sizes or sizes past the limits above, weights
 * of more than Q3_MAX_WEIGHT_BYTES, odd head_dim, heads not a multiple of kv_heads,
 * top_k > experts; and RoPE parameters out of their domain or unused by the variant
 * (rope_table.c). */
q3_status q3_config_check(const q3_config *cfg, q3_error *err);

/* The RoPE of cfg as transformers' rotary embedding computes it (rope_table.c), in its fp32
 * operation order: inv_freq [head_dim / 2] (model.rotary_emb.inv_freq) and *scale, which
 * multiplies cos and sin (its attention_scaling, rounded to fp32 as torch multiplies by it).
 * The angle of dim pair i at position p is (float)p * inv_freq[i]. cfg must pass
 * q3_config_check. */
void q3_rope_table(const q3_config *cfg, float *inv_freq, float *scale);
/* The RoPE half of q3_config_check (cfg's geometry already checked): each field the variant
 * reads in its domain, the others at Q3_ROPE_SCALING_DEFAULT's values, a finite table. */
q3_status q3_rope_check(const q3_config *cfg, q3_error *err);

/* ---- weights ------------------------------------------------------------------ */

/* The per-layer tensors, by checkpoint name (prefix "model.layers.N." dropped). */
typedef enum {
    Q3_W_INPUT_NORM, /* input_layernorm.weight            [H] */
    Q3_W_Q_PROJ,     /* self_attn.q_proj.weight           [Hq*D, H] */
    Q3_W_K_PROJ,     /* self_attn.k_proj.weight           [Hkv*D, H] */
    Q3_W_V_PROJ,     /* self_attn.v_proj.weight           [Hkv*D, H] */
    Q3_W_O_PROJ,     /* self_attn.o_proj.weight           [H, Hq*D] */
    Q3_W_Q_NORM,     /* self_attn.q_norm.weight           [D] */
    Q3_W_K_NORM,     /* self_attn.k_norm.weight           [D] */
    Q3_W_POST_NORM,  /* post_attention_layernorm.weight   [H] */
    Q3_W_ROUTER,     /* mlp.gate.weight                   [E, H] */
    Q3_W_DENSE_COUNT
} q3_dense_weight;

typedef enum {
    Q3_X_GATE, /* mlp.experts.{e}.gate_proj.weight    [I, H] */
    Q3_X_UP,   /* mlp.experts.{e}.up_proj.weight      [I, H] */
    Q3_X_DOWN, /* mlp.experts.{e}.down_proj.weight    [H, I] */
    Q3_X_COUNT
} q3_expert_weight;

const char *q3_dense_weight_name(q3_dense_weight w);
const char *q3_expert_weight_name(q3_expert_weight w); /* "gate_proj", "up_proj", "down_proj" */
/* shape of a dense weight: returns its rank (1 or 2), dims filled */
int q3_dense_weight_shape(const q3_config *cfg, q3_dense_weight w, int64_t dims[2]);
void q3_expert_weight_shape(const q3_config *cfg, q3_expert_weight w, int64_t dims[2]);
/* the distribution DecoderLayer.random draws a weight from: norms around 1, matrices
 * N(0, 0.02) like a trained (and initialised) Qwen3 layer */
void q3_weight_init(int is_norm, float *mean, float *std);

/* How the projection matrices (q/k/v/o_proj and the experts' gate/up/down_proj) are stored.
 * Norms and the router are always of the layer's dtype. */
typedef enum {
    Q3_WF_DENSE = 0,        /* of the layer's dtype, like every other weight */
    Q3_WF_FP8_BLOCK128 = 1, /* float8 e4m3fn bytes, each with a scale_inv [ceil(N/128), ceil(K/128)]
                             * of scale_dtype: W[i, j] = e4m3(w[i, j]) * scale_inv[i/128, j/128]
                             * (kernels/fp8.h); the checkpoints' quant_method "fp8", fmt "e4m3",
                             * weight_block_size [128, 128] */
    Q3_WF_GPTQ_INT4 = 2,    /* 4-bit GPTQ (kernels/int4.h): each matrix <module>.qweight int32 [K/8, N]
                             * with its .scales fp16 [G, N], .qzeros int32 [G, N/8] and .g_idx int32
                             * [K], G = K / gptq_group; the checkpoints' quant_method "gptq", bits 4,
                             * sym, "gptq" (v1) or "gptq_v2" zeros. Host and CUDA layers. */
} q3_weight_format;

const char *q3_weight_format_name(q3_weight_format f); /* "dense", "fp8_e4m3_block128", "gptq_int4" */
int q3_weight_format_count(void);                       /* the formats are 0 .. count - 1 */
/* whether dense weight w is a projection matrix (stored in the layer's weight format) */
int q3_dense_weight_is_matrix(q3_dense_weight w);

/* The experts fused: gate_up_proj [E, 2I, H] (expert e's gate rows, then its up rows) and
 * down_proj [E, H, I]; in the FP8 format their scale_inv are [E, 2 ceil(I/128), ceil(H/128)]
 * (the gate's blocks, then the up's: a 128-row block never spans both halves) and
 * [E, ceil(H/128), ceil(I/128)]. */
typedef enum { Q3_FUSED_GATE_UP, Q3_FUSED_DOWN, Q3_FUSED_COUNT } q3_fused_expert;
const char *q3_fused_expert_name(q3_fused_expert f); /* "mlp.experts.gate_up_proj", "mlp.experts.down_proj" */
/* the shape of fused tensor f (scale: of its FP8 scale_inv) */
void q3_fused_expert_shape(const q3_config *cfg, q3_fused_expert f, int scale, int64_t dims[3]);

typedef struct {
    q3_dtype dtype;                                   /* of the norms and the router, and of the
                                                       * matrices in the dense format */
    int device;                                       /* -1: host memory; else the CUDA device */
    q3_weight_format format;
    q3_dtype scale_dtype;                             /* FP8: of every scale_inv (fp32 or bf16) */
    const void *dense[Q3_W_DENSE_COUNT];              /* contiguous, shapes as above */
    const void *const *experts[Q3_X_COUNT];           /* [E] pointers each, contiguous */
    const void *dense_scale[Q3_W_DENSE_COUNT];        /* FP8: scale_inv of each matrix, else NULL */
    const void *const *expert_scales[Q3_X_COUNT];     /* FP8: [E] scale_inv pointers each */
    /* or the experts fused as transformers 5.x holds them (then experts and expert_scales are
     * NULL): q3_layer_create slices them (q3_fused_expert_shape) */
    const void *fused[Q3_FUSED_COUNT];                /* contiguous */
    const void *fused_scales[Q3_FUSED_COUNT];         /* FP8: their scale_inv */
    /* GPTQ int4: each matrix pointer is its qweight, its scale its fp16 scales, and beside them
     * its qzeros and g_idx (experts: [E] pointers each); the group size (0: 128; -1: one
     * group a matrix, of all its inputs; else a positive multiple of 8: q3_gptq_group) and the
     * zeros' convention (0: "gptq" v1, stored zero + 1; 1: "gptq_v2", the stored zero) */
    const void *dense_qzeros[Q3_W_DENSE_COUNT], *dense_g_idx[Q3_W_DENSE_COUNT];
    const void *const *expert_qzeros[Q3_X_COUNT];
    const void *const *expert_g_idx[Q3_X_COUNT];
    int64_t gptq_group;
    int gptq_v2;
    /* GPTQ int4: nonzero keeps q/k/v/o_proj dense (each matrix of dtype, as in the dense format;
     * their scale, qzeros and g_idx pointers not read), as checkpoints quantized to the experts
     * alone store them; the experts stay 4-bit */
    int gptq_dense_attention;
    /* [E]: nonzero for each expert the layer holds, the others' pointers not read (may be
     * NULL); NULL: every expert. A layer holding a subset runs only its halves (below) */
    const uint8_t *held;
    /* nonzero: the experts alone (a host layer): dense and dense_scale are not read (may be
     * NULL), and the layer runs only its expert half (the host side of a layer split over a
     * device and the host: qwen3layer/placement/hybrid.py) */
    int experts_only;
} q3_weights;

/* q3_weights.held [E] (zeroed by the caller) from the ids of the experts held, ids [n] (a
 * caller's experts=): Q3_ERR_VALUE naming the entry for an id outside [0, E) or one given twice */
q3_status q3_held_from_ids(const int64_t *ids, int64_t n, int E, uint8_t *held, q3_error *err);

/* the group size of a GPTQ matrix of K inputs for the weights' gptq_group (0: 128, -1: K) */
static inline int64_t q3_gptq_group(int64_t gptq_group, int64_t K) {
    return gptq_group == 0 ? 128 : gptq_group < 0 ? K : gptq_group;
}

/* The one table of a layer's tensors (weight_table.c), by checkpoint name (prefix
 * "model.layers.N." dropped): what a layer of a config and format reads, in the order it
 * reads them (the dense weights unless experts_only, then the experts), each projection
 * matrix followed by what its format stores beside it (FP8: its "_scale_inv"). The glue
 * takes each tensor as its storage says and writes its pointer to the slot; a new format is
 * a row of the table. */
#define Q3_WEIGHT_NAME_MAX 64
typedef enum {
    Q3_WS_LAYER,   /* of the layer's dtype: norms, the router, the dense format's matrices */
    Q3_WS_E4M3,    /* float8_e4m3fn bytes, contiguous: never converted */
    Q3_WS_SCALE,   /* of the layer's scale dtype: the scale_inv of matrix entry `of` */
    Q3_WS_QWEIGHT, /* int32 words of 4-bit values, contiguous, never converted: a GPTQ matrix */
    Q3_WS_GSCALES, /* float16, contiguous: the scales of GPTQ matrix entry `of` */
    Q3_WS_QZEROS,  /* int32 words of 4-bit zeros, contiguous: of GPTQ matrix entry `of` */
    Q3_WS_GIDX,    /* int32, contiguous: the group of each input of GPTQ matrix entry `of` */
    Q3_WS_COUNT
} q3_weight_storage;
/* "layer", "e4m3", "scale", "qweight", "gscales", "qzeros", "g_idx" */
const char *q3_weight_storage_name(q3_weight_storage s);
/* the dtype a tensor of storage s is held in, for a layer of dtype dt and scale dtype sdt */
q3_dtype q3_weight_storage_dtype(q3_weight_storage s, q3_dtype dt, q3_dtype sdt);
/* the per-expert pointer arrays a weight table's expert_ptrs holds: each matrix and up to three
 * tensors beside it, [Q3_EXPERT_PTR_ARRAYS][Q3_X_COUNT][E] */
#define Q3_EXPERT_PTR_ARRAYS 4

typedef struct {
    char name[Q3_WEIGHT_NAME_MAX];
    int rank;
    int64_t dims[3];
    q3_weight_storage storage;
    const void **slot;   /* where the q3_weights handed to q3_weight_table keep its pointer */
    int64_t of;          /* a scale: the index of its matrix's entry; else -1 */
    /* DecoderLayer.random's draws (q3_weight_fill_random): elements [first, first + numel) of
     * stream `stream` under the seed, norms around 1 (q3_weight_init) */
    uint64_t stream;
    int64_t first;
    int is_norm;
    int64_t matrix_rows; /* an E4M3 tensor: the rows of each matrix quantized on its own */
    int64_t matrix_dims[2]; /* a QWEIGHT entry: the matrix's [N, K] (its qweight is [K/8, N]) */
} q3_weight_entry;

/* The table for cfg and the weights' format, held experts and experts_only (w's fields);
 * fused: the experts as transformers 5.x fuses them (two tensors of every expert), else per
 * expert (mlp.experts.{e}.{gate,up,down}_proj.weight, the held ones only). The slots point
 * into *w and into expert_ptrs [Q3_EXPERT_PTR_ARRAYS * Q3_X_COUNT * E] (the per-expert pointer tables, which
 * w->experts and w->expert_scales are pointed at; NULL: no slots, for the names alone).
 * out NULL: *n is the count alone; else Q3_ERR_VALUE when more than max entries. */
q3_status q3_weight_table(const q3_config *cfg, q3_weights *w, int fused, const void **expert_ptrs,
                          q3_weight_entry *out, int64_t max, int64_t *n, q3_error *err);
int64_t q3_weight_entry_numel(const q3_weight_entry *e); /* -1 when the count overflows int64 */
/* DecoderLayer.random's draws into entry e's tensor data (dtype: its storage's, the layer's
 * for Q3_WS_LAYER); a matrix also fills the entries beside it (side[i]: the data of the
 * table's entry e + 1 + i: an E4M3 matrix's fp32 scale; a GPTQ matrix's scales, qzeros and
 * g_idx, quantized by RTN from the dense draws); an entry beside a matrix fills nothing.
 * Q3_ERR_NOMEM when a GPTQ matrix's fp32 draws find no memory. */
q3_status q3_weight_fill_random(const q3_weight_entry *e, void *data, q3_dtype dtype, void *const *side, uint64_t seed,
                                int64_t gptq_group, int gptq_v2, q3_error *err);
/* a format by name (Q3_ERR_VALUE naming what was given); the formats' names as a list for a
 * message ("'dense' or 'fp8_e4m3_block128'", in buf); the format a checkpoint is in, from the
 * dtype of self_attn.q_proj.weight; the weight whose dtype a layer takes when given none */
q3_status q3_weight_format_parse(const char *name, q3_weight_format *f, q3_error *err);
const char *q3_weight_format_list(char *buf, size_t size);
q3_weight_format q3_weight_format_of(q3_dtype q_proj);
q3_dense_weight q3_weight_format_dtype_source(q3_weight_format f);

/* scale_inv's shape for an FP8 matrix of shape dims [N, K] */
static inline void q3_fp8_scale_shape(const int64_t dims[2], int64_t out[2]) {
    out[0] = (dims[0] + 127) / 128;
    out[1] = (dims[1] + 127) / 128;
}

/* ---- layer -------------------------------------------------------------------- */

typedef struct q3_layer q3_layer;
typedef struct q3_cache q3_cache;

/* Borrows the weights (the caller keeps them alive and unchanged until destroy). */
q3_status q3_layer_create(q3_layer **out, const q3_config *cfg, const q3_weights *w, q3_error *err);
void q3_layer_destroy(q3_layer *layer);
const q3_config *q3_layer_config(const q3_layer *layer);
q3_dtype q3_layer_dtype(const q3_layer *layer);
q3_weight_format q3_layer_weight_format(const q3_layer *layer);
/* bytes of all the layer's weights as the engine reads them (FP8: the bytes and the scales);
 * of the experts, only the held ones' */
int64_t q3_layer_weight_bytes(const q3_layer *layer);
size_t q3_layer_workspace_bytes(const q3_layer *layer);

#define Q3_DEFAULT_CHUNK 512

/* One call of the layer: `tokens` new tokens for each of n_seqs sequences of the cache.
 * x and y are [n_seqs, tokens, hidden] of io_dtype, contiguous (y may be x). */
typedef struct {
    const void *x;
    void *y;
    q3_dtype io_dtype;
    int n_seqs;
    const int32_t *seqs; /* [n_seqs] distinct cache sequences, one per block of rows */
    int64_t tokens;      /* per sequence, >= 1 */
    int64_t chunk;       /* tokens per sequence per pass; <= 0 means Q3_DEFAULT_CHUNK */
    void *stream;        /* CUDA layers: the cudaStream_t the work is queued on (NULL: default) */
    /* polled between passes (NULL: never); nonzero stops the call, which then rolls the
     * cache back to where it began and returns Q3_ERR_INTERRUPTED (y is partly written) */
    int (*interrupted)(void *ctx);
    void *interrupt_ctx;
    /* The layer's insides, on request (NULL: not produced), in memory on the layer's device,
     * written pass by pass from the pass's own values; rows r = s * tokens + t as in x.
     * router_logits [rows, E] fp32: the router's logits; router_experts [rows, top_k] int32
     * and router_weights [rows, top_k] fp32: the experts chosen (by descending weight) and
     * their weights (normalised when norm_topk). attention [n_seqs, Hq, tokens,
     * attention_context] fp32: the probabilities of kernels/attention.h's
     * q3_attention_probs_fn, column j = cache row j of the sequence; attention_context must
     * hold the longest sequence after the call. */
    float *router_logits;
    int32_t *router_experts;
    float *router_weights;
    float *attention;
    int64_t attention_context;
    /* Per-token inputs, in host memory, [n_seqs, tokens] as x's rows (NULL: none).
     * token_mask: 0 hides a token from every query after it (the call's and later calls'):
     * right padding, a hole, what transformers' 2D attention_mask says of the new tokens; the
     * cache keeps the flag (cache.h). A hidden token's own query sees the keys before it,
     * or only itself when none is left. positions: each token's RoPE position, in
     * [0, 2^40) (NULL: the cache's rule, first position + row - padding, 0 in the padding). */
    const uint8_t *token_mask;
    const int64_t *positions;
    /* tree: [n_seqs, tokens, tokens] in host memory (NULL: causal): a per-query mask among the
     * call's tokens (tree attention, a speculative decoder's draft tree): token t sees the
     * cached tokens (less the hidden ones) and the call's tokens u with tree[t][u] nonzero;
     * u <= t, and t itself always (Q3_ERR_VALUE naming the entry otherwise). Not with
     * token_mask. */
    const uint8_t *tree;
} q3_forward_args;

/* Runs the layer over the tokens, chunk by chunk, appending their K/V to the cache.
 * All checks happen before the first write: on failure the cache is unchanged. */
q3_status q3_layer_forward(q3_layer *layer, q3_cache *cache, const q3_forward_args *a, q3_error *err);
/* The checks of q3_layer_forward alone (devices, geometry, sequences, room in the cache, the
 * size of a pass), reading neither x nor y: a caller runs them before it makes the output. */
q3_status q3_layer_check_call(const q3_layer *layer, const q3_cache *cache, const q3_forward_args *a,
                              q3_error *err);

/* ---- the layer's two halves (expert parallelism) ----------------------------------------
 * q3_layer_forward is, pass by pass, the attention half then the expert half on the same
 * rows; a caller that runs the experts elsewhere (other processes holding other experts)
 * runs the halves itself, moving rows between them. */

/* The attention half's outputs, rows r = s * tokens + t as in x, in memory on the layer's
 * device (host memory for a CPU layer). */
typedef struct {
    float *resid;          /* [rows, H] fp32: x + o_proj(attention(input_layernorm(x))) */
    void *normed;          /* [rows, H] of normed_dtype: post_attention_layernorm(resid), the experts' input */
    q3_dtype normed_dtype; /* fp32 or bf16 */
    int32_t *experts;      /* [rows, top_k] the router's choices, by descending weight */
    float *weights;        /* [rows, top_k] their weights (normalised when norm_topk) */
} q3_attention_half_out;

/* The call up to the experts: the K/V appended to the cache, the router run (its insides
 * written as by q3_layer_forward; a->y unused). The same checks as q3_layer_forward, except
 * that the layer may hold a subset of the experts. CPU and CUDA layers (a CUDA layer's passes
 * are its forward's, queued on a->stream). */
q3_status q3_layer_attention_half(q3_layer *layer, q3_cache *cache, const q3_forward_args *a,
                                  const q3_attention_half_out *out, q3_error *err);
/* its checks alone, reading neither x nor the outputs (a caller runs them before it makes them) */
q3_status q3_layer_check_attention_half(const q3_layer *layer, const q3_cache *cache, const q3_forward_args *a,
                                        q3_error *err);

/* The attention half a pass at a time, for a caller that moves each pass's rows elsewhere
 * before the next (qwen3layer's split and expert-parallel layers): begin checks the whole
 * call once (q3_layer_check_attention_half) and zeroes the cursor; each q3_layer_attention_pass
 * runs the next pass (q3_pass_cursor_tokens(a, cur) tokens of each sequence) with its outputs
 * holding that pass's rows alone, r = s * L + t, and the call's insides (a's) written at the
 * call's rows as q3_layer_forward writes them; abort rolls every sequence back to where the
 * call began. A failed pass rolls back the whole call itself and leaves the cursor unusable.
 * The caller keeps the cache from other calls between the passes (a pass checks only that
 * its tokens still fit). a->interrupted is not polled (the caller's loop is between passes). */
typedef struct {
    int64_t next;     /* the first token of the next pass, of each sequence */
    int64_t advanced; /* the tokens the passes so far appended to each sequence */
    int open;         /* 1 from a successful begin until a failure, the abort or the end */
    int64_t passes;   /* the call's passes (set by begin; kept through a roll-back) */
    int64_t done;     /* the passes run so far (kept through a roll-back) */
} q3_pass_cursor;

q3_status q3_layer_attention_passes_begin(const q3_layer *layer, const q3_cache *cache, const q3_forward_args *a,
                                          q3_pass_cursor *cur, q3_error *err);
/* the tokens of each sequence the next pass takes: 0 once every pass has run */
int64_t q3_pass_cursor_tokens(const q3_forward_args *a, const q3_pass_cursor *cur);
q3_status q3_layer_attention_pass(q3_layer *layer, q3_cache *cache, const q3_forward_args *a, q3_pass_cursor *cur,
                                  const q3_attention_half_out *out, q3_error *err);
void q3_layer_attention_passes_abort(q3_cache *cache, const q3_forward_args *a, q3_pass_cursor *cur);
/* the end of a call run pass by pass once every pass has run (the cache keeps what they
 * appended): Q3_ERR_STATE "close: ..." while the call is not open or passes are left */
q3_status q3_layer_attention_passes_end(q3_pass_cursor *cur, q3_error *err);

/* The expert half: out [n, H] (=, or += when acc) sum over j of weights[i, j] x
 * expert_{experts[i, j]}(rows[i]); an entry of -1 is skipped (an expert held elsewhere), every
 * other must be an expert the layer holds (Q3_ERR_VALUE naming [i, j] otherwise, before any
 * work). The experts' outputs are summed in expert order, as q3_layer_forward sums them.
 * n = 0 does nothing. CPU and CUDA layers: a CUDA layer's tensors are in its device's memory
 * (the ids copied to the host and checked there, on a->stream, before any work is queued),
 * its experts those of its forward's passes. */
typedef struct {
    const void *rows;  /* [n, H] */
    q3_dtype dtype;    /* of rows: fp32 or bf16 */
    int64_t n;
    const int32_t *experts; /* [n, top_k] */
    const float *weights;   /* [n, top_k] */
    void *out;              /* [n, H] of out_dtype (fp32 or bf16); not overlapping the inputs */
    q3_dtype out_dtype;
    int acc;
    void *stream; /* CUDA layers: the cudaStream_t the work is queued on (NULL: default) */
} q3_expert_half_args;
q3_status q3_layer_expert_half(q3_layer *layer, const q3_expert_half_args *a, q3_error *err);
/* Rows of a layer whose experts are split between places (qwen3layer/placement/hybrid.py: a
 * device and the host; qwen3layer/placement/parallel.py: processes), as views (q3_view: the
 * tensors from outside, below) in the memory of one device (-1: the host; else a CUDA device,
 * through the installed backend, queued on `stream`), each view float32, bfloat16 or float16 as
 * imported, `rows` int32 (Q3_VIEW_I32). Tensors of rows may have leading dims ([..., H]: their
 * rows in order, the product of the leading dims).
 * q3_take_rows: out [n, H] <- src [R, H] row rows[i] for i < n, of src's dtype, moved as
 * they are. q3_take_rows_check checks the views first (src contiguous [R, H >= 1]; rows a
 * contiguous [n]; out, when given (NULL: the caller makes one [n, H] of src's dtype after the
 * check), a writable contiguous [n, H] of src's dtype overlapping neither), each failure naming
 * the argument; q3_take_rows then moves the rows into dst (out's data, or the one made) and
 * checks only the row indices.
 * q3_combine_rows: resid [R, H] fp32 (writable, contiguous) += parts[i] [n, H] at row rows[i]
 * (rows [n]) for i < n in turn, then out [R, H] (NULL: none; writable, contiguous, any float
 * dtype, resid itself or overlapping neither) <- resid: every view checked, then the work.
 * Each row index is checked in [0, R) before any write (Q3_ERR_INDEX naming the first outside;
 * a device's rows read back on the stream first). On the host a row may be named by several
 * parts (they add in order); on a device a row named twice is refused (Q3_ERR_VALUE: its
 * kernel adds the parts in parallel). A refused call writes nothing. */
typedef struct q3_view q3_view; /* below: tensors from outside */
q3_status q3_take_rows_check(const q3_view *src, const q3_view *rows, const q3_view *out, q3_error *err);
q3_status q3_take_rows(void *dst, const q3_view *src, const q3_view *rows, void *stream, q3_error *err);
q3_status q3_combine_rows(const q3_view *resid, const q3_view *parts, const q3_view *rows, const q3_view *out,
                          void *stream, q3_error *err);
/* the check of those rows alone (host memory), distinct or not */
q3_status q3_check_split_rows(const int32_t *rows, int64_t n, int64_t R, int distinct, q3_error *err);
/* how many experts the layer holds, and whether it holds expert e */
int q3_layer_held_experts(const q3_layer *layer);
int q3_layer_holds_expert(const q3_layer *layer, int e);

/* Per-stage timing of the forward (profile.h): on (resets the totals) or off; the
 * seconds accumulated per stage since; the stages' names (NULL past the last). */
q3_status q3_layer_profiling(q3_layer *layer, int on, q3_error *err);
int q3_layer_profile_read(const q3_layer *layer, double *seconds, int max);
const char *q3_stage_name(int stage);

/* ---- routing summary (routing.c) ----------------------------------------------------- */

/* The router's choices summed up for a routing summary (qwen3layer.routing): how many
 * (token, slot) choices went to each expert in one layer call. */

/* What is checked before the choices are imported: E in [1, Q3_MAX_EXPERTS] and, for choices
 * on a CUDA device (`device` >= 0, their DLPack device; -1: the host), a backend installed
 * (Q3_ERR_VALUE naming num_experts, resp. experts: before a producer exports anything). */
q3_status q3_count_experts_check(int E, int device, q3_error *err);
/* counts [E] = how many entries of the int32 view `experts` (at least 1 dim: [..., top_k])
 * equal each e in [0, E), E as q3_count_experts_check took it. A host view is read in place
 * in any layout (a slice of a trace's choices works as well) whose elements do not overlap
 * (Q3_ERR_VALUE otherwise: the walk is bounded by the memory the tensor holds); a device view
 * must be contiguous and is copied to the host through the backend, after everything queued
 * on its device finished (the pass that wrote it may be on any stream), so the counts are of
 * finished choices (Q3_ERR_STATE "experts: copying them from cuda:d: ..." when that fails).
 * counts is zeroed first and counts every entry, so rows x top_k in all. An entry outside
 * [0, E) fails with Q3_ERR_INDEX naming its position ("experts[2, 7]") and value, counts then
 * zeroed. */
q3_status q3_count_experts(const q3_view *experts, int E, int64_t *counts, q3_error *err);

/* ---- the KV cache (cache.c, cache_ops.c; its layout: cache.h) ------------------------- */

q3_status q3_cache_create(q3_cache **out, int batch, int64_t capacity, int kv_heads,
                          int head_dim, q3_dtype dtype, q3_error *err);
/* the same on CUDA device `device` (-1: host); the CUDA backend must be open */
q3_status q3_cache_create_on(q3_cache **out, int batch, int64_t capacity, int kv_heads, int head_dim,
                             q3_dtype dtype, int device, q3_error *err);
void q3_cache_destroy(q3_cache *c);
/* Sequence arguments (seq, src_seq, dst_seq) are int64 as a caller gave them: one outside
 * [0, batch) is Q3_ERR_INDEX naming the argument. */
/* seq NULL: every sequence */
q3_status q3_cache_reset(q3_cache *c, const int64_t *seq, q3_error *err);
/* the first n tokens sequence seq will receive are padding; only while it is empty */
q3_status q3_cache_set_padding(q3_cache *c, int64_t seq, int64_t n, q3_error *err);
/* the first real token of sequence seq sits at position p (RoPE's, 0 by default: a caller
 * whose positions count its left padding, or run on from elsewhere); only while it is empty;
 * 0 <= p, p + capacity <= Q3_MAX_POSITIONS */
q3_status q3_cache_set_first_position(q3_cache *c, int64_t seq, int64_t p, q3_error *err);
/* keep the first n tokens of sequence seq (n <= its length) */
q3_status q3_cache_truncate(q3_cache *c, int64_t seq, int64_t n, q3_error *err);

/* Operations for generation (cache_ops.c). Each checks every argument before it writes and
 * leaves the cache as it was on failure. Lengths, padding and first positions travel with the tokens. On a
 * device cache the copying ones queue 2-D device copies on `stream` (a cudaStream_t: ordered
 * with the caller's layer calls on it, no wait); stream NULL: on the default stream between
 * two synchronizations of the device (ordered against every stream). A CUDA error leaves
 * lengths and padding unchanged (Q3_ERR_STATE, its text in the message). `stream` is ignored
 * for host caches. */
/* An index [n] is int64 as a caller gave it, each entry checked in [0, batch) (Q3_ERR_INDEX
 * naming the first outside, "index[i]") before the count. */
/* in place: sequence i <- old sequence index[i], n = c->batch (indices may repeat: beam
 * search). Takes a spare block of at most one sequence's tokens while it runs (on the
 * cache's device: allocating and freeing it waits for the device). */
q3_status q3_cache_reorder(q3_cache *c, const int64_t *index, int64_t n, void *stream, q3_error *err);
/* keep the first `length` tokens of sequence *seq (seq NULL: of every sequence); a sequence
 * holding fewer keeps what it holds. length < 0 drops -length tokens from the end of each
 * (an error if one holds fewer). The same as transformers' Cache.crop on a batch. */
q3_status q3_cache_crop(q3_cache *c, const int64_t *seq, int64_t length, q3_error *err);
/* the first `length` tokens of src_seq (length <= its length) become sequence dst_seq's
 * whole content (prefix reuse); padding min(src's, length). src_seq == dst_seq truncates. */
q3_status q3_cache_copy_prefix(q3_cache *c, int64_t src_seq, int64_t dst_seq, int64_t length, void *stream,
                               q3_error *err);

/* Tree verification (cache_accept.c). q3_tree_inputs: for a verify call of T tokens, from
 * parents (a contiguous host int64 view: [T], sequence seq's, or [batch, T], every sequence's;
 * -1: a root after the cache, else an earlier token of the call: Q3_ERR_VALUE naming the entry
 * otherwise), the tree's rank and shape (*ndim, shape: [T, T] or [batch, T, T]; Q3_ERR_VALUE for
 * another rank, batch or layout) and, tree non-NULL, the tree (q3_forward_args.tree: each token
 * sees its ancestors and itself) and positions (parents' shape: the sequence's next position by
 * the cache's rule, plus the token's depth; Q3_ERR_INDEX for a seq outside the batch).
 * q3_cache_accept: after a verify of sequence seq (its last call, with no cache operation
 * since: Q3_ERR_STATE otherwise), its tokens kept [n] (increasing indices into the verify's
 * tokens) become the rows after the tokens before it, in that order, and the others are
 * dropped (stream as for the operations below). */
q3_status q3_tree_inputs(const q3_cache *c, const q3_view *parents, int64_t seq, int *ndim, int64_t shape[3],
                         uint8_t *tree, int64_t *positions, q3_error *err);
q3_status q3_cache_accept(q3_cache *c, int64_t seq, const int64_t *kept, int64_t n, void *stream, q3_error *err);

/* Every sequence's room grows to `capacity` tokens (at least the cache's now; equal: nothing
 * happens): new zeroed K and V blocks of that capacity are allocated, each sequence's held
 * tokens are moved into them once (on a device cache: 2-D copies on `stream`, then waited for),
 * and the cache uses them from then on. The cache's reference to the old blocks is dropped:
 * they are freed now, or with the last view of them (q3_cache_blocks_ref).
 * Cost: 2 x batch x kv_heads x capacity x head_dim elements allocated (old and new held
 * together at the peak) and the tokens held copied once. A failure leaves the cache as it was. */
q3_status q3_cache_grow(q3_cache *c, int64_t capacity, void *stream, q3_error *err);
/* The K and V blocks a cache reads now [batch, kv_heads, capacity, head_dim] each, counted:
 * q3_cache_blocks_ref takes a reference (a view's: the blocks live while it does, however long
 * it outlives a growth or the cache), q3_cache_blocks_unref drops one (NULL: nothing), freeing
 * the blocks with the last; the count is atomic, so either may run on any thread. */
typedef struct q3_cache_blocks q3_cache_blocks;
q3_cache_blocks *q3_cache_blocks_ref(q3_cache *c);
void q3_cache_blocks_unref(q3_cache_blocks *b);

/* ---- the KV cache and the config as a binding calls them (cache.c, cache_ops.c, config.c,
 * rope_table.c): every check here, a binding only converts -------------------------------- */

/* New caches of src's geometry, capacity and device (*out, the caller's to destroy; NULL on
 * failure), sequence i a copy of src's index[i]: only the tokens held are copied, lengths,
 * padding and first positions with them (stream as above; a CUDA error's message begins
 * "gather: "). select: index [n], 1 <= n <= INT_MAX (indices may repeat); repeat_interleave:
 * batch x n sequences, i x n + j a copy of i (a prompt expanded to n beams), the batch at most
 * INT_MAX; copy: the same sequences. */
q3_status q3_cache_select(q3_cache **out, const q3_cache *src, const int64_t *index, int64_t n, void *stream,
                          q3_error *err);
q3_status q3_cache_repeat_interleave(q3_cache **out, const q3_cache *src, int64_t n, void *stream, q3_error *err);
q3_status q3_cache_copy(q3_cache **out, const q3_cache *src, void *stream, q3_error *err);

/* A zero-copy view of K (values 0) or V: base and shape, strides in elements. seq given:
 * sequence *seq's [kv_heads, length, head_dim]; seq NULL: every sequence's [batch, kv_heads,
 * tokens, head_dim], tokens *tokens (0 <= tokens <= capacity) or, tokens NULL, the length all
 * sequences hold (Q3_ERR_VALUE when they differ). Positions past a sequence's length read what
 * the cache holds there (zeros until written). Valid until the cache grows or is destroyed, or
 * while a reference to its blocks (q3_cache_blocks_ref) lives. */
typedef struct {
    void *base;
    int ndim;
    int64_t shape[4];
    int64_t strides[4];
} q3_cache_view;
q3_status q3_cache_view_of(const q3_cache *c, int values, const int64_t *seq, const int64_t *tokens,
                           q3_cache_view *v, q3_error *err);
/* the tokens every sequence holds together */
int64_t q3_cache_held(const q3_cache *c);

/* Every call that changes a cache or makes one from it, as one request: the calls above with
 * the request's fields as their arguments (a binding fills it and makes one call, the cache
 * kept from other threads meanwhile). */
typedef enum {
    Q3_CACHE_RESET,              /* seq, or every_seq */
    Q3_CACHE_TRUNCATE,           /* seq, n: the tokens kept */
    Q3_CACHE_SET_PADDING,        /* seq, n */
    Q3_CACHE_SET_FIRST_POSITION, /* seq, n: the position */
    Q3_CACHE_CROP,               /* seq or every_seq, n: the length */
    Q3_CACHE_COPY_PREFIX,        /* src_seq into seq (dst_seq), n: the length; stream */
    Q3_CACHE_REORDER,            /* index [n]; stream */
    Q3_CACHE_SELECT,             /* index [n]; stream -> out */
    Q3_CACHE_REPEAT_INTERLEAVE,  /* n; stream -> out */
    Q3_CACHE_COPY,               /* stream -> out */
    Q3_CACHE_GROW,               /* n: the capacity; stream */
    Q3_CACHE_ACCEPT,             /* seq, index [n]: the kept tokens; stream */
} q3_cache_op;
typedef struct {
    q3_cache_op op;
    int64_t seq;
    int every_seq; /* nonzero: seq is "every sequence" (reset, crop) */
    int64_t src_seq;
    int64_t n;
    const int64_t *index;
    void *stream;
    q3_cache *out; /* set by select, repeat_interleave, copy */
} q3_cache_call_args;
q3_status q3_cache_call(q3_cache *c, q3_cache_call_args *a, q3_error *err);

/* A config from a LayerConfig's fields as a binding reads them, before they are narrowed into
 * q3_config: the counts wide (Q3_CF_* order; their names and limits by index), the rest as
 * q3_config holds them. q3_config_make checks each count in [1, its limit] (the message naming
 * "config.<name>"; rope_original_max_position_embeddings only where given, else 0: unset),
 * narrows them and checks the rest as q3_config_check does. */
enum {
    Q3_CF_HIDDEN, Q3_CF_HEADS, Q3_CF_KV_HEADS, Q3_CF_HEAD_DIM, Q3_CF_EXPERTS, Q3_CF_TOP_K, Q3_CF_MOE_INTER,
    Q3_CF_MAX_POSITIONS, Q3_CF_ROPE_ORIGINAL_MAX, Q3_CF_COUNT
};
const char *q3_config_count_name(int i); /* "hidden_size", ... */
int64_t q3_config_count_max(int i);
typedef struct {
    int64_t counts[Q3_CF_COUNT];
    int original_max_given;
    int norm_topk;
    double eps, rope_theta;
    q3_rope_scaling rope; /* original_max: from counts */
} q3_config_values;
q3_status q3_config_make(const q3_config_values *v, q3_config *out, q3_error *err);
/* the RoPE variants by transformers' rope_type ("default", "linear", "yarn"): a variant's name,
 * a name's variant (Q3_ERR_VALUE naming what was given), the names as a list for a message
 * ("'default', 'linear' or 'yarn'", in buf) */
const char *q3_rope_type_name(q3_rope_type t);
q3_status q3_rope_type_parse(const char *name, q3_rope_type *t, q3_error *err);
const char *q3_rope_type_list(char *buf, size_t size);
/* The LayerConfig fields a binding reads into q3_config_values, in order: q3_config_field(f) for
 * f < Q3_CONFIG_FIELDS (NULL past them). Each names its attribute and says how a value converts
 * (type: COUNT an int, not a bool, into counts[count], checked by q3_config_make; NUMBER a real,
 * not a bool; FLAG any object's truth; ROPE_TYPE a variant's name), whether None is taken (unset:
 * a count not given, a number 0.0, the engine's "unset"; positive: a given number must then not
 * read so, > 0 or nan) and where its value lies in q3_config_values (at: an int64_t, double, int
 * or q3_rope_type). q3_config_field_given records field f given or None (unset);
 * q3_config_field_unset says whether it reads as None (rope_defaults: Q3_ROPE_SCALING_DEFAULT's). */
typedef enum { Q3_FIELD_COUNT, Q3_FIELD_NUMBER, Q3_FIELD_FLAG, Q3_FIELD_ROPE_TYPE } q3_field_type;
typedef struct {
    const char *name;
    q3_field_type type;
    int none_ok, positive, rope; /* None taken; a given number > 0 or nan; a RoPE field (from rope_type on) */
    int count;                   /* a count's Q3_CF_* index, else -1 */
    size_t at;
} q3_config_field_info;
#define Q3_CONFIG_FIELDS 20
const q3_config_field_info *q3_config_field(int f);
void q3_config_field_given(q3_config_values *v, int f, int given);
int q3_config_field_unset(const q3_config_values *v, int f);

/* base of sequence seq's [kv_heads, capacity, head_dim] block */
void *q3_cache_seq_keys(const q3_cache *c, int seq);
void *q3_cache_seq_values(const q3_cache *c, int seq);
size_t q3_cache_bytes(const q3_cache *c);
/* its geometry, and sequence seq's tokens held */
int q3_cache_batch(const q3_cache *c);
int q3_cache_kv_heads(const q3_cache *c);
int q3_cache_head_dim(const q3_cache *c);
int64_t q3_cache_capacity(const q3_cache *c);
q3_dtype q3_cache_dtype(const q3_cache *c);
int q3_cache_device(const q3_cache *c); /* -1: host memory; else the CUDA device */
int64_t q3_cache_length(const q3_cache *c, int seq);
/* A cache's counts by id, as a binding's attributes read them: batch, kv_heads, head_dim,
 * capacity (tokens a sequence), growths (the times q3_cache_grow moved it) and bytes (K and V
 * together) ignore seq; from Q3_CC_LENGTH on, sequence seq's (0 <= seq < batch): tokens held,
 * leading padding, first real position, hidden tokens (q3_cache_hidden_tokens' count) */
typedef enum {
    Q3_CC_BATCH, Q3_CC_KV_HEADS, Q3_CC_HEAD_DIM, Q3_CC_CAPACITY, Q3_CC_GROWTHS, Q3_CC_BYTES,
    Q3_CC_LENGTH, Q3_CC_PADDING, Q3_CC_FIRST_POSITION, Q3_CC_HIDDEN
} q3_cache_count_id;
int64_t q3_cache_count(const q3_cache *c, q3_cache_count_id id, int seq);
/* the hidden tokens of sequence seq (those a call's token mask hid): their count, and their
 * indices, ascending, into ids [count] unless NULL */
int64_t q3_cache_hidden_tokens(const q3_cache *c, int seq, int64_t *ids);

/* ---- tensors from outside (tensor_view.c) ------------------------------------------ */

#define Q3_MAX_DIM 8

/* A tensor borrowed from a producer (a DLPack tensor, dlpack_abi.h) as the engine reads it:
 * its first element, dims and strides (elements), where it lives, and what a call may do with
 * it. managed and versioned belong to the importer (the glue: the capsule's deleter to run). */
typedef struct q3_view {
    void *data; /* first element */
    int ndim;
    int64_t shape[Q3_MAX_DIM];
    int64_t strides[Q3_MAX_DIM]; /* elements */
    q3_dtype dtype;
    int device; /* -1: host memory; else the CUDA device */
    int contiguous;
    int readonly;
    void *managed; /* the importer's handle, released by it */
    int versioned;
} q3_view;

/* What an import takes besides float32, bfloat16 and float16 tensors on the device asked: host tensors
 * on any device (Q3_VIEW_HOST), float8 e4m3fn weights (Q3_VIEW_E4M3); or int32 tensors instead
 * of the float ones (Q3_VIEW_I32: the router's chosen experts); or every dtype the extension
 * has (Q3_VIEW_ANY: float32, bfloat16, float16, float8_e4m3fn, int32); or float16 alone (Q3_VIEW_F16: a
 * GPTQ matrix's scales, on any device); or bool and uint8 (Q3_VIEW_BOOL: a call's token mask, as Q3_BOOL), or
 * int64 (Q3_VIEW_I64: a call's positions) */
enum { Q3_VIEW_HOST = 1, Q3_VIEW_E4M3 = 2, Q3_VIEW_I32 = 4, Q3_VIEW_ANY = 8, Q3_VIEW_F16 = 16, Q3_VIEW_BOOL = 32,
       Q3_VIEW_I64 = 64 };
/* Q3_ERR_VALUE unless a tensor on DLPack device (type, id) may be imported for `device` (-1:
 * the host, else that CUDA device) under `allow`: asked before a producer exports anything */
q3_status q3_view_check_device(int type, int id, int device, int allow, const char *arg, q3_error *err);
/* v's fields but managed, versioned and readonly from DLPack tensor t, checked: its device,
 * its dtype (Q3_ERR_TYPE), at most Q3_MAX_DIM dims, data aligned to its elements,
 * non-negative dims whose count fits int64, strides whose farthest byte offset fits. Errors
 * name `arg` with what was expected and what came. */
q3_status q3_view_from_dlpack(q3_view *v, const q3_dl_tensor *t, const char *arg, int device, int allow,
                              q3_error *err);
/* what a call needs of a view it reads or writes: Q3_NEED_CONTIGUOUS ("<arg>: expected a
 * contiguous tensor, got strides [..]"), Q3_NEED_WRITABLE ("... got a read-only one") */
enum { Q3_NEED_CONTIGUOUS = 1, Q3_NEED_WRITABLE = 2 };
q3_status q3_view_require(const q3_view *v, const char *arg, int need, q3_error *err);
/* Q3_ERR_VALUE "<arg>: expected shape [dims], got [..]" unless v is [rank] dims */
q3_status q3_view_check_shape(const q3_view *v, const char *arg, int rank, const int64_t *dims, q3_error *err);
/* v is a contiguous tensor [..., cols] of `rows` rows (the product of its leading dims; rows < 0:
 * any), else Q3_ERR_VALUE naming arg (cols_name: what cols is); its rows; whether the bytes of
 * two such views overlap */
q3_status q3_view_check_rows(const q3_view *v, const char *arg, int64_t rows, int64_t cols, const char *cols_name,
                             q3_error *err);
int64_t q3_view_rows(const q3_view *v);
int q3_views_overlap(const q3_view *a, const q3_view *b);
/* copy_tensor's rules for a copy of v onto `device` (-1: the host): v contiguous, a backend
 * installed when either side is on a device (Q3_ERR_STATE "device: the CUDA backend is not
 * loaded"), not from one device buffer to another (Q3_ERR_VALUE) */
q3_status q3_view_check_copy(const q3_view *v, int device, q3_error *err);
/* v <- host bytes from `offset` on of a buffer of len bytes at base, as a
 * contiguous tensor [ndim dims: shape] (non-negative dims, at most Q3_MAX_DIM) of dt: a view of
 * a memory-mapped file. Q3_ERR_VALUE naming shape when its size overflows int64, buffer when
 * the bytes do not fit. */
q3_status q3_view_of_bytes(q3_view *v, void *base, int64_t len, int64_t offset, q3_dtype dt, int ndim,
                           const int64_t *shape, q3_error *err);
/* "[2, 3, 4]" into buf [n] */
void q3_format_shape(char *buf, size_t n, int ndim, const int64_t *shape);
/* whether element strides [ndim] lay shape [ndim] out in C order (an empty tensor always) */
int q3_strides_contiguous(int ndim, const int64_t *shape, const int64_t *strides);
/* the C-order strides of `shape` (non-negative dims); 0 when a stride, or the bytes the dims
 * span with each 0 dim counted as 1, overflows int64: a 0 dim empties the tensor but leaves the
 * other dims' products as strides, so the size alone does not bound them. numel <= that span,
 * so the tensor's bytes fit whenever this returns 1. */
int q3_contiguous_strides(int ndim, const int64_t *shape, size_t itemsize, int64_t *strides);

/* ---- the process's settings, DLPack out, a layer from a caller's tensors (cpu_dispatch.c,
 * status.c, dlpack_export.c, weight_load.c) ---------------------------------------------- */

/* "cpu" (device -1) or "cuda:N" into buf [n] (tensor_view.c) */
void q3_format_device(char *buf, size_t n, int device);
/* At load (cpu_dispatch.c): QWEN3LAYER_CPU_HIDE (q3_cpu_hide's list) takes levels away first,
 * QWEN3LAYER_CPU_PATH (q3_cpu_select's name; unset: the best) forces a kernel level,
 * QWEN3LAYER_PACKED_KC sets the packed k block (the tests run other machines' blocks): the
 * first failure, its message after the variable's name ("QWEN3LAYER_CPU_PATH: cpu path: ...").
 * err: not NULL. */
q3_status q3_cpu_configure_from_env(q3_error *err);
/* the compiler that built the engine ("gcc 13.2.0", "clang ...": status.c) */
const char *q3_build_compiler(void);

/* DLPack export, and the capsules consumed (dlpack_export.c) */

/* What __dlpack__ of a tensor v the extension owns (v->readonly: a view of read-only memory)
 * may give: stream_given (only a CUDA tensor takes a stream), dl_device (NULL: not asked; else
 * {type, id}, which must be v's own device), max_major (the consumer's major DLPack version, 0
 * when not given: a legacy capsule), copy (a host copy; a CUDA tensor has none). *versioned:
 * whether the capsule is a versioned one. Q3_ERR_VALUE with the reason (the glue's BufferError). */
q3_status q3_dlpack_export_check(const q3_view *v, int stream_given, const int *dl_device, unsigned max_major,
                                 int copy, int *versioned, q3_error *err);
/* v's DLPack device ({cpu, 0} for -1, else {cuda, device}) */
q3_dl_device q3_dlpack_device(int device);
/* *managed <- a new managed tensor of v (versioned: a q3_dl_managed_v of version
 * Q3_DL_MAJOR.Q3_DL_MINOR, READ_ONLY where v->readonly, IS_COPIED where copied; else a legacy
 * q3_dl_managed), its shape and strides in the same block, manager_ctx `owner`: its deleter
 * (any thread) calls release(owner) and frees the block. Q3_ERR_NOMEM when it cannot be had. */
q3_status q3_dlpack_export(void **managed, const q3_view *v, int versioned, int copied, void *owner,
                           void (*release)(void *owner), q3_error *err);
/* runs the deleter of a managed tensor (versioned or legacy; NULL or none: nothing) */
void q3_dlpack_delete(void *managed, int versioned);
/* v from the managed tensor of a consumed capsule (versioned or legacy): a versioned one of
 * another major version is refused untaken (Q3_ERR_VALUE, v->managed left NULL: its capsule
 * still owns it); else v takes it (v->managed and v->versioned, to pass to q3_dlpack_delete
 * once released; v->readonly from its flags), then q3_view_from_dlpack's checks. */
q3_status q3_view_from_managed(q3_view *v, void *managed, int versioned, const char *arg, int device, int allow,
                               q3_error *err);

/* The views of a layer call (call_views.c), checked before anything is made or written. x of
 * prefill ([tokens, hidden]: one sequence, or [batch, tokens, hidden]: every one) or decode
 * ([batch, hidden]), contiguous: the sequences it covers and the tokens of each. */
q3_status q3_call_check_x(const q3_config *cfg, const q3_cache *c, const q3_view *x, int decode, int *n_seqs,
                          int64_t *tokens, q3_error *err);
/* A layer call's arguments from its views, checked before anything is made or written (a
 * binding only converts): x (q3_call_check_x) gives a's x, io_dtype, n_seqs and tokens; the
 * sequences a->seqs: prefill's x [tokens, hidden] is sequence *seq (NULL: 0), any other x covers
 * 0 .. n_seqs - 1 (seq given: Q3_ERR_VALUE); the per-token inputs token[3] (token_mask,
 * positions, tree as imported for them, NULL: not given; q3_call_check_token_input,
 * q3_call_check_tree_input) into a; then the call itself (q3_layer_check_attention_half when
 * half, else q3_layer_check_call). a's other fields (chunk, stream, the poll, the outputs) are
 * the caller's. a->seqs points into seqs [cap] when the sequences fit, else at memory of its
 * own, which q3_call_release frees (a failure has released it already). */
q3_status q3_call_prepare(const q3_layer *layer, const q3_cache *c, const q3_view *x, int decode, const int *seq,
                          const q3_view *const token[3], int half, int32_t *seqs, int cap, q3_forward_args *a,
                          q3_error *err);
void q3_call_release(q3_forward_args *a, const int32_t *seqs);
/* out= of such a call: x's dtype (Q3_ERR_TYPE) and shape, contiguous and writable, and x itself
 * or apart from it (each pass reads its rows of x before it writes them) */
q3_status q3_call_check_out(const q3_view *o, const q3_view *x, q3_error *err);
/* a per-token input of such a call (token_mask, positions: host tensors as imported with
 * Q3_VIEW_BOOL, Q3_VIEW_I64): x's shape less its hidden dim ([tokens], [batch, tokens], decode's
 * [batch]), contiguous; errors name arg */
q3_status q3_call_check_token_input(const q3_view *v, const q3_view *x, const char *arg, q3_error *err);
/* a prefill's tree (bool or uint8, host): [tokens, tokens] or [batch, tokens, tokens] as x, contiguous */
q3_status q3_call_check_tree_input(const q3_view *v, const q3_view *x, q3_error *err);
/* return_attention's maps for call a (checked): shape [n_seqs, heads, tokens, context], context
 * the longest of its sequences after the call; Q3_ERR_VALUE when they take over `limit` bytes */
q3_status q3_call_attention_maps(const q3_config *cfg, const q3_cache *c, const q3_forward_args *a, int64_t limit,
                                 int64_t shape[4], q3_error *err);
/* the expert half's views (q3_layer_expert_half): rows [n, hidden] contiguous, experts int32 and
 * weights fp32 [n, top_k], out (NULL: the caller makes it) [n, hidden] writable and apart */
q3_status q3_expert_half_check_views(const q3_config *cfg, const q3_view *rows, const q3_view *experts,
                                     const q3_view *weights, const q3_view *out, q3_error *err);
/* How a layer on `device` (-1: the host) reads weight view v of a table entry stored as `want`
 * (the layer's or the scale dtype, or Q3_E4M3: an FP8 matrix, whose bytes are never
 * converted): borrowed as it is (on the layer's device, of that dtype, contiguous, and on a
 * CUDA device at a multiple of `align` bytes); copied once to the layer's device as it is
 * (Q3_WEIGHT_UPLOAD: a device weight off the alignment, or a host FP8 matrix for a CUDA
 * layer); or converted once from the host into a contiguous copy of `want` (then uploaded for
 * a CUDA layer). Q3_ERR_VALUE naming arg for a weight it cannot take (a CUDA weight of another
 * dtype or layout, an FP8 matrix of another dtype, layout or device). */
typedef enum { Q3_WEIGHT_BORROW, Q3_WEIGHT_UPLOAD, Q3_WEIGHT_CONVERT } q3_weight_use;
q3_status q3_weight_view_use(const q3_view *v, q3_dtype want, int device, int align, const char *arg,
                             q3_weight_use *use, q3_error *err);

/* A layer from a caller's tensors by name (weight_load.c): the caller imports; the engine
 * decides the format and dtype it was not told (the dtype of self_attn.q_proj.weight, and of
 * the format's dtype source: q3_weight_format_of, q3_weight_format_dtype_source), which
 * tensors the layer reads (q3_weight_table, fused when mlp.experts.gate_up_proj is given) and
 * how (q3_weight_view_use): a borrowed view is held, and released with src->release, until
 * q3_layer_destroy; a copy is the layer's. Errors name the tensor, as weights['<name>']. */
typedef struct {
    void *ctx;
    int (*has)(void *ctx, const char *name); /* whether a tensor of that name is given */
    /* imports it into *v as `allow` lets (Q3_VIEW_*), expected on `device`, errors naming arg:
     * 0, or -1 with the caller's own error (the engine returns Q3_ERR_CALLER) */
    int (*import)(void *ctx, const char *name, const char *arg, int device, int allow, q3_view *v);
    void (*release)(q3_view *v);
    /* around each conversion, which may take long: the caller's lock let go and retaken (NULL: none) */
    void *(*unlock)(void *ctx);
    void (*relock)(void *ctx, void *token);
} q3_weight_source;

typedef struct {
    int device;                     /* -1: the host; else the CUDA device (its backend open) */
    const q3_dtype *dtype;          /* NULL: the weights' */
    const q3_weight_format *format; /* NULL: the weights' */
    const uint8_t *held;            /* as q3_weights' (copied) */
    int experts_only;               /* as q3_weights' (a host layer given dtype and format, else refused) */
    int64_t gptq_group;
    int gptq_v2, gptq_dense_attention;
    /* nonzero: a host layer's every tensor copied, now, into one block the layer owns (laid out
     * by q3_weight_table_layout: huge pages for all), none borrowed; else refused */
    int copy_weights;
} q3_layer_load_args;

/* cfg: checked (q3_config_make) */
q3_status q3_layer_load(q3_layer **out, const q3_config *cfg, const q3_layer_load_args *a, const q3_weight_source *src,
                        q3_error *err);
/* the tensors a loaded layer reads, in the table's order (0 for a layer of q3_layer_create):
 * entry i's name, the pointer the engine reads and whether it is the layer's copy */
int64_t q3_layer_weight_count(const q3_layer *l);
const char *q3_layer_weight(const q3_layer *l, int64_t i, const void **ptr, int *converted);
/* FP8: the dtype of the block scales */
q3_dtype q3_layer_scale_dtype(const q3_layer *l);

/* ---- utilities ------------------------------------------------------------------ */

/* Aligned allocation for tensors (64-byte aligned; NULL when bytes cannot be had, an
 * absurd size included); q3_free releases it. */
void *q3_alloc(size_t bytes);
void q3_free(void *p);

/* dst (contiguous, dst_dt) <- src (strided, src_dt), shape [ndim], strides in elements */
void q3_copy_strided(void *dst, q3_dtype dst_dt, const void *src, q3_dtype src_dt, int ndim,
                     const int64_t *shape, const int64_t *strides);

/* dst [n] <- mean + std * N(0,1), deterministic in (seed, stream) */
void q3_fill_random(void *dst, q3_dtype dt, int64_t n, uint64_t seed, uint64_t stream,
                    float mean, float std);
/* the same from element `first` of the stream on: elements [first, first + n) of a tensor
 * drawn by q3_fill_random (one expert of a fused tensor) */
void q3_fill_random_from(void *dst, q3_dtype dt, int64_t n, uint64_t seed, uint64_t stream, int64_t first,
                         float mean, float std);

/* An FP8 matrix (kernels/fp8.h) quantized from the fp32 draws q3_fill_random(.., Q3_F32, ..,
 * seed, stream, mean, std) makes from element `offset` of the stream on (so under one seed the
 * FP8 matrix is, to the last bit of fp32 rounding, the quantized dense one): per 128 x 128
 * block scale_inv = amax / 448 (an all-zero block: 1), w = e4m3(value / scale_inv).
 * w [N, K] bytes, scale [ceil(N/128), ceil(K/128)] fp32. Deterministic whatever the threads. */
void q3_fill_random_fp8(uint8_t *w, float *scale, int64_t N, int64_t K, uint64_t seed, uint64_t stream,
                        int64_t offset, float mean, float std);
/* dst [count, n, K] fp32 <- count matrices w [count, n, K] of e4m3 bytes, each with its own
 * scale_inv blocks [ceil(n/128), ceil(K/128)] of sdt (stacked likewise): the scalar
 * dequantization of kernels/fp8.h, the reference for an FP8 checkpoint's values */
void q3_dequantize_fp8(float *dst, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t count, int64_t n,
                       int64_t K);
/* The same for views (host memory): weight [.., parts n, K] float8_e4m3fn, contiguous, each
 * matrix of its leading dims `parts` matrices [n, K] stacked with their own blocks (a fused
 * gate_up_proj: parts = 2); scale_inv [.., parts ceil(n/128), ceil(K/128)] fp32 or bf16,
 * contiguous, the same leading dims. q3_dequantize_fp8_check refuses anything else
 * (Q3_ERR_VALUE naming the argument, the shapes given); q3_dequantize_fp8_views writes dst
 * [weight's shape] fp32 after it. */
q3_status q3_dequantize_fp8_check(const q3_view *w, const q3_view *scale, int parts, q3_error *err);
void q3_dequantize_fp8_views(float *dst, const q3_view *w, const q3_view *scale, int parts);
/* A GPTQ matrix of views (host memory, contiguous): qweight [K/8, N] int32, qzeros [G, N/8]
 * int32, scales [G, N] float16, g_idx [K] int32. q3_dequantize_int4_check refuses anything
 * else, and what a layer refuses in its matrices (a g_idx outside [0, G), a scale not finite),
 * Q3_ERR_VALUE naming the argument; q3_dequantize_int4_views then writes dst [N, K] fp32, the
 * scalar reference of kernels/int4.h ("gptq_v2" zeros with v2, else stored + 1). */
q3_status q3_dequantize_int4_check(const q3_view *qweight, const q3_view *qzeros, const q3_view *scales,
                                   const q3_view *g_idx, q3_error *err);
void q3_dequantize_int4_views(float *dst, const q3_view *qweight, const q3_view *qzeros, const q3_view *scales,
                              const q3_view *g_idx, int v2);

/* Probes of this machine with the active CPU path (probe.c): the best of `repeats`
 * timed reads of a fresh `bytes` buffer in GB/s (0 if it cannot be allocated), and the
 * fp32 multiply-add peak of all threads in GFLOP/s. */
double q3_probe_read_gbs(size_t bytes, int repeats);
double q3_probe_fma_gflops(double seconds);

/* CPU kernel paths (cpu_dispatch.c): the ones this CPU can run, lowest first;
 * select one by name (NULL: the best); the one in use. */
int q3_cpu_paths(const char **names, int max);
q3_status q3_cpu_select(const char *name, q3_error *err);
const char *q3_cpu_path(void);
int q3_max_threads(void);
/* take levels away from this CPU's (a comma-separated list of level names, not portable), as
 * if it lacked them: which path a CPU without them gets by default, tried on this one */
q3_status q3_cpu_hide(const char *names, q3_error *err);
/* the k block of the avx2 and avx512 packed matmuls (kernels/cpu/matmul_packed.c), a decimal
 * count of columns, 1 to 2048 (0: from the L1 data cache, the default) */
q3_status q3_cpu_set_packed_kc(const char *value, q3_error *err);

/* ---- the tensors a binding makes for a call, and the weight table's (call_outputs.c,
 * weight_table.c): every size computed here, a binding only makes them ------------------- */

/* One tensor a binding makes before an engine call runs: contiguous, dtype and shape (ndim 0:
 * none to make, an output not asked for) */
typedef struct {
    q3_dtype dtype;
    int ndim;
    int64_t shape[Q3_MAX_DIM];
} q3_tensor_spec;
/* The attention half's outputs for call a (checked: q3_call_check_x's x) run as a pass of
 * `tokens` tokens a sequence (the whole call: a->tokens): resid fp32 and normed of x's dtype
 * [..., hidden], experts int32 and weights fp32 [..., top_k], x's leading dims with the pass's
 * tokens; q3_attention_half_outputs points the outputs at their data [4]. */
void q3_attention_half_specs(const q3_config *cfg, const q3_view *x, const q3_forward_args *a, int64_t tokens,
                             q3_tensor_spec spec[4]);
q3_attention_half_out q3_attention_half_outputs(void *const data[4], q3_dtype normed_dtype);
/* The insides a layer call asks for (prefill/decode's return_router, return_attention), for call
 * a (checked) on x: router_logits fp32 [..., experts], router_experts int32 and router_weights
 * fp32 [..., top_k] (x's leading dims) when router; the attention maps when attention
 * (q3_call_attention_maps: Q3_ERR_VALUE past `limit` bytes, by default
 * Q3_ATTENTION_LIMIT_DEFAULT: 1 GiB, e.g. 64 heads x 2048 new tokens x 2048 positions).
 * q3_call_insides_bind points a's insides at the data [4] made (NULL: not asked). */
#define Q3_ATTENTION_LIMIT_DEFAULT ((int64_t)1 << 30)
q3_status q3_call_insides_specs(const q3_config *cfg, const q3_cache *c, const q3_view *x, const q3_forward_args *a,
                                int router, int attention, int64_t limit, q3_tensor_spec spec[4], q3_error *err);
void q3_call_insides_bind(q3_forward_args *a, void *const data[4], const q3_tensor_spec spec[4]);
/* The expert half's views checked (q3_expert_half_check_views; out NULL: the caller makes it)
 * and the call's arguments from them; *made: the out to make when out is NULL, [n, hidden] of
 * rows' dtype (then a->out NULL, for the caller to point at it) */
q3_status q3_expert_half_prepare(const q3_config *cfg, const q3_view *rows, const q3_view *experts,
                                 const q3_view *weights, const q3_view *out, int acc, void *stream,
                                 q3_expert_half_args *a, q3_tensor_spec *made, q3_error *err);
/* The table of q3_weight_table in memory of its own (*out: q3_alloc'd, the caller's to q3_free;
 * NULL on failure), *n entries */
q3_status q3_weight_table_new(const q3_config *cfg, q3_weights *w, int fused, const void **expert_ptrs,
                              q3_weight_entry **out, int64_t *n, q3_error *err);
/* Where each entry of table [n] lies in one block holding them all, for a layer of dtype dt with
 * scales of scale_dt: offsets[i] in bytes, each a multiple of 64, and the block's *bytes.
 * DecoderLayer.random and a layer loaded with copy_weights make that one block, so that tensors
 * too small for huge pages of their own (q3_alloc: from 4 MiB; a GPTQ matrix's 3 MiB of words at
 * the real geometry) share the block's (an Intel Xeon, 2 threads: the int4 layer's decode from
 * memory 6.8 -> 5.7 ms). */
q3_status q3_weight_table_layout(const q3_weight_entry *table, int64_t n, q3_dtype dt, q3_dtype scale_dt,
                                 int64_t *offsets, int64_t *bytes, q3_error *err);
/* DecoderLayer.random's draws into every tensor of table [n] (q3_weight_fill_random: the stream
 * layout is the table's), data[i] entry i's, of its storage's dtype for a layer of dtype dt with
 * fp32 scales (q3_weight_storage_dtype) */
q3_status q3_weight_table_fill_random(const q3_weight_entry *table, int64_t n, void *const *data, q3_dtype dt,
                                      uint64_t seed, int64_t gptq_group, int gptq_v2, q3_error *err);

#endif

/* The CUDA kernel self-check: every kernel against its CPU twin (kernel_check_dense.c,
 * kernel_check_attention.c, kernel_check_hidden.c, kernel_check_tree.c, kernel_check_moe.c, kernel_check_fp8.c,
 * kernel_check_int4.c), for the GPU tests, benchmarks/gpu_check.sh and, on the SIMT executor,
 * every CI run: hand-made cases, then loops over the shapes that change a kernel's behaviour
 * (1 and 17 tokens, contexts, batches of sequences of different lengths, head dims, top-k,
 * left padding, hidden keys, trees). On the executor each case runs under each thread
 * schedule and its results must be bitwise equal across them: a missing barrier shows as a
 * difference. The cuBLAS setting is read first and restored last, whatever happens between. */
#include <stdlib.h>

#include "kernel_check.h"

/* the shapes the generated cases run at (issue 12): odd as well as usual ones */
static const int64_t TOKENS[] = {1, 17}, CONTEXTS[] = {1, 33, 100}, ROWS[] = {1, 17};
static const int BATCHES[] = {1, 3, 5}, HEAD_DIMS[] = {64, 128}, MAX_TOP = 8;
/* the multi-row GEMV's token counts (matmul.cu): each block-column size (8, 16, 32, 64: a
 * decode batch in one column) at and past its edges */
static const int64_t GEMV_ROWS[] = {1, 7, 8, 9, 16, 17, 33, 64};
/* left padding: a batch pads its even sequences (q3_check_batch), so one of 3 or 5 mixes
 * padded and unpadded ones; a batch of 1 runs without and with */
static const int PADS_1[] = {0, 5}, PADS_MORE[] = {5};
#define PADS(B) ((B) == 1 ? PADS_1 : PADS_MORE)
#define N_PADS(B) ((B) == 1 ? 2 : 1)
/* EACH(v, list) { ... }: the body once for each value v of the array `list` */
#define EACH(v, list)                                                                              \
    for (size_t v##_i = 0; v##_i < sizeof list / sizeof list[0]; v##_i++)                         \
        for (__typeof__(list[0] + 0) v = list[v##_i], v##_once = 1; v##_once; v##_once = 0)

/* whether a case of launchers `kernel` ('+'-separated) runs: every case where only is NULL,
 * else the cases with at least one launcher named in only (','-separated) */
static int selected(const char *only, const char *kernel) {
    if (!only) return 1;
    for (const char *a = kernel; *a;) {
        const size_t n = strcspn(a, "+");
        for (const char *b = only; *b;) {
            const size_t m = strcspn(b, ",");
            if (m == n && strncmp(a, b, n) == 0) return 1;
            b += m + (b[m] == ',');
        }
        a += n + (a[n] == '+');
    }
    return 0;
}

/* one pass over every selected case; out[i].max_err and digests[i] filled, *n counted */
static q3_status run_cases(check *k, q3_check_result *out, uint64_t *digests, int max, int *n, int blas) {
    const q3_cuda_ops *g = k->g;
    char name[sizeof out->name + 32];
    /* RUN(kernel, label, tolerance, expr): kernel names the launcher(s) of kernels/cuda/ops_cuda.h
     * the case exercises, label the case (unique, at most 63 characters) */
#define RUN(kernel_, label, tolerance, expr)                                                       \
    do {                                                                                           \
        if (!selected(k->only, kernel_)) break;                                                    \
        if (*n >= max) return q3_fail(k->err, Q3_ERR_VALUE, "cuda check: more than %d cases", max); \
        if (snprintf(out[*n].name, sizeof out[*n].name, "%s", label) >= (int)sizeof out[*n].name || \
            snprintf(out[*n].kernel, sizeof out[*n].kernel, "%s", kernel_) >= (int)sizeof out[*n].kernel) \
            return q3_fail(k->err, Q3_ERR_VALUE, "cuda check: case name too long: %s", label);      \
        k->digest = 0xcbf29ce484222325ull;                                                         \
        const double e_ = (expr);                                                                  \
        release(k);                                                                                \
        if (k->failed) return k->err->status;                                                      \
        out[*n].max_err = e_;                                                                      \
        out[*n].tol = tolerance;                                                                   \
        digests[*n] = k->digest;                                                                   \
        (*n)++;                                                                                    \
    } while (0)
#define NAME(...) snprintf(name, sizeof name, __VA_ARGS__)
    RUN("rmsnorm", "rmsnorm f32 weights", 1e-5, q3_case_rmsnorm(k, Q3_F32, 7, 1.0f));
    RUN("rmsnorm", "rmsnorm bf16 weights", 1e-5, q3_case_rmsnorm(k, Q3_BF16, 7, 1.0f));
    RUN("rmsnorm", "rmsnorm f16 weights", 1e-5, q3_case_rmsnorm(k, Q3_F16, 7, 1.0f));
    RUN("rmsnorm", "rmsnorm rows of magnitude 1e-3 (eps shows)", 1e-5, q3_case_rmsnorm(k, Q3_F32, 7, 1e-3f));
    RUN("add_rmsnorm", "add + rmsnorm fused, f32 weights", 1e-5, q3_case_add_rmsnorm(k, Q3_F32, 7, 0));
    RUN("add_rmsnorm", "add + rmsnorm fused, bf16, out aliasing r", 1e-5, q3_case_add_rmsnorm(k, Q3_BF16, 7, 1));
    RUN("add_rmsnorm", "add + rmsnorm fused, f16, out aliasing r", 1e-5, q3_case_add_rmsnorm(k, Q3_F16, 7, 1));
    EACH(rows, ROWS) {
        NAME("rmsnorm f32 weights, rows=%d", (int)rows);
        RUN("rmsnorm", name, 1e-5, q3_case_rmsnorm(k, Q3_F32, rows, 1.0f));
        NAME("rmsnorm bf16 weights, rows=%d", (int)rows);
        RUN("rmsnorm", name, 1e-5, q3_case_rmsnorm(k, Q3_BF16, rows, 1.0f));
        NAME("add + rmsnorm fused, bf16, out aliasing r, rows=%d", (int)rows);
        RUN("add_rmsnorm", name, 1e-5, q3_case_add_rmsnorm(k, Q3_BF16, rows, 1));
    }
    RUN("matmul", "matmul bf16 T=1 K=4096", 1e-5, q3_case_matmul(k, Q3_BF16, 1, 4096));
    RUN("matmul", "matmul bf16 T=13 K=72", 1e-5, q3_case_matmul(k, Q3_BF16, 13, 72));
    RUN("matmul", "matmul bf16 T=5 K=100", 1e-5, q3_case_matmul(k, Q3_BF16, 5, 100));
    RUN("matmul", "matmul f32 T=9 K=64", 1e-5, q3_case_matmul(k, Q3_F32, 9, 64));
    RUN("gate_up", "gate + up + SiLU*up fused, T=3 I=96 K=4096", 1e-5, q3_case_gate_up(k, Q3_BF16, 3, 96, 4096));
    EACH(T, TOKENS) { /* K = 64: 16-byte loads of bf16; K = 100: one element a lane */
        NAME("matmul bf16 T=%d K=64", (int)T);
        RUN("matmul", name, 1e-5, q3_case_matmul(k, Q3_BF16, T, 64));
        NAME("matmul bf16 T=%d K=100", (int)T);
        RUN("matmul", name, 1e-5, q3_case_matmul(k, Q3_BF16, T, 100));
        NAME("matmul f32 T=%d K=100", (int)T);
        RUN("matmul", name, 1e-5, q3_case_matmul(k, Q3_F32, T, 100));
        NAME("gate + up + SiLU*up fused, T=%d I=40 K=64", (int)T);
        RUN("gate_up", name, 1e-5, q3_case_gate_up(k, Q3_BF16, T, 40, 64));
        NAME("gate + up + SiLU*up fused, f16, T=%d I=40 K=64", (int)T);
        RUN("gate_up", name, 1e-5, q3_case_gate_up(k, Q3_F16, T, 40, 64));
    }
    /* K = 64: 16-byte loads of w and x; 67: odd, one element a lane; x 4 bytes off 16-byte
     * alignment: w in 16-byte loads, x in 4-byte ones; fp32 weights */
    EACH(T, GEMV_ROWS) {
        NAME("matmul GEMV bf16 T=%d K=64", (int)T);
        RUN("matmul", name, 1e-5, q3_case_matmul(k, Q3_BF16, T, 64));
        NAME("matmul GEMV bf16 T=%d K=67", (int)T);
        RUN("matmul", name, 1e-5, q3_case_matmul(k, Q3_BF16, T, 67));
        NAME("matmul GEMV bf16 T=%d K=64, x not 16-byte aligned", (int)T);
        RUN("matmul", name, 1e-5, q3_case_matmul_at(k, Q3_BF16, T, 70, 64, 4));
        NAME("matmul GEMV f32 T=%d K=67", (int)T);
        RUN("matmul", name, 1e-5, q3_case_matmul(k, Q3_F32, T, 67));
        /* fp16: the same two paths as bf16 (16-byte loads of 8 halves; one element a lane) */
        NAME("matmul GEMV f16 T=%d K=64", (int)T);
        RUN("matmul", name, 1e-5, q3_case_matmul(k, Q3_F16, T, 64));
        NAME("matmul GEMV f16 T=%d K=67", (int)T);
        RUN("matmul", name, 1e-5, q3_case_matmul(k, Q3_F16, T, 67));
    }
    RUN("matmul", "matmul GEMV f16 T=9 K=64, x not 16-byte aligned", 1e-5, q3_case_matmul_at(k, Q3_F16, 9, 70, 64, 4));
    RUN("matmul", "matmul GEMV bf16 T=150 K=64: 3 block columns of 64", 1e-5,
        q3_case_matmul(k, Q3_BF16, 150, 64));
    /* N >= 4096: two weight rows a warp up to 32 tokens; N odd, so the last warp's second
     * row is past N */
    static const int64_t PAIR_ROWS[] = {1, 9, 17, 33};
    EACH(T, PAIR_ROWS) {
        NAME("matmul GEMV 2 rows a warp, bf16 T=%d N=4097 K=64", (int)T);
        RUN("matmul", name, 1e-5, q3_case_matmul_at(k, Q3_BF16, T, 4097, 64, 0));
    }
    RUN("matmul", "matmul GEMV 2 rows a warp, f32 T=9 N=4097 K=67", 1e-5, q3_case_matmul_at(k, Q3_F32, 9, 4097, 67, 0));
    RUN("matmul", "matmul GEMV 2 rows a warp, f16 T=9 N=4097 K=64", 1e-5, q3_case_matmul_at(k, Q3_F16, 9, 4097, 64, 0));
    RUN("matmul", "matmul GEMV 2 rows a warp, T=17 N=4097 K=64, x unaligned", 1e-5,
        q3_case_matmul_at(k, Q3_BF16, 17, 4097, 64, 4));
    RUN("gate_up", "gate + up + SiLU*up fused, T=9 I=40 K=64", 1e-5, q3_case_gate_up(k, Q3_BF16, 9, 40, 64));
    RUN("gate_up", "gate + up + SiLU*up fused, T=16 I=40 K=100", 1e-5, q3_case_gate_up(k, Q3_BF16, 16, 40, 100));
    RUN("gate_up", "gate + up + SiLU*up fused, f16, T=16 I=40 K=100", 1e-5, q3_case_gate_up(k, Q3_F16, 16, 40, 100));
    RUN("gate_up", "gate + up + SiLU*up fused, T=33 I=40 K=64", 1e-5, q3_case_gate_up(k, Q3_BF16, 33, 40, 64));
    g->blas_enable(0); /* the WMMA kernel first, then cuBLAS where it was on */
    RUN("matmul_tc", "matmul tensor cores (WMMA) T=70 N=80 K=96", 1e-5, q3_case_matmul_tc(k, 70, 80, 96, 0));
    RUN("matmul_tc", "matmul tensor cores T=130 N=144 K=160, partial tiles, 5 steps", 1e-5,
        q3_case_matmul_tc(k, 130, 144, 160, 0));
    RUN("matmul_tc", "matmul tensor cores T=64 N=64 K=32: one tile, one k step", 1e-5,
        q3_case_matmul_tc(k, 64, 64, 32, 0));
    RUN("matmul_tc", "matmul tensor cores T=17 N=48 K=64, x, w not 16-byte aligned", 1e-5,
        q3_case_matmul_tc_at(k, 17, 48, 64, 0, 1));
    RUN("matmul_tc", "matmul tensor cores (WMMA) T=16 N=4096 K=1536", 1e-5, q3_case_matmul_tc(k, 16, 4096, 1536, 0));
    EACH(T, TOKENS) {
        NAME("matmul tensor cores (WMMA) T=%d N=80 K=96", (int)T);
        RUN("matmul_tc", name, 1e-5, q3_case_matmul_tc(k, T, 80, 96, 0));
    }
    if (blas && g->blas_enable(1)) {
        RUN("matmul_tc", "matmul cuBLAS T=70 N=80 K=96", 1e-5, q3_case_matmul_tc(k, 70, 80, 96, 0));
        RUN("matmul_tc", "matmul cuBLAS T=512 N=4096 K=1536", 1e-5, q3_case_matmul_tc(k, 512, 4096, 1536, 0));
    }
    RUN("matmul_wmma", "matmul WMMA only (never cuBLAS) T=70 N=80 K=96", 1e-5, q3_case_matmul_tc(k, 70, 80, 96, 1));

    RUN("qk_rope_kv", "qk_norm + rope + kv_write fused, D=128", 1e-2, q3_case_qk_rope_kv(k, 128, Q3_BF16));
    RUN("qk_rope_kv", "qk_norm + rope + kv_write fused, D=24", 1e-2, q3_case_qk_rope_kv(k, 24, Q3_BF16));
    /* an fp16 cache and norms: within 1e-3 (an fp16 ulp where the two sides' sums round apart) */
    RUN("qk_rope_kv", "qk_norm + rope + kv_write fused, f16, D=128", 1e-3, q3_case_qk_rope_kv(k, 128, Q3_F16));
    RUN("qk_rope_kv", "qk_norm + rope + kv_write fused, f16, D=24", 1e-3, q3_case_qk_rope_kv(k, 24, Q3_F16));
    RUN("qk_rope_kv", "qk_rope_kv at positions 1e5 to 2^40, D=128", 1e-2,
        q3_case_qk_rope_kv_far(k, 128, Q3_ROPE_DEFAULT));
    RUN("qk_rope_kv", "qk_rope_kv at positions 1e5 to 2^40, D=24", 1e-2, q3_case_qk_rope_kv_far(k, 24, Q3_ROPE_DEFAULT));
    /* the scaled tables (rope_table.c) at the same positions, far past their original window */
    RUN("qk_rope_kv", "qk_rope_kv linear RoPE x4 at positions 1e5 to 2^40, D=128", 1e-2,
        q3_case_qk_rope_kv_far(k, 128, Q3_ROPE_LINEAR));
    RUN("qk_rope_kv", "qk_rope_kv linear RoPE x4 at positions 1e5 to 2^40, D=24", 1e-2,
        q3_case_qk_rope_kv_far(k, 24, Q3_ROPE_LINEAR));
    RUN("qk_rope_kv", "qk_rope_kv YaRN x4 of 4096 at positions 1e5 to 2^40, D=128", 1e-2,
        q3_case_qk_rope_kv_far(k, 128, Q3_ROPE_YARN));
    RUN("qk_rope_kv", "qk_rope_kv YaRN x4 of 4096 at positions 1e5 to 2^40, D=24", 1e-2,
        q3_case_qk_rope_kv_far(k, 24, Q3_ROPE_YARN));
    EACH(D, HEAD_DIMS) EACH(B, BATCHES) EACH(T, TOKENS) EACH(ctx, CONTEXTS) for (int p = 0; p < N_PADS(B); p++) {
        const int pad = PADS(B)[p];
        const q3_check_batch b = {T, ctx, pad, B};
        NAME("qk_rope_kv, tokens=%d context=%d batch=%d D=%d pad=%d", (int)T, (int)ctx, B, D, pad);
        RUN("qk_rope_kv", name, 1e-2, q3_case_qk_rope_kv_batch(k, &b, D, Q3_BF16));
    }
    EACH(B, BATCHES) EACH(T, TOKENS) {
        const q3_check_batch b = {T, 33, 5, B};
        NAME("qk_rope_kv f16, tokens=%d context=33 batch=%d D=64 pad=5", (int)T, B);
        RUN("qk_rope_kv", name, 1e-3, q3_case_qk_rope_kv_batch(k, &b, 64, Q3_F16));
    }
    RUN("attention", "attention bf16 cache, 3 tokens", 1e-5, q3_case_attention(k, 3, 5, 17, 40, 0));
    RUN("attention", "attention, 6 tokens after 4 of padding", 1e-5, q3_case_attention(k, 6, 0, 17, 40, 4));
    RUN("attention", "attention split-KV, decode over 3000 keys", 1e-5, q3_case_attention(k, 1, 2999, 1800, 3100, 0));
    RUN("attention", "attention split-KV, 4 tokens over 900 keys", 1e-5, q3_case_attention(k, 4, 900, 40, 1000, 700));
    /* tensor cores: q and the probabilities rounded to bf16 */
    RUN("attention", "attention tensor cores, 40 tokens, G=4 D=32", 2e-2,
        q3_case_attention_heads(k, 40, 0, 17, 80, 0, 8, 2, 32));
    RUN("attention", "attention tensor cores, G=16 D=128, padding", 2e-2,
        q3_case_attention_heads(k, 37, 100, 0, 160, 45, 32, 2, 128));
    RUN("attention", "attention tensor cores, prompt in padding", 2e-2,
        q3_case_attention_heads(k, 21, 0, 3, 40, 12, 16, 2, 64));
    /* the online softmax: scores growing along the keys over many key tiles (each tile
     * rescales the output), mildly and into the thousands; G = 1 (a partial tile of 64
     * rows) and 32 (the launcher's most) with D = 48 (an odd count of 16 columns) */
    RUN("attention", "attention tc, scores growing, 9 key tiles, G=8 D=128", 2e-2,
        q3_case_attention_growing(k, 70, 200, 30, 16, 2, 128, 0.01f));
    RUN("attention", "attention tc, scores in the thousands, G=8 D=128", 2e-2,
        q3_case_attention_growing(k, 70, 200, 0, 16, 2, 128, 0.5f));
    RUN("attention", "attention tc, scores growing, G=1 D=64", 2e-2,
        q3_case_attention_growing(k, 67, 100, 0, 2, 2, 64, 0.02f));
    RUN("attention", "attention tc, scores growing, G=32 D=48", 2e-2,
        q3_case_attention_growing(k, 19, 90, 7, 64, 2, 48, 0.02f));
    /* Each path of the launcher at the listed shapes, G = 8 query heads a KV head at D = 128
     * (Qwen3-MoE's) and 4 at D = 64: 17 tokens over a bf16 cache go to tensor cores, over an
     * fp32 one to a block per token (G = 2 there: the slowest kernel on the executor, and G
     * changes nothing of its token and key ranges); 1 token with the exact max_keys runs
     * unsplit, with max_keys the capacity of 2100 rows (as a captured decode graph passes it)
     * in 8 slices, most of them empty at these contexts */
    EACH(D, HEAD_DIMS) EACH(B, BATCHES) EACH(ctx, CONTEXTS) for (int p = 0; p < N_PADS(B); p++) {
        const int G = D == 128 ? 8 : 4, pad = PADS(B)[p];
        const q3_check_batch many = {17, ctx, pad, B}, one = {1, ctx, pad, B};
        NAME("attention tc, tokens=17 context=%d batch=%d D=%d pad=%d", (int)ctx, B, D, pad);
        RUN("attention", name, 2e-2, q3_case_attention_batch(k, &many, G, D, Q3_BF16, 0));
        NAME("attention f32 G=2, tokens=17 context=%d batch=%d D=%d pad=%d", (int)ctx, B, D, pad);
        RUN("attention", name, 1e-5, q3_case_attention_batch(k, &many, 2, D, Q3_F32, 0));
        NAME("attention, tokens=1 context=%d batch=%d D=%d pad=%d", (int)ctx, B, D, pad);
        RUN("attention", name, 1e-5, q3_case_attention_batch(k, &one, G, D, Q3_BF16, 0));
        NAME("attention split-KV, tokens=1 context=%d batch=%d D=%d pad=%d", (int)ctx, B, D, pad);
        RUN("attention", name, 1e-5, q3_case_attention_batch(k, &one, G, D, Q3_BF16, 2100));
        /* an fp16 cache: never tensor cores (17 tokens: a block per token, G = 2 as f32's) */
        NAME("attention f16 G=2, tokens=17 context=%d batch=%d D=%d pad=%d", (int)ctx, B, D, pad);
        RUN("attention", name, 1e-5, q3_case_attention_batch(k, &many, 2, D, Q3_F16, 0));
        NAME("attention f16 split, tokens=1 context=%d batch=%d D=%d pad=%d", (int)ctx, B, D, pad);
        RUN("attention", name, 1e-5, q3_case_attention_batch(k, &one, G, D, Q3_F16, 2100));
    }
    /* The block-per-token kernel at other head dims and group sizes (issue 13): 256, the
     * most the CUDA layer takes, and 192 and 200 past 48 KiB of shared memory (its limit
     * raised); 72 (an odd number of 16-byte chunks a row); 36 and 18 without 16-byte loads
     * of bf16 (36 % 8) and of fp32 (18 % 4); G = 1 to 32 (99,840 bytes at D = 256, G = 32).
     * Each unsplit and split over both cache dtypes: a decode step of 3 sequences at context
     * 100, padded ones among them; and 17 tokens at D = 256, which tensor cores don't take */
    static const struct {
        int D, G;
    } WIDE[] = {{256, 16}, {256, 1}, {256, 4}, {192, 16}, {200, 4}, {72, 16}, {36, 4}, {18, 1}, {256, 32}};
    static const q3_dtype KV_DTYPES[] = {Q3_BF16, Q3_F32, Q3_F16};
    static const char *const KV_NAMES[] = {"bf16", "f32", "f16"};
    for (size_t w = 0; w < sizeof WIDE / sizeof WIDE[0]; w++)
        for (int d = 0; d < 3; d++)
            for (int split = 0; split < 2; split++) {
                const q3_check_batch one = {1, 100, 5, 3};
                NAME("attention%s D=%d G=%d %s cache, batch 3 pad 5", split ? " split-KV," : ",", WIDE[w].D,
                     WIDE[w].G, KV_NAMES[d]);
                RUN("attention", name, 1e-5,
                    q3_case_attention_batch(k, &one, WIDE[w].G, WIDE[w].D, KV_DTYPES[d], split ? 2100 : 0));
            }
    const q3_check_batch prompt = {17, 33, 5, 3};
    RUN("attention", "attention bf16 cache, 17 tokens D=256 G=4 (not tensor cores)", 1e-5,
        q3_case_attention_batch(k, &prompt, 4, 256, Q3_BF16, 0));
    /* The attention maps (on request only): decode and prefill rows; a pass that is a chunk
     * of a longer call (t0 > 0, rows past it untouched); sequences of different lengths with
     * left padding (padding queries see only themselves), one all inside it; context past the
     * longest; both cache dtypes; head dims 128, 64, 72 (not a multiple of the warp's 32
     * lanes), 18 (fewer than 32) and 256 (the most); G = 1 (where the wrong KV head is the
     * right one), 2, 4, 8 and 16; and 3000 keys, 12 iterations of the block's 256-key loop.
     * Then the batches of the lists above, decode and 17 tokens. */
    static const q3_probs_case PROBS[] = {
        {1, 0, 1, 7, 3, {40, 17, 0}, {5, 0, 3}, 8, 2, 128, Q3_BF16, NULL, 0, NULL},
        {9, 0, 9, 0, 2, {0, 0}, {4, 0}, 8, 2, 64, Q3_F32, NULL, 0, NULL},
        {6, 5, 20, 9, 2, {12, 7}, {3, 0}, 4, 2, 72, Q3_BF16, NULL, 0, NULL},
        {4, 3, 11, 2, 2, {1, 5}, {8, 2}, 2, 2, 18, Q3_F32, NULL, 0, NULL},
        {1, 0, 1, 5, 2, {2999, 1500}, {0, 700}, 4, 2, 128, Q3_BF16, NULL, 0, NULL},
        {17, 0, 17, 1, 1, {300}, {20}, 2, 1, 256, Q3_F32, NULL, 0, NULL},
        {1, 0, 1, 4, 2, {100, 61}, {0, 9}, 32, 2, 128, Q3_BF16, NULL, 0, NULL},
        {6, 5, 20, 9, 2, {12, 7}, {3, 0}, 4, 2, 72, Q3_F16, NULL, 0, NULL},
    };
    static const char *const PROBS_NAMES[] = {
        "attention probs, decode of 3, one in padding, G=4 D=128 bf16",
        "attention probs, prefill 9 tokens after 4 of padding, D=64 f32",
        "attention probs, chunk 5..10 of a 20-token call, D=72 bf16",
        "attention probs, chunk inside the padding, G=1 D=18 f32",
        "attention probs, decode over 3000 keys, G=2 D=128 bf16",
        "attention probs, 17 tokens after 300, G=2 D=256 f32",
        "attention probs, decode, G=16 D=128 bf16",
        "attention probs, chunk 5..10 of a 20-token call, D=72 f16",
    };
    for (size_t c = 0; c < sizeof PROBS / sizeof PROBS[0]; c++)
        RUN("attention_probs", PROBS_NAMES[c], 1e-5, q3_case_attention_probs(k, &PROBS[c]));
    EACH(B, BATCHES) EACH(T, TOKENS) {
        const q3_check_batch b = {T, 33, 5, B};
        NAME("attention probs, tokens=%d context=33 batch=%d D=64 pad=5", (int)T, B);
        RUN("attention_probs", name, 1e-5, q3_case_attention_probs_batch(k, &b, 4, 64, B == 3 ? Q3_F32 : Q3_BF16));
    }
    /* hidden keys (a token mask's): each pattern of kernel_check_hidden.c on each path */
    for (int c = 0; c < q3_hidden_cases(); c++) {
        double tol;
        const char *kernel = q3_hidden_case(c, name, sizeof name, &tol);
        RUN(kernel, name, tol, q3_case_hidden(k, c));
    }
    /* a call's tree (a verify's): each tree and scenario of kernel_check_tree.c on each path */
    for (int c = 0; c < q3_tree_cases(); c++) {
        double tol;
        const char *kernel = q3_tree_case(c, name, sizeof name, &tol);
        RUN(kernel, name, tol, q3_case_tree(k, c));
    }
    EACH(B, BATCHES) {
        NAME("decode_prepare: lengths, positions, batch=%d", B);
        RUN("decode_prepare", name, 0.0, q3_case_decode_prepare(k, B));
    }

    RUN("router_topk", "router top-k, renormalised", 1e-6, q3_case_router(k, 9, 16, 4, 1));
    RUN("router_topk", "router top-k", 1e-6, q3_case_router(k, 9, 16, 4, 0));
    RUN("router_topk", "router top-k ties: lower expert index first", 1e-6, q3_case_router_ties(k));
    for (int top = 1; top <= MAX_TOP; top++) {
        NAME("router top-k, k=%d E=60 T=17, renormalised", top);
        RUN("router_topk", name, 1e-6, q3_case_router(k, 17, 60, top, 1));
        NAME("router top-k, k=%d E=128 T=1", top);
        RUN("router_topk", name, 1e-6, q3_case_router(k, 1, 128, top, 0));
    }
    /* tied logits: E of the model (128), of Qwen1.5-MoE (60), a large one and one under a
     * warp; k of 1, 8 and the launcher's largest, 32. The weights' tolerance grows with E: the
     * softmax's sum is the CPU's E terms in turn and the kernel's 32 lanes' partials summed in
     * a tree, each within about sqrt(E) roundings of the exact sum (1.2e-5 apart measured at
     * E = 4096, 4e-7 at 128) */
    static const struct { int T, E, top; } TIED[] = {{5, 60, 1}, {5, 60, 8}, {5, 60, 32}, {17, 128, 1}, {17, 128, 8},
                                                      {3, 128, 32}, {2, 4096, 8}, {1, 4096, 32}, {6, 20, 8}};
    for (size_t c = 0; c < sizeof TIED / sizeof TIED[0]; c++) {
        NAME("router top-k, tied logits, k=%d E=%d T=%d", TIED[c].top, TIED[c].E, TIED[c].T);
        RUN("router_topk", name, TIED[c].E > 128 ? 5e-5 : 1e-6,
            q3_case_router_tied(k, TIED[c].T, TIED[c].E, TIED[c].top, (int)(c % 2)));
    }
    RUN("moe_route", "moe_route: expert grouping on the device", 0.0, q3_case_moe_route(k, 5, 3, 16));
    RUN("moe_route", "moe_route, T=17 k=8 E=128", 0.0, q3_case_moe_route(k, 17, 8, 128));
    RUN("moe_gate_up+moe_down+moe_combine", "moe gate_up + down + combine, T=5 k=3 E=16", 1e-5,
        q3_case_moe_experts(k, Q3_BF16, 5, 3, 16, 96, 256));
    /* experts of many tokens (chunks of 8), and I, H with K % 8 != 0 (one element a lane) */
    RUN("moe_gate_up+moe_down+moe_combine", "moe gate_up + down + combine, T=64 k=8 E=12", 1e-5,
        q3_case_moe_experts(k, Q3_BF16, 64, 8, 12, 32, 64));
    RUN("moe_gate_up+moe_down+moe_combine", "moe gate_up + down + combine, T=9 k=4 E=12 I=36 H=100", 1e-5,
        q3_case_moe_experts(k, Q3_BF16, 9, 4, 12, 36, 100));
    /* fp16 experts: 16-byte loads of 8 halves (I = 32, H = 64), one element a lane (36, 100) */
    RUN("moe_gate_up+moe_down+moe_combine", "moe gate_up + down + combine, f16, T=17 k=8 E=12", 1e-5,
        q3_case_moe_experts(k, Q3_F16, 17, 8, 12, 32, 64));
    RUN("moe_gate_up+moe_down+moe_combine", "moe gate_up + down + combine, f16, T=9 k=4 E=12 I=36 H=100", 1e-5,
        q3_case_moe_experts(k, Q3_F16, 9, 4, 12, 36, 100));
    RUN("moe_gate_up_tc+moe_down_tc", "moe prefill gate_up + down, tensor cores, E=6", 1e-5, q3_case_moe_prefill_tc(k));
    RUN("moe_combine_csr", "moe prefill combine_csr, 1..3 slots a token", 1e-6, q3_case_moe_combine_csr(k));
    /* E = 60 for the grouping (not a multiple of the warp's 32 lanes); E = 12 experts of
     * I = 32, H = 64 for the products, so that 17 tokens' top 8 give experts of more than
     * the GEMV's 8 tokens a warp */
    for (int top = 1; top <= MAX_TOP; top++) EACH(T, TOKENS) {
        NAME("moe_route, T=%d k=%d E=60", (int)T, top);
        RUN("moe_route", name, 0.0, q3_case_moe_route(k, T, top, 60));
        NAME("moe gate_up + down + combine, T=%d k=%d E=12", (int)T, top);
        RUN("moe_gate_up+moe_down+moe_combine", name, 1e-5, q3_case_moe_experts(k, Q3_BF16, T, top, 12, 32, 64));
        NAME("moe prefill tiles + combine_csr, T=%d k=%d E=12", (int)T, top);
        RUN("moe_gate_up_tc+moe_down_tc+moe_combine_csr", name, 1e-5, q3_case_moe_prefill_batch(k, T, top, 12, 32, 64));
    }
    /* FP8 weights, fp32 and bf16 scales: K = 400 and N = 300 end in partial 128-blocks (16-byte
     * loads, K % 16 == 0); K = 100 and w one byte off 16-byte alignment take one element a
     * lane; NaN codes on both paths; T over each block-column size */
    static const q3_dtype SCALE_DTYPES[] = {Q3_F32, Q3_BF16};
    static const int64_t FP8_ROWS[] = {1, 7, 9, 17, 33};
    EACH(sdt, SCALE_DTYPES) {
        const char *sn = sdt == Q3_BF16 ? "bf16" : "f32";
        EACH(T, FP8_ROWS) {
            NAME("fp8 matmul GEMV %s scales T=%d N=300 K=400", sn, (int)T);
            RUN("matmul_fp8", name, 1e-5, q3_case_fp8_matmul(k, sdt, T, 300, 400, 0, 0, 0));
            NAME("fp8 matmul GEMV %s scales T=%d N=70 K=100", sn, (int)T);
            RUN("matmul_fp8", name, 1e-5, q3_case_fp8_matmul(k, sdt, T, 70, 100, 0, 0, 0));
        }
        NAME("fp8 matmul GEMV %s scales T=1 N=70 K=4096", sn);
        RUN("matmul_fp8", name, 1e-5, q3_case_fp8_matmul(k, sdt, 1, 70, 4096, 0, 0, 0));
        NAME("fp8 matmul GEMV %s scales T=3 N=129 K=400, w unaligned", sn);
        RUN("matmul_fp8", name, 1e-5, q3_case_fp8_matmul(k, sdt, 3, 129, 400, 1, 0, 0));
        NAME("fp8 matmul GEMV %s scales T=9 N=70 K=256, x unaligned", sn);
        RUN("matmul_fp8", name, 1e-5, q3_case_fp8_matmul(k, sdt, 9, 70, 256, 0, 4, 0));
        NAME("fp8 matmul GEMV %s scales T=3 N=70 K=400, NaN codes", sn);
        RUN("matmul_fp8", name, 1e-5, q3_case_fp8_matmul(k, sdt, 3, 70, 400, 0, 0, 1));
        NAME("fp8 matmul GEMV %s scales T=3 N=70 K=100, NaN codes", sn);
        RUN("matmul_fp8", name, 1e-5, q3_case_fp8_matmul(k, sdt, 3, 70, 100, 0, 0, 1));
        NAME("fp8 dequant to bf16, %s scales N=300 K=400", sn);
        RUN("fp8_dequant", name, 0.0, q3_case_fp8_dequant(k, sdt, 300, 400, 0));
        NAME("fp8 dequant to bf16, %s scales N=130 K=100", sn);
        RUN("fp8_dequant", name, 0.0, q3_case_fp8_dequant(k, sdt, 130, 100, 0));
        NAME("fp8 dequant to bf16, %s scales N=129 K=256, w unaligned", sn);
        RUN("fp8_dequant", name, 0.0, q3_case_fp8_dequant(k, sdt, 129, 256, 3));
        /* H = 272, I = 144: 16-byte loads, partial blocks; H = 100, I = 36: one element a lane */
        NAME("fp8 moe gate_up + down, %s scales T=5 k=3 E=16 I=144 H=272", sn);
        RUN("moe_gate_up_fp8+moe_down_fp8", name, 1e-5, q3_case_moe_experts_fp8(k, 5, 3, 16, 144, 272, sdt));
        NAME("fp8 moe gate_up + down, %s scales T=17 k=8 E=12 I=144 H=272", sn);
        RUN("moe_gate_up_fp8+moe_down_fp8", name, 1e-5, q3_case_moe_experts_fp8(k, 17, 8, 12, 144, 272, sdt));
        NAME("fp8 moe gate_up + down, %s scales T=9 k=4 E=12 I=36 H=100", sn);
        RUN("moe_gate_up_fp8+moe_down_fp8", name, 1e-5, q3_case_moe_experts_fp8(k, 9, 4, 12, 36, 100, sdt));
    }
    /* GPTQ int4 weights: groups of 128, 64, 32 and one of all K, desc_act, both zero offsets; N
     * not a multiple of the tile's 32 outputs, K/8 word rows not of its 32 slices (which then
     * cut groups); T 1 to 16 (two token tiles), accumulate on for 3 and 16; w and x unaligned */
    static const struct {
        int64_t N, K;
        q3_int4_kind kind;
    } INT4[] = {{72, 512, {128, 0, 1}}, {200, 256, {64, 0, 0}}, {40, 384, {32, 0, 1}}, {104, 320, {0, 0, 0}},
                {72, 256, {32, 1, 1}},  {48, 384, {128, 1, 0}}};
    static const int64_t INT4_ROWS[] = {1, 3, 8, 16};
    char kind[32];
    for (size_t s = 0; s < sizeof INT4 / sizeof INT4[0]; s++) {
        const int64_t N = INT4[s].N, K = INT4[s].K;
        q3_int4_kind_name(kind, sizeof kind, &INT4[s].kind);
        EACH(T, INT4_ROWS) {
            const int acc = T == 3 || T == 16;
            NAME("int4 matmul GEMV %s T=%d N=%d K=%d%s", kind, (int)T, (int)N, (int)K, acc ? " acc" : "");
            RUN("matmul_int4", name, 1e-5, q3_case_int4_matmul(k, &INT4[s].kind, T, N, K, acc, 0, 0));
        }
        NAME("int4 dequant to bf16, %s N=%d K=%d", kind, (int)N, (int)K);
        RUN("int4_dequant", name, 0.0, q3_case_int4_dequant(k, &INT4[s].kind, N, K, 0));
    }
    RUN("matmul_int4", "int4 matmul GEMV g32 v1 T=3 N=24 K=4096: 4 groups a slice", 1e-5,
        q3_case_int4_matmul(k, &INT4[2].kind, 3, 24, 4096, 0, 0, 0));
    RUN("matmul_int4", "int4 matmul GEMV g128 v1 T=3 N=72 K=512 acc, w, x unaligned", 1e-5,
        q3_case_int4_matmul(k, &INT4[0].kind, 3, 72, 512, 1, 4, 4));
    RUN("int4_dequant", "int4 dequant to bf16, g64 v2 N=200 K=256, dst unaligned", 0.0,
        q3_case_int4_dequant(k, &INT4[1].kind, 200, 256, 2));
    static const struct {
        int64_t T, I, H;
        int top, E;
        q3_int4_kind kind;
    } INT4_MOE[] = {{3, 96, 224, 4, 12, {32, 0, 1}},
                    {16, 72, 136, 8, 12, {0, 0, 0}},
                    {1, 40, 64, 8, 16, {8, 1, 1}},
                    {8, 128, 192, 2, 16, {64, 0, 0}}};
    for (size_t s = 0; s < sizeof INT4_MOE / sizeof INT4_MOE[0]; s++) {
        q3_int4_kind_name(kind, sizeof kind, &INT4_MOE[s].kind);
        NAME("int4 moe gate_up + down, %s T=%d k=%d E=%d I=%d H=%d", kind, (int)INT4_MOE[s].T, INT4_MOE[s].top,
             INT4_MOE[s].E, (int)INT4_MOE[s].I, (int)INT4_MOE[s].H);
        RUN("moe_gate_up_int4+moe_down_int4", name, 1e-5,
            q3_case_moe_experts_int4(k, &INT4_MOE[s].kind, INT4_MOE[s].T, INT4_MOE[s].top, INT4_MOE[s].E,
                                     INT4_MOE[s].I, INT4_MOE[s].H));
    }
    RUN("swiglu", "swiglu", 1e-5, q3_case_swiglu(k));
    RUN("gather_rows+scatter_add_rows", "gather + scatter_add rows", 1e-6, q3_case_rows(k));
    RUN("from_f32+to_f32", "convert fp32 <-> bf16", 0.0, q3_case_convert(k, Q3_BF16));
    RUN("from_f32+to_f32", "convert fp32 <-> fp16: subnormals, overflow, ties", 0.0, q3_case_convert(k, Q3_F16));
    RUN("take_rows+add_rows", "take + add rows, bf16 rows, fp32 parts, n=5", 0.0,
        q3_case_take_add_rows(k, Q3_BF16, Q3_F32, 5));
    RUN("take_rows+add_rows", "take + add rows, fp32 rows, bf16 parts, n=5", 0.0,
        q3_case_take_add_rows(k, Q3_F32, Q3_BF16, 5));
    RUN("take_rows+add_rows", "take + add rows, fp32 rows, fp32 parts, n=1", 0.0,
        q3_case_take_add_rows(k, Q3_F32, Q3_F32, 1));
    RUN("take_rows+add_rows", "take + add rows, fp16 rows, fp16 parts, n=5", 0.0,
        q3_case_take_add_rows(k, Q3_F16, Q3_F16, 5));
#undef NAME
#undef RUN
    return Q3_OK;
}

q3_status q3_cuda_check(int device_index, const char *only, q3_check_result *out, int max, int *n, q3_error *err) {
    *n = 0;
    const q3_cuda_ops *g = q3_cuda();
    if (!g) return q3_fail(err, Q3_ERR_STATE, "cuda check: the CUDA backend is not loaded");
    /* against the portable CPU kernels, whichever variant the engine picked for this CPU */
    check k = {g, &q3_ops_cpu_portable, err, 0, {0}, 0, {0}, 0, 0, only};
    if (!cuda_ok(&k, g->set_device(device_index), "cudaSetDevice")) return err->status;
    const int schedules = q3_cuda_schedules();
    q3_check_result *again = calloc((size_t)max, sizeof *again);
    uint64_t *digests = calloc((size_t)max * (size_t)schedules, sizeof *digests);
    if (!again || !digests) {
        free(again);
        free(digests);
        return q3_fail(err, Q3_ERR_NOMEM, "cuda check: out of host memory");
    }
    const int blas = g->blas_enable(-1); /* read: restored below */
    q3_status s = Q3_OK;
    for (int sch = 0; sch < schedules && s == Q3_OK; sch++) {
        int m = 0;
        s = q3_cuda_set_schedule(sch, 0x5eed + (uint64_t)sch, err);
        if (s == Q3_OK) s = run_cases(&k, sch ? again : out, digests + (size_t)sch * max, max, sch ? &m : n, blas);
        for (int i = 0; sch && s == Q3_OK && i < m; i++)
            if (again[i].max_err > out[i].max_err || again[i].max_err != again[i].max_err) out[i].max_err = again[i].max_err;
    }
    for (int i = 0; s == Q3_OK && i < *n; i++) {
        out[i].schedules = schedules;
        out[i].agree = 1;
        for (int sch = 1; sch < schedules; sch++) out[i].agree &= digests[(size_t)sch * max + i] == digests[i];
    }
    if (schedules > 1) q3_cuda_set_schedule(0, 0, NULL);
    g->blas_enable(blas);
    free(again);
    free(digests);
    return s;
}

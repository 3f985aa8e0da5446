/* The CUDA kernel self-check's harness (kernel_check.c runs the cases, kernel_check_dense.c,
 * kernel_check_attention.c, kernel_check_hidden.c, kernel_check_tree.c, kernel_check_moe.c, kernel_check_fp8.c and
 * kernel_check_int4.c hold them): host and device buffers of one case, freed together, and the
 * first CUDA failure; the helpers the cases share. Internal to those files. */
#ifndef Q3_CHECK_KERNEL_CHECK_H
#define Q3_CHECK_KERNEL_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../kernels/cpu/ops.h"
#include "../../kernels/cpu/twins.h"
#include "../cuda/backend.h"
#include "q3_check.h"

typedef struct {
    const q3_cuda_ops *g;
    const q3_cpu_ops *c; /* the portable kernels, the readable oracle (as the twins use) */
    q3_error *err;
    int failed;
    void *dev[32];
    int n_dev;
    void *host[32];
    int n_host;
    uint64_t digest; /* of every result fetched since the case began: the race check compares it
                        across thread schedules */
    const char *only; /* the launchers whose cases run (','-separated), NULL: every case */
} check;

static inline int cuda_ok(check *k, int code, const char *what) {
    if (code == 0 || k->failed) return !k->failed;
    k->failed = 1;
    q3_fail(k->err, Q3_ERR_STATE, "cuda check: %s: %s", what, k->g->error_string(code));
    return 0;
}

static inline void *host(check *k, size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (p && k->n_host < 32) k->host[k->n_host++] = p;
    else if (!k->failed) {
        free(p);
        p = NULL;
        k->failed = 1;
        q3_fail(k->err, Q3_ERR_NOMEM, "cuda check: out of host memory");
    }
    return p;
}

static inline float *host_random(check *k, int64_t n, q3_dtype dt, uint64_t seed) {
    void *p = host(k, (size_t)n * q3_dtype_size(dt));
    if (p) k->c->fill_normal(p, dt, n, seed, 7, 0, 0.0f, 1.0f);
    return p;
}

/* a device copy of host[bytes] (or fresh device memory when host is NULL) */
static inline void *device(check *k, const void *src, size_t bytes) {
    void *d = NULL;
    if (k->failed || k->n_dev >= 32) return NULL;
    if (!cuda_ok(k, k->g->malloc_device(&d, bytes ? bytes : 4), "cudaMalloc")) return NULL;
    k->dev[k->n_dev++] = d;
    if (src && !cuda_ok(k, k->g->copy(d, src, bytes, 1), "copy to device")) return NULL;
    return d;
}

/* a device result into host memory, its bytes folded into k->digest (FNV-1a) */
static inline void fetch(check *k, void *dst, const void *d, size_t bytes) {
    if (!k->failed && cuda_ok(k, k->g->synchronize(), "kernel")) cuda_ok(k, k->g->copy(dst, d, bytes, 0), "copy to host");
    if (k->failed) return;
    for (size_t i = 0; i < bytes; i++) k->digest = (k->digest ^ ((const unsigned char *)dst)[i]) * 0x100000001b3ull;
}

/* src's bytes copied `off` bytes into a fresh device buffer (off % 16 != 0: not 16-byte aligned) */
static inline void *device_off(check *k, const void *src, size_t bytes, size_t off) {
    char *d = device(k, NULL, bytes + off);
    if (!d || !cuda_ok(k, k->g->copy(d + off, src, bytes, 1), "copy to device")) return NULL;
    return d + off;
}

/* k distinct experts of E per token, in no particular order (as the router's top-k), from a
 * fixed LCG; with T * k near E, several experts are chosen by more than one token */
static inline void pick_experts(int32_t *idx, int64_t T, int k, int E, uint32_t seed) {
    for (int64_t t = 0; t < T; t++)
        for (int j = 0; j < k;) {
            seed = seed * 1664525u + 1013904223u;
            const int32_t e = (int32_t)((seed >> 8) % (uint32_t)E);
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= idx[t * k + i] == e;
            if (!taken) idx[t * k + j++] = e;
        }
}

static inline void release(check *k) {
    for (int i = 0; i < k->n_dev; i++) k->g->free_device(k->dev[i]);
    for (int i = 0; i < k->n_host; i++) free(k->host[i]);
    k->n_dev = k->n_host = 0;
}

static inline double max_err(const void *a, const void *b, q3_dtype dt, int64_t n) {
    double worst = 0.0, scale = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const float x = q3_float_at(a, dt, i), y = q3_float_at(b, dt, i);
        if (isnan(x) != isnan(y)) return INFINITY;
        worst = fabs((double)x - y) > worst ? fabs((double)x - y) : worst;
        scale = fabs((double)y) > scale ? fabs((double)y) : scale;
    }
    return worst / (scale > 0.0 ? scale : 1.0);
}

/* the dense kernels' cases (kernel_check_dense.c): max |cuda - twin| / max |twin| */
double q3_case_rmsnorm(check *k, q3_dtype wdt, int64_t rows, float scale);
double q3_case_add_rmsnorm(check *k, q3_dtype wdt, int64_t rows, int alias);
double q3_case_matmul(check *k, q3_dtype wdt, int64_t T, int64_t K);
double q3_case_matmul_at(check *k, q3_dtype wdt, int64_t T, int64_t N, int64_t K, size_t x_off);
double q3_case_gate_up(check *k, q3_dtype wdt, int64_t T, int64_t I, int64_t K);
double q3_case_matmul_tc(check *k, int64_t T, int64_t N, int64_t K, int wmma_only);
double q3_case_matmul_tc_at(check *k, int64_t T, int64_t N, int64_t K, int wmma_only, int misalign);
double q3_case_router(check *k, int64_t T, int E, int top, int normalize);
double q3_case_router_ties(check *k);
double q3_case_router_tied(check *k, int64_t T, int E, int top, int normalize);
double q3_case_swiglu(check *k);
double q3_case_rows(check *k);
double q3_case_convert(check *k, q3_dtype dt);
double q3_case_take_add_rows(check *k, q3_dtype dt, q3_dtype pdt, int64_t n);

/* the attention kernels' cases (kernel_check_attention.c) */
/* the rows attention reads of a sequence of past cached tokens (start of them padding) and L
 * new ones, whose keys flagged in flags [past + L] are hidden (NULL: none): k, v and mem in
 * the memory the kernel reads (mem: the flags there, flags itself for the CPU), hidden set
 * and first_key found as the cache does (q3_cache_attn_seq) */
q3_attn_seq q3_check_attn_seq(const void *k, const void *v, int64_t past, int64_t start, int64_t L,
                              const uint8_t *flags, const uint8_t *mem);
double q3_case_qk_rope_kv(check *k, int D, q3_dtype dt);
double q3_case_qk_rope_kv_far(check *k, int D, q3_rope_type type);
double q3_case_attention_heads(check *k, int64_t L, int64_t past0, int64_t past1, int64_t capacity, int64_t pad0,
                               int Hq, int Hkv, int D);
double q3_case_attention(check *k, int64_t L, int64_t past0, int64_t past1, int64_t capacity, int64_t pad0);
double q3_case_attention_growing(check *k, int64_t L, int64_t past0, int64_t pad0, int Hq, int Hkv, int D,
                                 float grow);
/* A batch at one of the self-check's shapes: n_seqs (<= Q3_CHECK_MAX_SEQS) sequences of L new
 * tokens each; sequence s has context * (n_seqs - s) / n_seqs cached tokens before the call
 * (the first the longest, so lengths differ and later ones may be fresh), and the even ones
 * pad + s tokens of left padding (which may reach past the call: queries inside it). */
#define Q3_CHECK_MAX_SEQS 8
typedef struct {
    int64_t L, context, pad;
    int n_seqs;
} q3_check_batch;
void q3_check_batch_seqs(const q3_check_batch *b, int64_t *past, int64_t *start);
double q3_case_qk_rope_kv_batch(check *k, const q3_check_batch *b, int D, q3_dtype dt);
/* Hq = G * Hkv query heads on Hkv = 2 of dim D over a kv_dt cache; bound: max_keys is the
 * capacity (as a captured decode graph passes it, the lengths being on the device), which is
 * then `bound` rows; else the exact most keys a query sees */
double q3_case_attention_batch(check *k, const q3_check_batch *b, int G, int D, q3_dtype kv_dt, int64_t bound);
/* n_seqs sequences of sh->L tokens after past[s] cached ones (start[s] of them padding), the
 * keys flagged in hidden [n_seqs, ld] hidden (ld >= the longest sequence), on the path the
 * launcher picks for sh */
double q3_case_attention_masked(check *k, const q3_attn_shape *sh, int n_seqs, const int64_t *past,
                                const int64_t *start, const uint8_t *hidden, int64_t ld);
/* a call's trees (q3_attn_seq.tree) for the cases: bytes [n_seqs, T, T] on the host, sequence
 * s's tree_first first[s] (its cached rows before the call) */
typedef struct {
    const uint8_t *bytes;
    int64_t T;
    int64_t first[Q3_CHECK_MAX_SEQS];
} q3_check_tree;
/* q3_case_attention_masked's case with each sequence's tree (tree NULL: causal) */
double q3_case_attention_tree(check *k, const q3_attn_shape *sh, int n_seqs, const int64_t *past,
                              const int64_t *start, const uint8_t *hidden, int64_t ld, const q3_check_tree *tree);
double q3_case_decode_prepare(check *k, int n_seqs);
/* The attention maps (q3_attention_probs_fn) of one pass: n_seqs sequences of L new tokens
 * after past[s] cached ones, start[s] of them padding, Hq heads on Hkv of dim D over a dt
 * cache; the pass is rows t0 .. t0 + L - 1 of a call of out_tokens, and the maps' context
 * extra columns past the longest sequence; hidden [n_seqs, hidden_ld] flags the hidden keys
 * (NULL, as the cases that leave it out: none) */
#define Q3_PROBS_MAX_SEQS Q3_CHECK_MAX_SEQS
typedef struct {
    int64_t L, t0, out_tokens, extra;
    int n_seqs;
    int64_t past[Q3_PROBS_MAX_SEQS], start[Q3_PROBS_MAX_SEQS];
    int Hq, Hkv, D;
    q3_dtype dt;
    const uint8_t *hidden;
    int64_t hidden_ld;
    const q3_check_tree *tree; /* NULL (as the cases that leave it out): causal */
} q3_probs_case;
double q3_case_attention_probs(check *k, const q3_probs_case *c);
/* the maps of batch b in one pass, 2 G heads on 2, 3 columns past the longest sequence */
double q3_case_attention_probs_batch(check *k, const q3_check_batch *b, int G, int D, q3_dtype kv_dt);

/* A launcher's path the masked cases (hidden keys, trees) take: L tokens a sequence, G query
 * heads a KV head of dim D, over a cache of dt; bound: max_keys and capacity (a decode graph's
 * way: split-KV slices), 0: exact; tc: whether the launcher takes it to the tensor-core kernel
 * (q3_attention_tc_fits), whose q and probabilities are rounded to bf16 (its tolerance) */
typedef struct {
    const char *name, *kernel;
    int64_t L;
    int G, D;
    q3_dtype dt;
    int64_t bound;
    int tc;
} q3_masked_path;
static inline double q3_masked_path_tol(const q3_masked_path *p) { return p->tc ? 2e-2 : 1e-5; }

/* attention and its maps over hidden keys (kernel_check_hidden.c): q3_hidden_cases() cases,
 * case i's label (into name [n]) and tolerance, its launcher returned; and its run */
int q3_hidden_cases(void);
const char *q3_hidden_case(int i, char *name, size_t n, double *tol);
double q3_case_hidden(check *k, int i);

/* attention and its maps under a call's tree (kernel_check_tree.c), as the hidden keys' */
int q3_tree_cases(void);
const char *q3_tree_case(int i, char *name, size_t n, double *tol);
double q3_case_tree(check *k, int i);

/* the MoE cases (kernel_check_moe.c): max |cuda - twin| / max |twin| */
double q3_case_moe_route(check *k, int64_t T, int top, int E);
double q3_case_moe_experts(check *k, q3_dtype wdt, int64_t T, int top, int E, int64_t I, int64_t H);
double q3_case_moe_prefill_tc(check *k);
double q3_case_moe_prefill_batch(check *k, int64_t T, int top, int E, int64_t I, int64_t H);
double q3_case_moe_combine_csr(check *k);

/* the FP8 kernels' cases (kernel_check_fp8.c): w_off, x_off bytes into their buffers (not 16-byte
 * aligned: the fallbacks); nan: NaN codes in two rows */
double q3_case_fp8_matmul(check *k, q3_dtype sdt, int64_t T, int64_t N, int64_t K, size_t w_off, size_t x_off,
                          int nan);
double q3_case_fp8_dequant(check *k, q3_dtype sdt, int64_t N, int64_t K, size_t w_off);
double q3_case_moe_experts_fp8(check *k, int64_t T, int top, int E, int64_t I, int64_t H, q3_dtype sdt);

/* the 4-bit GPTQ kernels' cases (kernel_check_int4.c): matrices of one kind; w_off, x_off,
 * d_off bytes into their buffers (not 16-byte aligned: the fallbacks) */
typedef struct {
    int64_t group;   /* inputs a group; 0: one group of all K */
    int desc_act;    /* g_idx a shuffle of k / group, not k / group (the matrix's group 0) */
    int zero_offset; /* 1: "gptq" (v1), 0: "gptq_v2" */
} q3_int4_kind;
/* "g128 v1", "1 group v2", "desc_act g32 v1" */
void q3_int4_kind_name(char *out, size_t n, const q3_int4_kind *kind);
double q3_case_int4_matmul(check *k, const q3_int4_kind *kind, int64_t T, int64_t N, int64_t K, int accumulate,
                           size_t w_off, size_t x_off);
double q3_case_int4_dequant(check *k, const q3_int4_kind *kind, int64_t N, int64_t K, size_t d_off);
double q3_case_moe_experts_int4(check *k, const q3_int4_kind *kind, int64_t T, int top, int E, int64_t I,
                                int64_t H);

#endif

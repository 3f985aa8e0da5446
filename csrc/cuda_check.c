/* Every CUDA kernel against its CPU twin, on random inputs with odd sizes, for the GPU tests
 * and benchmarks/gpu_check.sh. The CPU side runs the active CPU path with fp32 activations
 * (the matmul gets no bf16 scratch), so the two differ only by summation order. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dispatch.h"
#include "cuda_backend.h"
#include "cuda_twins.h"

typedef struct {
    const q3_cuda_ops *g;
    const q3_cpu_ops *c;
    q3_error *err;
    int failed;
    void *dev[32];
    int n_dev;
    void *host[32];
    int n_host;
} check;

static int cuda_ok(check *k, int code, const char *what) {
    if (code == 0 || k->failed) return !k->failed;
    k->failed = 1;
    q3_fail(k->err, Q3_ERR_STATE, "cuda check: %s: %s", what, k->g->error_string(code));
    return 0;
}

static void *host(check *k, size_t bytes) {
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

static float *host_random(check *k, int64_t n, q3_dtype dt, uint64_t seed) {
    void *p = host(k, (size_t)n * q3_dtype_size(dt));
    if (p) k->c->fill_normal(p, dt, n, seed, 7, 0.0f, 1.0f);
    return p;
}

/* a device copy of host[bytes] (or fresh device memory when host is NULL) */
static void *device(check *k, const void *src, size_t bytes) {
    void *d = NULL;
    if (k->failed || k->n_dev >= 32) return NULL;
    if (!cuda_ok(k, k->g->malloc_device(&d, bytes ? bytes : 4), "cudaMalloc")) return NULL;
    k->dev[k->n_dev++] = d;
    if (src && !cuda_ok(k, k->g->copy(d, src, bytes, 1), "copy to device")) return NULL;
    return d;
}

static void fetch(check *k, void *dst, const void *d, size_t bytes) {
    if (!k->failed && cuda_ok(k, k->g->synchronize(), "kernel")) cuda_ok(k, k->g->copy(dst, d, bytes, 0), "copy to host");
}

static void release(check *k) {
    for (int i = 0; i < k->n_dev; i++) k->g->free_device(k->dev[i]);
    for (int i = 0; i < k->n_host; i++) free(k->host[i]);
    k->n_dev = k->n_host = 0;
}

static double max_err(const void *a, const void *b, q3_dtype dt, int64_t n) {
    double worst = 0.0, scale = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const float x = dt == Q3_BF16 ? q3_bf16_to_f32(((const uint16_t *)a)[i]) : ((const float *)a)[i];
        const float y = dt == Q3_BF16 ? q3_bf16_to_f32(((const uint16_t *)b)[i]) : ((const float *)b)[i];
        if (isnan(x) != isnan(y)) return INFINITY;
        worst = fabs((double)x - y) > worst ? fabs((double)x - y) : worst;
        scale = fabs((double)y) > scale ? fabs((double)y) : scale;
    }
    return worst / (scale > 0.0 ? scale : 1.0);
}

static double case_rmsnorm(check *k, q3_dtype wdt) {
    const int64_t rows = 7, n = 1000;
    float *x = host_random(k, rows * n, Q3_F32, 1), *want = host(k, rows * n * 4), *got = host(k, rows * n * 4);
    void *w = host_random(k, n, wdt, 2);
    if (k->failed) return INFINITY;
    k->c->rmsnorm(want, x, w, wdt, rows, n, 1e-6f);
    float *dx = device(k, x, rows * n * 4), *dout = device(k, NULL, rows * n * 4);
    void *dw = device(k, w, n * q3_dtype_size(wdt));
    if (!k->failed) cuda_ok(k, k->g->rmsnorm(dout, dx, dw, wdt, rows, n, 1e-6f, NULL), "rmsnorm launch");
    fetch(k, got, dout, rows * n * 4);
    return k->failed ? INFINITY : max_err(got, want, Q3_F32, rows * n);
}

/* the residual add fused with the norm: both the updated x and out; with `alias`, out is r's
 * buffer (as the layer calls it) */
static double case_add_rmsnorm(check *k, q3_dtype wdt, int alias) {
    const int64_t rows = 7, n = 1000;
    float *x = host_random(k, rows * n, Q3_F32, 30), *r = host_random(k, rows * n, Q3_F32, 31);
    float *want = host(k, rows * n * 4), *out_got = host(k, rows * n * 4), *x_got = host(k, rows * n * 4);
    void *w = host_random(k, n, wdt, 32);
    if (k->failed) return INFINITY;
    float *dx = device(k, x, rows * n * 4), *dr = device(k, r, rows * n * 4);
    float *dout = alias ? dr : device(k, NULL, rows * n * 4);
    void *dw = device(k, w, n * q3_dtype_size(wdt));
    q3_add_rmsnorm_host(want, x, r, w, wdt, rows, n, 1e-6f);
    if (!k->failed) cuda_ok(k, k->g->add_rmsnorm(dout, dx, dr, dw, wdt, rows, n, 1e-6f, NULL), "add_rmsnorm launch");
    fetch(k, out_got, dout, rows * n * 4);
    fetch(k, x_got, dx, rows * n * 4);
    if (k->failed) return INFINITY;
    const double e_out = max_err(out_got, want, Q3_F32, rows * n), e_x = max_err(x_got, x, Q3_F32, rows * n);
    return e_out > e_x ? e_out : e_x;
}

static double case_matmul(check *k, q3_dtype wdt, int64_t T, int64_t K) {
    const int64_t N = 70;
    float *x = host_random(k, T * K, Q3_F32, 3), *want = host_random(k, T * N, Q3_F32, 4), *got = host(k, T * N * 4);
    void *w = host_random(k, N * K, wdt, 5);
    if (k->failed) return INFINITY;
    float *dy = device(k, want, T * N * 4), *dx = device(k, x, T * K * 4);
    void *dw = device(k, w, N * K * q3_dtype_size(wdt));
    k->c->matmul(want, x, w, wdt, T, N, K, 1, NULL);
    if (!k->failed) cuda_ok(k, k->g->matmul(dy, dx, dw, wdt, T, N, K, 1, NULL), "matmul launch");
    fetch(k, got, dy, T * N * 4);
    return k->failed ? INFINITY : max_err(got, want, Q3_F32, T * N);
}

/* gate, up and SiLU * up in one pass against matmul, matmul, swiglu */
static double case_gate_up(check *k, int64_t T, int64_t I, int64_t K) {
    float *x = host_random(k, T * K, Q3_F32, 27), *want = host(k, T * I * 4), *up = host(k, T * I * 4);
    float *got = host(k, T * I * 4);
    void *gw = host_random(k, I * K, Q3_BF16, 28), *uw = host_random(k, I * K, Q3_BF16, 29);
    if (k->failed) return INFINITY;
    float *dx = device(k, x, T * K * 4), *dact = device(k, NULL, T * I * 4);
    void *dg = device(k, gw, I * K * 2), *du = device(k, uw, I * K * 2);
    k->c->matmul(want, x, gw, Q3_BF16, T, I, K, 0, NULL);
    k->c->matmul(up, x, uw, Q3_BF16, T, I, K, 0, NULL);
    k->c->swiglu(want, want, up, T * I);
    if (!k->failed) cuda_ok(k, k->g->gate_up(dact, dx, dg, du, Q3_BF16, T, I, K, NULL), "gate_up launch");
    fetch(k, got, dact, T * I * 4);
    return k->failed ? INFINITY : max_err(got, want, Q3_F32, T * I);
}

/* tensor cores see x in bf16: give both sides bf16-valued x, so only summation order differs;
 * wmma_only: the entry that never calls cuBLAS */
static double case_matmul_tc(check *k, int64_t T, int64_t N, int64_t K, int wmma_only) {
    float *x = host_random(k, T * K, Q3_F32, 19), *want = host_random(k, T * N, Q3_F32, 20), *got = host(k, T * N * 4);
    void *w = host_random(k, N * K, Q3_BF16, 21);
    if (k->failed) return INFINITY;
    for (int64_t i = 0; i < T * K; i++) x[i] = q3_bf16_to_f32(q3_f32_to_bf16(x[i]));
    float *dy = device(k, want, T * N * 4), *dx = device(k, x, T * K * 4);
    void *dw = device(k, w, N * K * 2);
    uint16_t *dxb = device(k, NULL, T * K * 2);
    k->c->matmul(want, x, w, Q3_BF16, T, N, K, 1, NULL);
    int (*const tc)(float *, const float *, const void *, int64_t, int64_t, int64_t, int, uint16_t *, void *) =
        wmma_only ? k->g->matmul_wmma : k->g->matmul_tc;
    if (!k->failed) cuda_ok(k, tc(dy, dx, dw, T, N, K, 1, dxb, NULL), "matmul_tc launch");
    fetch(k, got, dy, T * N * 4);
    return k->failed ? INFINITY : max_err(got, want, Q3_F32, T * N);
}

static double case_rope(check *k) {
    const int64_t rows = 5;
    const int heads = 3, D = 16;
    int64_t pos[5] = {0, 1, 7, 100, 4000};
    float *x = host_random(k, rows * heads * D, Q3_F32, 6), *got = host(k, rows * heads * D * 4);
    if (k->failed) return INFINITY;
    float *dx = device(k, x, rows * heads * D * 4);
    int64_t *dpos = device(k, pos, sizeof pos);
    k->c->rope(x, pos, rows, heads, D, 1e6f);
    if (!k->failed) cuda_ok(k, k->g->rope(dx, dpos, rows, heads, D, 1e6f, NULL), "rope launch");
    fetch(k, got, dx, rows * heads * D * 4);
    return k->failed ? INFINITY : max_err(got, x, Q3_F32, rows * heads * D);
}

static double case_kv_write(check *k) {
    const int64_t L = 3, cap = 10, start = 4;
    const int kvh = 2, D = 8;
    const size_t cache_bytes = (size_t)kvh * cap * D * 2;
    float *src = host_random(k, L * kvh * D, Q3_F32, 8);
    void *want = host(k, cache_bytes), *got = host(k, cache_bytes);
    if (k->failed) return INFINITY;
    void *dcache = device(k, want, cache_bytes);
    float *dsrc = device(k, src, L * kvh * D * 4);
    k->c->kv_write(want, Q3_BF16, src, kvh * D, L, kvh, D, cap, start);
    if (!k->failed) cuda_ok(k, k->g->kv_write(dcache, Q3_BF16, dsrc, kvh * D, L, kvh, D, cap, start, NULL), "kv_write launch");
    fetch(k, got, dcache, cache_bytes);
    return k->failed ? INFINITY : max_err(got, want, Q3_BF16, (int64_t)kvh * cap * D);
}

/* the fused QK-norm + RoPE + KV append against its composition: q and both caches */
static double case_qk_rope_kv(check *k, int D) {
    const q3_attn_shape sh = {3, 6, 2, D, 12, Q3_BF16, 1.0f, 0};
    const int n_seqs = 2;
    const int64_t R = n_seqs * sh.L, qn = R * sh.heads * D, kn = R * sh.kv_heads * D;
    const int64_t per_seq = (int64_t)sh.kv_heads * sh.capacity * D, n_past[2] = {4, 0};
    int64_t pos[6];
    for (int64_t r = 0; r < R; r++) pos[r] = n_past[r / sh.L] + r % sh.L;
    float *q = host_random(k, qn, Q3_F32, 22), *kk = host_random(k, kn, Q3_F32, 23), *v = host_random(k, kn, Q3_F32, 24);
    void *qw = host_random(k, D, Q3_BF16, 25), *kw = host_random(k, D, Q3_BF16, 26);
    uint16_t *kc = host(k, n_seqs * per_seq * 2), *vc = host(k, n_seqs * per_seq * 2);
    float *q_got = host(k, qn * 4);
    uint16_t *kc_got = host(k, n_seqs * per_seq * 2), *vc_got = host(k, n_seqs * per_seq * 2);
    if (k->failed) return INFINITY;
    float *dq = device(k, q, qn * 4), *dk = device(k, kk, kn * 4), *dv = device(k, v, kn * 4);
    void *dqw = device(k, qw, D * 2), *dkw = device(k, kw, D * 2);
    uint16_t *dkc = device(k, kc, n_seqs * per_seq * 2), *dvc = device(k, vc, n_seqs * per_seq * 2);
    int64_t *dpos = device(k, pos, sizeof pos);
    q3_attn_seq hs[2], ds[2];
    for (int s = 0; s < n_seqs; s++) {
        hs[s] = (q3_attn_seq){kc + s * per_seq, vc + s * per_seq, n_past[s], 0};
        ds[s] = (q3_attn_seq){dkc ? dkc + s * per_seq : NULL, dvc ? dvc + s * per_seq : NULL, n_past[s], 0};
    }
    q3_attn_seq *dseqs = device(k, ds, sizeof ds);
    q3_qk_rope_kv_host(q, kk, v, qw, kw, Q3_BF16, pos, hs, n_seqs, &sh, 1e-6f, 1e6f);
    if (!k->failed)
        cuda_ok(k, k->g->qk_rope_kv(dq, dk, dv, dqw, dkw, Q3_BF16, dpos, dseqs, n_seqs, &sh, 1e-6f, 1e6f, NULL),
                "qk_rope_kv launch");
    fetch(k, q_got, dq, qn * 4);
    fetch(k, kc_got, dkc, n_seqs * per_seq * 2);
    fetch(k, vc_got, dvc, n_seqs * per_seq * 2);
    if (k->failed) return INFINITY;
    const double e1 = max_err(q_got, q, Q3_F32, qn), e2 = max_err(kc_got, kc, Q3_BF16, n_seqs * per_seq),
                 e3 = max_err(vc_got, vc, Q3_BF16, n_seqs * per_seq);
    return e1 > e2 ? (e1 > e3 ? e1 : e3) : (e2 > e3 ? e2 : e3);
}

/* L query tokens after n_past[s] cached ones, for 2 sequences; long ones split on the GPU */
static double case_attention(check *k, int64_t L, int64_t past0, int64_t past1, int64_t capacity, int64_t pad0) {
    const q3_attn_shape sh = {L, 8, 2, 24, capacity, Q3_BF16, 1.0f / sqrtf(24.0f), (past0 > past1 ? past0 : past1) + L};
    const int n_seqs = 2;
    const int64_t n_past[2] = {past0, past1}, per_seq = (int64_t)sh.kv_heads * sh.capacity * sh.head_dim;
    const int64_t qn = n_seqs * sh.L * sh.heads * sh.head_dim;
    uint16_t *kc = (uint16_t *)host_random(k, n_seqs * per_seq, Q3_BF16, 9);
    uint16_t *vc = (uint16_t *)host_random(k, n_seqs * per_seq, Q3_BF16, 10);
    float *q = host_random(k, qn, Q3_F32, 11), *want = host(k, qn * 4), *got = host(k, qn * 4);
    float *scratch = host(k, (size_t)q3_attention_scratch_floats(&sh) * 4);
    if (k->failed) return INFINITY;
    q3_attn_seq hs[2], ds[2];
    uint16_t *dk = device(k, kc, n_seqs * per_seq * 2), *dv = device(k, vc, n_seqs * per_seq * 2);
    for (int s = 0; s < n_seqs; s++) {
        const int64_t pad = s == 0 ? pad0 : 0;
        hs[s] = (q3_attn_seq){kc + s * per_seq, vc + s * per_seq, n_past[s], pad};
        ds[s] = (q3_attn_seq){dk ? dk + s * per_seq : NULL, dv ? dv + s * per_seq : NULL, n_past[s], pad};
    }
    q3_attn_seq *dseqs = device(k, ds, sizeof ds);
    float *dq = device(k, q, qn * 4), *dout = device(k, NULL, qn * 4);
    float *dpart = device(k, NULL, (size_t)q3_attention_cuda_partial_floats(n_seqs * L, &sh) * 4);
    k->c->attention(want, q, hs, n_seqs, &sh, scratch, 1);
    if (!k->failed) cuda_ok(k, k->g->attention(dout, dq, dseqs, n_seqs, &sh, dpart, NULL), "attention launch");
    fetch(k, got, dout, qn * 4);
    return k->failed ? INFINITY : max_err(got, want, Q3_F32, qn);
}

static double case_router(check *k, int normalize) {
    const int64_t T = 9;
    const int E = 16, top = 4;
    float *logits = host_random(k, T * E, Q3_F32, 12), *w_want = host(k, T * top * 4), *w_got = host(k, T * top * 4);
    int32_t *i_want = host(k, T * top * 4), *i_got = host(k, T * top * 4);
    if (k->failed) return INFINITY;
    float *dl = device(k, logits, T * E * 4), *dw = device(k, NULL, T * top * 4);
    int32_t *di = device(k, NULL, T * top * 4);
    k->c->router_topk(i_want, w_want, logits, T, E, top, normalize);
    if (!k->failed) cuda_ok(k, k->g->router_topk(di, dw, dl, T, E, top, normalize, NULL), "router launch");
    fetch(k, i_got, di, T * top * 4);
    fetch(k, w_got, dw, T * top * 4);
    if (k->failed || memcmp(i_got, i_want, T * top * 4)) return INFINITY;
    return max_err(w_got, w_want, Q3_F32, T * top);
}

static double case_swiglu(check *k) {
    const int64_t n = 1000;
    float *g = host_random(k, n, Q3_F32, 13), *u = host_random(k, n, Q3_F32, 14);
    float *want = host(k, n * 4), *got = host(k, n * 4);
    if (k->failed) return INFINITY;
    float *dg = device(k, g, n * 4), *du = device(k, u, n * 4), *da = device(k, NULL, n * 4);
    k->c->swiglu(want, g, u, n);
    if (!k->failed) cuda_ok(k, k->g->swiglu(da, dg, du, n, NULL), "swiglu launch");
    fetch(k, got, da, n * 4);
    return k->failed ? INFINITY : max_err(got, want, Q3_F32, n);
}

static double case_rows(check *k) {
    const int64_t T = 6, H = 50, n = 3;
    const int32_t rows[3] = {4, 1, 5};
    float *src = host_random(k, T * H, Q3_F32, 15), *scale = host_random(k, n, Q3_F32, 16);
    float *dst = host_random(k, T * H, Q3_F32, 17), *gath = host(k, n * H * 4), *got = host(k, T * H * 4);
    if (k->failed) return INFINITY;
    float *dsrc = device(k, src, T * H * 4), *dscale = device(k, scale, n * 4), *ddst = device(k, dst, T * H * 4);
    float *dgath = device(k, NULL, n * H * 4);
    int32_t *drows = device(k, rows, sizeof rows);
    k->c->gather_rows(gath, src, rows, n, H);
    k->c->scatter_add_rows(dst, gath, rows, scale, n, H);
    if (!k->failed) cuda_ok(k, k->g->gather_rows(dgath, dsrc, drows, n, H, NULL), "gather launch");
    if (!k->failed) cuda_ok(k, k->g->scatter_add_rows(ddst, dgath, drows, dscale, n, H, NULL), "scatter launch");
    fetch(k, got, ddst, T * H * 4);
    return k->failed ? INFINITY : max_err(got, dst, Q3_F32, T * H);
}

static double case_convert(check *k) {
    const int64_t n = 777;
    float *x = host_random(k, n, Q3_F32, 18), *back = host(k, n * 4);
    uint16_t *want = host(k, n * 2), *got = host(k, n * 2);
    if (k->failed) return INFINITY;
    float *dx = device(k, x, n * 4), *dback = device(k, NULL, n * 4);
    uint16_t *dh = device(k, NULL, n * 2);
    k->c->from_f32(want, Q3_BF16, x, n);
    if (!k->failed) cuda_ok(k, k->g->from_f32(dh, Q3_BF16, dx, n, NULL), "from_f32 launch");
    if (!k->failed) cuda_ok(k, k->g->to_f32(dback, dh, Q3_BF16, n, NULL), "to_f32 launch");
    fetch(k, got, dh, n * 2);
    fetch(k, back, dback, n * 4);
    if (k->failed) return INFINITY;
    const double e = max_err(got, want, Q3_BF16, n);
    k->c->to_f32(x, want, Q3_BF16, n); /* bf16 -> fp32 is exact: the round trip must match */
    const double r = max_err(back, x, Q3_F32, n);
    return e > r ? e : r;
}

/* a decode step's bookkeeping: one sequence past its padding, one empty, one still inside
 * its padding (pos 0); all of seqs, pos and lengths must match exactly */
static double case_decode_prepare(check *k) {
    enum { N_SEQS = 3 };
    q3_attn_seq seqs[N_SEQS] = {{NULL, NULL, -1, 3}, {NULL, NULL, -1, 0}, {NULL, NULL, -1, 4}};
    int64_t pos[N_SEQS] = {-1, -1, -1}, lengths[N_SEQS] = {7, 0, 2};
    q3_attn_seq seqs_got[N_SEQS];
    int64_t pos_got[N_SEQS], lengths_got[N_SEQS];
    q3_attn_seq *dseqs = device(k, seqs, sizeof seqs);
    int64_t *dpos = device(k, pos, sizeof pos), *dlengths = device(k, lengths, sizeof lengths);
    q3_decode_prepare_host(seqs, pos, lengths, N_SEQS);
    if (!k->failed) cuda_ok(k, k->g->decode_prepare(dseqs, dpos, dlengths, N_SEQS, NULL), "decode_prepare launch");
    fetch(k, seqs_got, dseqs, sizeof seqs);
    fetch(k, pos_got, dpos, sizeof pos);
    fetch(k, lengths_got, dlengths, sizeof lengths);
    if (k->failed || memcmp(seqs_got, seqs, sizeof seqs) || memcmp(pos_got, pos, sizeof pos) ||
        memcmp(lengths_got, lengths, sizeof lengths))
        return INFINITY;
    return 0.0;
}

/* k distinct experts of E per token, in no particular order (as the router's top-k), from a
 * fixed LCG; with T * k near E, several experts are chosen by more than one token */
static void pick_experts(int32_t *idx, int64_t T, int k, int E, uint32_t seed) {
    for (int64_t t = 0; t < T; t++)
        for (int j = 0; j < k;) {
            seed = seed * 1664525u + 1013904223u;
            const int32_t e = (int32_t)((seed >> 8) % (uint32_t)E);
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= idx[t * k + i] == e;
            if (!taken) idx[t * k + j++] = e;
        }
}

/* the expert grouping on the device: offsets, rows, weights, active and slot exactly */
static double case_moe_route(check *k) {
    const int64_t T = 5;
    const int top = 3, E = 16, P = (int)T * top;
    int32_t *idx = host(k, P * 4), *rows = host(k, P * 4), *slot = host(k, P * 4), *active = host(k, (E + 1) * 4);
    int32_t *rows_got = host(k, P * 4), *slot_got = host(k, P * 4), *active_got = host(k, (E + 1) * 4);
    int64_t *offsets = host(k, (E + 1) * 8), *offsets_got = host(k, (E + 1) * 8);
    float *w = host_random(k, P, Q3_F32, 33), *weights = host(k, P * 4), *weights_got = host(k, P * 4);
    if (k->failed) return INFINITY;
    pick_experts(idx, T, top, E, 34);
    int32_t *didx = device(k, idx, P * 4), *drows = device(k, NULL, P * 4), *dslot = device(k, NULL, P * 4);
    int32_t *dactive = device(k, active, (E + 1) * 4); /* zeros past the active experts, as on the host */
    int64_t *doffsets = device(k, NULL, (E + 1) * 8);
    float *dw = device(k, w, P * 4), *dweights = device(k, NULL, P * 4);
    q3_moe_route_host(offsets, rows, weights, active, slot, idx, w, T, top, E);
    if (!k->failed)
        cuda_ok(k, k->g->moe_route(doffsets, drows, dweights, dactive, dslot, didx, dw, T, top, E, NULL),
                "moe_route launch");
    fetch(k, offsets_got, doffsets, (E + 1) * 8);
    fetch(k, rows_got, drows, P * 4);
    fetch(k, weights_got, dweights, P * 4);
    fetch(k, active_got, dactive, (E + 1) * 4);
    fetch(k, slot_got, dslot, P * 4);
    if (k->failed || memcmp(offsets_got, offsets, (E + 1) * 8) || memcmp(rows_got, rows, P * 4) ||
        memcmp(weights_got, weights, P * 4) || memcmp(active_got, active, (E + 1) * 4) ||
        memcmp(slot_got, slot, P * 4))
        return INFINITY;
    return 0.0;
}

/* device arrays of E device pointers, one per expert's [rows, cols] bf16 block of `all` */
static const void *const *expert_table(check *k, const uint16_t *all, int E, int64_t rows, int64_t cols) {
    const void *ptrs[64];
    if (k->failed || E > 64) return NULL;
    for (int e = 0; e < E; e++) ptrs[e] = all + e * rows * cols;
    return device(k, ptrs, E * sizeof ptrs[0]);
}

/* the routed experts on grouping from the host twin: gate_up, down and the weighted combine,
 * each against its twin (act, y and x) */
static double case_moe_experts(check *k) {
    const int64_t T = 5, I = 96, H = 256;
    const int top = 3, E = 16, P = (int)T * top;
    int32_t *idx = host(k, P * 4), *rows = host(k, P * 4), *slot = host(k, P * 4), *active = host(k, (E + 1) * 4);
    int64_t *offsets = host(k, (E + 1) * 8);
    float *x = host_random(k, T * H, Q3_F32, 35), *w = host_random(k, P, Q3_F32, 36), *weights = host(k, P * 4);
    uint16_t *gate = (uint16_t *)host_random(k, E * I * H, Q3_BF16, 37);
    uint16_t *up = (uint16_t *)host_random(k, E * I * H, Q3_BF16, 38);
    uint16_t *down = (uint16_t *)host_random(k, E * H * I, Q3_BF16, 39);
    float *act = host(k, P * I * 4), *y = host(k, P * H * 4), *act_got = host(k, P * I * 4);
    float *y_got = host(k, P * H * 4), *x_got = host(k, T * H * 4);
    if (k->failed) return INFINITY;
    pick_experts(idx, T, top, E, 40);
    q3_moe_route_host(offsets, rows, weights, active, slot, idx, w, T, top, E);
    const void *hg[16], *hu[16], *hd[16];
    for (int e = 0; e < E; e++) {
        hg[e] = gate + e * I * H;
        hu[e] = up + e * I * H;
        hd[e] = down + e * H * I;
    }
    float *dx = device(k, x, T * H * 4), *dweights = device(k, weights, P * 4);
    float *dact = device(k, NULL, P * I * 4), *dy = device(k, NULL, P * H * 4);
    int32_t *drows = device(k, rows, P * 4), *dslot = device(k, slot, P * 4);
    int32_t *dactive = device(k, active, (E + 1) * 4);
    int64_t *doffsets = device(k, offsets, (E + 1) * 8);
    const void *const *dg = expert_table(k, device(k, gate, E * I * H * 2), E, I, H);
    const void *const *du = expert_table(k, device(k, up, E * I * H * 2), E, I, H);
    const void *const *dd = expert_table(k, device(k, down, E * H * I * 2), E, H, I);
    if (q3_moe_gate_up_host(act, x, rows, offsets, active, hg, hu, Q3_BF16, I, H)) return INFINITY;
    q3_moe_down_host(y, act, offsets, active, hd, Q3_BF16, H, I);
    q3_moe_combine_host(x, y, weights, slot, T, top, H);
    const int max_active = E < P ? E : P;
    if (!k->failed)
        cuda_ok(k, k->g->moe_gate_up(dact, dx, drows, doffsets, dactive, dg, du, Q3_BF16, max_active, I, H, NULL),
                "moe_gate_up launch");
    if (!k->failed)
        cuda_ok(k, k->g->moe_down(dy, dact, doffsets, dactive, dd, Q3_BF16, max_active, H, I, NULL), "moe_down launch");
    if (!k->failed) cuda_ok(k, k->g->moe_combine(dx, dy, dweights, dslot, T, top, H, NULL), "moe_combine launch");
    fetch(k, act_got, dact, P * I * 4);
    fetch(k, y_got, dy, P * H * 4);
    fetch(k, x_got, dx, T * H * 4);
    if (k->failed) return INFINITY;
    const double e_act = max_err(act_got, act, Q3_F32, P * I), e_y = max_err(y_got, y, Q3_F32, P * H);
    const double e_x = max_err(x_got, x, Q3_F32, T * H);
    return e_act > e_y ? (e_act > e_x ? e_act : e_x) : (e_y > e_x ? e_y : e_x);
}

/* the prefill MoE on tensor cores against its twins, on hand-made tiles: a full tile of 64
 * slots, a single slot, two tiles of one expert, slots no tile covers (left as they were) and
 * rows that map slots to tokens with repeats. down gets the twin's act on both sides, so
 * each product is checked alone (bf16 rounding of act would amplify gate_up's differences) */
static double case_moe_prefill_tc(check *k) {
    enum { E = 6, T = 70, S = 160, N_TILES = 5 };
    const int64_t I = 96, H = 256;
    const q3_moe_tile tiles[N_TILES] = {{4, 0, 64, 0}, {1, 64, 1, 0}, {3, 65, 40, 0}, {3, 105, 17, 0}, {0, 130, 29, 0}};
    int32_t rows[S];
    for (int s = 0; s < S; s++) rows[s] = (s * 37 + 11) % T; /* each token about twice */
    float *x = host_random(k, T * H, Q3_F32, 41);
    uint16_t *gate = (uint16_t *)host_random(k, E * I * H, Q3_BF16, 42);
    uint16_t *up = (uint16_t *)host_random(k, E * I * H, Q3_BF16, 43);
    uint16_t *down = (uint16_t *)host_random(k, E * H * I, Q3_BF16, 44);
    float *act = host_random(k, S * I, Q3_F32, 45), *y = host_random(k, S * H, Q3_F32, 46);
    float *act_got = host(k, S * I * 4), *y_got = host(k, S * H * 4);
    if (k->failed) return INFINITY;
    const void *hg[E], *hu[E], *hd[E];
    for (int e = 0; e < E; e++) {
        hg[e] = gate + e * I * H;
        hu[e] = up + e * I * H;
        hd[e] = down + e * H * I;
    }
    /* the untouched slots start alike on both sides */
    float *dx = device(k, x, T * H * 4), *dact = device(k, act, S * I * 4), *dy = device(k, y, S * H * 4);
    int32_t *drows = device(k, rows, sizeof rows);
    q3_moe_tile *dtiles = device(k, tiles, sizeof tiles);
    const void *const *dg = expert_table(k, device(k, gate, E * I * H * 2), E, I, H);
    const void *const *du = expert_table(k, device(k, up, E * I * H * 2), E, I, H);
    const void *const *dd = expert_table(k, device(k, down, E * H * I * 2), E, H, I);
    if (q3_moe_gate_up_tc_host(act, x, rows, tiles, N_TILES, hg, hu, I, H)) return INFINITY;
    if (q3_moe_down_tc_host(y, act, tiles, N_TILES, hd, H, I)) return INFINITY;
    float *dact_twin = device(k, act, S * I * 4);
    if (!k->failed)
        cuda_ok(k, k->g->moe_gate_up_tc(dact, dx, drows, dtiles, N_TILES, dg, du, I, H, NULL), "moe_gate_up_tc launch");
    if (!k->failed)
        cuda_ok(k, k->g->moe_down_tc(dy, dact_twin, dtiles, N_TILES, dd, H, I, NULL), "moe_down_tc launch");
    fetch(k, act_got, dact, S * I * 4);
    fetch(k, y_got, dy, S * H * 4);
    if (k->failed) return INFINITY;
    const double e_act = max_err(act_got, act, Q3_F32, S * I), e_y = max_err(y_got, y, Q3_F32, S * H);
    return e_act > e_y ? e_act : e_y;
}

/* the prefill combine: 4 of 6 tokens with 1, 2, 3 and 2 slots in no sorted order, H not a
 * multiple of the block */
static double case_moe_combine_csr(check *k) {
    enum { T = 6, S = 10, N = 4 };
    const int64_t H = 300;
    const int32_t tokens[N] = {5, 0, 3, 2}, ptr[N + 1] = {0, 1, 3, 6, 8}, slot[8] = {7, 2, 9, 0, 4, 8, 1, 6};
    float *x = host_random(k, T * H, Q3_F32, 47), *y = host_random(k, S * H, Q3_F32, 48);
    float *weights = host_random(k, S, Q3_F32, 49), *got = host(k, T * H * 4);
    if (k->failed) return INFINITY;
    float *dx = device(k, x, T * H * 4), *dy = device(k, y, S * H * 4), *dweights = device(k, weights, S * 4);
    int32_t *dtokens = device(k, tokens, sizeof tokens), *dptr = device(k, ptr, sizeof ptr);
    int32_t *dslot = device(k, slot, sizeof slot);
    q3_moe_combine_csr_host(x, y, weights, tokens, ptr, slot, N, H);
    if (!k->failed)
        cuda_ok(k, k->g->moe_combine_csr(dx, dy, dweights, dtokens, dptr, dslot, N, H, NULL), "moe_combine_csr launch");
    fetch(k, got, dx, T * H * 4);
    return k->failed ? INFINITY : max_err(got, x, Q3_F32, T * H);
}

q3_status q3_cuda_check(int device_index, q3_check_result *out, int max, int *n, q3_error *err) {
    *n = 0;
    const q3_cuda_ops *g = q3_cuda();
    if (!g) return q3_fail(err, Q3_ERR_STATE, "cuda check: the CUDA backend is not loaded");
    check k = {g, q3_cpu_ops_active(), err, 0, {0}, 0, {0}, 0};
    if (!cuda_ok(&k, g->set_device(device_index), "cudaSetDevice")) return err->status;
#define RUN(label, tolerance, expr)                                                              \
    do {                                                                                         \
        if (*n >= max) return q3_fail(err, Q3_ERR_VALUE, "cuda check: more than %d cases", max); \
        const double e_ = (expr);                                                                \
        release(&k);                                                                             \
        if (k.failed) return err->status;                                                        \
        snprintf(out[*n].name, sizeof out[*n].name, "%s", label);                                \
        out[*n].max_err = e_;                                                                    \
        out[*n].tol = tolerance;                                                                 \
        (*n)++;                                                                                  \
    } while (0)
    RUN("rmsnorm f32 weights", 1e-5, case_rmsnorm(&k, Q3_F32));
    RUN("rmsnorm bf16 weights", 1e-5, case_rmsnorm(&k, Q3_BF16));
    RUN("add + rmsnorm fused, f32 weights", 1e-5, case_add_rmsnorm(&k, Q3_F32, 0));
    RUN("add + rmsnorm fused, bf16, out aliasing r", 1e-5, case_add_rmsnorm(&k, Q3_BF16, 1));
    RUN("matmul bf16 T=1 K=4096", 1e-5, case_matmul(&k, Q3_BF16, 1, 4096));
    RUN("matmul bf16 T=13 K=72", 1e-5, case_matmul(&k, Q3_BF16, 13, 72));
    RUN("matmul bf16 T=5 K=100", 1e-5, case_matmul(&k, Q3_BF16, 5, 100));
    RUN("matmul f32 T=9 K=64", 1e-5, case_matmul(&k, Q3_F32, 9, 64));
    RUN("gate + up + SiLU*up fused, T=3 I=96 K=4096", 1e-5, case_gate_up(&k, 3, 96, 4096));
    const int blas = g->blas_enable(0); /* the WMMA kernel first, then cuBLAS where it is */
    RUN("matmul tensor cores (WMMA) T=70 N=80 K=96", 1e-5, case_matmul_tc(&k, 70, 80, 96, 0));
    RUN("matmul tensor cores (WMMA) T=16 N=4096 K=1536", 1e-5, case_matmul_tc(&k, 16, 4096, 1536, 0));
    if (g->blas_enable(blas)) {
        RUN("matmul cuBLAS T=70 N=80 K=96", 1e-5, case_matmul_tc(&k, 70, 80, 96, 0));
        RUN("matmul cuBLAS T=512 N=4096 K=1536", 1e-5, case_matmul_tc(&k, 512, 4096, 1536, 0));
    }
    RUN("matmul WMMA only (never cuBLAS) T=70 N=80 K=96", 1e-5, case_matmul_tc(&k, 70, 80, 96, 1));
    RUN("rope", 1e-5, case_rope(&k));
    RUN("kv_write bf16", 0.0, case_kv_write(&k));
    RUN("qk_norm + rope + kv_write fused, D=128", 1e-2, case_qk_rope_kv(&k, 128));
    RUN("qk_norm + rope + kv_write fused, D=24", 1e-2, case_qk_rope_kv(&k, 24));
    RUN("attention bf16 cache, 3 tokens", 1e-5, case_attention(&k, 3, 5, 17, 40, 0));
    RUN("attention, 6 tokens after 4 of padding", 1e-5, case_attention(&k, 6, 0, 17, 40, 4));
    RUN("attention split-KV, decode over 3000 keys", 1e-5, case_attention(&k, 1, 2999, 1800, 3100, 0));
    RUN("attention split-KV, 4 tokens over 900 keys", 1e-5, case_attention(&k, 4, 900, 40, 1000, 700));
    RUN("router top-k, renormalised", 1e-6, case_router(&k, 1));
    RUN("router top-k", 1e-6, case_router(&k, 0));
    RUN("decode_prepare: lengths, positions", 0.0, case_decode_prepare(&k));
    RUN("moe_route: expert grouping on the device", 0.0, case_moe_route(&k));
    RUN("moe gate_up + down + combine, T=5 k=3 E=16", 1e-5, case_moe_experts(&k));
    RUN("moe prefill gate_up + down, tensor cores, E=6", 1e-5, case_moe_prefill_tc(&k));
    RUN("moe prefill combine_csr, 1..3 slots a token", 1e-6, case_moe_combine_csr(&k));
    RUN("swiglu", 1e-5, case_swiglu(&k));
    RUN("gather + scatter_add rows", 1e-6, case_rows(&k));
    RUN("convert fp32 <-> bf16", 0.0, case_convert(&k));
#undef RUN
    return Q3_OK;
}

/* Every CUDA kernel against its CPU twin, on random inputs with odd sizes, for the GPU tests
 * and benchmarks/gpu_check.sh. The CPU side runs the active CPU path with fp32 activations
 * (the matmul gets no bf16 scratch), so the two differ only by summation order. The harness
 * is in kernel_check.h; the MoE cases in kernel_check_moe.c. */
#include "kernel_check.h"

/* x of N(0, scale^2): at scale 1e-3, mean(x^2) is the size of eps, so where eps goes shows */
static double case_rmsnorm(check *k, q3_dtype wdt, float scale) {
    const int64_t rows = 7, n = 1000;
    float *x = host_random(k, rows * n, Q3_F32, 1), *want = host(k, rows * n * 4), *got = host(k, rows * n * 4);
    void *w = host_random(k, n, wdt, 2);
    if (k->failed) return INFINITY;
    for (int64_t i = 0; i < rows * n; i++) x[i] *= scale;
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

/* L query tokens after n_past[s] cached ones, for 2 sequences, Hq heads on Hkv of dim D;
 * long contexts split on the GPU, many tokens on tensor cores where the shape fits */
static double case_attention_heads(check *k, int64_t L, int64_t past0, int64_t past1, int64_t capacity, int64_t pad0,
                                   int Hq, int Hkv, int D) {
    const q3_attn_shape sh = {L, Hq, Hkv, D, capacity, Q3_BF16, 1.0f / sqrtf((float)D), (past0 > past1 ? past0 : past1) + L};
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

static double case_attention(check *k, int64_t L, int64_t past0, int64_t past1, int64_t capacity, int64_t pad0) {
    return case_attention_heads(k, L, past0, past1, capacity, pad0, 8, 2, 24);
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

/* the tie rule of kernels/router.h on hand-made logits: the twin must give the documented
 * experts, the kernel the twin's (random logits never tie) */
static double case_router_ties(check *k) {
    enum { T = 4, E = 8, TOP = 4 };
    static const float logits[T][E] = {
        {0.5f, 2.0f, 2.5f, 1.0f, 3.0f, 1.0f, -2.0f, -1.0f}, /* 3 and 5 tie for the last slot */
        {1.0f, 3.0f, 1.0f, 1.0f, 0.0f, 3.0f, 1.0f, -1.0f},  /* 0, 2, 3, 6 tie for the last two */
        {0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f}, /* all tie */
        {2.0f, 5.0f, 5.0f, 5.0f, 5.0f, 5.0f, 0.0f, 1.0f},   /* five tie for the first four */
    };
    static const int32_t rule[T][TOP] = {{4, 2, 1, 3}, {1, 5, 0, 2}, {0, 1, 2, 3}, {1, 2, 3, 4}};
    float w_want[T * TOP], w_got[T * TOP];
    int32_t i_want[T * TOP], i_got[T * TOP];
    float *dl = device(k, logits, sizeof logits), *dw = device(k, NULL, sizeof w_got);
    int32_t *di = device(k, NULL, sizeof i_got);
    k->c->router_topk(i_want, w_want, &logits[0][0], T, E, TOP, 1);
    if (memcmp(i_want, rule, sizeof rule)) return INFINITY;
    if (!k->failed) cuda_ok(k, k->g->router_topk(di, dw, dl, T, E, TOP, 1, NULL), "router launch");
    fetch(k, i_got, di, sizeof i_got);
    fetch(k, w_got, dw, sizeof w_got);
    if (k->failed || memcmp(i_got, i_want, sizeof i_want)) return INFINITY;
    return max_err(w_got, w_want, Q3_F32, T * TOP);
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
    RUN("rmsnorm f32 weights", 1e-5, case_rmsnorm(&k, Q3_F32, 1.0f));
    RUN("rmsnorm bf16 weights", 1e-5, case_rmsnorm(&k, Q3_BF16, 1.0f));
    RUN("rmsnorm rows of magnitude 1e-3 (eps shows)", 1e-5, case_rmsnorm(&k, Q3_F32, 1e-3f));
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
    RUN("qk_norm + rope + kv_write fused, D=128", 1e-2, case_qk_rope_kv(&k, 128));
    RUN("qk_norm + rope + kv_write fused, D=24", 1e-2, case_qk_rope_kv(&k, 24));
    RUN("attention bf16 cache, 3 tokens", 1e-5, case_attention(&k, 3, 5, 17, 40, 0));
    RUN("attention, 6 tokens after 4 of padding", 1e-5, case_attention(&k, 6, 0, 17, 40, 4));
    RUN("attention split-KV, decode over 3000 keys", 1e-5, case_attention(&k, 1, 2999, 1800, 3100, 0));
    RUN("attention split-KV, 4 tokens over 900 keys", 1e-5, case_attention(&k, 4, 900, 40, 1000, 700));
    /* tensor cores: q and the probabilities rounded to bf16 */
    RUN("attention tensor cores, 40 tokens, G=4 D=32", 2e-2, case_attention_heads(&k, 40, 0, 17, 80, 0, 8, 2, 32));
    RUN("attention tensor cores, G=16 D=128, padding", 2e-2,
        case_attention_heads(&k, 37, 100, 0, 160, 45, 32, 2, 128));
    RUN("attention tensor cores, prompt in padding", 2e-2, case_attention_heads(&k, 21, 0, 3, 40, 12, 16, 2, 64));
    RUN("router top-k, renormalised", 1e-6, case_router(&k, 1));
    RUN("router top-k", 1e-6, case_router(&k, 0));
    RUN("router top-k ties: lower expert index first", 1e-6, case_router_ties(&k));
    RUN("decode_prepare: lengths, positions", 0.0, q3_case_decode_prepare(&k));
    RUN("moe_route: expert grouping on the device", 0.0, q3_case_moe_route(&k));
    RUN("moe gate_up + down + combine, T=5 k=3 E=16", 1e-5, q3_case_moe_experts(&k));
    RUN("moe prefill gate_up + down, tensor cores, E=6", 1e-5, q3_case_moe_prefill_tc(&k));
    RUN("moe prefill combine_csr, 1..3 slots a token", 1e-6, q3_case_moe_combine_csr(&k));
    RUN("swiglu", 1e-5, case_swiglu(&k));
    RUN("gather + scatter_add rows", 1e-6, case_rows(&k));
    RUN("convert fp32 <-> bf16", 0.0, case_convert(&k));
#undef RUN
    return Q3_OK;
}

/* The self-check cases of the dense kernels (norms, projections, router, elementwise): each
 * kernel against its CPU twin on random inputs with odd sizes. The CPU side runs the active CPU path with fp32 activations (the matmul gets no
 * bf16 scratch), so the two differ only by summation order. The harness is kernel_check.h,
 * the driver kernel_check.c. */
#include "kernel_check.h"

/* x of N(0, scale^2): at scale 1e-3, mean(x^2) is the size of eps, so where eps goes shows */
double q3_case_rmsnorm(check *k, q3_dtype wdt, int64_t rows, float scale) {
    const int64_t n = 1000;
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
double q3_case_add_rmsnorm(check *k, q3_dtype wdt, int64_t rows, int alias) {
    const int64_t n = 1000;
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

/* src's bytes copied to `off` bytes into a fresh device buffer: with off % 16 != 0, a view
 * that is not 16-byte aligned (the kernels' fallback from 16-byte loads) */
static void *device_at(check *k, const void *src, size_t bytes, size_t off) {
    char *d = device(k, NULL, bytes + off);
    if (!d || !cuda_ok(k, k->g->copy(d + off, src, bytes, 1), "copy to device")) return NULL;
    return d + off;
}

/* y [T, N] += x [T, K] W^T; x_off: x placed that many bytes into its buffer (4: rows not
 * 16-byte aligned) */
double q3_case_matmul_at(check *k, q3_dtype wdt, int64_t T, int64_t N, int64_t K, size_t x_off) {
    float *x = host_random(k, T * K, Q3_F32, 3), *want = host_random(k, T * N, Q3_F32, 4), *got = host(k, T * N * 4);
    void *w = host_random(k, N * K, wdt, 5);
    if (k->failed) return INFINITY;
    float *dy = device(k, want, T * N * 4), *dx = device_at(k, x, T * K * 4, x_off);
    void *dw = device(k, w, N * K * q3_dtype_size(wdt));
    k->c->matmul(want, x, w, wdt, T, N, K, 1, NULL);
    if (!k->failed) cuda_ok(k, k->g->matmul(dy, dx, dw, wdt, T, N, K, 1, NULL), "matmul launch");
    fetch(k, got, dy, T * N * 4);
    return k->failed ? INFINITY : max_err(got, want, Q3_F32, T * N);
}

/* N = 70: the GEMV's one-row-a-warp kernel */
double q3_case_matmul(check *k, q3_dtype wdt, int64_t T, int64_t K) { return q3_case_matmul_at(k, wdt, T, 70, K, 0); }

/* gate, up and SiLU * up in one pass against matmul, matmul, swiglu; weights of wdt */
double q3_case_gate_up(check *k, q3_dtype wdt, int64_t T, int64_t I, int64_t K) {
    float *x = host_random(k, T * K, Q3_F32, 27), *want = host(k, T * I * 4), *up = host(k, T * I * 4);
    float *got = host(k, T * I * 4);
    void *gw = host_random(k, I * K, wdt, 28), *uw = host_random(k, I * K, wdt, 29);
    if (k->failed) return INFINITY;
    const size_t wbytes = (size_t)(I * K) * q3_dtype_size(wdt);
    float *dx = device(k, x, T * K * 4), *dact = device(k, NULL, T * I * 4);
    void *dg = device(k, gw, wbytes), *du = device(k, uw, wbytes);
    k->c->matmul(want, x, gw, wdt, T, I, K, 0, NULL);
    k->c->matmul(up, x, uw, wdt, T, I, K, 0, NULL);
    k->c->swiglu(want, want, up, T * I);
    if (!k->failed) cuda_ok(k, k->g->gate_up(dact, dx, dg, du, wdt, T, I, K, NULL), "gate_up launch");
    fetch(k, got, dact, T * I * 4);
    return k->failed ? INFINITY : max_err(got, want, Q3_F32, T * I);
}

/* tensor cores see x in bf16: give both sides bf16-valued x, so only summation order differs;
 * wmma_only: the entry that never calls cuBLAS; misalign: x 4 bytes and w 2 bytes into their
 * buffers (the staging's fallback from 16-byte loads) */
double q3_case_matmul_tc_at(check *k, int64_t T, int64_t N, int64_t K, int wmma_only, int misalign) {
    float *x = host_random(k, T * K, Q3_F32, 19), *want = host_random(k, T * N, Q3_F32, 20), *got = host(k, T * N * 4);
    void *w = host_random(k, N * K, Q3_BF16, 21);
    if (k->failed) return INFINITY;
    for (int64_t i = 0; i < T * K; i++) x[i] = q3_bf16_to_f32(q3_f32_to_bf16(x[i]));
    float *dy = device(k, want, T * N * 4), *dx = device_at(k, x, T * K * 4, misalign ? 4 : 0);
    void *dw = device_at(k, w, N * K * 2, misalign ? 2 : 0);
    uint16_t *dxb = device(k, NULL, T * K * 2);
    k->c->matmul(want, x, w, Q3_BF16, T, N, K, 1, NULL);
    int (*const tc)(float *, const float *, const void *, int64_t, int64_t, int64_t, int, uint16_t *, void *) =
        wmma_only ? k->g->matmul_wmma : k->g->matmul_tc;
    if (!k->failed) cuda_ok(k, tc(dy, dx, dw, T, N, K, 1, dxb, NULL), "matmul_tc launch");
    fetch(k, got, dy, T * N * 4);
    return k->failed ? INFINITY : max_err(got, want, Q3_F32, T * N);
}

double q3_case_matmul_tc(check *k, int64_t T, int64_t N, int64_t K, int wmma_only) {
    return q3_case_matmul_tc_at(k, T, N, K, wmma_only, 0);
}

/* T tokens' top `top` of E experts (a warp per token, four a block) */
double q3_case_router(check *k, int64_t T, int E, int top, int normalize) {
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

/* T tokens' top `top` of E experts on logits rounded to halves (normal ones: about a dozen
 * distinct values, so every selection breaks ties, the k-th place too); the twin gives the
 * tie rule of kernels/router.h (tests/ops/test_router_ties.py), the kernel must give the twin's
 * experts. Probabilities of distinct logits differ by a factor e^0.5, far past any expf
 * rounding, so a GPU's choices are the CPU's too. */
double q3_case_router_tied(check *k, int64_t T, int E, int top, int normalize) {
    float *logits = host_random(k, T * E, Q3_F32, 31), *w_want = host(k, T * top * 4), *w_got = host(k, T * top * 4);
    int32_t *i_want = host(k, T * top * 4), *i_got = host(k, T * top * 4);
    if (k->failed) return INFINITY;
    for (int64_t i = 0; i < T * E; i++) logits[i] = roundf(logits[i] * 2.0f) / 2.0f;
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
double q3_case_router_ties(check *k) {
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

double q3_case_swiglu(check *k) {
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

double q3_case_rows(check *k) {
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

/* fp32 -> dt (bf16 or fp16) -> fp32; for fp16 the draws span its range's edges too: values
 * scaled into its subnormals (below 2^-14) and past its largest finite (65504: inf), and
 * the ties of its rounding to even, where a wrong rounding shows as a nonzero error */
double q3_case_convert(check *k, q3_dtype dt) {
    const int64_t n = 777;
    float *x = host_random(k, n, Q3_F32, 18), *back = host(k, n * 4);
    uint16_t *want = host(k, n * 2), *got = host(k, n * 2);
    if (k->failed) return INFINITY;
    if (dt == Q3_F16)
        for (int64_t i = 0; i < n; i++) {
            const float ties[4] = {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 0x1p-24f * 1.5f, 65520.0f};
            x[i] *= i % 4 == 0 ? 1e-5f : i % 4 == 1 ? 4e4f : 1.0f;
            if (i % 7 == 0) x[i] = ties[i / 7 % 4] * (i % 2 ? -1.0f : 1.0f);
        }
    float *dx = device(k, x, n * 4), *dback = device(k, NULL, n * 4);
    uint16_t *dh = device(k, NULL, n * 2);
    k->c->from_f32(want, dt, x, n);
    if (!k->failed) cuda_ok(k, k->g->from_f32(dh, dt, dx, n, NULL), "from_f32 launch");
    if (!k->failed) cuda_ok(k, k->g->to_f32(dback, dh, dt, n, NULL), "to_f32 launch");
    fetch(k, got, dh, n * 2);
    fetch(k, back, dback, n * 4);
    if (k->failed) return INFINITY;
    if (memcmp(got, want, (size_t)n * 2)) return INFINITY; /* the same bits (and infinities) */
    const double e = max_err(got, want, dt, n);
    k->c->to_f32(x, want, dt, n); /* bf16, fp16 -> fp32 are exact: the round trip must match */
    if (memcmp(back, x, (size_t)n * 4)) return INFINITY;
    const double r = max_err(back, x, Q3_F32, n);
    return e > r ? e : r;
}

/* a split layer's rows (qwen3layer/placement/hybrid.py): take_rows in dtype dt (a move:
 * exact), then add_rows of parts in pdt into an fp32 residual (one add an element: exact); H
 * odd, a row named past the last one taken, n = 1 */
double q3_case_take_add_rows(check *k, q3_dtype dt, q3_dtype pdt, int64_t n) {
    const int64_t R = 9, H = 77;
    const int32_t rows[5] = {8, 0, 3, 7, 2};
    const size_t es = q3_dtype_size(dt), ps = q3_dtype_size(pdt);
    void *src = host_random(k, R * H, dt, 19), *parts = host_random(k, n * H, pdt, 20);
    float *resid = host_random(k, R * H, Q3_F32, 21), *got_resid = host(k, (size_t)(R * H) * 4);
    void *taken = host(k, (size_t)(n * H) * es), *got_taken = host(k, (size_t)(n * H) * es);
    if (k->failed) return INFINITY;
    void *dsrc = device(k, src, (size_t)(R * H) * es), *dtaken = device(k, NULL, (size_t)(n * H) * es);
    void *dparts = device(k, parts, (size_t)(n * H) * ps);
    float *dresid = device(k, resid, (size_t)(R * H) * 4);
    int32_t *drows = device(k, rows, sizeof rows);
    k->c->take_rows(taken, src, dt, rows, n, H);
    k->c->add_rows(resid, parts, pdt, rows, n, H);
    if (!k->failed) cuda_ok(k, k->g->take_rows(dtaken, dsrc, dt, drows, n, H, NULL), "take_rows launch");
    if (!k->failed) cuda_ok(k, k->g->add_rows(dresid, dparts, pdt, drows, n, H, NULL), "add_rows launch");
    fetch(k, got_taken, dtaken, (size_t)(n * H) * es);
    fetch(k, got_resid, dresid, (size_t)(R * H) * 4);
    if (k->failed || memcmp(got_taken, taken, (size_t)(n * H) * es)) return INFINITY;
    return max_err(got_resid, resid, Q3_F32, R * H);
}

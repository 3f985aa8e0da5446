/* The matmuls' cases (cpu_ops.h): y [T, N] (+)= x [T, K] W^T with fp32 and bf16 weights, the
 * block-scaled e4m3 weights, and the e4m3 decoders inside the latter, on 1 to 130 tokens (the
 * GEMVs below 8 and 16 tokens, the tiles from there), N and K off every vector, tile and block.
 *
 * Where kernels/matmul.h and kernels/fp8.h let a path round (bf16 weights or e4m3 weights
 * given the bf16 scratch xb: x, and for e4m3 the dequantized weights, to bf16), the path is
 * held to whichever of the portable results on those operands is closest, each within fp32
 * rounding: err_i = |got_i - want_i| / (sum_k |x_k w_k| + |y0_i| + 1 for the dense matmul),
 * as tests/ops/test_matmul_paths.py and tests/fp8/test_fp8_kernels.py hold each against float64
 * (1e-5, 1e-6 (sqrt(K) + 4)), doubled: both sides may be off by one bound. */
#include "cpu_ops.h"

#include "../../../kernels/fp8.h"

#define DENSE_TOL 2e-5

static float *copy_f32(ops_run *r, const float *src, int64_t n) {
    float *p = ops_alloc(r, (size_t)n * 4);
    if (p) memcpy(p, src, (size_t)n * 4);
    return p;
}

float *ops_rounded(ops_run *r, const float *x, int64_t n) {
    float *p = ops_alloc(r, (size_t)n * 4);
    for (int64_t i = 0; p && i < n; i++) p[i] = q3_bf16_to_f32(q3_f32_to_bf16(x[i]));
    return p;
}

double *ops_term_bound(ops_run *r, const float *x, const float *w, int64_t T, int64_t N, int64_t K,
                       const float *y0, double extra) {
    double *b = ops_alloc(r, (size_t)(T * N) * sizeof(double));
    for (int64_t t = 0; b && t < T; t++)
        for (int64_t n = 0; n < N; n++) {
            double s = extra + (y0 ? fabs(y0[t * N + n]) : 0.0);
            for (int64_t k = 0; k < K; k++) s += fabs((double)x[t * K + k] * w[n * K + k]);
            b[t * N + n] = s;
        }
    return b;
}

static double bound_err(const float *got, const float *want, const double *bound, int64_t n) {
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double d = isnan(got[i]) != isnan(want[i]) ? INFINITY : isnan(want[i]) ? 0.0 : fabs(got[i] - want[i]) / bound[i];
        worst = d > worst ? d : worst;
    }
    return worst;
}

const float *ops_closest(const float *got, const float *const *want, int n_want, const double *bound, int64_t n) {
    const float *best = want[0];
    double best_err = INFINITY;
    for (int i = 0; i < n_want; i++) {
        const double e = want[i] ? bound_err(got, want[i], bound, n) : INFINITY;
        if (e < best_err) best_err = e, best = want[i];
    }
    return best;
}

static const int64_t DENSE_SHAPES[][3] = { /* T, N, K */
    {1, 5, 7}, {2, 16, 64}, {3, 7, 300}, {5, 9, 100}, {7, 13, 4096}, {8, 13, 300}, {17, 37, 300},
    {40, 48, 96}, {130, 19, 72}, {9, 6, 5000}, {33, 50, 2050}, {14, 11, 2048}, {4, 11, 300}, {6, 7, 2050},
};

static void dense_case(ops_run *r, q3_dtype wdt, int with_xb, int accumulate, int64_t T, int64_t N, int64_t K,
                       uint64_t seed) {
    const int64_t ny = T * N;
    float *x = ops_random(r, T * K, Q3_F32, seed, 1.0f), *y0 = ops_random(r, ny, Q3_F32, seed + 1, 1.0f);
    void *w = ops_random(r, N * K, wdt, seed + 2, 1.0f);
    float *wf = ops_alloc(r, (size_t)(N * K) * 4);
    uint16_t *xb = with_xb ? ops_alloc(r, (size_t)(q3_matmul_scratch_elems(T, K) + 1) * 2) : NULL;
    float *got = y0 ? copy_f32(r, y0, ny) : NULL, *want = y0 ? copy_f32(r, y0, ny) : NULL;
    float *want_rounded = y0 && wdt == Q3_BF16 && with_xb ? copy_f32(r, y0, ny) : NULL;
    float *xr = want_rounded ? ops_rounded(r, x, T * K) : NULL;
    if (r->oom) return ops_check_f32(r, "matmul", NULL, NULL, 0, DENSE_TOL);
    r->ref->to_f32(wf, w, wdt, N * K);
    r->ref->matmul(want, x, w, wdt, T, N, K, accumulate, NULL);
    if (want_rounded) r->ref->matmul(want_rounded, xr, w, wdt, T, N, K, accumulate, NULL);
    r->path->matmul(got, x, w, wdt, T, N, K, accumulate, xb);
    const double *bound = ops_term_bound(r, x, wf, T, N, K, accumulate ? y0 : NULL, 1.0);
    const float *refs[2] = {want, want_rounded};
    char label[96];
    snprintf(label, sizeof label, "%s weights%s%s T=%lld N=%lld K=%lld", ops_dt(wdt),
             with_xb ? ", bf16 scratch" : "", accumulate ? ", accumulate" : "", (long long)T, (long long)N, (long long)K);
    if (!bound) return ops_check_f32(r, label, NULL, NULL, 0, DENSE_TOL);
    ops_check_bound(r, label, got, ops_closest(got, refs, 2, bound, ny), bound, ny, DENSE_TOL);
}

void ops_matmul(ops_run *r) {
    uint64_t seed = 100;
    for (int s = 0; s < (int)(sizeof DENSE_SHAPES / sizeof DENSE_SHAPES[0]); s++)
        for (int form = 0; form < 12; form++, seed += 3) { /* 3 dtypes x (bf16 scratch or not) x accumulate */
            dense_case(r, OPS_FLOATS[form % 3], form / 3 & 1, form / 6, DENSE_SHAPES[s][0],
                       DENSE_SHAPES[s][1], DENSE_SHAPES[s][2], seed);
            ops_release(r);
        }
}

/* w [N, K] random e4m3 codes (no NaN: the conversion saturates), scale [ceil(N/128), ceil(K/128)]
 * of sdt in [0.01, 0.05) */
static void fp8_weights(ops_run *r, int64_t N, int64_t K, q3_dtype sdt, uint64_t seed, uint8_t **w, void **scale) {
    const int64_t ns = q3_fp8_blocks(N) * q3_fp8_blocks(K);
    float *wf = ops_random(r, N * K, Q3_F32, seed, 120.0f), *sf = ops_random(r, ns, Q3_F32, seed + 1, 1.0f);
    *w = ops_alloc(r, (size_t)(N * K));
    *scale = ops_alloc(r, (size_t)ns * 4);
    if (r->oom) return;
    for (int64_t i = 0; i < N * K; i++) (*w)[i] = q3_f32_to_e4m3(wf[i]);
    for (int64_t i = 0; i < ns; i++) sf[i] = 0.01f + 0.01f * fabsf(sf[i]);
    r->ref->from_f32(*scale, sdt, sf, ns);
}

/* the scratch and bf16 scratch (with_xb) the layer gives matmul_fp8 for T tokens */
static void fp8_scratch(ops_run *r, int64_t T, int64_t K, int with_xb, float **scratch, uint16_t **xb) {
    *scratch = ops_alloc(r, (size_t)(r->threads * q3_matmul_fp8_scratch_floats(T, K)) * 4);
    *xb = with_xb ? ops_alloc(r, (size_t)(q3_matmul_scratch_elems(T, K) + 1) * 2) : NULL;
}

static void fp8_case(ops_run *r, q3_dtype sdt, int with_xb, int64_t T, int64_t N, int64_t K, int nan, uint64_t seed) {
    const int accumulate = T % 2, ny = (int)(T * N);
    uint8_t *w = NULL;
    void *scale = NULL;
    fp8_weights(r, N, K, sdt, seed, &w, &scale);
    float *x = ops_random(r, T * K, Q3_F32, seed + 2, 1.0f), *y0 = ops_random(r, ny, Q3_F32, seed + 3, 1.0f);
    float *wd = ops_alloc(r, (size_t)(N * K) * 4);
    uint16_t *wb = ops_alloc(r, (size_t)(N * K) * 2);
    float *got = y0 ? copy_f32(r, y0, ny) : NULL, *want = y0 ? copy_f32(r, y0, ny) : NULL;
    float *want_x = with_xb && y0 ? copy_f32(r, y0, ny) : NULL, *want_xw = with_xb && y0 ? copy_f32(r, y0, ny) : NULL;
    float *xr = with_xb ? ops_rounded(r, x, T * K) : NULL;
    const double tol = 2e-6 * (sqrt((double)K) + 4.0);
    char label[96];
    snprintf(label, sizeof label, "%s scales%s%s%s T=%lld N=%lld K=%lld", sdt == Q3_BF16 ? "bf16" : "f32",
             with_xb ? ", bf16 scratch" : "", accumulate ? ", accumulate" : "", nan ? ", NaN codes" : "",
             (long long)T, (long long)N, (long long)K);
    if (r->oom) return ops_check_f32(r, label, NULL, NULL, 0, tol);
    for (int64_t i = 0; nan && i < N - 1; i++) /* a NaN code in every row but the last, at every offset */
        w[i * K + (9 * i + i % 3) % K] = i % 2 ? 0xff : 0x7f;
    q3_fp8_dequant_rows(wd, w, scale, sdt, 0, N, K);
    for (int64_t i = 0; i < N * K; i++) wb[i] = q3_f32_to_bf16(wd[i]);
    float *scratch, *scratch_path;
    uint16_t *unused, *xb;
    fp8_scratch(r, T, K, 0, &scratch, &unused);
    fp8_scratch(r, T, K, with_xb, &scratch_path, &xb);
    if (r->oom) return ops_check_f32(r, label, NULL, NULL, 0, tol);
    r->ref->matmul_fp8(want, x, w, scale, sdt, T, N, K, accumulate, scratch, r->threads, NULL);
    r->path->matmul_fp8(got, x, w, scale, sdt, T, N, K, accumulate, scratch_path, r->threads, xb);
    if (with_xb) {
        r->ref->matmul(want_x, xr, wd, Q3_F32, T, N, K, accumulate, NULL);
        r->ref->matmul(want_xw, xr, wb, Q3_BF16, T, N, K, accumulate, NULL);
    }
    const double *bound = ops_term_bound(r, x, wd, T, N, K, accumulate ? y0 : NULL, 1e-30);
    const float *refs[3] = {want, want_x, want_xw};
    if (!bound) return ops_check_f32(r, label, NULL, NULL, 0, tol);
    ops_check_bound(r, label, got, ops_closest(got, refs, 3, bound, ny), bound, ny, tol);
}

static const int64_t FP8_SHAPES[][2] = {{5, 100}, {130, 129}, {32, 256}, {48, 1056}, {40, 4160}}; /* N, K */
static const int64_t FP8_TOKENS[] = {1, 2, 3, 4, 6, 8, 15, 16, 17, 40};

void ops_matmul_fp8(ops_run *r) {
    uint64_t seed = 300;
    for (int s = 0; s < (int)(sizeof FP8_SHAPES / sizeof FP8_SHAPES[0]); s++)
        for (int t = 0; t < (int)(sizeof FP8_TOKENS / sizeof FP8_TOKENS[0]); t++)
            for (int form = 0; form < 4; form++, seed += 4) {
                fp8_case(r, form & 1 ? Q3_BF16 : Q3_F32, form >> 1, FP8_TOKENS[t], FP8_SHAPES[s][0], FP8_SHAPES[s][1],
                         0, seed);
                ops_release(r);
            }
    for (int t = 0; t < 3; t++, seed += 4) { /* NaN codes: NaN in exactly their rows */
        fp8_case(r, Q3_F32, t == 1, (int64_t[]){1, 5, 17}[t], 34, 300, 1, seed);
        ops_release(r);
    }
}

/* Every e4m3 code through the path's decoders, exactly: w [32, 256] holds code (j + 8 n) % 256
 * at row n, column j (the NaN codes replaced by zeros: matmul_fp8's NaN case has them), scales
 * 1/8 and 4 (exact products), and x one-hot, token t taking column c_t, so y [t, n] is one
 * decoded weight times its scale; columns in turn over calls of T tokens (1 and 15: the GEMV,
 * 16: the dequantization to fp32, with and without the bf16 scratch: e4m3 times 2^k is exact
 * in bf16 too). */
void ops_e4m3_decode(ops_run *r) {
    const int64_t N = 32, K = 256;
    const float scale[2] = {0.125f, 4.0f};
    for (int form = 0; form < 6; form++) {
        const int64_t T = (int64_t[]){1, 15, 16}[form / 2], calls = (K + T - 1) / T;
        uint8_t *w = ops_alloc(r, (size_t)(N * K));
        float *x = ops_alloc(r, (size_t)(T * K) * 4), *got = ops_alloc(r, (size_t)(calls * T * N) * 4),
              *want = ops_alloc(r, (size_t)(calls * T * N) * 4);
        float *scratch;
        uint16_t *xb;
        fp8_scratch(r, T, K, form % 2, &scratch, &xb);
        if (r->oom) return ops_check_bits(r, "e4m3 decode", NULL, NULL, 0);
        for (int64_t n = 0; n < N; n++)
            for (int64_t j = 0; j < K; j++) {
                const uint8_t code = (uint8_t)((j + 8 * n) % 256);
                w[n * K + j] = (code & 0x7f) == 0x7f ? 0 : code;
            }
        for (int64_t c = 0; c < calls; c++) {
            memset(x, 0, (size_t)(T * K) * 4);
            for (int64_t t = 0; t < T; t++) x[t * K + (c * T + t) % K] = 1.0f;
            r->ref->matmul_fp8(want + c * T * N, x, w, scale, Q3_F32, T, N, K, 0, scratch, r->threads, NULL);
            r->path->matmul_fp8(got + c * T * N, x, w, scale, Q3_F32, T, N, K, 0, scratch, r->threads, xb);
        }
        char label[64];
        snprintf(label, sizeof label, "every code, T=%lld%s", (long long)T, form % 2 ? ", bf16 scratch" : "");
        ops_check_bits(r, label, got, want, (size_t)(calls * T * N) * 4);
        ops_release(r);
    }
}

/* The GPTQ 4-bit matmul's cases (cpu_ops.h): y [T, N] (+)= x [T, K] W^T, W a GPTQ matrix
 * (kernels/int4.h), on each path against the scalar reference: W from q3_int4_dequant_rows
 * and the sums in float64. Within 1e-5 of max |y| (fp32 sums of K terms; the path's order
 * differs: per group, the zero applied to the group's sum of x).
 *
 * Every nibble of qweight and qzeros random (asymmetric zeros, so a zero read from the wrong
 * column or nibble shows), scales differing per group and column, both zero offsets (v1 and
 * v2); groups of 128, 64, 32, 24 (an odd count of words), 192 and one group = K, and group 0
 * with a permuted g_idx (desc_act); tokens 1, 3, 15 (the GEMV), 16 and 20 (the prefill
 * paths), and 40 and 72 given xb (amx's token blocks in pairs and one left); N = 136 leaves
 * 8 columns past avx512's last vector, N = 200 a partial prefill chunk, N = 1104 more of amx's
 * strips than its scratch parks at once; 1 to 3 threads (the column splits).
 * The harness never runs portable as the path under test, so each case also holds portable to
 * the reference (never planted: a planted defect goes into the path's result). One shape is
 * quantized from normal weights by kernels/int4.h's RTN quantizer (the checkpoint's symmetric
 * zeros). */
#include <math.h>

#include "../../../kernels/cpu/int4_digits.h"
#include "cpu_ops.h"

#define INT4_TOL 1e-5

static uint32_t next(uint32_t *s) {
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8; /* 24 bits */
}

/* 32 random bits: two draws */
static int32_t word(uint32_t *s) {
    const uint32_t lo = next(s), hi = next(s);
    return (int32_t)(lo ^ hi << 16);
}

/* an [N, K] GPTQ matrix in r's buffers: random nibbles, scales in [2^-8, 2^-6) as fp16, or
 * (rtn) quantized from normal weights; g_idx k / gs, or (desc_act) a random permutation of
 * k / gs with m->group 0 */
static void int4_matrix(ops_run *r, q3_int4_matrix *m, int64_t N, int64_t K, int64_t gs, int desc_act,
                        int zero_offset, int rtn, uint32_t seed) {
    const int64_t G = K / gs;
    int32_t *qweight = ops_alloc(r, (size_t)(K / Q3_INT4_PACK * N) * 4);
    int32_t *qzeros = ops_alloc(r, (size_t)(G * (N / Q3_INT4_PACK)) * 4);
    uint16_t *scales = ops_alloc(r, (size_t)(G * N) * 2);
    int32_t *g_idx = ops_alloc(r, (size_t)K * 4);
    float *wf = rtn ? ops_random(r, N * K, Q3_F32, seed, 0.05f) : NULL;
    *m = (q3_int4_matrix){qweight, qzeros, scales, g_idx, G, desc_act ? 0 : gs, zero_offset};
    if (r->oom) return;
    if (rtn) {
        q3_int4_quantize_rtn(wf, N, K, gs, zero_offset, qweight, qzeros, scales, g_idx);
        return;
    }
    for (int64_t i = 0; i < K / Q3_INT4_PACK * N; i++) qweight[i] = word(&seed);
    for (int64_t i = 0; i < G * (N / Q3_INT4_PACK); i++) qzeros[i] = word(&seed);
    for (int64_t i = 0; i < G * N; i++) {
        const float mantissa = 1.0f + (float)next(&seed) / 16777216.0f;
        scales[i] = q3_f32_to_f16(ldexpf(mantissa, -8 + (int)(next(&seed) % 2u)));
    }
    for (int64_t k = 0; k < K; k++) g_idx[k] = (int32_t)(k / gs);
    for (int64_t k = K - 1; desc_act && k > 0; k--) { /* Fisher-Yates */
        const int64_t j = next(&seed) % (uint32_t)(k + 1);
        const int32_t t = g_idx[k];
        g_idx[k] = g_idx[j];
        g_idx[j] = t;
    }
}

/* want [T, N] = y0 (accumulate) + x W^T, W the scalar reference's, summed in float64 */
static void reference(float *want, const float *x, const float *wd, const float *y0, int64_t T, int64_t N,
                      int64_t K, int accumulate) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++) {
            double s = accumulate ? y0[t * N + n] : 0.0;
            for (int64_t k = 0; k < K; k++) s += (double)x[t * K + k] * wd[n * K + k];
            want[t * N + n] = (float)s;
        }
}

typedef struct {
    int64_t N, K, group; /* group: the group size (of g_idx's permutation with desc_act) */
    int desc_act, rtn;
} int4_shape;

static const int4_shape SHAPES[] = {
    {64, 256, 128, 0, 0},  {136, 512, 128, 0, 0}, {256, 384, 32, 0, 0}, {200, 256, 64, 0, 0},
    {64, 512, 512, 0, 0},  {96, 256, 128, 1, 0},  {256, 512, 32, 1, 0}, {128, 512, 128, 0, 1},
    {72, 264, 24, 0, 0},   {64, 384, 192, 0, 0}, /* groups of an odd count of words, of 1.5 blocks */
    {1104, 256, 128, 0, 0}, /* amx's panels: 34.5 strips, more than a thread's scratch parks */
};
static const int64_t TOKENS[] = {1, 3, 15, 16, 20};
/* given xb, 40 and 72 too: 3 and 5 token blocks of amx's tiles (a pair and a single parked) */
static const int64_t XB_TOKENS[] = {1, 3, 15, 16, 20, 40, 72};

static void int4_case(ops_run *r, const int4_shape *s, int64_t T, int accumulate, int zero_offset, int threads,
                      uint32_t seed) {
    const int64_t N = s->N, K = s->K, ny = T * N;
    q3_int4_matrix m;
    int4_matrix(r, &m, N, K, s->group, s->desc_act, zero_offset, s->rtn, seed);
    float *x = ops_random(r, T * K, Q3_F32, seed + 1, 1.0f), *y0 = ops_random(r, ny, Q3_F32, seed + 2, 1.0f);
    float *wd = ops_alloc(r, (size_t)(N * K) * 4), *want = ops_alloc(r, (size_t)ny * 4);
    float *got = ops_alloc(r, (size_t)ny * 4), *got_ref = ops_alloc(r, (size_t)ny * 4);
    float *scratch = ops_alloc(r, (size_t)(threads * q3_matmul_int4_scratch_floats(T, K)) * 4);
    char label[128];
    snprintf(label, sizeof label, "T=%lld N=%lld K=%lld group %lld%s, %s%s, %d threads", (long long)T, (long long)N,
             (long long)K, (long long)s->group, s->desc_act ? " permuted (desc_act)" : "", zero_offset ? "v1" : "v2",
             accumulate ? ", accumulate" : "", threads);
    if (r->oom) return ops_check_f32(r, label, NULL, NULL, 0, INT4_TOL);
    q3_int4_dequant_rows(wd, &m, N, K, 0, N);
    reference(want, x, wd, y0, T, N, K, accumulate);
    memcpy(got, y0, (size_t)ny * 4);
    memcpy(got_ref, y0, (size_t)ny * 4);
    r->path->matmul_int4(got, x, &m, T, N, K, accumulate, scratch, threads, NULL);
    r->ref->matmul_int4(got_ref, x, &m, T, N, K, accumulate, scratch, threads, NULL);
    ops_check_f32(r, label, got, want, ny, INT4_TOL);
    const int plant = r->plant;
    char ref_label[160];
    snprintf(ref_label, sizeof ref_label, "portable, %s", label);
    r->plant = 0;
    ops_check_f32(r, ref_label, got_ref, want, ny, INT4_TOL);
    r->plant = plant;
}

/* Given the bf16 scratch (a bf16 layer's), a path may round x to bf16 with the weights exact
 * (the prefill of avx512bf16, matmul_int4_dot.c) or rounded to bf16 too (its panel path, for
 * groups the first does not take, and amx's tiles, matmul_int4_amx.c), or hold x as two 8-bit
 * digits a block (the VNNI GEMV of avx512bf16, matmul_int4_vnni.c: within max |x| / 65024 of
 * each input): held, as cases_matmul.c holds FP8's, to the closest of the portable results on
 * the exact, x-rounded and both-rounded operands, within fp32 rounding of its terms; y0 added
 * where accumulate */
static void int4_xb_case(ops_run *r, const int4_shape *s, int64_t T, int accumulate, int threads, uint32_t seed) {
    const int64_t N = s->N, K = s->K, ny = T * N;
    q3_int4_matrix m;
    int4_matrix(r, &m, N, K, s->group, s->desc_act, 1, s->rtn, seed);
    float *x = ops_random(r, T * K, Q3_F32, seed + 1, 1.0f), *wd = ops_alloc(r, (size_t)(N * K) * 4);
    float *wr = ops_alloc(r, (size_t)(N * K) * 4), *got = ops_alloc(r, (size_t)ny * 4);
    float *want = ops_alloc(r, (size_t)ny * 4), *want_x = ops_alloc(r, (size_t)ny * 4);
    float *want_xw = ops_alloc(r, (size_t)ny * 4), *xr = ops_rounded(r, x, T * K);
    float *y0 = accumulate ? ops_random(r, ny, Q3_F32, seed + 2, 1.0f) : NULL;
    float *scratch = ops_alloc(r, (size_t)(threads * q3_matmul_int4_scratch_floats(T, K)) * 4);
    uint16_t *xb = ops_alloc(r, (size_t)(q3_matmul_scratch_elems(T, K) + 1) * 2);
    const double tol = 2e-6 * (sqrt((double)K) + 4.0);
    char label[128];
    snprintf(label, sizeof label, "bf16 scratch, T=%lld N=%lld K=%lld group %lld%s%s, %d threads", (long long)T,
             (long long)N, (long long)K, (long long)s->group, s->desc_act ? " permuted (desc_act)" : "",
             accumulate ? ", accumulate" : "", threads);
    if (r->oom) return ops_check_f32(r, label, NULL, NULL, 0, tol);
    q3_int4_dequant_rows(wd, &m, N, K, 0, N);
    for (int64_t i = 0; i < N * K; i++) wr[i] = q3_bf16_to_f32(q3_f32_to_bf16(wd[i]));
    float *outs[4] = {got, want, want_x, want_xw};
    for (int i = 0; i < 4 && accumulate; i++) memcpy(outs[i], y0, (size_t)ny * 4);
    r->path->matmul_int4(got, x, &m, T, N, K, accumulate, scratch, threads, xb);
    r->ref->matmul(want, x, wd, Q3_F32, T, N, K, accumulate, NULL);
    r->ref->matmul(want_x, xr, wd, Q3_F32, T, N, K, accumulate, NULL);
    r->ref->matmul(want_xw, xr, wr, Q3_F32, T, N, K, accumulate, NULL);
    const double *bound = ops_term_bound(r, x, wd, T, N, K, y0, 1e-30);
    const float *refs[3] = {want, want_x, want_xw};
    if (!bound) return ops_check_f32(r, label, NULL, NULL, 0, tol);
    ops_check_bound(r, label, got, ops_closest(got, refs, 3, bound, ny), bound, ny, tol);
}

void ops_matmul_int4(ops_run *r) {
    uint32_t seed = 500;
    int threads = 1;
    for (int s = 0; s < (int)(sizeof SHAPES / sizeof SHAPES[0]); s++)
        for (int t = 0; t < (int)(sizeof TOKENS / sizeof TOKENS[0]); t++)
            for (int form = 0; form < 4; form++, seed += 7) {
                int4_case(r, &SHAPES[s], TOKENS[t], form & 1, form >> 1 & 1, threads, seed);
                ops_release(r);
                threads = threads % 3 + 1;
            }
    for (int s = 0; s < (int)(sizeof SHAPES / sizeof SHAPES[0]); s++)
        for (int t = 0; t < (int)(sizeof XB_TOKENS / sizeof XB_TOKENS[0]); t++)
            for (int accumulate = 0; accumulate < 2; accumulate++, seed += 7) {
                int4_xb_case(r, &SHAPES[s], XB_TOKENS[t], accumulate, threads, seed);
                ops_release(r);
                threads = threads % 3 + 1;
            }
}

/* The digits of the int4 decode GEMVs on integer dot products (int4_digits.h: x held as two
 * 8-bit digits a block of 128 inputs; matmul_int4_vnni.c on avx512bf16 and amx, whose
 * quantize_token_avx512 must make quantize_token's bytes, and matmul_int4_sdot.c on
 * neon_bf16), seen exactly through the GEMV: W [K, K] whose nibbles are their zero but for
 * q - z = 1 at (n, n), scales 1, so y[n] = sx/256 (256 hi[n] + lo[n]), one rounding of an exact
 * product, from the digits of input n. Held bit for bit to the digits the scalar
 * quantize_token makes on those paths; the others (no digits: y = x but for the fp32 GEMV's
 * rounding, which sums every group's x with its zero: matmul_int4's cases hold them) within
 * 1e-4 of the token's sum of |x| (a sum of 128 terms of up to 2 |x| each, times 16). Blocks of
 * normal draws; of halves after scaling (ties of both roundings, and lo's clamp at 127); one
 * all zero; one with a lone nonzero; magnitudes of 1e-30 and 1e30; the largest a negative. */
static void digits_input(float *x, int64_t K, uint32_t seed, const float *normal) {
    for (int64_t k = 0; k < K; k++) {
        const int64_t b = (k / 128 + seed) % 8, i = k % 128;
        const float z = normal[k];
        x[k] = b == 0 ? z
             : b == 1 ? (i == 0 ? 127.0f : (float)(i % 121) - 60.0f + 0.5f)      /* sx 1: hi's ties, lo 128 */
             : b == 2 ? (i == 0 ? -127.0f : 3.0f + (float)(i % 200) / 256.0f + 0.5f / 256.0f) /* lo's ties */
             : b == 3 ? 0.0f
             : b == 4 ? (i == 77 ? -3.7f : 0.0f)
             : b == 5 ? 1e-30f * z
             : b == 6 ? 1e30f * z
             : (i == 5 ? -9.0f : fabsf(z));
    }
}

static void digits_case(ops_run *r, int64_t T, int64_t K, int threads, uint32_t seed) {
    const int64_t N = K, G = K / 128, ny = T * N;
    int32_t *qweight = ops_alloc(r, (size_t)(K / Q3_INT4_PACK * N) * 4), *g_idx = ops_alloc(r, (size_t)K * 4);
    int32_t *qzeros = ops_alloc(r, (size_t)(G * (N / Q3_INT4_PACK)) * 4);
    uint16_t *scales = ops_alloc(r, (size_t)(G * N) * 2);
    float *normal = ops_random(r, T * K, Q3_F32, seed, 1.0f), *x = ops_alloc(r, (size_t)(T * K) * 4);
    float *got = ops_alloc(r, (size_t)ny * 4), *digits = ops_alloc(r, (size_t)ny * 4);
    float *scratch = ops_alloc(r, (size_t)(threads * q3_matmul_int4_scratch_floats(T, K)) * 4), sx[2048 / 128];
    uint16_t *xb = ops_alloc(r, (size_t)(q3_matmul_scratch_elems(T, K) + 1) * 2);
    int8_t *xq = ops_alloc(r, (size_t)K * 2);
    char label[96];
    snprintf(label, sizeof label, "digits, T=%lld K=%lld, %d threads", (long long)T, (long long)K, threads);
    if (r->oom) return ops_check_bits(r, label, NULL, NULL, 1);
    for (int64_t g = 0; g < G; g++) /* v1: the zero is the stored nibble + 1, in 1 .. 14 */
        for (int64_t n = 0; n < N; n++) {
            const uint32_t stored = next(&seed) % 14u;
            qzeros[g * (N / 8) + n / 8] |= (int32_t)(stored << (4 * (n % 8)));
            for (int64_t k = g * 128; k < g * 128 + 128; k++) {
                const uint32_t q = stored + 1 + (k == n);
                qweight[k / 8 * N + n] |= (int32_t)(q << (4 * (k % 8)));
            }
        }
    for (int64_t i = 0; i < G * N; i++) scales[i] = 0x3c00; /* 1.0 */
    for (int64_t k = 0; k < K; k++) g_idx[k] = (int32_t)(k / 128);
    const q3_int4_matrix m = {qweight, qzeros, scales, g_idx, G, 128, 1};
    for (int64_t t = 0; t < T; t++) {
        digits_input(x + t * K, K, seed + (uint32_t)t, normal + t * K);
        quantize_token(xq, sx, x + t * K, K);
        for (int64_t n = 0; n < N; n++) {
            const int j = (int)(n % 8), at = (j & 1) * 4 + j / 2;
            const int32_t d = 256 * xq[n / 8 * 16 + at] + xq[n / 8 * 16 + 8 + at];
            digits[t * N + n] = (float)((double)(sx[n / 128] / 256.0f) * d);
        }
    }
    r->path->matmul_int4(got, x, &m, T, N, K, 0, scratch, threads, xb);
    const char *name = r->path->name;
    if (!strcmp(name, "avx512bf16") || !strcmp(name, "amx") || !strcmp(name, "neon_bf16"))
        return ops_check_bits(r, label, got, digits, (size_t)ny * 4);
    double *bound = ops_alloc(r, (size_t)ny * sizeof *bound);
    for (int64_t t = 0; bound && t < T; t++) {
        double b = 0.0;
        for (int64_t k = 0; k < K; k++) b += fabs((double)x[t * K + k]);
        for (int64_t n = 0; n < N; n++) bound[t * N + n] = b;
    }
    if (!bound) return ops_check_bits(r, label, NULL, NULL, 1);
    ops_check_bound(r, label, got, x, bound, ny, 1e-4);
}

void ops_int4_digits(ops_run *r) {
    int threads = 1;
    uint32_t seed = 900;
    for (int64_t T = 1; T <= 3; T += 2)
        for (int64_t K = 1024; K <= 2048; K *= 2, seed += 11) { /* (digits_case's sx holds 2048 / 128) */
            digits_case(r, T, K, threads, seed);
            ops_release(r);
            threads = threads % 3 + 1;
        }
}

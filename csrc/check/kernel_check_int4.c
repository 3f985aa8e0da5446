/* The self-check cases of the 4-bit GPTQ kernels (see kernel_check.c): the GEMV, the
 * dequantization to bf16 and the grouped decode experts, each against its twin
 * (kernels/cpu/twins.h: the portable matmul_int4, the scalar reference, and their
 * compositions), on random nibbles, zeros and scales that differ from column to column and
 * group to group (a zero or scale of another column or group shows), for each kind of matrix
 * (q3_int4_kind): groups of any size or one of all K inputs, g_idx k / group or a shuffle's
 * (desc_act), both zero offsets. */
#include "kernel_check.h"

/* the next value of a fixed LCG */
static uint32_t lcg(uint32_t *seed) { return *seed = *seed * 1664525u + 1013904223u; }

void q3_int4_kind_name(char *out, size_t n, const q3_int4_kind *kind) {
    char group[24] = "1 group";
    if (kind->group) snprintf(group, sizeof group, "g%lld", (long long)kind->group);
    snprintf(out, n, "%s%s v%d", kind->desc_act ? "desc_act " : "", group, kind->zero_offset ? 1 : 2);
}

/* E random GPTQ matrices [N, K] of one kind, each tensor stacked over the experts in one host
 * buffer (freed with the case); m[e] expert e's. Random words and zero nibbles (zeros 0 .. 16
 * with zero_offset 1), scales in [2^-9, 2^-6); g_idx k / group, or with desc_act a shuffle of
 * those per expert (each group still `group` inputs, spread over K; the matrix's group 0). */
static void host_int4(check *k, q3_int4_matrix *m, int E, int64_t N, int64_t K, const q3_int4_kind *kind,
                      uint32_t seed) {
    const int64_t group = kind->group ? kind->group : K, G = K / group, words = K / 8 * N;
    int32_t *qweight = host(k, E * words * 4), *qzeros = host(k, E * G * N / 8 * 4), *g_idx = host(k, E * K * 4);
    uint16_t *scales = host(k, E * G * N * 2);
    if (k->failed) return;
    for (int64_t i = 0; i < E * words; i++) qweight[i] = (int32_t)lcg(&seed);
    for (int64_t i = 0; i < E * G * N / 8; i++) qzeros[i] = (int32_t)lcg(&seed);
    for (int64_t i = 0; i < E * G * N; i++) {
        const uint32_t r = lcg(&seed);
        scales[i] = q3_f32_to_f16(ldexpf(1.0f + (float)(r >> 8) / 16777216.0f, -9 + (int)(r % 3u)));
    }
    for (int e = 0; e < E; e++) {
        int32_t *gi = g_idx + e * K;
        for (int64_t j = 0; j < K; j++) gi[j] = (int32_t)j;
        for (int64_t j = K - 1; kind->desc_act && j > 0; j--) { /* Fisher-Yates */
            const int64_t i = lcg(&seed) % (uint64_t)(j + 1);
            const int32_t t = gi[i];
            gi[i] = gi[j];
            gi[j] = t;
        }
        for (int64_t j = 0; j < K; j++) gi[j] = (int32_t)(gi[j] / group);
        m[e] = (q3_int4_matrix){qweight + e * words, qzeros + e * G * N / 8, scales + e * G * N, gi, G,
                                kind->desc_act ? 0 : group, kind->zero_offset};
    }
}

/* host_int4's matrices on the device, each tensor copied once (qweight w_off bytes into its
 * buffer: not 16-byte aligned where w_off % 16): dm[e] expert e's */
static void device_int4(check *k, q3_int4_matrix *dm, const q3_int4_matrix *m, int E, int64_t N, int64_t K,
                        size_t w_off) {
    const int64_t G = m[0].groups;
    const int32_t *qweight = device_off(k, m[0].qweight, E * K / 8 * N * 4, w_off);
    const int32_t *qzeros = device(k, m[0].qzeros, E * G * N / 8 * 4), *g_idx = device(k, m[0].g_idx, E * K * 4);
    const uint16_t *scales = device(k, m[0].scales, E * G * N * 2);
    for (int e = 0; e < E && !k->failed; e++) {
        dm[e] = m[e];
        dm[e].qweight = qweight + (m[e].qweight - m[0].qweight);
        dm[e].qzeros = qzeros + (m[e].qzeros - m[0].qzeros);
        dm[e].scales = scales + (m[e].scales - m[0].scales);
        dm[e].g_idx = g_idx + (m[e].g_idx - m[0].g_idx);
    }
}

/* the GEMV (y random beforehand: added to, or overwritten) */
double q3_case_int4_matmul(check *k, const q3_int4_kind *kind, int64_t T, int64_t N, int64_t K, int accumulate,
                           size_t w_off, size_t x_off) {
    float *x = host_random(k, T * K, Q3_F32, 70), *want = host_random(k, T * N, Q3_F32, 71), *got = host(k, T * N * 4);
    q3_int4_matrix m, dm;
    host_int4(k, &m, 1, N, K, kind, 72);
    if (k->failed) return INFINITY;
    float *dy = device(k, want, T * N * 4), *dx = device_off(k, x, T * K * 4, x_off);
    device_int4(k, &dm, &m, 1, N, K, w_off);
    if (q3_matmul_int4_host(want, x, &m, T, N, K, accumulate)) return INFINITY;
    if (!k->failed) cuda_ok(k, k->g->matmul_int4(dy, dx, &dm, T, N, K, accumulate, NULL), "matmul_int4 launch");
    fetch(k, got, dy, T * N * 4);
    return k->failed ? INFINITY : max_err(got, want, Q3_F32, T * N);
}

/* the dequantization to bf16, bit for bit; dst d_off bytes into its buffer */
double q3_case_int4_dequant(check *k, const q3_int4_kind *kind, int64_t N, int64_t K, size_t d_off) {
    uint16_t *want = host(k, N * K * 2), *got = host(k, N * K * 2);
    q3_int4_matrix m, dm;
    host_int4(k, &m, 1, N, K, kind, 73);
    char *dst = device(k, NULL, N * K * 2 + d_off);
    device_int4(k, &dm, &m, 1, N, K, 0);
    if (k->failed) return INFINITY;
    q3_int4_dequant_host(want, &m, N, K);
    cuda_ok(k, k->g->int4_dequant((uint16_t *)(dst + d_off), &dm, N, K, NULL), "int4_dequant launch");
    fetch(k, got, dst + d_off, N * K * 2);
    return k->failed || memcmp(got, want, N * K * 2) ? INFINITY : 0.0;
}

/* the grouped decode experts on GPTQ weights against their twins: act and y; gate and up
 * [I, H], down [H, I], all of one kind (its group dividing both) */
double q3_case_moe_experts_int4(check *k, const q3_int4_kind *kind, int64_t T, int top, int E, int64_t I,
                                int64_t H) {
    enum { MAX_E = 64 };
    const int P = (int)T * top;
    if (top > E || E > MAX_E) return INFINITY;
    int32_t *idx = host(k, P * 4), *rows = host(k, P * 4), *slot = host(k, P * 4), *active = host(k, (E + 1) * 4);
    int64_t *offsets = host(k, (E + 1) * 8);
    float *x = host_random(k, T * H, Q3_F32, 78), *w = host_random(k, P, Q3_F32, 79), *weights = host(k, P * 4);
    float *act = host(k, P * I * 4), *y = host(k, P * H * 4), *act_got = host(k, P * I * 4), *y_got = host(k, P * H * 4);
    q3_int4_matrix hg[MAX_E], hu[MAX_E], hd[MAX_E], dg[MAX_E], du[MAX_E], dd[MAX_E];
    host_int4(k, hg, E, I, H, kind, 74);
    host_int4(k, hu, E, I, H, kind, 75);
    host_int4(k, hd, E, H, I, kind, 76);
    if (k->failed) return INFINITY;
    pick_experts(idx, T, top, E, 77);
    q3_moe_route_host(offsets, rows, weights, active, slot, idx, w, T, top, E);
    float *dx = device(k, x, T * H * 4), *dact = device(k, NULL, P * I * 4), *dy = device(k, NULL, P * H * 4);
    int32_t *drows = device(k, rows, P * 4), *dactive = device(k, active, (E + 1) * 4);
    int64_t *doffsets = device(k, offsets, (E + 1) * 8);
    device_int4(k, dg, hg, E, I, H, 0);
    device_int4(k, du, hu, E, I, H, 0);
    device_int4(k, dd, hd, E, H, I, 0);
    const q3_int4_matrix *tg = device(k, dg, E * sizeof dg[0]), *tu = device(k, du, E * sizeof du[0]);
    const q3_int4_matrix *td = device(k, dd, E * sizeof dd[0]);
    if (q3_moe_gate_up_int4_host(act, x, rows, offsets, active, hg, hu, I, H) ||
        q3_moe_down_int4_host(y, act, offsets, active, hd, H, I))
        return INFINITY;
    const int max_active = E < P ? E : P;
    if (!k->failed)
        cuda_ok(k, k->g->moe_gate_up_int4(dact, dx, drows, doffsets, dactive, tg, tu, max_active, I, H, NULL),
                "moe_gate_up_int4 launch");
    if (!k->failed)
        cuda_ok(k, k->g->moe_down_int4(dy, dact, doffsets, dactive, td, max_active, H, I, NULL), "moe_down_int4 launch");
    fetch(k, act_got, dact, P * I * 4);
    fetch(k, y_got, dy, P * H * 4);
    if (k->failed) return INFINITY;
    const double e_act = max_err(act_got, act, Q3_F32, P * I), e_y = max_err(y_got, y, Q3_F32, P * H);
    return e_act > e_y ? e_act : e_y;
}

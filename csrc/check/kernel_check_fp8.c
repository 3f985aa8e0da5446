/* The self-check cases of the FP8 kernels (see kernel_check.c): the GEMV, the dequantization
 * to bf16 and the grouped decode experts, each against its twin (kernels/cpu/twins.h: the
 * portable matmul_fp8 and its compositions), on random e4m3 codes with scales that differ
 * from block to block (a scale taken from the wrong block shows), at sizes that are not
 * multiples of 128 (partial scale blocks) or of 16 (the one-element-a-lane paths), with fp32
 * and bf16 scales and NaN codes. */
#include "kernel_check.h"

/* n random e4m3 codes from a fixed LCG: every finite code (NaN codes 0x7f, 0xff replaced by
 * 0x7e, 0xfe) */
static uint8_t *host_fp8(check *k, int64_t n, uint32_t seed) {
    uint8_t *p = host(k, (size_t)n);
    for (int64_t i = 0; p && i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        const uint8_t b = (uint8_t)(seed >> 24);
        p[i] = (b & 0x7fu) == 0x7fu ? (uint8_t)(b - 1) : b;
    }
    return p;
}

/* the scale_inv of an [N, K] matrix: ceil(N/128) x ceil(K/128) values in [2^-10, 2^-6) of
 * dtype sdt, each block its own */
static void *host_scale(check *k, int64_t N, int64_t K, q3_dtype sdt, uint32_t seed) {
    const int64_t n = q3_fp8_blocks(N) * q3_fp8_blocks(K);
    void *p = host(k, (size_t)n * q3_dtype_size(sdt));
    for (int64_t i = 0; p && i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        const float v = ldexpf(1.0f + (float)(seed >> 8) / 16777216.0f, -10 + (int)(seed % 4u));
        if (sdt == Q3_BF16) ((uint16_t *)p)[i] = q3_f32_to_bf16(v);
        else ((float *)p)[i] = v;
    }
    return p;
}

double q3_case_fp8_matmul(check *k, q3_dtype sdt, int64_t T, int64_t N, int64_t K, size_t w_off, size_t x_off,
                          int nan) {
    const size_t sbytes = (size_t)(q3_fp8_blocks(N) * q3_fp8_blocks(K)) * q3_dtype_size(sdt);
    float *x = host_random(k, T * K, Q3_F32, 50), *want = host_random(k, T * N, Q3_F32, 51), *got = host(k, T * N * 4);
    uint8_t *w = host_fp8(k, N * K, 52);
    void *scale = host_scale(k, N, K, sdt, 53);
    if (k->failed) return INFINITY;
    if (nan) { /* a NaN code in row 1 (at its last column) and in row N - 1, of both signs */
        w[1 * K + K - 1] = 0x7f;
        w[(N - 1) * K + K / 2] = 0xff;
    }
    float *dy = device(k, want, T * N * 4), *dx = device_off(k, x, T * K * 4, x_off);
    uint8_t *dw = device_off(k, w, N * K, w_off);
    void *ds = device(k, scale, sbytes);
    if (q3_matmul_fp8_host(want, x, w, scale, sdt, T, N, K, 1)) return INFINITY;
    if (!k->failed) cuda_ok(k, k->g->matmul_fp8(dy, dx, dw, ds, sdt, T, N, K, 1, NULL), "matmul_fp8 launch");
    fetch(k, got, dy, T * N * 4);
    if (k->failed) return INFINITY;
    if (nan && !(isnan(got[1]) && isnan(got[N - 1]))) return INFINITY; /* max_err skips NaN pairs */
    return max_err(got, want, Q3_F32, T * N);
}

/* the dequantization to bf16, bit for bit (NaN codes among the bytes) */
double q3_case_fp8_dequant(check *k, q3_dtype sdt, int64_t N, int64_t K, size_t w_off) {
    const size_t sbytes = (size_t)(q3_fp8_blocks(N) * q3_fp8_blocks(K)) * q3_dtype_size(sdt);
    uint8_t *w = host_fp8(k, N * K, 54);
    void *scale = host_scale(k, N, K, sdt, 55);
    uint16_t *want = host(k, N * K * 2), *got = host(k, N * K * 2);
    if (k->failed) return INFINITY;
    w[0] = 0x7f;
    w[N * K - 1] = 0xff;
    uint8_t *dw = device_off(k, w, N * K, w_off);
    uint16_t *dd = device(k, NULL, N * K * 2);
    void *ds = device(k, scale, sbytes);
    if (q3_fp8_dequant_host(want, w, scale, sdt, N, K)) return INFINITY;
    if (!k->failed) cuda_ok(k, k->g->fp8_dequant(dd, dw, ds, sdt, N, K, NULL), "fp8_dequant launch");
    fetch(k, got, dd, N * K * 2);
    return k->failed || memcmp(got, want, N * K * 2) ? INFINITY : 0.0;
}

/* device arrays of E device pointers: base + e * stride bytes */
static const void *const *table(check *k, const void *base, int E, size_t stride) {
    const void *ptrs[64];
    if (k->failed || E > 64) return NULL;
    for (int e = 0; e < E; e++) ptrs[e] = (const char *)base + e * stride;
    return device(k, ptrs, E * sizeof ptrs[0]);
}

/* the grouped decode experts on FP8 weights against their twins: act and y */
double q3_case_moe_experts_fp8(check *k, int64_t T, int top, int E, int64_t I, int64_t H, q3_dtype sdt) {
    const int P = (int)T * top;
    if (top > E || E > 64) return INFINITY;
    const size_t ss = q3_dtype_size(sdt);
    const int64_t gsn = q3_fp8_blocks(I) * q3_fp8_blocks(H), dsn = q3_fp8_blocks(H) * q3_fp8_blocks(I);
    int32_t *idx = host(k, P * 4), *rows = host(k, P * 4), *slot = host(k, P * 4), *active = host(k, (E + 1) * 4);
    int64_t *offsets = host(k, (E + 1) * 8);
    float *x = host_random(k, T * H, Q3_F32, 56), *w = host_random(k, P, Q3_F32, 57), *weights = host(k, P * 4);
    uint8_t *gate = host_fp8(k, E * I * H, 58), *up = host_fp8(k, E * I * H, 59), *down = host_fp8(k, E * H * I, 60);
    void *gs = host_scale(k, E * q3_fp8_blocks(I) * 128, H, sdt, 61); /* E blocks of rows, stacked */
    void *us = host_scale(k, E * q3_fp8_blocks(I) * 128, H, sdt, 62);
    void *ds = host_scale(k, E * q3_fp8_blocks(H) * 128, I, sdt, 63);
    float *act = host(k, P * I * 4), *y = host(k, P * H * 4), *act_got = host(k, P * I * 4), *y_got = host(k, P * H * 4);
    if (k->failed) return INFINITY;
    pick_experts(idx, T, top, E, 64);
    q3_moe_route_host(offsets, rows, weights, active, slot, idx, w, T, top, E);
    const uint8_t *hg[64], *hu[64], *hd[64];
    const void *hgs[64], *hus[64], *hds[64];
    for (int e = 0; e < E; e++) {
        hg[e] = gate + e * I * H;
        hu[e] = up + e * I * H;
        hd[e] = down + e * H * I;
        hgs[e] = (const char *)gs + e * gsn * ss;
        hus[e] = (const char *)us + e * gsn * ss;
        hds[e] = (const char *)ds + e * dsn * ss;
    }
    float *dx = device(k, x, T * H * 4), *dact = device(k, NULL, P * I * 4), *dy = device(k, NULL, P * H * 4);
    int32_t *drows = device(k, rows, P * 4), *dactive = device(k, active, (E + 1) * 4);
    int64_t *doffsets = device(k, offsets, (E + 1) * 8);
    const uint8_t *const *dg = (const uint8_t *const *)table(k, device(k, gate, E * I * H), E, I * H);
    const uint8_t *const *du = (const uint8_t *const *)table(k, device(k, up, E * I * H), E, I * H);
    const uint8_t *const *dd = (const uint8_t *const *)table(k, device(k, down, E * H * I), E, H * I);
    const void *const *dgs = table(k, device(k, gs, E * gsn * ss), E, gsn * ss);
    const void *const *dus = table(k, device(k, us, E * gsn * ss), E, gsn * ss);
    const void *const *dds = table(k, device(k, ds, E * dsn * ss), E, dsn * ss);
    if (q3_moe_gate_up_fp8_host(act, x, rows, offsets, active, hg, hu, hgs, hus, sdt, I, H) ||
        q3_moe_down_fp8_host(y, act, offsets, active, hd, hds, sdt, H, I))
        return INFINITY;
    const int max_active = E < P ? E : P;
    if (!k->failed)
        cuda_ok(k, k->g->moe_gate_up_fp8(dact, dx, drows, doffsets, dactive, dg, du, dgs, dus, sdt, max_active, I, H,
                                         NULL), "moe_gate_up_fp8 launch");
    if (!k->failed)
        cuda_ok(k, k->g->moe_down_fp8(dy, dact, doffsets, dactive, dd, dds, sdt, max_active, H, I, NULL),
                "moe_down_fp8 launch");
    fetch(k, act_got, dact, P * I * 4);
    fetch(k, y_got, dy, P * H * 4);
    if (k->failed) return INFINITY;
    const double e_act = max_err(act_got, act, Q3_F32, P * I), e_y = max_err(y_got, y, Q3_F32, P * H);
    return e_act > e_y ? e_act : e_y;
}

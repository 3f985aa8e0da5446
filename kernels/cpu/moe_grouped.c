/* The CPU twins of kernels/cuda/moe_grouped.cu, the routed experts of a decode step (twins.h):
 * the device-side grouping (moe_route), the gate/up and down projections per active expert on
 * dense, FP8 or GPTQ int4 weights (one loop for all over an expert_rows, as the CUDA kernels'
 * one source over their weight-row readers for dense and FP8), and the weighted combine, as
 * compositions of the portable kernels. Portable variant only. x [T, K]; act, y by slot:
 * [T * k, I], [T * k, N]. */
#include <stdlib.h>

#include "ops.h"
#include "twins.h"

#if Q3_CPU_TWINS

void q3_moe_route_host(int64_t *offsets, int32_t *rows, float *weights, int32_t *active, int32_t *slot,
                       const int32_t *idx, const float *w, int64_t T, int k, int E) {
    q3_moe_group_cpu_portable(offsets, rows, weights, idx, w, T, k, E);
    int n = 0;
    for (int e = 0; e < E; e++)
        if (offsets[e + 1] > offsets[e]) active[1 + n++] = e;
    active[0] = n;
    /* pair (t, j) lands after the pairs of earlier tokens that chose the same expert */
    for (int e = 0; e < E; e++)
        for (int64_t s = offsets[e]; s < offsets[e + 1]; s++) {
            const int64_t t = rows[s];
            for (int j = 0; j < k; j++)
                if (idx[t * k + j] == e) slot[t * k + j] = (int32_t)s;
        }
}

/* the most slots any active expert has (active[0] experts listed after it) */
static int64_t most_slots(const int64_t *offsets, const int32_t *active) {
    int64_t most = 0;
    for (int a = 0; a < active[0]; a++) {
        const int e = active[1 + a];
        most = offsets[e + 1] - offsets[e] > most ? offsets[e + 1] - offsets[e] : most;
    }
    return most;
}

void q3_moe_combine_host(float *x, const float *y, const float *weights, const int32_t *slot, int64_t T, int k,
                         int64_t H) {
    for (int64_t t = 0; t < T; t++) {
        int32_t s[k];
        for (int j = 0; j < k; j++) { /* insertion sort: the slots in expert order */
            int p = j;
            for (; p > 0 && s[p - 1] > slot[t * k + j]; p--) s[p] = s[p - 1];
            s[p] = slot[t * k + j];
        }
        for (int j = 0; j < k; j++)
            for (int64_t i = 0; i < H; i++) x[t * H + i] += weights[s[j]] * y[(int64_t)s[j] * H + i];
    }
}

/* An expert's weights, as the CUDA kernels take them: per matrix j (gate and up, or down),
 * [E] pointers to dense rows [*, K] of dt, or to e4m3 rows and their block scales of dt
 * (kernels/fp8.h), or [E] GPTQ matrices (kernels/int4.h) */
typedef struct {
    const void *const *dense[2];
    const uint8_t *const *fp8[2];
    const void *const *scale[2];
    q3_dtype dt;
    const q3_int4_matrix *int4[2];
} expert_rows;

/* y [n, N] = x [n, K] W^T, W matrix j of expert e */
static int project(float *y, const float *x, const expert_rows *r, int j, int e, int64_t n, int64_t N, int64_t K) {
    if (r->int4[j]) return q3_matmul_int4_host(y, x, &r->int4[j][e], n, N, K, 0);
    if (r->fp8[j]) return q3_matmul_fp8_host(y, x, r->fp8[j][e], r->scale[j][e], r->dt, n, N, K, 0);
    q3_matmul_cpu_portable(y, x, r->dense[j][e], r->dt, n, N, K, 0, NULL);
    return 0;
}

/* per active expert: gather_rows, the gate and the up projection, swiglu */
static int gate_up(float *act, const float *x, const int32_t *rows, const int64_t *offsets, const int32_t *active,
                   const expert_rows *r, int64_t I, int64_t K) {
    const int64_t most = most_slots(offsets, active);
    float *xe = malloc((size_t)(most * K + most * I + 1) * sizeof(float)); /* gathered rows, then up */
    if (!xe) return 1;
    float *upv = xe + most * K;
    int bad = 0;
    for (int a = 0; a < active[0] && !bad; a++) {
        const int e = active[1 + a];
        const int64_t first = offsets[e], n = offsets[e + 1] - first;
        q3_gather_rows_cpu_portable(xe, x, rows + first, n, K);
        bad = project(act + first * I, xe, r, 0, e, n, I, K) || project(upv, xe, r, 1, e, n, I, K);
        q3_swiglu_cpu_portable(act + first * I, act + first * I, upv, n * I);
    }
    free(xe);
    return bad;
}

/* per active expert: the down projection of its slots */
static int down(float *y, const float *act, const int64_t *offsets, const int32_t *active, const expert_rows *r,
                int64_t N, int64_t K) {
    for (int a = 0; a < active[0]; a++) {
        const int e = active[1 + a];
        const int64_t first = offsets[e], n = offsets[e + 1] - first;
        if (project(y + first * N, act + first * K, r, 0, e, n, N, K)) return 1;
    }
    return 0;
}

int q3_moe_gate_up_host(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                        const int32_t *active, const void *const *gate, const void *const *up, q3_dtype w_dt,
                        int64_t I, int64_t K) {
    const expert_rows r = {.dense = {gate, up}, .dt = w_dt};
    return gate_up(act, x, rows, offsets, active, &r, I, K);
}

void q3_moe_down_host(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                      const void *const *down_w, q3_dtype w_dt, int64_t N, int64_t K) {
    const expert_rows r = {.dense = {down_w, NULL}, .dt = w_dt};
    down(y, act, offsets, active, &r, N, K);
}

int q3_moe_gate_up_fp8_host(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                            const int32_t *active, const uint8_t *const *gate, const uint8_t *const *up,
                            const void *const *gate_scale, const void *const *up_scale, q3_dtype sdt, int64_t I,
                            int64_t K) {
    const expert_rows r = {.fp8 = {gate, up}, .scale = {gate_scale, up_scale}, .dt = sdt};
    return gate_up(act, x, rows, offsets, active, &r, I, K);
}

int q3_moe_down_fp8_host(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                         const uint8_t *const *down_w, const void *const *down_scale, q3_dtype sdt, int64_t N,
                         int64_t K) {
    const expert_rows r = {.fp8 = {down_w, NULL}, .scale = {down_scale, NULL}, .dt = sdt};
    return down(y, act, offsets, active, &r, N, K);
}

int q3_moe_gate_up_int4_host(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                             const int32_t *active, const q3_int4_matrix *gate, const q3_int4_matrix *up, int64_t I,
                             int64_t K) {
    const expert_rows r = {.int4 = {gate, up}};
    return gate_up(act, x, rows, offsets, active, &r, I, K);
}

int q3_moe_down_int4_host(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                          const q3_int4_matrix *down_w, int64_t N, int64_t K) {
    const expert_rows r = {.int4 = {down_w, NULL}};
    return down(y, act, offsets, active, &r, N, K);
}

#endif

/* CPU twins of the fused and device-side CUDA kernels (twins.h): compositions of
 * the active CPU path's kernels, in the order the CUDA kernels must reproduce. */
#include <stdlib.h>

#include "../engine/cpu_dispatch.h"
#include "twins.h"

void q3_qk_rope_kv_host(float *q, float *k, const float *v, const void *q_norm, const void *k_norm, q3_dtype w_dt,
                        const int64_t *pos, const q3_attn_seq *seqs, int n_seqs, const q3_attn_shape *sh,
                        float eps, const float *inv_freq, float scale) {
    const q3_cpu_ops *c = q3_cpu_ops_active();
    const int64_t R = n_seqs * sh->L, D = sh->head_dim, KVD = (int64_t)sh->kv_heads * D;
    c->rmsnorm(q, q, q_norm, w_dt, R * sh->heads, D, eps);
    c->rmsnorm(k, k, k_norm, w_dt, R * sh->kv_heads, D, eps);
    c->rope(q, pos, R, sh->heads, (int)D, inv_freq, scale);
    c->rope(k, pos, R, sh->kv_heads, (int)D, inv_freq, scale);
    for (int s = 0; s < n_seqs; s++) {
        c->kv_write((void *)seqs[s].k, sh->kv_dtype, k + s * sh->L * KVD, KVD, sh->L, sh->kv_heads, (int)D,
                    sh->capacity, seqs[s].n_past);
        c->kv_write((void *)seqs[s].v, sh->kv_dtype, v + s * sh->L * KVD, KVD, sh->L, sh->kv_heads, (int)D,
                    sh->capacity, seqs[s].n_past);
    }
}

void q3_add_rmsnorm_host(float *out, float *x, const float *r, const void *w, q3_dtype w_dt, int64_t rows,
                         int64_t n, float eps) {
    for (int64_t i = 0; i < rows * n; i++) x[i] += r[i];
    q3_cpu_ops_active()->rmsnorm(out, x, w, w_dt, rows, n, eps);
}

void q3_decode_prepare_host(q3_attn_seq *seqs, int64_t *pos, int64_t *lengths, int n_seqs) {
    for (int s = 0; s < n_seqs; s++) {
        const int64_t n = lengths[s];
        seqs[s].n_past = n;
        pos[s] = n >= seqs[s].start ? seqs[s].first_pos + n - seqs[s].start : 0;
        lengths[s] = n + 1;
    }
}

void q3_moe_route_host(int64_t *offsets, int32_t *rows, float *weights, int32_t *active, int32_t *slot,
                       const int32_t *idx, const float *w, int64_t T, int k, int E) {
    q3_cpu_ops_active()->moe_group(offsets, rows, weights, idx, w, T, k, E);
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

int q3_moe_gate_up_host(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                        const int32_t *active, const void *const *gate, const void *const *up, q3_dtype w_dt,
                        int64_t I, int64_t K) {
    const q3_cpu_ops *c = q3_cpu_ops_active();
    const int64_t most = most_slots(offsets, active);
    float *xe = malloc((size_t)(most * K + most * I + 1) * sizeof(float));
    if (!xe) return 1;
    float *upv = xe + most * K;
    for (int a = 0; a < active[0]; a++) {
        const int e = active[1 + a];
        const int64_t first = offsets[e], n = offsets[e + 1] - first;
        c->gather_rows(xe, x, rows + first, n, K);
        c->matmul(act + first * I, xe, gate[e], w_dt, n, I, K, 0, NULL);
        c->matmul(upv, xe, up[e], w_dt, n, I, K, 0, NULL);
        c->swiglu(act + first * I, act + first * I, upv, n * I);
    }
    free(xe);
    return 0;
}

void q3_moe_down_host(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                      const void *const *down, q3_dtype w_dt, int64_t N, int64_t K) {
    for (int a = 0; a < active[0]; a++) {
        const int e = active[1 + a];
        const int64_t first = offsets[e], n = offsets[e + 1] - first;
        q3_cpu_ops_active()->matmul(y + first * N, act + first * K, down[e], w_dt, n, N, K, 0, NULL);
    }
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

/* n rows of src (row i: src + (rows ? rows[i] : i) * K) rounded to bf16 values, as the tensor
 * cores read them */
static void rows_as_bf16(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t K) {
    for (int64_t i = 0; i < n; i++) {
        const float *r = src + (rows ? rows[i] : i) * K;
        for (int64_t c = 0; c < K; c++) dst[i * K + c] = q3_bf16_to_f32(q3_f32_to_bf16(r[c]));
    }
}

int q3_matmul_tc_host(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K, int accumulate) {
    float *xr = malloc((size_t)(T * K + 1) * sizeof(float));
    if (!xr) return 1;
    rows_as_bf16(xr, x, NULL, T, K);
    q3_cpu_ops_active()->matmul(y, xr, w, Q3_BF16, T, N, K, accumulate, NULL);
    free(xr);
    return 0;
}

int q3_moe_gate_up_tc_host(float *act, const float *x, const int32_t *rows, const q3_moe_tile *tiles, int n_tiles,
                           const void *const *gate, const void *const *up, int64_t I, int64_t K) {
    const q3_cpu_ops *c = q3_cpu_ops_active();
    float *xe = malloc((size_t)Q3_MOE_TILE_ROWS * (size_t)(K + I) * sizeof(float));
    if (!xe) return 1;
    float *upv = xe + Q3_MOE_TILE_ROWS * K;
    for (int i = 0; i < n_tiles; i++) {
        const q3_moe_tile t = tiles[i];
        float *out = act + (int64_t)t.first * I;
        rows_as_bf16(xe, x, rows + t.first, t.rows, K);
        c->matmul(out, xe, gate[t.expert], Q3_BF16, t.rows, I, K, 0, NULL);
        c->matmul(upv, xe, up[t.expert], Q3_BF16, t.rows, I, K, 0, NULL);
        c->swiglu(out, out, upv, t.rows * I);
    }
    free(xe);
    return 0;
}

int q3_moe_down_tc_host(float *y, const float *act, const q3_moe_tile *tiles, int n_tiles, const void *const *down,
                        int64_t N, int64_t K) {
    float *ab = malloc((size_t)Q3_MOE_TILE_ROWS * (size_t)K * sizeof(float));
    if (!ab) return 1;
    for (int i = 0; i < n_tiles; i++) {
        const q3_moe_tile t = tiles[i];
        rows_as_bf16(ab, act + (int64_t)t.first * K, NULL, t.rows, K);
        q3_cpu_ops_active()->matmul(y + (int64_t)t.first * N, ab, down[t.expert], Q3_BF16, t.rows, N, K, 0, NULL);
    }
    free(ab);
    return 0;
}

void q3_moe_combine_csr_host(float *x, const float *y, const float *weights, const int32_t *tokens,
                             const int32_t *ptr, const int32_t *slot, int n, int64_t H) {
    for (int i = 0; i < n; i++)
        for (int32_t j = ptr[i]; j < ptr[i + 1]; j++)
            for (int64_t c = 0; c < H; c++) x[(int64_t)tokens[i] * H + c] += weights[slot[j]] * y[(int64_t)slot[j] * H + c];
}

int q3_matmul_fp8_host(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t T,
                       int64_t N, int64_t K, int accumulate) {
    const int64_t n = q3_matmul_fp8_scratch_floats(T, K);
    float *scratch = n ? malloc((size_t)n * sizeof(float)) : NULL;
    if (n && !scratch) return 1;
    q3_cpu_ops_active()->matmul_fp8(y, x, w, scale, sdt, T, N, K, accumulate, scratch, 1);
    free(scratch);
    return 0;
}

int q3_fp8_dequant_host(uint16_t *dst, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t N, int64_t K) {
    float *row = malloc((size_t)(K ? K : 1) * sizeof(float));
    if (!row) return 1;
    for (int64_t n = 0; n < N; n++) {
        q3_fp8_dequant_rows(row, w, scale, sdt, n, 1, K);
        for (int64_t j = 0; j < K; j++) dst[n * K + j] = q3_f32_to_bf16(row[j]);
    }
    free(row);
    return 0;
}

int q3_moe_gate_up_fp8_host(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                            const int32_t *active, const uint8_t *const *gate, const uint8_t *const *up,
                            const void *const *gate_scale, const void *const *up_scale, q3_dtype sdt, int64_t I,
                            int64_t K) {
    const q3_cpu_ops *c = q3_cpu_ops_active();
    const int64_t most = most_slots(offsets, active);
    float *xe = malloc((size_t)(most * K + most * I + 1) * sizeof(float));
    if (!xe) return 1;
    float *upv = xe + most * K;
    int bad = 0;
    for (int a = 0; a < active[0] && !bad; a++) {
        const int e = active[1 + a];
        const int64_t first = offsets[e], n = offsets[e + 1] - first;
        c->gather_rows(xe, x, rows + first, n, K);
        bad = q3_matmul_fp8_host(act + first * I, xe, gate[e], gate_scale[e], sdt, n, I, K, 0) ||
              q3_matmul_fp8_host(upv, xe, up[e], up_scale[e], sdt, n, I, K, 0);
        c->swiglu(act + first * I, act + first * I, upv, n * I);
    }
    free(xe);
    return bad;
}

int q3_moe_down_fp8_host(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                         const uint8_t *const *down, const void *const *down_scale, q3_dtype sdt, int64_t N,
                         int64_t K) {
    for (int a = 0; a < active[0]; a++) {
        const int e = active[1 + a];
        const int64_t first = offsets[e], n = offsets[e + 1] - first;
        if (q3_matmul_fp8_host(y + first * N, act + first * K, down[e], down_scale[e], sdt, n, N, K, 0)) return 1;
    }
    return 0;
}

/* The MoE's routing and row movement (cpu_ops.h): the router's top-k (tied logits too: the tie
 * rule is the same on every path, kernels/router.h), the grouping by expert, and the gathers
 * and scatters between a call's tokens and an expert's rows. All bit for bit but the router's
 * weights (a softmax: fp32 rounding) and scatter_add_rows (a multiply-add a path may fuse). */
#include "cpu_ops.h"

/* n row indices in [0, R), from the stream `seed`: distinct (a prefix of a shuffle) or not */
static int32_t *row_indices(ops_run *r, int64_t n, int64_t R, int distinct, uint64_t seed) {
    int32_t *rows = ops_alloc(r, (size_t)(n > R ? n : R) * 4);
    if (!rows) return NULL;
    for (int64_t i = 0; i < R; i++) rows[i] = (int32_t)i;
    for (int64_t i = 0; i < n; i++) {
        if (!distinct) {
            rows[i] = (int32_t)(q3_mix64(seed + i) % (uint64_t)R);
            continue;
        }
        const int64_t j = i + (int64_t)(q3_mix64(seed + i) % (uint64_t)(R - i));
        const int32_t keep = rows[i];
        rows[i] = rows[j];
        rows[j] = keep;
    }
    return rows;
}

static const struct {
    int64_t T;
    int E, k, normalize, ties;
} ROUTER[] = {{17, 10, 3, 1, 0}, {17, 60, 8, 0, 0}, {5, 128, 8, 1, 0}, {1, 60, 1, 0, 0}, {9, 4096, 32, 1, 0},
              {23, 60, 8, 1, 1}, {7, 10, 4, 0, 1}};

/* logits [T, E]: random, or with ties in halves of a unit (token 0 all equal) */
static float *router_logits(ops_run *r, int64_t T, int E, int ties, uint64_t seed) {
    float *logits = ops_random(r, T * E, Q3_F32, seed, 2.0f);
    for (int64_t i = 0; logits && ties && i < T * E; i++) logits[i] = i < E ? 0.5f : roundf(logits[i] * 2.0f) / 2.0f;
    return logits;
}

void ops_router_topk(ops_run *r) {
    for (int i = 0; i < (int)(sizeof ROUTER / sizeof ROUTER[0]); i++) {
        const int64_t T = ROUTER[i].T, n = T * ROUTER[i].k;
        const int E = ROUTER[i].E, k = ROUTER[i].k;
        float *logits = router_logits(r, T, E, ROUTER[i].ties, 900 + i);
        int32_t *idx = ops_alloc(r, (size_t)n * 4), *idx_ref = ops_alloc(r, (size_t)n * 4);
        float *w = ops_alloc(r, (size_t)n * 4), *w_ref = ops_alloc(r, (size_t)n * 4);
        if (r->oom) return ops_check_bits(r, "router", NULL, NULL, 0);
        r->ref->router_topk(idx_ref, w_ref, logits, T, E, k, ROUTER[i].normalize);
        r->path->router_topk(idx, w, logits, T, E, k, ROUTER[i].normalize);
        char label[96];
        snprintf(label, sizeof label, "T=%lld E=%d k=%d%s%s", (long long)T, E, k,
                 ROUTER[i].normalize ? ", renormalised" : "", ROUTER[i].ties ? ", tied logits" : "");
        ops_check_bits(r, label, idx, idx_ref, (size_t)n * 4);
        ops_check_f32(r, label, w, w_ref, n, 1e-6);
        ops_release(r);
    }
}

void ops_moe_group(ops_run *r) {
    static const int64_t shapes[][3] = {{37, 3, 10}, {1, 8, 128}, {64, 8, 60}, {5, 4, 4}}; /* T, k, E */
    for (int i = 0; i < 4; i++) {
        const int64_t T = shapes[i][0], n = T * shapes[i][1];
        const int k = (int)shapes[i][1], E = (int)shapes[i][2];
        float *logits = router_logits(r, T, E, 0, 950 + i), *w = ops_alloc(r, (size_t)n * 4);
        int32_t *idx = ops_alloc(r, (size_t)n * 4);
        int64_t *off = ops_alloc(r, (size_t)(E + 1) * 8), *off_ref = ops_alloc(r, (size_t)(E + 1) * 8);
        int32_t *rows = ops_alloc(r, (size_t)n * 4), *rows_ref = ops_alloc(r, (size_t)n * 4);
        float *weights = ops_alloc(r, (size_t)n * 4), *weights_ref = ops_alloc(r, (size_t)n * 4);
        if (r->oom) return ops_check_bits(r, "moe_group", NULL, NULL, 0);
        r->ref->router_topk(idx, w, logits, T, E, k, 1);
        r->ref->moe_group(off_ref, rows_ref, weights_ref, idx, w, T, k, E);
        r->path->moe_group(off, rows, weights, idx, w, T, k, E);
        char label[64];
        snprintf(label, sizeof label, "T=%lld k=%d E=%d", (long long)T, k, E);
        ops_check_bits(r, label, off, off_ref, (size_t)(E + 1) * 8);
        ops_check_bits(r, label, rows, rows_ref, (size_t)n * 4);
        ops_check_bits(r, label, weights, weights_ref, (size_t)n * 4);
        ops_release(r);
    }
}

static const int64_t ROW_SHAPES[][3] = {{29, 41, 77}, {64, 1, 4096}, {7, 7, 3}}; /* rows T, moved n, width H */

void ops_gather_rows(ops_run *r) {
    for (int i = 0; i < 3; i++) {
        const int64_t T = ROW_SHAPES[i][0], n = ROW_SHAPES[i][1], H = ROW_SHAPES[i][2];
        float *src = ops_random(r, T * H, Q3_F32, 960 + i, 1.0f);
        float *got = ops_alloc(r, (size_t)(n * H) * 4), *want = ops_alloc(r, (size_t)(n * H) * 4);
        const int32_t *rows = row_indices(r, n, T, 0, 970 + i);
        if (r->oom) return ops_check_bits(r, "gather_rows", NULL, NULL, 0);
        r->ref->gather_rows(want, src, rows, n, H);
        r->path->gather_rows(got, src, rows, n, H);
        char label[64];
        snprintf(label, sizeof label, "%lld of %lld rows of %lld", (long long)n, (long long)T, (long long)H);
        ops_check_bits(r, label, got, want, (size_t)(n * H) * 4);
        ops_release(r);
    }
}

void ops_scatter_add_rows(ops_run *r) {
    for (int i = 0; i < 3; i++) {
        const int64_t T = ROW_SHAPES[i][0] + 13, n = ROW_SHAPES[i][1] < T ? ROW_SHAPES[i][1] : T, H = ROW_SHAPES[i][2];
        float *want = ops_random(r, T * H, Q3_F32, 980 + i, 1.0f), *got = ops_alloc(r, (size_t)(T * H) * 4);
        const float *src = ops_random(r, n * H, Q3_F32, 985 + i, 1.0f), *scale = ops_random(r, n, Q3_F32, 990 + i, 1.0f);
        const int32_t *rows = row_indices(r, n, T, 1, 995 + i);
        if (r->oom) return ops_check_f32(r, "scatter_add_rows", NULL, NULL, 0, 0);
        memcpy(got, want, (size_t)(T * H) * 4);
        r->ref->scatter_add_rows(want, src, rows, scale, n, H);
        r->path->scatter_add_rows(got, src, rows, scale, n, H);
        char label[64];
        snprintf(label, sizeof label, "%lld distinct of %lld rows of %lld", (long long)n, (long long)T, (long long)H);
        ops_check_f32(r, label, got, want, T * H, 1e-6);
        ops_release(r);
    }
}

void ops_take_rows(ops_run *r) {
    for (int i = 0; i < 9; i++) {
        const q3_dtype dt = OPS_FLOATS[i % 3];
        const int64_t R = ROW_SHAPES[i / 3][0], n = ROW_SHAPES[i / 3][1], H = ROW_SHAPES[i / 3][2];
        const size_t bytes = (size_t)(n * H) * q3_dtype_size(dt);
        const void *src = ops_random(r, R * H, dt, 1000 + i, 1.0f);
        void *got = ops_alloc(r, bytes), *want = ops_alloc(r, bytes);
        const int32_t *rows = row_indices(r, n, R, 0, 1010 + i);
        if (r->oom) return ops_check_bits(r, "take_rows", NULL, NULL, 0);
        r->ref->take_rows(want, src, dt, rows, n, H);
        r->path->take_rows(got, src, dt, rows, n, H);
        char label[64];
        snprintf(label, sizeof label, "%s, %lld of %lld rows of %lld", ops_dt(dt), (long long)n,
                 (long long)R, (long long)H);
        ops_check_bits(r, label, got, want, bytes);
        ops_release(r);
    }
}

/* rows named more than once too: their parts add in turn (kernels/rows.h) */
void ops_add_rows(ops_run *r) {
    for (int i = 0; i < 9; i++) {
        const q3_dtype dt = OPS_FLOATS[i % 3];
        const int64_t R = ROW_SHAPES[i / 3][0], n = ROW_SHAPES[i / 3][1], H = ROW_SHAPES[i / 3][2];
        float *want = ops_random(r, R * H, Q3_F32, 1020 + i, 1.0f), *got = ops_alloc(r, (size_t)(R * H) * 4);
        const void *src = ops_random(r, n * H, dt, 1030 + i, 1.0f);
        const int32_t *rows = row_indices(r, n, R, 0, 1040 + i);
        if (r->oom) return ops_check_bits(r, "add_rows", NULL, NULL, 0);
        memcpy(got, want, (size_t)(R * H) * 4);
        r->ref->add_rows(want, src, dt, rows, n, H);
        r->path->add_rows(got, src, dt, rows, n, H);
        char label[64];
        snprintf(label, sizeof label, "%s, %lld into %lld rows of %lld", ops_dt(dt), (long long)n,
                 (long long)R, (long long)H);
        ops_check_bits(r, label, got, want, (size_t)(R * H) * 4);
        ops_release(r);
    }
}

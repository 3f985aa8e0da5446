/* The emulated device's launchers: each one packs its arguments (host structs passed by
 * pointer are copied, as a kernel launch copies its parameters) and hands them to
 * q3_emu_submit, which runs the CPU twin now or records it for a graph. */
#include <stdlib.h>

#include "../engine/cpu_dispatch.h"
#include "emulated_device.h"
#include "twins.h"

static const q3_cpu_ops *cpu(void) { return q3_cpu_ops_active(); }

#define SUBMIT(run, ...)                                            \
    do {                                                            \
        const run##_args a_ = {__VA_ARGS__};                        \
        return q3_emu_submit(run, &a_, sizeof a_);                  \
    } while (0)

typedef struct { float *out, *x; const float *r; const void *w; q3_dtype dt; int64_t rows, n; float eps; } rmsnorm_run_args;
static int rmsnorm_run(const void *p) {
    const rmsnorm_run_args *a = p;
    if (a->x) q3_add_rmsnorm_host(a->out, a->x, a->r, a->w, a->dt, a->rows, a->n, a->eps);
    else cpu()->rmsnorm(a->out, a->r, a->w, a->dt, a->rows, a->n, a->eps);
    return 0;
}
static int rmsnorm(float *o, const float *x, const void *w, q3_dtype dt, int64_t r, int64_t n, float eps, void *s) {
    (void)s;
    SUBMIT(rmsnorm_run, o, NULL, x, w, dt, r, n, eps);
}
static int add_rmsnorm(float *o, float *x, const float *r, const void *w, q3_dtype dt, int64_t rows, int64_t n,
                       float eps, void *s) {
    (void)s;
    SUBMIT(rmsnorm_run, o, x, r, w, dt, rows, n, eps);
}

/* matmul, gate_up and the tensor-core matmul (which sees x rounded to bf16) */
typedef struct { float *y; const float *x; const void *w, *w2; q3_dtype dt; int64_t T, N, K; int acc, kind; } matmul_run_args;
enum { PLAIN, GATE_UP, BF16_X };
static int matmul_run(const void *p) {
    const matmul_run_args *a = p;
    if (a->kind == BF16_X) return q3_matmul_tc_host(a->y, a->x, a->w, a->T, a->N, a->K, a->acc);
    if (a->kind == PLAIN) {
        cpu()->matmul(a->y, a->x, a->w, a->dt, a->T, a->N, a->K, a->acc, NULL);
        return 0;
    }
    float *up = malloc((size_t)(a->T * a->N) * sizeof(float));
    if (!up) return 2;
    cpu()->matmul(a->y, a->x, a->w, a->dt, a->T, a->N, a->K, 0, NULL);
    cpu()->matmul(up, a->x, a->w2, a->dt, a->T, a->N, a->K, 0, NULL);
    cpu()->swiglu(a->y, a->y, up, a->T * a->N);
    free(up);
    return 0;
}
static int matmul(float *y, const float *x, const void *w, q3_dtype dt, int64_t T, int64_t N, int64_t K, int acc,
                  void *s) {
    (void)s;
    SUBMIT(matmul_run, y, x, w, NULL, dt, T, N, K, acc, PLAIN);
}
static int gate_up(float *act, const float *x, const void *g, const void *u, q3_dtype dt, int64_t T, int64_t I,
                   int64_t K, void *s) {
    (void)s;
    SUBMIT(matmul_run, act, x, g, u, dt, T, I, K, 0, GATE_UP);
}
static int matmul_tc(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K, int acc, uint16_t *xb,
                     void *s) {
    (void)s;
    (void)xb;
    SUBMIT(matmul_run, y, x, w, NULL, Q3_BF16, T, N, K, acc, BF16_X);
}

typedef struct {
    float *q, *k;
    const float *v;
    const void *qn, *kn;
    q3_dtype dt;
    const int64_t *pos;
    const q3_attn_seq *seqs;
    int n;
    q3_attn_shape sh;
    float eps, theta;
} qk_rope_kv_run_args;
static int qk_rope_kv_run(const void *p) {
    const qk_rope_kv_run_args *a = p;
    q3_qk_rope_kv_host(a->q, a->k, a->v, a->qn, a->kn, a->dt, a->pos, a->seqs, a->n, &a->sh, a->eps, a->theta);
    return 0;
}
static int qk_rope_kv(float *q, float *k, const float *v, const void *qn, const void *kn, q3_dtype dt,
                      const int64_t *pos, const q3_attn_seq *seqs, int n, const q3_attn_shape *sh, float eps,
                      float theta, void *s) {
    (void)s;
    SUBMIT(qk_rope_kv_run, q, k, v, qn, kn, dt, pos, seqs, n, *sh, eps, theta);
}

typedef struct { float *out; const float *q; const q3_attn_seq *seqs; int n; q3_attn_shape sh; } attention_run_args;
static int attention_run(const void *p) {
    const attention_run_args *a = p;
    float *scratch = malloc((size_t)q3_attention_scratch_floats(&a->sh) * sizeof(float));
    if (!scratch) return 2;
    cpu()->attention(a->out, a->q, a->seqs, a->n, &a->sh, scratch, 1);
    free(scratch);
    return 0;
}
static int attention(float *out, const float *q, const q3_attn_seq *seqs, int n, const q3_attn_shape *sh,
                     float *partial, void *s) {
    (void)s;
    (void)partial;
    SUBMIT(attention_run, out, q, seqs, n, *sh);
}

typedef struct { int32_t *idx; float *w; const float *lg; int64_t T; int E, k, norm; } router_run_args;
static int router_run(const void *p) {
    const router_run_args *a = p;
    cpu()->router_topk(a->idx, a->w, a->lg, a->T, a->E, a->k, a->norm);
    return 0;
}
static int router(int32_t *idx, float *w, const float *lg, int64_t T, int E, int k, int norm, void *s) {
    (void)s;
    SUBMIT(router_run, idx, w, lg, T, E, k, norm);
}

/* swiglu, gather_rows, scatter_add_rows, conversions: element- and row-wise */
typedef struct { void *dst; const void *a, *b; const int32_t *rows; int64_t n, H; q3_dtype dt; int kind; } rows_run_args;
enum { SWIGLU, GATHER, SCATTER, TO_F32, FROM_F32 };
static int rows_run(const void *p) {
    const rows_run_args *a = p;
    switch (a->kind) {
    case SWIGLU: cpu()->swiglu(a->dst, a->a, a->b, a->n); break;
    case GATHER: cpu()->gather_rows(a->dst, a->a, a->rows, a->n, a->H); break;
    case SCATTER: cpu()->scatter_add_rows(a->dst, a->a, a->rows, a->b, a->n, a->H); break;
    case TO_F32: cpu()->to_f32(a->dst, a->a, a->dt, a->n); break;
    default: cpu()->from_f32(a->dst, a->dt, a->a, a->n); break;
    }
    return 0;
}
static int swiglu(float *act, const float *g, const float *u, int64_t n, void *s) {
    (void)s;
    SUBMIT(rows_run, act, g, u, NULL, n, 0, Q3_F32, SWIGLU);
}
static int gather(float *d, const float *src, const int32_t *rows, int64_t n, int64_t H, void *s) {
    (void)s;
    SUBMIT(rows_run, d, src, NULL, rows, n, H, Q3_F32, GATHER);
}
static int scatter(float *d, const float *src, const int32_t *rows, const float *sc, int64_t n, int64_t H, void *s) {
    (void)s;
    SUBMIT(rows_run, d, src, sc, rows, n, H, Q3_F32, SCATTER);
}
static int to_f32(float *d, const void *src, q3_dtype dt, int64_t n, void *s) {
    (void)s;
    SUBMIT(rows_run, d, src, NULL, NULL, n, 0, dt, TO_F32);
}
static int from_f32(void *d, q3_dtype dt, const float *src, int64_t n, void *s) {
    (void)s;
    SUBMIT(rows_run, d, src, NULL, NULL, n, 0, dt, FROM_F32);
}

/* ---- decode without the host ---- */
typedef struct { q3_attn_seq *seqs; int64_t *pos, *lengths; int n; } prepare_run_args;
static int prepare_run(const void *p) {
    const prepare_run_args *a = p;
    q3_decode_prepare_host(a->seqs, a->pos, a->lengths, a->n);
    return 0;
}
static int decode_prepare(q3_attn_seq *seqs, int64_t *pos, int64_t *lengths, int n, void *s) {
    (void)s;
    SUBMIT(prepare_run, seqs, pos, lengths, n);
}

typedef struct {
    int64_t *offsets;
    int32_t *rows;
    float *weights;
    int32_t *active, *slot;
    const int32_t *idx;
    const float *w;
    int64_t T;
    int k, E;
} route_run_args;
static int route_run(const void *p) {
    const route_run_args *a = p;
    q3_moe_route_host(a->offsets, a->rows, a->weights, a->active, a->slot, a->idx, a->w, a->T, a->k, a->E);
    return 0;
}
static int moe_route(int64_t *offsets, int32_t *rows, float *weights, int32_t *active, int32_t *slot,
                     const int32_t *idx, const float *w, int64_t T, int k, int E, void *s) {
    (void)s;
    SUBMIT(route_run, offsets, rows, weights, active, slot, idx, w, T, k, E);
}

typedef struct {
    float *out;
    const float *in;
    const int32_t *rows;
    const int64_t *offsets;
    const int32_t *active;
    const void *const *w1, *const *w2;
    q3_dtype dt;
    int64_t N, K;
} experts_run_args;
static int experts_run(const void *p) {
    const experts_run_args *a = p;
    if (a->rows) return q3_moe_gate_up_host(a->out, a->in, a->rows, a->offsets, a->active, a->w1, a->w2, a->dt, a->N, a->K);
    q3_moe_down_host(a->out, a->in, a->offsets, a->active, a->w1, a->dt, a->N, a->K);
    return 0;
}
static int moe_gate_up(float *act, const float *x, const int32_t *rows, const int64_t *offsets, const int32_t *active,
                       const void *const *gate, const void *const *up, q3_dtype dt, int max_active, int64_t I,
                       int64_t K, void *s) {
    (void)s;
    (void)max_active;
    SUBMIT(experts_run, act, x, rows, offsets, active, gate, up, dt, I, K);
}
static int moe_down(float *y, const float *act, const int64_t *offsets, const int32_t *active, const void *const *down,
                    q3_dtype dt, int max_active, int64_t N, int64_t K, void *s) {
    (void)s;
    (void)max_active;
    SUBMIT(experts_run, y, act, NULL, offsets, active, down, NULL, dt, N, K);
}

typedef struct { float *x; const float *y, *w; const int32_t *slot; int64_t T; int k; int64_t H; } combine_run_args;
static int combine_run(const void *p) {
    const combine_run_args *a = p;
    q3_moe_combine_host(a->x, a->y, a->w, a->slot, a->T, a->k, a->H);
    return 0;
}
static int moe_combine(float *x, const float *y, const float *w, const int32_t *slot, int64_t T, int k, int64_t H,
                       void *s) {
    (void)s;
    SUBMIT(combine_run, x, y, w, slot, T, k, H);
}

/* ---- prefill MoE, grouped on the host ---- */
typedef struct {
    float *out;
    const float *in;
    const int32_t *rows;
    const q3_moe_tile *tiles;
    int n_tiles;
    const void *const *w1, *const *w2;
    int64_t N, K;
} tiles_run_args;
static int tiles_run(const void *p) {
    const tiles_run_args *a = p;
    if (a->w2) return q3_moe_gate_up_tc_host(a->out, a->in, a->rows, a->tiles, a->n_tiles, a->w1, a->w2, a->N, a->K);
    return q3_moe_down_tc_host(a->out, a->in, a->tiles, a->n_tiles, a->w1, a->N, a->K);
}
static int moe_gate_up_tc(float *act, const float *x, const int32_t *rows, const q3_moe_tile *tiles, int n_tiles,
                          const void *const *gate, const void *const *up, int64_t I, int64_t K, void *s) {
    (void)s;
    SUBMIT(tiles_run, act, x, rows, tiles, n_tiles, gate, up, I, K);
}
static int moe_down_tc(float *y, const float *act, const q3_moe_tile *tiles, int n_tiles, const void *const *down,
                       int64_t N, int64_t K, void *s) {
    (void)s;
    SUBMIT(tiles_run, y, act, NULL, tiles, n_tiles, down, NULL, N, K);
}

typedef struct { float *x; const float *y, *w; const int32_t *tokens, *ptr, *slot; int n; int64_t H; } csr_run_args;
static int csr_run(const void *p) {
    const csr_run_args *a = p;
    q3_moe_combine_csr_host(a->x, a->y, a->w, a->tokens, a->ptr, a->slot, a->n, a->H);
    return 0;
}
static int moe_combine_csr(float *x, const float *y, const float *w, const int32_t *tokens, const int32_t *ptr,
                           const int32_t *slot, int n, int64_t H, void *s) {
    (void)s;
    SUBMIT(csr_run, x, y, w, tokens, ptr, slot, n, H);
}

void q3_emu_kernels(q3_cuda_ops *t) {
    t->rmsnorm = rmsnorm;
    t->add_rmsnorm = add_rmsnorm;
    t->matmul = matmul;
    t->gate_up = gate_up;
    t->matmul_tc = matmul_tc;
    t->matmul_wmma = matmul_tc;
    t->qk_rope_kv = qk_rope_kv;
    t->attention = attention;
    t->router_topk = router;
    t->swiglu = swiglu;
    t->gather_rows = gather;
    t->scatter_add_rows = scatter;
    t->to_f32 = to_f32;
    t->from_f32 = from_f32;
    t->decode_prepare = decode_prepare;
    t->moe_route = moe_route;
    t->moe_gate_up = moe_gate_up;
    t->moe_down = moe_down;
    t->moe_combine = moe_combine;
    t->moe_gate_up_tc = moe_gate_up_tc;
    t->moe_down_tc = moe_down_tc;
    t->moe_combine_csr = moe_combine_csr;
}

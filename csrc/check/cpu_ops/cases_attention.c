/* The attention block's cases (cpu_ops.h): attention and its maps on a prefill, decode steps
 * over more than one key tile, a chunk after cached tokens, left padding (queries inside it),
 * sequences of different lengths in one call, hidden keys (holes, hidden runs, a sequence's
 * first keys hidden), a call's tree mask, group sizes 1 to 6, head dims 20 to 128, fp32
 * and bf16 caches; the KV append; RoPE at small and far positions. Errors: max |got - want| /
 * max |want|; the tolerances are fp32's with room for the paths' other orders of summation
 * and their vector exp (kernels/cpu/vec.h). */
#include "cpu_ops.h"

#define ATTN_TOL 1e-5
#define MAX_SEQS 3

enum { PLAIN, HIDDEN, TREE }; /* what a case hides besides causality and padding */

typedef struct {
    const char *what;
    int n_seqs;
    int64_t L, past[MAX_SEQS], start[MAX_SEQS];
    int Hq, Hkv, D;
    q3_dtype dt;
    int mask;
} attn_case;

static const attn_case CASES[] = {
    {"prefill", 1, 37, {0}, {0}, 6, 2, 20, Q3_BF16, PLAIN},
    {"decode over 3 key tiles", 3, 1, {70, 5, 130}, {0}, 8, 2, 64, Q3_BF16, PLAIN},
    {"chunk after cached tokens", 2, 13, {50, 19}, {0}, 4, 4, 24, Q3_F32, PLAIN},
    {"left padding", 2, 9, {0, 12}, {5, 3}, 12, 2, 20, Q3_BF16, PLAIN},
    {"long context", 1, 5, {300}, {0}, 6, 2, 128, Q3_F32, PLAIN},
    {"hidden keys", 3, 9, {0, 12, 70}, {0, 2, 0}, 8, 2, 24, Q3_BF16, HIDDEN},
    {"decode over hidden keys", 3, 1, {70, 5, 130}, {0, 1, 0}, 4, 1, 20, Q3_F32, HIDDEN},
    {"tree after cached tokens", 2, 11, {60, 0}, {0}, 6, 2, 20, Q3_BF16, TREE},
    {"prefill", 1, 37, {0}, {0}, 6, 2, 20, Q3_F16, PLAIN},
    {"decode over 3 key tiles", 3, 1, {70, 5, 130}, {0}, 8, 2, 64, Q3_F16, PLAIN},
    {"hidden keys", 3, 9, {0, 12, 70}, {0, 2, 0}, 8, 2, 24, Q3_F16, HIDDEN},
};

/* sequence s's hidden flags [capacity] and first key: every fifth row of a pattern, and the
 * first three rows past its padding in sequence 0 (whose first queries then see only
 * themselves) */
static int64_t hidden_keys(uint8_t *h, const attn_case *c, int s, int64_t capacity) {
    for (int64_t j = 0; j < capacity; j++) h[j] = (j * 7 + s) % 5 == 0 || (s == 0 && j - c->start[s] < 3);
    int64_t first = c->start[s];
    while (first < c->past[s] + c->L && h[first]) first++;
    return first;
}

/* the call's tree [L, L]: token t sees itself and its ancestors, its parent (t - 1) / 2 */
static void tree_of(uint8_t *tree, int64_t L) {
    memset(tree, 0, (size_t)(L * L));
    for (int64_t t = 0; t < L; t++)
        for (int64_t u = t;; u = (u - 1) / 2) {
            tree[t * L + u] = 1;
            if (u == 0) break;
        }
}
#define N_CASES (int)(sizeof CASES / sizeof CASES[0])

/* one call of a case: its shape, caches (random in every row), queries [n_seqs, L, Hq, D] and
 * the most keys a query sees; its label */
typedef struct {
    const attn_case *c;
    q3_attn_shape sh;
    q3_attn_seq seqs[MAX_SEQS];
    float *q;
    int64_t keys;
    char label[96];
} attn_call;

static int attn_setup(ops_run *r, int i, attn_call *a, uint64_t seed) {
    const attn_case *c = a->c = &CASES[i];
    a->keys = 0;
    for (int s = 0; s < c->n_seqs; s++) a->keys = c->past[s] + c->L > a->keys ? c->past[s] + c->L : a->keys;
    a->sh = (q3_attn_shape){c->L, c->Hq, c->Hkv, c->D, a->keys + 5, c->dt, 1.0f / sqrtf((float)c->D), a->keys};
    const int64_t per_seq = (int64_t)c->Hkv * a->sh.capacity * c->D;
    for (int s = 0; s < c->n_seqs; s++) {
        const void *k = ops_random(r, per_seq, c->dt, seed + 2 * s, 1.0f), *v = ops_random(r, per_seq, c->dt, seed + 2 * s + 1, 1.0f);
        a->seqs[s] = (q3_attn_seq){k, v, c->past[s], c->start[s], 0, NULL, c->start[s], NULL, 0, 0};
        if (c->mask == HIDDEN) {
            uint8_t *h = ops_alloc(r, (size_t)a->sh.capacity);
            if (h) a->seqs[s].first_key = hidden_keys(h, c, s, a->sh.capacity);
            a->seqs[s].hidden = h;
        } else if (c->mask == TREE) {
            uint8_t *tree = ops_alloc(r, (size_t)(c->L * c->L));
            if (tree) tree_of(tree, c->L);
            a->seqs[s].tree = tree;
            a->seqs[s].tree_first = c->past[s];
            a->seqs[s].tree_tokens = c->L;
        }
    }
    a->q = ops_random(r, c->n_seqs * c->L * c->Hq * c->D, Q3_F32, seed + 10, 1.0f);
    snprintf(a->label, sizeof a->label, "%s, G=%d D=%d %s cache", c->what, c->Hq / c->Hkv, c->D,
             ops_dt(c->dt));
    return !r->oom;
}

void ops_attention(ops_run *r) {
    for (int i = 0; i < N_CASES; i++) {
        attn_call a;
        const int ok = attn_setup(r, i, &a, 500 + 20 * i);
        const int64_t n = a.c->n_seqs * a.c->L * a.c->Hq * a.c->D;
        float *got = ops_alloc(r, (size_t)n * 4), *want = ops_alloc(r, (size_t)n * 4);
        float *scratch = ops_alloc(r, (size_t)(r->threads * q3_attention_scratch_floats(&a.sh)) * 4);
        if (!ok || r->oom) return ops_check_f32(r, a.label, NULL, NULL, 0, 0);
        r->ref->attention(want, a.q, a.seqs, a.c->n_seqs, &a.sh, scratch, r->threads);
        r->path->attention(got, a.q, a.seqs, a.c->n_seqs, &a.sh, scratch, r->threads);
        ops_check_f32(r, a.label, got, want, n, ATTN_TOL);
        ops_release(r);
    }
}

/* the maps of the same calls as rows 2 .. L + 1 of a call of L + 3 tokens, 3 columns past the
 * longest sequence (both zero there) */
void ops_attention_probs(ops_run *r) {
    for (int i = 0; i < N_CASES; i++) {
        attn_call a;
        const int ok = attn_setup(r, i, &a, 600 + 20 * i);
        const int64_t out_tokens = a.c->L + 3, context = a.keys + 3, n = a.c->n_seqs * a.c->Hq * out_tokens * context;
        float *got = ops_alloc(r, (size_t)n * 4), *want = ops_alloc(r, (size_t)n * 4);
        if (!ok || r->oom) return ops_check_f32(r, a.label, NULL, NULL, 0, 0);
        r->ref->attention_probs(want, a.q, a.seqs, a.c->n_seqs, &a.sh, 2, out_tokens, context, r->threads);
        r->path->attention_probs(got, a.q, a.seqs, a.c->n_seqs, &a.sh, 2, out_tokens, context, r->threads);
        ops_check_f32(r, a.label, got, want, n, ATTN_TOL);
        ops_release(r);
    }
}

/* L tokens into rows [start, start + L) of a cache of capacity rows (the rest random, to stay
 * as they were), read from rows of Hkv * D + 3 floats; bit for bit (bf16: round to nearest even) */
void ops_kv_write(ops_run *r) {
    static const struct {
        int64_t L, capacity, start;
        int Hkv, D;
    } shapes[] = {{7, 13, 4, 3, 20}, {1, 40, 39, 2, 128}, {19, 19, 0, 1, 6}};
    for (int i = 0; i < 9; i++) {
        const q3_dtype dt = OPS_FLOATS[i % 3];
        const int64_t L = shapes[i / 3].L, cap = shapes[i / 3].capacity, start = shapes[i / 3].start;
        const int Hkv = shapes[i / 3].Hkv, D = shapes[i / 3].D;
        const int64_t stride = (int64_t)Hkv * D + 3, n = (int64_t)Hkv * cap * D;
        const size_t bytes = (size_t)n * q3_dtype_size(dt);
        float *src = ops_random(r, L * stride, Q3_F32, 700 + i, 1.0f);
        void *want = ops_random(r, n, dt, 710 + i, 1.0f), *got = ops_alloc(r, bytes);
        if (r->oom) return ops_check_bits(r, "kv_write", NULL, NULL, 0);
        memcpy(got, want, bytes);
        r->ref->kv_write(want, dt, src, stride, L, Hkv, D, cap, start);
        r->path->kv_write(got, dt, src, stride, L, Hkv, D, cap, start);
        char label[96];
        snprintf(label, sizeof label, "%s cache, %lld tokens at row %lld of %lld, %d heads of %d", ops_dt(dt),
                 (long long)L, (long long)start, (long long)cap, Hkv, D);
        ops_check_bits(r, label, got, want, bytes);
        ops_release(r);
    }
}

/* x [7, 3, D] at positions 0 .. 6 and far ones (past sincosf's fast range, up to 2^40), tables
 * of rope_theta 1e6, scale 1 and a YaRN-like 1.2 */
void ops_rope(ops_run *r) {
    static const int64_t far[7] = {100000, ((int64_t)1 << 31) + 5, 1000000000000, ((int64_t)1 << 40) - 1, 987654321,
                                   40959, 3};
    static const int dims[3] = {20, 128, 6};
    for (int i = 0; i < 12; i++) {
        const int D = dims[i % 3], heads = 3, rows = 7;
        const float scale = i / 3 % 2 ? 1.2f : 1.0f;
        int64_t pos[7];
        float inv_freq[64];
        for (int j = 0; j < rows; j++) pos[j] = i / 6 ? far[j] : j;
        for (int j = 0; j < D / 2; j++) inv_freq[j] = (float)pow(1e6, -2.0 * j / D);
        const int64_t n = (int64_t)rows * heads * D;
        float *want = ops_random(r, n, Q3_F32, 800 + i, 1.0f), *got = ops_alloc(r, (size_t)n * 4);
        if (r->oom) return ops_check_f32(r, "rope", NULL, NULL, 0, 0);
        memcpy(got, want, (size_t)n * 4);
        r->ref->rope(want, pos, rows, heads, D, inv_freq, scale);
        r->path->rope(got, pos, rows, heads, D, inv_freq, scale);
        char label[64];
        snprintf(label, sizeof label, "D=%d scale %.1f, %s positions", D, scale, i / 6 ? "far" : "small");
        ops_check_f32(r, label, got, want, n, 1e-6);
        ops_release(r);
    }
}

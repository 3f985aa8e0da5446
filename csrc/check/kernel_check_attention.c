/* The self-check cases of the attention kernels (see kernel_check.c): the fused QK-norm +
 * RoPE + KV write (default, linear and YaRN tables), attention on each of its paths (a block per query token and KV head;
 * split-KV slices and their merge; tensor cores), the attention maps a call may ask for, and
 * a decode step's bookkeeping, each against its twin (the maps: the CPU kernel), on hand-made shapes and on the batches of kernel_check.c's lists
 * (sequences of different lengths, left padding); the runs of attention and its maps over
 * hidden keys that kernel_check_hidden.c lays out, and under the trees of kernel_check_tree.c. */
#include "kernel_check.h"

void q3_check_batch_seqs(const q3_check_batch *b, int64_t *past, int64_t *start) {
    for (int s = 0; s < b->n_seqs; s++) {
        past[s] = b->context * (b->n_seqs - s) / b->n_seqs;
        start[s] = s % 2 == 0 && b->pad > 0 ? b->pad + s : 0;
    }
}

/* The RoPE table of a head dim D, rope_theta 1e6 (Qwen3's) and the variant `type`: linear
 * with factor 4; YaRN with factor 4 over an original 4096 positions (cos and sin scaled by
 * 0.1 ln 4 + 1), as the model card's YaRN with a shorter original window */
static void case_table(int D, q3_rope_type type, float *inv_freq, float *scale) {
    q3_config c = {.head_dim = D, .rope_theta = 1e6, .max_positions = 40960, .rope = Q3_ROPE_SCALING_DEFAULT};
    c.rope.type = type;
    if (type != Q3_ROPE_DEFAULT) c.rope.factor = 4.0;
    if (type == Q3_ROPE_YARN) c.rope.original_max = 4096;
    q3_rope_table(&c, inv_freq, scale);
}

/* the fused QK-norm + RoPE + KV append against its composition, q and both caches: n_seqs
 * sequences of sh->L tokens, token t of sequence s at cache row past[s] + t and at
 * position pos[s * L + t]; RoPE of the variant `type` (case_table) */
static double qk_rope_kv(check *k, const q3_attn_shape *sh, int n_seqs, const int64_t *past, const int64_t *pos,
                         q3_rope_type type) {
    const int D = sh->head_dim;
    float inv_freq[Q3_CUDA_MAX_HEAD_DIM / 2], scale;
    if (D > Q3_CUDA_MAX_HEAD_DIM) return INFINITY;
    case_table(D, type, inv_freq, &scale);
    const int64_t R = n_seqs * sh->L, qn = R * sh->heads * D, kn = R * sh->kv_heads * D;
    const int64_t per_seq = (int64_t)sh->kv_heads * sh->capacity * D, cn = n_seqs * per_seq;
    /* the norms' weights and the cache of the cache's dtype dt (a layer's own, bf16 or fp16) */
    const q3_dtype dt = sh->kv_dtype;
    const size_t es = q3_dtype_size(dt);
    float *q = host_random(k, qn, Q3_F32, 22), *kk = host_random(k, kn, Q3_F32, 23), *v = host_random(k, kn, Q3_F32, 24);
    void *qw = host_random(k, D, dt, 25), *kw = host_random(k, D, dt, 26);
    char *kc = host(k, cn * es), *vc = host(k, cn * es), *kc_got = host(k, cn * es), *vc_got = host(k, cn * es);
    float *q_got = host(k, qn * 4);
    if (k->failed || n_seqs > Q3_CHECK_MAX_SEQS) return INFINITY;
    float *dq = device(k, q, qn * 4), *dk = device(k, kk, kn * 4), *dv = device(k, v, kn * 4);
    void *dqw = device(k, qw, D * es), *dkw = device(k, kw, D * es);
    char *dkc = device(k, kc, cn * es), *dvc = device(k, vc, cn * es);
    int64_t *dpos = device(k, pos, R * sizeof *pos);
    q3_attn_seq hs[Q3_CHECK_MAX_SEQS], ds[Q3_CHECK_MAX_SEQS];
    for (int s = 0; s < n_seqs; s++) {
        const int64_t off = s * per_seq * (int64_t)es;
        hs[s] = (q3_attn_seq){kc + off, vc + off, past[s], 0, 0, NULL, 0, NULL, 0, 0};
        ds[s] = (q3_attn_seq){dkc ? dkc + off : NULL, dvc ? dvc + off : NULL, past[s], 0, 0, NULL, 0, NULL, 0, 0};
    }
    q3_attn_seq *dseqs = device(k, ds, n_seqs * sizeof ds[0]);
    q3_qk_rope_kv_host(q, kk, v, qw, kw, dt, pos, hs, n_seqs, sh, 1e-6f, inv_freq, scale);
    if (!k->failed)
        cuda_ok(k, k->g->qk_rope_kv(dq, dk, dv, dqw, dkw, dt, dpos, dseqs, n_seqs, sh, 1e-6f, inv_freq, scale,
                                    NULL), "qk_rope_kv launch");
    fetch(k, q_got, dq, qn * 4);
    fetch(k, kc_got, dkc, cn * es);
    fetch(k, vc_got, dvc, cn * es);
    if (k->failed) return INFINITY;
    const double e1 = max_err(q_got, q, Q3_F32, qn), e2 = max_err(kc_got, kc, dt, cn), e3 = max_err(vc_got, vc, dt, cn);
    return e1 > e2 ? (e1 > e3 ? e1 : e3) : (e2 > e3 ? e2 : e3);
}

/* 2 sequences of 3 tokens after 4 and 0 cached ones, 6 query heads on 2, a cache of dt */
double q3_case_qk_rope_kv(check *k, int D, q3_dtype dt) {
    const q3_attn_shape sh = {3, 6, 2, D, 12, dt, 1.0f, 0};
    const int64_t past[2] = {4, 0};
    int64_t pos[6];
    for (int64_t r = 0; r < 6; r++) pos[r] = past[r / sh.L] + r % sh.L;
    return qk_rope_kv(k, &sh, 2, past, pos, Q3_ROPE_DEFAULT);
}

/* the shape of q3_case_qk_rope_kv at large positions (the config allows up to 2^40): angles
 * past sincosf's fast range (|a| > 105615), where the kernel reduces them itself; with a
 * linear or YaRN table, all far past their original window too */
double q3_case_qk_rope_kv_far(check *k, int D, q3_rope_type type) {
    const q3_attn_shape sh = {3, 6, 2, D, 12, Q3_BF16, 1.0f, 0};
    const int64_t past[2] = {4, 0};
    const int64_t pos[6] = {100000, ((int64_t)1 << 31) + 5, 1000000000000, Q3_MAX_POSITIONS - 1, 987654321, 40959};
    return qk_rope_kv(k, &sh, 2, past, pos, type);
}

/* 8 query heads on 2; positions count from each sequence's first token past its padding
 * (0 inside it), as the layer gives them */
double q3_case_qk_rope_kv_batch(check *k, const q3_check_batch *b, int D, q3_dtype dt) {
    const q3_attn_shape sh = {b->L, 8, 2, D, b->context + b->L + 3, dt, 1.0f, 0};
    int64_t past[Q3_CHECK_MAX_SEQS], start[Q3_CHECK_MAX_SEQS], pos[Q3_CHECK_MAX_SEQS * 32];
    if (b->n_seqs > Q3_CHECK_MAX_SEQS || b->L > 32) return INFINITY;
    q3_check_batch_seqs(b, past, start);
    for (int s = 0; s < b->n_seqs; s++)
        for (int64_t t = 0; t < b->L; t++) {
            const int64_t n = past[s] + t;
            pos[s * b->L + t] = n >= start[s] ? n - start[s] : 0;
        }
    return qk_rope_kv(k, &sh, b->n_seqs, past, pos, Q3_ROPE_DEFAULT);
}

q3_attn_seq q3_check_attn_seq(const void *k, const void *v, int64_t past, int64_t start, int64_t L,
                              const uint8_t *flags, const uint8_t *mem) {
    q3_attn_seq a = {k, v, past, start, 0, NULL, start, NULL, 0, 0};
    int any = 0;
    for (int64_t j = start; flags && j < past + L; j++) any |= flags[j] != 0;
    if (!any) return a;
    a.hidden = mem;
    while (a.first_key < past + L && flags[a.first_key]) a.first_key++;
    return a;
}

/* key j of one head's rows [rows, D] plus grow * j in every element: with q positive, each
 * key's score is about grow * j * (the sum of q) above the last one's */
static void grow_keys(uint16_t *keys, int64_t rows, int D, float grow) {
    for (int64_t j = 0; j < rows; j++)
        for (int d = 0; d < D; d++)
            keys[j * D + d] = q3_f32_to_bf16(q3_bf16_to_f32(keys[j * D + d]) + grow * (float)j);
}

/* the trees of t [n_seqs, T, T] in device memory, followed by a row of T zero bytes: what a
 * query reading one key past its tree's row (the mask one key too far) finds there */
static const uint8_t *device_tree(check *k, const q3_check_tree *t, int n_seqs) {
    const size_t n = (size_t)n_seqs * (size_t)(t->T * t->T);
    uint8_t *bytes = host(k, n + (size_t)t->T);
    if (k->failed) return NULL;
    memcpy(bytes, t->bytes, n);
    return device(k, bytes, n + (size_t)t->T);
}

/* sequence s's tree of t (NULL: none) into a, its bytes at mem (the memory the kernel reads) */
static void set_tree(q3_attn_seq *a, const q3_check_tree *t, const uint8_t *mem, int s) {
    if (!t || !mem) return;
    a->tree = mem + (size_t)s * (size_t)(t->T * t->T);
    a->tree_first = t->first[s];
    a->tree_tokens = t->T;
}

/* attention of n_seqs sequences of sh->L new tokens after past[s] cached ones, start[s] of
 * them padding, the keys flagged in hidden [n_seqs, ld] hidden (NULL: none), against the CPU
 * kernel. The cache is random in the rows a query sees and a key tile beyond (where an
 * overrun would read), zero past them: a large capacity costs no random fill. The launcher
 * picks the path: more tokens than split-KV takes go to tensor cores where the shape fits; a
 * long max_keys splits. */
static double attention_grown(check *k, const q3_attn_shape *sh, int n_seqs, const int64_t *past,
                              const int64_t *start, const uint8_t *hidden, int64_t ld, float grow,
                              const q3_check_tree *tree) {
    const int64_t per_seq = (int64_t)sh->kv_heads * sh->capacity * sh->head_dim;
    const int64_t qn = n_seqs * sh->L * sh->heads * sh->head_dim;
    const size_t es = q3_dtype_size(sh->kv_dtype);
    char *kc = host(k, n_seqs * per_seq * es), *vc = host(k, n_seqs * per_seq * es);
    float *q = host_random(k, qn, Q3_F32, 11), *want = host(k, qn * 4), *got = host(k, qn * 4);
    float *scratch = host(k, (size_t)q3_attention_scratch_floats(sh) * 4);
    if (k->failed || n_seqs > Q3_CHECK_MAX_SEQS) return INFINITY;
    for (int s = 0; s < n_seqs; s++)
        for (int h = 0; h < sh->kv_heads; h++) {
            const int64_t end = past[s] + sh->L + 64, rows = end < sh->capacity ? end : sh->capacity;
            const int64_t off = (s * per_seq + (int64_t)h * sh->capacity * sh->head_dim) * (int64_t)es;
            const uint64_t stream = 7 + (uint64_t)(s * sh->kv_heads + h);
            k->c->fill_normal(kc + off, sh->kv_dtype, rows * sh->head_dim, 9, stream, 0, 0.0f, 1.0f);
            k->c->fill_normal(vc + off, sh->kv_dtype, rows * sh->head_dim, 10, stream, 0, 0.0f, 1.0f);
            if (grow != 0.0f && sh->kv_dtype == Q3_BF16) grow_keys((uint16_t *)(kc + off), rows, sh->head_dim, grow);
        }
    if (grow != 0.0f) /* positive, and exact in bf16: the tensor-core kernel rounds q to bf16 */
        for (int64_t i = 0; i < qn; i++) q[i] = q3_bf16_to_f32(q3_f32_to_bf16(fabsf(q[i])));
    q3_attn_seq hs[Q3_CHECK_MAX_SEQS], ds[Q3_CHECK_MAX_SEQS];
    char *dk = device(k, kc, n_seqs * per_seq * es), *dv = device(k, vc, n_seqs * per_seq * es);
    uint8_t *dh = hidden ? device(k, hidden, (size_t)(n_seqs * ld)) : NULL;
    const uint8_t *dt = tree ? device_tree(k, tree, n_seqs) : NULL;
    for (int s = 0; s < n_seqs; s++) {
        const int64_t off = s * per_seq * (int64_t)es;
        const uint8_t *flags = hidden ? hidden + s * ld : NULL;
        hs[s] = q3_check_attn_seq(kc + off, vc + off, past[s], start[s], sh->L, flags, flags);
        ds[s] = q3_check_attn_seq(dk ? dk + off : NULL, dv ? dv + off : NULL, past[s], start[s], sh->L, flags,
                                  dh ? dh + s * ld : NULL);
        set_tree(&hs[s], tree, tree ? tree->bytes : NULL, s);
        set_tree(&ds[s], tree, dt, s);
    }
    q3_attn_seq *dseqs = device(k, ds, n_seqs * sizeof ds[0]);
    float *dq = device(k, q, qn * 4), *dout = device(k, NULL, qn * 4);
    float *dpart = device(k, NULL, (size_t)q3_attention_cuda_partial_floats(n_seqs * sh->L, sh) * 4);
    k->c->attention(want, q, hs, n_seqs, sh, scratch, 1);
    if (!k->failed) cuda_ok(k, k->g->attention(dout, dq, dseqs, n_seqs, sh, dpart, NULL), "attention launch");
    fetch(k, got, dout, qn * 4);
    return k->failed ? INFINITY : max_err(got, want, Q3_F32, qn);
}

static double attention(check *k, const q3_attn_shape *sh, int n_seqs, const int64_t *past, const int64_t *start) {
    return attention_grown(k, sh, n_seqs, past, start, NULL, 0, 0.0f, NULL);
}

double q3_case_attention_masked(check *k, const q3_attn_shape *sh, int n_seqs, const int64_t *past,
                                const int64_t *start, const uint8_t *hidden, int64_t ld) {
    return attention_grown(k, sh, n_seqs, past, start, hidden, ld, 0.0f, NULL);
}

double q3_case_attention_tree(check *k, const q3_attn_shape *sh, int n_seqs, const int64_t *past,
                              const int64_t *start, const uint8_t *hidden, int64_t ld, const q3_check_tree *tree) {
    return attention_grown(k, sh, n_seqs, past, start, hidden, ld, 0.0f, tree);
}

/* L query tokens after n_past[s] cached ones, for 2 sequences (the first with pad0 tokens
 * of padding), Hq heads on Hkv of dim D, max_keys exact */
double q3_case_attention_heads(check *k, int64_t L, int64_t past0, int64_t past1, int64_t capacity, int64_t pad0,
                               int Hq, int Hkv, int D) {
    const q3_attn_shape sh = {L, Hq, Hkv, D, capacity, Q3_BF16, 1.0f / sqrtf((float)D), (past0 > past1 ? past0 : past1) + L};
    const int64_t past[2] = {past0, past1}, start[2] = {pad0, 0};
    return attention(k, &sh, 2, past, start);
}

/* Scores that grow along the keys, so that every key tile raises the rows' maxima and the
 * tensor-core kernel's online softmax rescales its output on every tile (grow_keys): L
 * tokens after past0 and 3 cached ones (the first sequence with pad0 of padding), Hq heads
 * on Hkv of dim D. At D = 128, grow 0.01 raises a scaled score by ~0.1 a key (~3 a tile:
 * the earlier tiles still count), grow 0.5 by ~5 a key, to scores of thousands */
double q3_case_attention_growing(check *k, int64_t L, int64_t past0, int64_t pad0, int Hq, int Hkv, int D,
                                 float grow) {
    const int64_t capacity = past0 + L + 8;
    const q3_attn_shape sh = {L, Hq, Hkv, D, capacity, Q3_BF16, 1.0f / sqrtf((float)D), past0 + L};
    const int64_t past[2] = {past0, 3}, start[2] = {pad0, 0};
    return attention_grown(k, &sh, 2, past, start, NULL, 0, grow, NULL);
}

double q3_case_attention(check *k, int64_t L, int64_t past0, int64_t past1, int64_t capacity, int64_t pad0) {
    return q3_case_attention_heads(k, L, past0, past1, capacity, pad0, 8, 2, 24);
}

double q3_case_attention_batch(check *k, const q3_check_batch *b, int G, int D, q3_dtype kv_dt, int64_t bound) {
    int64_t past[Q3_CHECK_MAX_SEQS], start[Q3_CHECK_MAX_SEQS];
    if (b->n_seqs > Q3_CHECK_MAX_SEQS) return INFINITY;
    q3_check_batch_seqs(b, past, start);
    const int64_t most = b->context + b->L; /* the first sequence is the longest */
    const q3_attn_shape sh = {b->L, 2 * G, 2, D, bound ? bound : most + 5, kv_dt, 1.0f / sqrtf((float)D),
                              bound ? bound : most};
    if (sh.capacity < most) return INFINITY;
    return attention(k, &sh, b->n_seqs, past, start);
}

/* The attention maps of one pass against the CPU kernel (kernels/cpu/attention_probs.c, the
 * oracle): c->n_seqs sequences of c->L new tokens after past[s] cached ones, start[s] of them
 * padding, the keys flagged in c->hidden hidden, the pass being rows t0 .. t0 + L - 1 of a call of out_tokens; context = the
 * longest sequence after the pass + extra. The cache is random in every row a query sees
 * and 32 past them (a key past the causal bound, or another head's, changes the row); both
 * outputs start as the same sentinel, so the rows and columns the pass must leave or zero
 * are compared too. */
double q3_case_attention_probs(check *k, const q3_probs_case *c) {
    int64_t context = 0;
    for (int s = 0; s < c->n_seqs; s++) context = c->past[s] + c->L > context ? c->past[s] + c->L : context;
    context += c->extra;
    const q3_attn_shape sh = {c->L, c->Hq, c->Hkv, c->D, context + 8, c->dt, 1.0f / sqrtf((float)c->D), context};
    const int64_t per_seq = (int64_t)sh.kv_heads * sh.capacity * sh.head_dim;
    const int64_t qn = c->n_seqs * c->L * c->Hq * c->D, pn = (int64_t)c->n_seqs * c->Hq * c->out_tokens * context;
    const size_t es = q3_dtype_size(c->dt);
    if (c->n_seqs < 1 || c->n_seqs > Q3_PROBS_MAX_SEQS) return INFINITY;
    char *kc = host(k, c->n_seqs * per_seq * es);
    float *q = host_random(k, qn, Q3_F32, 31), *want = host(k, pn * 4), *got = host(k, pn * 4);
    if (k->failed) return INFINITY;
    for (int64_t i = 0; i < pn; i++) want[i] = -1.0f; /* the sentinel: no probability */
    for (int s = 0; s < c->n_seqs; s++)
        for (int h = 0; h < c->Hkv; h++) {
            const int64_t end = c->past[s] + c->L + 32, rows = end < sh.capacity ? end : sh.capacity;
            const int64_t off = (s * per_seq + (int64_t)h * sh.capacity * c->D) * (int64_t)es;
            k->c->fill_normal(kc + off, c->dt, rows * c->D, 32, 7 + (uint64_t)(s * c->Hkv + h), 0, 0.0f, 1.0f);
        }
    q3_attn_seq hs[Q3_PROBS_MAX_SEQS], ds[Q3_PROBS_MAX_SEQS];
    char *dk = device(k, kc, c->n_seqs * per_seq * es);
    uint8_t *dh = c->hidden ? device(k, c->hidden, (size_t)(c->n_seqs * c->hidden_ld)) : NULL;
    const uint8_t *dt = c->tree ? device_tree(k, c->tree, c->n_seqs) : NULL;
    for (int s = 0; s < c->n_seqs; s++) {
        const int64_t off = s * per_seq * (int64_t)es;
        const uint8_t *flags = c->hidden ? c->hidden + s * c->hidden_ld : NULL;
        hs[s] = q3_check_attn_seq(kc + off, NULL, c->past[s], c->start[s], c->L, flags, flags);
        ds[s] = q3_check_attn_seq(dk ? dk + off : NULL, NULL, c->past[s], c->start[s], c->L, flags,
                                  dh ? dh + s * c->hidden_ld : NULL);
        set_tree(&hs[s], c->tree, c->tree ? c->tree->bytes : NULL, s);
        set_tree(&ds[s], c->tree, dt, s);
    }
    q3_attn_seq *dseqs = device(k, ds, c->n_seqs * sizeof ds[0]);
    float *dq = device(k, q, qn * 4), *dprobs = device(k, want, pn * 4);
    k->c->attention_probs(want, q, hs, c->n_seqs, &sh, c->t0, c->out_tokens, context, 1);
    if (!k->failed)
        cuda_ok(k, k->g->attention_probs(dprobs, dq, dseqs, c->n_seqs, &sh, c->t0, c->out_tokens, context, NULL),
                "attention_probs launch");
    fetch(k, got, dprobs, pn * 4);
    return k->failed ? INFINITY : max_err(got, want, Q3_F32, pn);
}

/* the maps of a q3_check_batch (kernel_check.c's shapes): the whole call in one pass */
double q3_case_attention_probs_batch(check *k, const q3_check_batch *b, int G, int D, q3_dtype kv_dt) {
    q3_probs_case c = {b->L, 0, b->L, 3, b->n_seqs, {0}, {0}, 2 * G, 2, D, kv_dt, NULL, 0, NULL};
    if (b->n_seqs > Q3_PROBS_MAX_SEQS) return INFINITY;
    q3_check_batch_seqs(b, c.past, c.start);
    return q3_case_attention_probs(k, &c);
}

/* a decode step's bookkeeping for the first n_seqs of: one sequence past its padding (its
 * first real token at position 9), one empty, one still inside its padding (pos 0), one just
 * at its padding's end, one long with none (first at 2^40 - 200); all of seqs, pos and
 * lengths must match exactly */
double q3_case_decode_prepare(check *k, int n_seqs) {
    enum { MAX = 5 };
    q3_attn_seq seqs[MAX] = {{NULL, NULL, -1, 3, 9, NULL, 3, NULL, 0, 0}, {NULL, NULL, -1, 0, 0, NULL, 0, NULL, 0, 0},
                             {NULL, NULL, -1, 4, 7, NULL, 4, NULL, 0, 0}, {NULL, NULL, -1, 5, 0, NULL, 5, NULL, 0, 0},
                             {NULL, NULL, -1, 0, ((int64_t)1 << 40) - 200, NULL, 0, NULL, 0, 0}};
    int64_t pos[MAX] = {-1, -1, -1, -1, -1}, lengths[MAX] = {7, 0, 2, 5, 100};
    q3_attn_seq seqs_got[MAX];
    int64_t pos_got[MAX], lengths_got[MAX];
    if (n_seqs < 1 || n_seqs > MAX) return INFINITY;
    const size_t n_seq_bytes = n_seqs * sizeof seqs[0], n_bytes = n_seqs * sizeof pos[0];
    q3_attn_seq *dseqs = device(k, seqs, n_seq_bytes);
    int64_t *dpos = device(k, pos, n_bytes), *dlengths = device(k, lengths, n_bytes);
    q3_decode_prepare_host(seqs, pos, lengths, n_seqs);
    if (!k->failed) cuda_ok(k, k->g->decode_prepare(dseqs, dpos, dlengths, n_seqs, NULL), "decode_prepare launch");
    fetch(k, seqs_got, dseqs, n_seq_bytes);
    fetch(k, pos_got, dpos, n_bytes);
    fetch(k, lengths_got, dlengths, n_bytes);
    if (k->failed || memcmp(seqs_got, seqs, n_seq_bytes) || memcmp(pos_got, pos, n_bytes) ||
        memcmp(lengths_got, lengths, n_bytes))
        return INFINITY;
    return 0.0;
}

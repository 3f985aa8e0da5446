/* Causal GQA attention, flash style, as two small register-blocked matrix products per tile
 * of keys. One work item is (sequence, KV head, block of up to Q3_ATTN_QUERY_BLOCK query
 * tokens); its rows r = tq * G + g are the G = Hq / Hkv query heads of each of those tokens,
 * all reading the same KV head, so each K and V row is loaded once for all of them.
 *   scores  S^T [j][r] = sum_i K[j][i] * Qt[i][r]   (Qt: the block's queries, transposed
 *                                                     and pre-scaled, once per block)
 *   softmax over j for each r, online: vectors run across rows
 *   output  A[r][i]   += sum_j P^T[j][r] * V[j][i]   (vectors run across head dims)
 * K and V tiles are converted to fp32 once; head_dim is padded to PAD_D in the tiles. */
#include <math.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#include "ops.h"
#include "team.h"
#include "thread_scratch.h"
#include "vec.h"
#include "widen.h"

#define KT Q3_ATTN_KEY_TILE
_Static_assert(KT % 8 == 0, "tile_scores takes a tile's keys 4 and 8 at a time");
#define LN Q3_LANES

typedef struct {
    int rows, rp, dp; /* rows, rows padded to 16, head_dim padded to 32 */
    float *qt;        /* [D][rp] */
    float *acc;       /* [rows][dp] */
    float *st;        /* [KT][rp] scores, then probabilities */
    float *m, *l;     /* [rp] running max and sum */
    float *kt, *vt;   /* [KT][dp] key and value tiles */
} block_scratch;

static block_scratch carve(float *s, int rows, int D) {
    block_scratch b;
    b.rows = rows;
    b.rp = (rows + 15) / 16 * 16;
    b.dp = (D + 31) / 32 * 32;
    float *p = (float *)(((uintptr_t)s + 63) & ~(uintptr_t)63);
    b.qt = p;
    p += (int64_t)b.dp * b.rp;
    b.acc = p;
    p += (int64_t)b.rp * b.dp;
    b.st = p;
    p += (int64_t)KT * b.rp;
    b.m = p;
    b.l = p + b.rp;
    p += 2 * b.rp;
    b.kt = p;
    b.vt = p + (int64_t)KT * b.dp;
    return b;
}

/* kt, vt [KT][dp] <- rows [j0, j0 + nj) of the cache, fp32, zero past D and in the rows after nj
 * that tile_scores reads (to a multiple of 8). K and V row by row: the two streams in one loop
 * (a tile of keys before the scores and one of values before the products, each in L1, took
 * 1-4% longer) */
static void load_tile(const block_scratch *b, const void *k, const void *v, q3_dtype dt, int64_t j0,
                      int nj, int D) {
    for (int j = 0; j < (nj + 7) / 8 * 8; j++) {
        float *kr = b->kt + (int64_t)j * b->dp, *vr = b->vt + (int64_t)j * b->dp;
        if (j < nj) {
            const int64_t off = (j0 + j) * D;
            if (dt == Q3_BF16) {
                q3_bf16_row(kr, (const uint16_t *)k + off, D);
                q3_bf16_row(vr, (const uint16_t *)v + off, D);
            } else if (dt == Q3_F16) {
                const uint16_t *ks = (const uint16_t *)k + off, *vs = (const uint16_t *)v + off;
#pragma omp simd
                for (int i = 0; i < D; i++) {
                    kr[i] = q3_f16_to_f32(ks[i]);
                    vr[i] = q3_f16_to_f32(vs[i]);
                }
            } else {
                memcpy(kr, (const float *)k + off, (size_t)D * sizeof(float));
                memcpy(vr, (const float *)v + off, (size_t)D * sizeof(float));
            }
        }
        for (int i = j < nj ? D : 0; i < b->dp; i++) kr[i] = vr[i] = 0.0f;
    }
}

/* Register blocking: RB row vectors per step of the scores, VR rows of the values' 4 dim
 * vectors; with AVX-512's 32 registers 16 accumulators, else 8 (16 registers). */
#if Q3_VBYTES == 64
#define RB 4
#define VR 4
#else
#define RB 2
#define VR 2
#endif

/* st[j][:] = K[j] . Qt for the tile's nj keys (and up to 7 of its zero rows after them: the
 * loops take 4 and 8 keys a step; a tile's last rows are the context's end, where a decode
 * step's last tile holds its own key alone): 4 keys x RB row vectors per step (4 + RB
 * loads for 4 RB multiply-adds), then the rows left (a decode step's G rows: one vector) one
 * vector and 8 keys at a time, 8 sums in flight to cover the multiply-add's latency (4 held
 * the avx512 level's decode attention at half its throughput). Each score is summed over i in
 * order either way. */
static void tile_scores(const block_scratch *b, int D, int nj) {
    const int blocked = b->rp / (RB * LN) * (RB * LN); /* rows in whole RB blocks */
    for (int j = 0; blocked && j < nj; j += 4) {
        const float *k0 = b->kt + (int64_t)j * b->dp;
        for (int r = 0; r < blocked; r += RB * LN) {
            q3_vf a[4][RB];
            #pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                #pragma GCC unroll 4
                for (int v = 0; v < RB; v++) a[c][v] = (q3_vf){0};
            for (int i = 0; i < D; i++) {
                q3_vf q[RB];
                #pragma GCC unroll 4
                for (int v = 0; v < RB; v++) q[v] = q3_vload(b->qt + (int64_t)i * b->rp + r + v * LN);
                #pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    const float kc = k0[(int64_t)c * b->dp + i];
                    #pragma GCC unroll 4
                    for (int v = 0; v < RB; v++) a[c][v] += kc * q[v];
                }
            }
            #pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                #pragma GCC unroll 4
                for (int v = 0; v < RB; v++) q3_vstore(b->st + (int64_t)(j + c) * b->rp + r + v * LN, a[c][v]);
        }
    }
    for (int j = 0; blocked < b->rp && j < nj; j += 8) { /* (KT a multiple of 8) */
        const float *k0 = b->kt + (int64_t)j * b->dp;
        for (int r = blocked; r < b->rp; r += LN) {
            q3_vf a[8];
            #pragma GCC unroll 8
            for (int c = 0; c < 8; c++) a[c] = (q3_vf){0};
            for (int i = 0; i < D; i++) {
                const q3_vf q = q3_vload(b->qt + (int64_t)i * b->rp + r);
                #pragma GCC unroll 8
                for (int c = 0; c < 8; c++) a[c] += k0[(int64_t)c * b->dp + i] * q;
            }
            #pragma GCC unroll 8
            for (int c = 0; c < 8; c++) q3_vstore(b->st + (int64_t)(j + c) * b->rp + r, a[c]);
        }
    }
}

/* What a sequence hides beyond the causal run [lower, idx] of each row (kernels/attention.h):
 * the hidden keys of the tile (hk [nj]: NULL when none), which only a row seeing itself
 * alone (lower == idx: a query with no other key) still reads; and a call's per-query mask
 * (tree: NULL when causal) over the keys from cache row tree_first on. An unmasked call tests
 * two pointers per key. */
typedef struct {
    const uint8_t *hk;
    int nj;
    const uint8_t *tree;
    int64_t tree_first, tree_tokens;
} key_filter;

/* the lanes of rows r0 .. r0 + LN - 1 (cache rows idx [LN]) whose tree row shows key `key` */
static inline q3_vi tree_lanes(const key_filter *f, const int64_t *idx, int64_t key) {
    q3_vi v = {0};
    for (int i = 0; i < LN; i++) {
        int64_t t = idx[i] - f->tree_first; /* rows past the block's (padding lanes) read the last */
        t = t < 0 ? 0 : t >= f->tree_tokens ? f->tree_tokens - 1 : t;
        v[i] = f->tree[t * f->tree_tokens + (key - f->tree_first)] ? -1 : 0;
    }
    return v;
}

/* whether rows r0 .. r0 + LN - 1 see key j of the tile (key j0 + j): `inside` their causal
 * runs, less what f hides */
static inline q3_vi key_seen(q3_vi inside, q3_vi alone, const key_filter *f, const int64_t *idx, int64_t j0, int j) {
    if (f->hk && j < f->nj && f->hk[j]) inside &= alone;
    if (f->tree && j < f->nj && j0 + j >= f->tree_first) inside &= tree_lanes(f, idx, j0 + j);
    return inside;
}

/* online softmax over the tile, vectors across rows; row r (token tq = r / G, at cache index
 * i = first + tq - 1) sees keys [lo, i] with lo = start (the first key), or lo = i for a
 * token before it, less what f hides (filtered: a constant, so that an unmasked call's copy
 * of the loops has no test of f at all). Leaves probabilities in st and the accumulator
 * rescale factors in corr [rp]. */
static inline __attribute__((always_inline)) void softmax_rows(const block_scratch *b, float *corr, int G,
                                                               int64_t first, int64_t start, int64_t j0,
                                                               const key_filter *f, const int filtered) {
    for (int r0 = 0; r0 < b->rp; r0 += LN) {
        q3_vf visible, lower;
        int64_t idx[LN];
        for (int i = 0; i < LN; i++) {
            idx[i] = first + (r0 + i) / G - 1;
            visible[i] = (float)(idx[i] + 1 - j0);
            lower[i] = (float)((idx[i] >= start ? start : idx[i]) - j0);
        }
        const q3_vi alone = lower == visible - 1.0f;
        q3_vf mt = q3_vload(b->m + r0);
        for (int j = 0; j < f->nj; j++) {
            const q3_vf s = q3_vload(b->st + (int64_t)j * b->rp + r0);
            const q3_vi inside = ((float)j < visible) & ((float)j >= lower);
            const q3_vi seen = filtered ? key_seen(inside, alone, f, idx, j0, j) : inside;
            mt = q3_vsel(seen, q3_vmax(mt, s), mt);
        }
        const q3_vf m_old = q3_vload(b->m + r0);
        q3_vf sum = {0};
        for (int j = 0; j < f->nj; j++) {
            float *sj = b->st + (int64_t)j * b->rp + r0;
            const q3_vi inside = ((float)j < visible) & ((float)j >= lower);
            const q3_vi seen = filtered ? key_seen(inside, alone, f, idx, j0, j) : inside;
            const q3_vf p = q3_vsel(seen, q3_vexp_v(q3_vload(sj) - mt), (q3_vf){0});
            q3_vstore(sj, p);
            sum += p;
        }
        const q3_vf c = q3_vsel(m_old == mt, q3_vsplat(1.0f), q3_vexp_v(m_old - mt));
        q3_vstore(corr + r0, c);
        q3_vstore(b->l + r0, q3_vload(b->l + r0) * c + sum);
        q3_vstore(b->m + r0, mt);
    }
}

static void tile_softmax(const block_scratch *b, float *corr, int G, int64_t first, int64_t start, int64_t j0,
                         const key_filter *f) {
    if (f->hk || f->tree) softmax_rows(b, corr, G, first, start, j0, f, 1);
    else softmax_rows(b, corr, G, first, start, j0, f, 0);
}

/* acc[r][:] = acc[r][:] * corr[r] + sum_j st[j][r] * vt[j][:]: VR rows x 4 vectors of
 * dims per step where the padded head dim allows (VR + 4 loads for 4 VR multiply-adds),
 * else one row x 2 vectors */
static void tile_values(const block_scratch *b, const float *corr, int nj) {
    const int wide = b->dp % (4 * LN) == 0;
    int r = 0;
    for (; wide && r + VR <= b->rows; r += VR)
        for (int i = 0; i < b->dp; i += 4 * LN) {
            q3_vf a[VR][4];
            #pragma GCC unroll 4
            for (int w = 0; w < VR; w++)
                #pragma GCC unroll 4
                for (int v = 0; v < 4; v++) a[w][v] = q3_vload(b->acc + (int64_t)(r + w) * b->dp + i + v * LN) * corr[r + w];
            for (int j = 0; j < nj; j++) {
                const float *vj = b->vt + (int64_t)j * b->dp + i;
                q3_vf vv[4];
                #pragma GCC unroll 4
                for (int v = 0; v < 4; v++) vv[v] = q3_vload(vj + v * LN);
                #pragma GCC unroll 4
                for (int w = 0; w < VR; w++) {
                    const float p = b->st[(int64_t)j * b->rp + r + w];
                    #pragma GCC unroll 4
                    for (int v = 0; v < 4; v++) a[w][v] += p * vv[v];
                }
            }
            #pragma GCC unroll 4
            for (int w = 0; w < VR; w++)
                #pragma GCC unroll 4
                for (int v = 0; v < 4; v++) q3_vstore(b->acc + (int64_t)(r + w) * b->dp + i + v * LN, a[w][v]);
        }
    for (; r < b->rows; r++)
        for (int i = 0; i < b->dp; i += 2 * LN) {
            float *ap = b->acc + (int64_t)r * b->dp + i;
            q3_vf a0 = q3_vload(ap) * corr[r], a1 = q3_vload(ap + LN) * corr[r];
            for (int j = 0; j < nj; j++) {
                const float *vj = b->vt + (int64_t)j * b->dp + i;
                const float p = b->st[(int64_t)j * b->rp + r];
                a0 += p * q3_vload(vj);
                a1 += p * q3_vload(vj + LN);
            }
            q3_vstore(ap, a0);
            q3_vstore(ap + LN, a1);
        }
}

/* Rows r = tq * G + g: query q + tq * ld + g * D sees keys [sq's first_key, first + tq) less
 * what sq hides (its hidden keys, its call's tree), a token before first_key only itself;
 * k and v: the block of the query's KV head. */
static void attend_block(float *out, const float *q, int64_t ld, int nq, int G, int D, int64_t first,
                         const q3_attn_seq *sq, const void *k, const void *v, q3_dtype dt, float scale,
                         float *scratch) {
    const block_scratch b = carve(scratch, nq * G, D);
    float corr[b.rp];
    for (int i = 0; i < D; i++)
        for (int r = 0; r < b.rp; r++)
            b.qt[(int64_t)i * b.rp + r] = r < b.rows ? q[(r / G) * ld + (int64_t)(r % G) * D + i] * scale : 0.0f;
    for (int r = 0; r < b.rp; r++) {
        b.m[r] = -INFINITY;
        b.l[r] = 0.0f;
    }
    memset(b.acc, 0, (size_t)b.rp * b.dp * sizeof(float));
    const int64_t n_keys = first + nq - 1;
    for (int64_t j0 = 0; j0 < n_keys; j0 += KT) {
        const int nj = (int)(n_keys - j0 < KT ? n_keys - j0 : KT);
        load_tile(&b, k, v, dt, j0, nj, D);
        tile_scores(&b, D, nj);
        const key_filter f = {sq->hidden ? sq->hidden + j0 : NULL, nj, sq->tree, sq->tree_first, sq->tree_tokens};
        tile_softmax(&b, corr, G, first, sq->first_key, j0, &f);
        tile_values(&b, corr, nj);
    }
    for (int r = 0; r < b.rows; r++) {
        const float inv = 1.0f / b.l[r];
        float *o = out + (r / G) * ld + (int64_t)(r % G) * D;
        for (int i = 0; i < D; i++) o[i] = b.acc[(int64_t)r * b.dp + i] * inv;
    }
}

/* item `it` of q3_attention's: one query block of one KV head of one sequence, last query
 * blocks first (they see the most keys) */
static void attend_item(float *out, const float *q, const q3_attn_seq *seqs, const q3_attn_shape *sh, int64_t it,
                        int64_t blocks, float *scratch) {
    const int Hq = sh->heads, Hkv = sh->kv_heads, D = sh->head_dim, G = Hq / Hkv;
    const int64_t L = sh->L, ld = (int64_t)Hq * D;
    const int64_t b = blocks - 1 - it % blocks;
    const int h = (int)((it / blocks) % Hkv);
    const int s = (int)(it / (blocks * Hkv));
    const int64_t t0 = b * Q3_ATTN_QUERY_BLOCK;
    const int nq = (int)(L - t0 < Q3_ATTN_QUERY_BLOCK ? L - t0 : Q3_ATTN_QUERY_BLOCK);
    const int64_t head_off = (int64_t)h * sh->capacity * D * (int64_t)q3_dtype_size(sh->kv_dtype);
    const int64_t row0 = ((int64_t)s * L + t0) * ld + (int64_t)h * G * D;
    attend_block(out + row0, q + row0, ld, nq, G, D, seqs[s].n_past + t0 + 1, &seqs[s],
                 (const char *)seqs[s].k + head_off, (const char *)seqs[s].v + head_off, sh->kv_dtype, sh->scale,
                 scratch);
}

void Q3_CPU_FN(q3_attention)(float *out, const float *q, const q3_attn_seq *seqs, int n_seqs,
                             const q3_attn_shape *sh, float *scratch, int threads) {
    const int64_t blocks = (sh->L + Q3_ATTN_QUERY_BLOCK - 1) / Q3_ATTN_QUERY_BLOCK;
    const int64_t items = (int64_t)n_seqs * sh->kv_heads * blocks, per_thread = q3_attention_scratch_floats(sh);
    if (!q3_team(items > 1, threads)) { /* inline (team.h) */
        for (int64_t it = 0; it < items; it++)
            attend_item(out, q, seqs, sh, it, blocks, q3_thread_scratch(scratch, per_thread));
        return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t it = 0; it < items; it++)
        attend_item(out, q, seqs, sh, it, blocks, q3_thread_scratch(scratch, per_thread));
}

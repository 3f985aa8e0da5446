// Causal GQA attention on tensor cores, for calls of many tokens per sequence (prefill and
// prefill chunks) over a bf16 cache. Same arguments and result as attention.cu's kernel
// (twin: kernels/cpu/attention.c); q3_attention_cuda picks this one when it applies.
//
// A block takes one (sequence, KV head, tile of QT = 64 / G query tokens): its 64 rows are
// (token t0 + r / G, query head h G + r % G), so each tile of KT keys and values is read
// once for all the G query heads of QT tokens; warp w owns rows 16 w .. 16 w + 15. Scores
// S = Q K^T and the output O += P V are bf16 products with fp32 accumulation (WMMA); q is
// rounded to bf16 as it is staged, P as it is formed. Softmax in one pass over the keys
// (online, as in FlashAttention-2): per key tile, S goes through shared memory (fp32), each
// row's running max m and sum l are updated, P = exp(S - m) is rounded to bf16, the output
// fragments are multiplied by exp(m_old - m_new) row by row where a row's max grew, and
// O += P V; O / l at the end. A WMMA accumulator's element-to-row map is unspecified, so the
// rescale goes through shared memory (store, scale each row, load back); a tile where no
// row of a warp grew skips it (most tiles, once the maxima settle).
// Hidden keys (kernels/attention.h): each warp gathers the tile's flags into a 32-bit mask
// with a ballot, a lane a key, where the sequence has flags (one pointer test a tile else).
// A call's tree (q3_attn_seq.tree, device memory): each lane reads its two keys' bytes of
// each of its rows' tree rows, in a second instance of the softmax step (TREE), so that an
// untreed call runs the first unchanged (one pointer test a tile).
#include <cuda_bf16.h>
#include <mma.h>

#include "../attention.h"
#include "common.cuh"

using namespace nvcuda;

#define ROWS 64      // query rows of a block: (token, head) pairs
#define KT 32        // keys per tile
#define TC_MAX_D 128 // head_dim limit (and a multiple of 16)
#define LDQ (TC_MAX_D + 8)
#define LDS KT
#define LDP (KT + 8)
#define TC_THREADS 128
// Shared memory, static: qs 64 x 136 bf16 (17408 B), ks and vs 32 x 136 bf16 (8704 B each),
// ss 64 x 32 fp32 (8192 B: the scores, then each warp's stash for the rescale and the output),
// ps 64 x 40 bf16 (5120 B), alpha 64 fp32 (256 B): 48384 B, under the 48 KiB a launch gets
// without cudaFuncSetAttribute. ptxas (sm_90): 166 registers, no spills.

typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc_frag;

// the block's rows of q as bf16, zero past the call's tokens
__device__ __forceinline__ void stage_queries(__nv_bfloat16 (*qs)[LDQ], const float *q, const q3_attn_shape *sh,
                                              int s, int h, int64_t t0, int G) {
    const int D = sh->head_dim;
    for (int e = threadIdx.x; e < ROWS * D; e += blockDim.x) {
        const int r = e / D, d = e % D;
        const int64_t t = t0 + r / G;
        float v = 0.0f;
        if (t < sh->L) v = q[(((int64_t)s * sh->L + t) * sh->heads + (int64_t)h * G + r % G) * D + d];
        qs[r][d] = __float2bfloat16_rn(v);
    }
}

// keys (or values) j0 .. j0 + KT - 1 of KV head h into the tile, zero from `end` on
__device__ __forceinline__ void stage_keys(__nv_bfloat16 (*dst)[LDQ], const void *cache, const q3_attn_shape *sh,
                                           int h, int64_t j0, int64_t end) {
    const int D = sh->head_dim, vecs = D / 8; // 8 bf16 per 16-byte load
    const uint16_t *row = (const uint16_t *)cache + ((int64_t)h * sh->capacity + j0) * D + Q3_MUTANT(5);
    const uint4 *src = (const uint4 *)row;
    for (int e = threadIdx.x; e < KT * vecs; e += blockDim.x) {
        const int j = e / vecs, c = e % vecs;
        const uint4 v = j0 + j < end ? src[(int64_t)j * vecs + c] : make_uint4(0u, 0u, 0u, 0u);
        *(uint4 *)&dst[j][c * 8] = v;
    }
}

// S [16, KT] of this warp's rows = Q K^T for the staged tile, into ss (row stride LDS)
__device__ __forceinline__ void warp_scores(float (*ss)[LDS], const __nv_bfloat16 (*qs)[LDQ],
                                            const __nv_bfloat16 (*ks)[LDQ], int D, int warp) {
    acc_frag sc[2];
    wmma::fill_fragment(sc[0], 0.0f);
    wmma::fill_fragment(sc[1], 0.0f);
    for (int d0 = 0; d0 < D; d0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
        wmma::load_matrix_sync(a, &qs[16 * warp][d0], LDQ);
#pragma unroll
        for (int j = 0; j < 2; j++) { // K^T: element (d, key) sits at ks[key][d]
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
            wmma::load_matrix_sync(b, &ks[16 * j][d0], LDQ);
            wmma::mma_sync(sc[j], a, b, sc[j]);
        }
    }
    wmma::store_matrix_sync(&ss[16 * warp][0], sc[0], LDS, wmma::mem_row_major);
    wmma::store_matrix_sync(&ss[16 * warp][16], sc[1], LDS, wmma::mem_row_major);
    __syncwarp();
}

// whether the query at cache row i sees key j (hidden: whether j is hidden): the keys of
// [first_key, i] not hidden, only itself before first_key (kernels/attention.h)
__device__ __forceinline__ bool sees(int64_t i, int64_t j, int64_t first_key, bool hidden) {
    return i >= first_key ? (j >= first_key && j <= i && !hidden) : j == i;
}

// whether the call's tree lets the query at cache row i (>= tree_first) see key j <= i: yes
// for a key before the call's tokens, else the tree's byte [i - tree_first][j - tree_first]
__device__ __forceinline__ bool tree_sees(const q3_attn_seq *sq, int64_t i, int64_t j) {
    return j < sq->tree_first || sq->tree[(i - sq->tree_first) * sq->tree_tokens + (j - sq->tree_first)] != 0;
}

// max and sum over the 16 lanes of a half warp (xor offsets below 16 stay inside it)
__device__ __forceinline__ float half_max(float v) {
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float half_sum(float v) {
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One key tile's softmax step for this warp's 16 rows. Half warp hf = lane / 16 takes rows
// 2 k + hf (k = 0..7) and each lane keys `lane` and `lane ^ 16` of the tile: ss[r][c] with
// the row stride of 32 floats sits in bank c, so both reads are conflict-free. m[k] and l[k]
// are row 2 k + hf's running max and sum (the same in all 16 lanes of the half); P (bf16)
// goes to ps, each row's factor exp(m_old - m_new) to alpha[row - 16 warp]. The sum adds
// P as rounded, the values O accumulates. hid: bit c set where key j0 + c is hidden. TREE:
// the sequence has a tree (sq->tree), which the rows' keys pass too. Returns whether some
// row's factor is not 1.
template <bool TREE>
__device__ __forceinline__ bool warp_softmax(__nv_bfloat16 (*ps)[LDP], float *alpha, const float (*ss)[LDS],
                                             float *m, float *l, int64_t j0, unsigned hid, int64_t t0, int G,
                                             const q3_attn_seq *sq, const q3_attn_shape *sh, int warp, int lane) {
    const int hf = lane >> 4;
    const bool hid0 = (hid >> lane) & 1u, hid1 = (hid >> (lane ^ 16)) & 1u;
    bool grew = false;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int i = 2 * k + hf, r = 16 * warp + i;
        const int64_t t = t0 + r / G, at = t < sh->L ? sq->n_past + t : -1; // -1: no query in this row
        const int c0 = lane, c1 = lane ^ 16;
        bool ok0 = at >= 0 && sees(at, j0 + c0, sq->first_key, hid0),
             ok1 = at >= 0 && sees(at, j0 + c1, sq->first_key, hid1);
        if (TREE) { // a seen key is <= at, and at >= tree_first for a query of the call
            ok0 = ok0 && tree_sees(sq, at, j0 + c0);
            ok1 = ok1 && tree_sees(sq, at, j0 + c1);
        }
        const float v0 = ok0 ? ss[r][c0] * sh->scale : -INFINITY, v1 = ok1 ? ss[r][c1] * sh->scale : -INFINITY;
        const float mn = fmaxf(m[k], half_max(fmaxf(v0, v1)));
        // nothing seen before (O and l are 0, any factor will do) or nothing seen still: 1
        const float a = m[k] == -INFINITY ? 1.0f : expf(m[k] - mn);
        const __nv_bfloat16 p0 = __float2bfloat16_rn(ok0 ? expf(v0 - mn) : 0.0f);
        const __nv_bfloat16 p1 = __float2bfloat16_rn(ok1 ? expf(v1 - mn) : 0.0f);
        ps[r][c0] = p0;
        ps[r][c1] = p1;
        l[k] = l[k] * a + half_sum(__bfloat162float(p0) + __bfloat162float(p1));
        m[k] = mn;
        if ((lane & 15) == 0) alpha[i] = a;
        grew = grew || a != 1.0f;
    }
    return __any_sync(0xffffffffu, grew);
}

// o[f] (this warp's 16 rows, columns 16 f ..) times alpha[row], two fragments at a time
// through the warp's 16 x 32 floats of ss: lane c scales column c of every row (bank c)
__device__ __forceinline__ void warp_rescale(acc_frag *o, float (*stash)[LDS], const float *alpha, int D, int lane) {
#pragma unroll
    for (int f = 0; f < TC_MAX_D / 16; f += 2) {
        if (16 * f >= D) break;
        const bool two = 16 * (f + 1) < D;
        wmma::store_matrix_sync(&stash[0][0], o[f], LDS, wmma::mem_row_major);
        if (two) wmma::store_matrix_sync(&stash[0][16], o[f + 1], LDS, wmma::mem_row_major);
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 16; i++) stash[i][lane] *= alpha[i];
        __syncwarp();
        wmma::load_matrix_sync(o[f], &stash[0][0], LDS, wmma::mem_row_major);
        if (two) wmma::load_matrix_sync(o[f + 1], &stash[0][16], LDS, wmma::mem_row_major);
        __syncwarp(); // read before the next pair is stored
    }
}

// O += P V for this warp's rows and the staged tile of values
__device__ __forceinline__ void warp_accumulate(acc_frag *o, const __nv_bfloat16 (*ps)[LDP],
                                                const __nv_bfloat16 (*vs)[LDQ], int D, int warp) {
#pragma unroll
    for (int k0 = 0; k0 < KT; k0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
        wmma::load_matrix_sync(a, &ps[16 * warp][k0], LDP);
#pragma unroll
        for (int f = 0; f < TC_MAX_D / 16; f++) {
            if (16 * f >= D) break;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> b;
            wmma::load_matrix_sync(b, &vs[k0][16 * f], LDQ);
            wmma::mma_sync(o[f], a, b, o[f]);
        }
    }
}

__global__ void __launch_bounds__(TC_THREADS) attention_tc_kernel(float *out, const float *q,
                                                                  const q3_attn_seq *seqs, q3_attn_shape sh) {
    Q3_SHARED(__nv_bfloat16[ROWS][LDQ], qs);
    Q3_SHARED(__nv_bfloat16[KT][LDQ], ks);
    Q3_SHARED(__nv_bfloat16[KT][LDQ], vs);
    Q3_SHARED(float[ROWS][LDS], ss);
    Q3_SHARED(__nv_bfloat16[ROWS][LDP], ps);
    Q3_SHARED(float[ROWS], alpha); // each row's rescale factor, then 1 / l
    const int G = sh.heads / sh.kv_heads, QT = ROWS / G, D = sh.head_dim;
    const int64_t tiles = (sh.L + QT - 1) / QT;
    const int64_t t0 = (int64_t)(blockIdx.x % tiles) * QT;
    const int h = (int)((blockIdx.x / tiles) % sh.kv_heads), s = (int)(blockIdx.x / (tiles * sh.kv_heads));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const q3_attn_seq sq = seqs[s];
    // the keys any row of the block sees: from the first key (or the first query, if it is
    // before it) to the last query
    const int64_t first_q = sq.n_past + t0, last_t = t0 + QT < sh.L ? t0 + QT - 1 : sh.L - 1;
    const int64_t lo = first_q < sq.first_key ? first_q : sq.first_key, end = sq.n_past + last_t + 1;
    stage_queries(qs, q, &sh, s, h, t0, G);

    float m[8], l[8]; // rows 2 k + lane / 16 of the warp's (warp_softmax)
#pragma unroll
    for (int k = 0; k < 8; k++) {
        m[k] = -INFINITY;
        l[k] = 0.0f;
    }
    acc_frag o[TC_MAX_D / 16];
#pragma unroll
    for (int f = 0; f < TC_MAX_D / 16; f++) wmma::fill_fragment(o[f], 0.0f);
    float(*stash)[LDS] = &ss[16 * warp];
    for (int64_t j0 = lo; j0 < end; j0 += KT) {
        __syncthreads(); // the previous tile is no longer read
        stage_keys(ks, sq.k, &sh, h, j0, end);
        stage_keys(vs, sq.v, &sh, h, j0, end);
        __syncthreads();
        // the tile's hidden keys, bit c for key j0 + c (flags are read up to `end` alone)
        const unsigned hid = sq.hidden ? __ballot_sync(0xffffffffu, j0 + lane < end && sq.hidden[j0 + lane]) : 0u;
        warp_scores(ss, qs, ks, D, warp);
        float *aw = &alpha[16 * warp];
        const bool grew = sq.tree ? warp_softmax<true>(ps, aw, ss, m, l, j0, hid, t0, G, &sq, &sh, warp, lane)
                                  : warp_softmax<false>(ps, aw, ss, m, l, j0, hid, t0, G, &sq, &sh, warp, lane);
        __syncwarp(); // the scores are read (the stash reuses them), P and alpha written
        if (grew) warp_rescale(o, stash, &alpha[16 * warp], D, lane);
        warp_accumulate(o, ps, vs, D, warp);
    }

    // out rows = O / l through the warp's part of ss (16 x 32 at a time): lane c writes
    // column c of each row, 128 contiguous bytes a row
#pragma unroll
    for (int k = 0; k < 8; k++)
        if ((lane & 15) == 0) alpha[16 * warp + 2 * k + (lane >> 4)] = l[k] > 0.0f ? 1.0f / l[k] : 0.0f;
#pragma unroll
    for (int f = 0; f < TC_MAX_D / 16; f += 2) {
        if (16 * f >= D) break;
        __syncwarp();
        wmma::store_matrix_sync(&stash[0][0], o[f], LDS, wmma::mem_row_major);
        if (16 * (f + 1) < D) wmma::store_matrix_sync(&stash[0][16], o[f + 1], LDS, wmma::mem_row_major);
        __syncwarp();
        const int d = 16 * f + lane;
        for (int i = 0; i < 16; i++) {
            const int r = 16 * warp + i;
            const int64_t t = t0 + r / G;
            if (t < sh.L && d < D)
                out[(((int64_t)s * sh.L + t) * sh.heads + (int64_t)h * G + r % G) * D + d] = stash[i][lane] * alpha[r];
        }
    }
}

// whether the tensor-core kernel takes this call: bf16 cache, D a multiple of 16 up to 128,
// G dividing the 64 rows of a block
extern "C" int q3_attention_tc_fits(const q3_attn_shape *sh) {
    const int G = sh->heads / sh->kv_heads;
    return sh->kv_dtype == Q3_BF16 && sh->head_dim % 16 == 0 && sh->head_dim <= TC_MAX_D && G >= 1 && ROWS % G == 0;
}

// out, q [n_seqs, L, Hq, D] (out may be q: a block reads its rows of q before it writes them)
extern "C" int q3_attention_tc_cuda(float *out, const float *q, const q3_attn_seq *seqs, int n_seqs,
                                    const q3_attn_shape *sh, void *stream) {
    if (!q3_attention_tc_fits(sh)) return (int)cudaErrorInvalidValue;
    const int QT = ROWS / (sh->heads / sh->kv_heads);
    const int64_t blocks = (int64_t)n_seqs * sh->kv_heads * ((sh->L + QT - 1) / QT);
    if (blocks == 0) return 0;
    if (blocks > 0x7fffffff) return (int)cudaErrorInvalidValue;
    Q3_LAUNCH(attention_tc_kernel, (unsigned)blocks, TC_THREADS, 0, (cudaStream_t)stream)(out, q, seqs, *sh);
    return q3_launch_status();
}

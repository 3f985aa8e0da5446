// Causal GQA attention over the KV cache, online softmax (twin: kernels/cpu/attention.c).
// One block per (sequence, KV head, query token, slice of keys); its G warps are the
// G = Hq / Hkv query heads of that KV head, so each K/V row fetched into shared memory serves
// all of them. Keys go in tiles of KEY_TILE: each lane scores one key per step, then the warp
// rescales and adds the tile's values, 4 consecutive head dims per lane and step of 128.
// Split-KV: a decode over a long context has few (token, KV head) pairs, so its keys are cut
// into slices run by separate blocks, each writing its (max, sum, accumulator) partial; a
// second kernel merges the slices of each query head. Prefill runs unsplit, and on tensor
// cores (attention_tc.cu) where the shape allows.
// Hidden keys (kernels/attention.h: a sequence's flags, NULL when it has none): a query at row
// i >= first_key sees the keys of [first_key, i] whose flag is 0, one before first_key only
// itself. Each lane reads its key's flag after scoring it, a hidden key scoring -inf as a
// lane past the tile does; a slice whose keys are all hidden leaves the partial (m = -inf,
// l = 0) that the merge skips. A call's tree (q3_attn_seq.tree, device memory) the same way:
// a key of the call's tokens that the query's row of the tree leaves out scores -inf. Unmasked
// and untreed, a key tile costs two shared loads (the two pointers, NULL) and their tests:
// no global load.
//
// Shared memory (dynamic, fp32), rows of S = row_stride(D) floats, D rounded up to whole
// 16-byte chunks of 4 dims and then to an odd number of them:
//   kt [KEY_TILE][S]  the tile's keys, dims D .. 4 * ceil(D / 4) - 1 zero
//   vt [KEY_TILE][S]  its values, the same
//   qs [G][S]         each warp's query row, staged once, zero past D
// Bank math (32 banks of 4 bytes; a 16-byte access is served a quarter-warp, 8 lanes, at a
// time, without conflict when those 8 lanes hit 8 different 4-bank groups, i.e. 16-byte
// chunk indices distinct mod 8):
//   scoring: lane j reads chunk c of key j, index j * S/4 + c; S/4 odd makes j * S/4 distinct
//            mod 8 for 8 consecutive j, so conflict-free. (The old [KEY_TILE][D] tile with
//            D = 128 put all 32 lanes on one bank: 32-way.) q: every lane reads the same
//            chunk of qs, a broadcast.
//   values:  lane reads chunk lane + 32 i of one row: 32 consecutive chunks, conflict-free.
//   staging: fp32 and the fallback store chunk c of row j from thread c of the row:
//            consecutive, conflict-free. bf16 and fp16 store two chunks per 16-byte load (2c, 2c + 1),
//            the half first that keeps the quarter-warp's 8 stores on 8 groups (c >> 2 & 1),
//            conflict-free when a row is a whole number of quarter-warps (D % 64 == 0), at
//            most 2-way otherwise (tests/ops/test_attention_banks.py checks all of this).
// q sits in shared memory rather than registers: a lane scoring a key needs all D dims of q,
// and a broadcast read of 4 of them costs one shared load beside the key's.
// Registers: the accumulator is MAX_D / 128 float4 per lane, loops over it unrolled with
// compile-time bounds and guards, so it stays in registers. __launch_bounds__(1024) caps a
// thread at 64 registers; the unroll pragmas are what fits that without spilling on sm_80,
// sm_90, sm_100 and sm_120 (ptxas -v: 0 bytes stack frame, 0 spill stores and loads), with
// what lives through the key loop but is read only once a tile or after it (the flags' and
// the tree row's pointers, each warp's output row) in shared memory, and the K/V pointers
// advanced a tile at a time: on sm_120 the flags' test alone spilled otherwise (with the
// tree's: 51, 54 and 64 registers on sm_80, sm_90 and sm_120, no spill).
#include <math.h>

#include "../attention.h"
#include "common.cuh"
#include "ops_cuda.h"

#define KEY_TILE 32 // keys per step: one per lane while scoring
#define MAX_D Q3_CUDA_MAX_HEAD_DIM
#define MAX_CHUNKS (MAX_D / 128) // float4 accumulators a lane holds

// floats per row of the tiles: ceil(D / 4) chunks of 4, made odd (bank math above)
__host__ __device__ static inline int row_stride(int D) { return ((D + 3) / 4 | 1) * 4; }

// 4 bf16 (the low half of a first) as fp32
__device__ __forceinline__ float4 bf16x4(uint32_t a, uint32_t b) {
    return make_float4(__uint_as_float(a << 16), __uint_as_float(a & 0xffff0000u), __uint_as_float(b << 16),
                       __uint_as_float(b & 0xffff0000u));
}

// 4 halves (the low half of a first) as fp32: fp16 when f16 (widened exactly, as the CPU's
// kernels/dtype.h), else bf16
__device__ __forceinline__ float4 halves4(uint32_t a, uint32_t b, bool f16) {
    if (!f16) return bf16x4(a, b);
    return make_float4(q3_f16_bits_to_f32((uint16_t)(a & 0xffffu)), q3_f16_bits_to_f32((uint16_t)(a >> 16)),
                       q3_f16_bits_to_f32((uint16_t)(b & 0xffffu)), q3_f16_bits_to_f32((uint16_t)(b >> 16)));
}

// nj cache rows of one KV head into kt and vt [KEY_TILE][S] as fp32 (k, v: the first key and
// value row, rows contiguous, D elements each), a key and a value load in flight together.
// 16-byte global loads where the dtype, D and alignment allow (8 bf16 or fp16 dims or 4 fp32 dims a
// load; __ldg: the cache is read-only here and its pointer comes from memory, so only it
// makes them global loads, LDG.E.128), else one chunk of 4 dims a thread.
__device__ __forceinline__ void stage_tile(float *kt, float *vt, const void *k, const void *v, q3_dtype dt, int nj,
                                           int D, int S) {
    const bool aligned = (((uintptr_t)k | (uintptr_t)v) & 15) == 0;
    if ((dt == Q3_BF16 || dt == Q3_F16) && D % 8 == 0 && aligned) {
        const int per = D / 8;
        const bool f16 = dt == Q3_F16;
#pragma unroll 1
        for (int e = threadIdx.x; e < nj * per; e += blockDim.x) {
            const int j = e / per, c = e % per, h = (c >> 2) & 1;
            const uint4 a = __ldg((const uint4 *)k + e), b = __ldg((const uint4 *)v + e);
            float *kd = kt + j * S + 8 * c, *vd = vt + j * S + 8 * c;
            *(float4 *)(kd + 4 * h) = halves4(h ? a.z : a.x, h ? a.w : a.y, f16); // half h first
            *(float4 *)(kd + 4 - 4 * h) = halves4(h ? a.x : a.z, h ? a.y : a.w, f16);
            *(float4 *)(vd + 4 * h) = halves4(h ? b.z : b.x, h ? b.w : b.y, f16);
            *(float4 *)(vd + 4 - 4 * h) = halves4(h ? b.x : b.z, h ? b.y : b.w, f16);
        }
    } else if (dt == Q3_F32 && D % 4 == 0 && aligned) {
        const int per = D / 4;
#pragma unroll 1
        for (int e = threadIdx.x; e < nj * per; e += blockDim.x) {
            const int off = e / per * S + 4 * (e % per);
            const float4 a = __ldg((const float4 *)k + e), b = __ldg((const float4 *)v + e);
            *(float4 *)(kt + off) = a;
            *(float4 *)(vt + off) = b;
        }
    } else {
        const int per = (D + 3) / 4;
#pragma unroll 1
        for (int e = threadIdx.x; e < nj * per; e += blockDim.x) {
            const int j = e / per, d = 4 * (e % per), i = j * D + d; // D even: d + 1 < D
            float4 a = make_float4(q3_load(k, dt, i), q3_load(k, dt, i + 1), 0.0f, 0.0f);
            float4 b = make_float4(q3_load(v, dt, i), q3_load(v, dt, i + 1), 0.0f, 0.0f);
            if (d + 2 < D) a.z = q3_load(k, dt, i + 2), b.z = q3_load(v, dt, i + 2);
            if (d + 3 < D) a.w = q3_load(k, dt, i + 3), b.w = q3_load(v, dt, i + 3);
            *(float4 *)(kt + j * S + d) = a;
            *(float4 *)(vt + j * S + d) = b;
        }
    }
}

// partial layout: [item = (s, t, query head)][slice][D + 2]: acc[D], then m, l.
// blockDim.x = 32 G: warp w is query head h G + w. Bounded for G = 32 (1024 threads): at
// most 64 registers a thread, so that a block of any G fits an SM's 64K registers.
__global__ void __launch_bounds__(Q3_CUDA_MAX_GROUP * 32)
    attention_kernel(float *out, float *partial, const float *q, const q3_attn_seq *seqs, q3_attn_shape sh, int splits) {
    const int G = sh.heads / sh.kv_heads, D = sh.head_dim, S = row_stride(D), C = (D + 3) / 4;
    const unsigned L = (unsigned)sh.L, item = blockIdx.x; // items = n_seqs * Hkv * L < 2^32
    const int t = (int)(item % L), h = (int)(item / L % (unsigned)sh.kv_heads), s = (int)(item / L / (unsigned)sh.kv_heads);
    const int slice = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    Q3_DYNAMIC_SHARED(float, smem); // kt [KEY_TILE][S], vt [KEY_TILE][S], qs [G][S]
    float *kt = smem, *vt = smem + KEY_TILE * S, *qs = smem + (2 * KEY_TILE + warp) * S;
    const q3_attn_seq sq = seqs[s];
    const int64_t head_off = (int64_t)h * sh.capacity * D;
    const int64_t n_keys = sq.n_past + t + 1 + Q3_MUTANT(2);
    // keys [lo, n_keys): from the sequence's first key (past its padding and the hidden rows
    // that follow it), or only itself for a query before it, whose flag is then not read
    const int64_t lo = n_keys - 1 >= sq.first_key ? sq.first_key : n_keys - 1;
    const int64_t per = (n_keys - lo + splits - 1) / splits;
    const int64_t k_begin = lo + slice * per, k_end = k_begin + per < n_keys ? k_begin + per : n_keys;
    const int64_t row = ((int64_t)s * L + t) * sh.heads + (int64_t)h * G + warp; // this warp's query head
    const float *qr = q + row * D;
    for (int i = lane; i < 4 * C; i += 32) qs[i] = i < D ? qr[i] : 0.0f; // read after the first barrier
    float m = -INFINITY, l = 0.0f;
    float4 acc[MAX_CHUNKS]; // dims 4 (lane + 32 i) .. + 3
#pragma unroll
    for (int i = 0; i < MAX_CHUNKS; i++) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // the slice's keys: n rows from its first, kp and vp (bytes)
    const int es = (int)q3_dtype_size(sh.kv_dtype), n = (int)(k_end - k_begin);
    const int64_t first = (head_off + k_begin * D) * es;
    const char *kp = (const char *)sq.k + first, *vp = (const char *)sq.v + first;
    // the flags of the slice's keys from its first, NULL where none can be hidden (the planted
    // defect: the flags never read, every key of [lo, n_keys) seen); the warp's output row.
    // In shared memory (registers above): flags read after the loop's first barrier, the row
    // by its warp after the __syncwarp (a slice of no keys has no barrier).
    // The query's row of the call's tree likewise (NULL: causal, or a query seeing itself
    // alone), with the slice's place in it: key k_begin + j is the call's token j - skip.
    Q3_SHARED(const uint8_t *, flags);
    Q3_SHARED(const uint8_t *, tree_row);
    Q3_SHARED(int, tree_skip);
    Q3_SHARED(int64_t[Q3_CUDA_MAX_GROUP], rows);
    if (threadIdx.x == 0) {
        flags = sq.hidden && lo < n_keys - 1 && !Q3_MUTANT(20) ? sq.hidden + k_begin : NULL;
        const int64_t qt = sq.n_past + t - sq.tree_first; // the query's token in the call
        tree_row = sq.tree && lo < n_keys - 1 && qt >= 0 && !Q3_MUTANT(21) ? sq.tree + qt * sq.tree_tokens : NULL;
        tree_skip = (int)(sq.tree_first - k_begin);
    }
    if (lane == 0) rows[warp] = row;
    __syncwarp();
    const int64_t tile_bytes = (int64_t)KEY_TILE * D * es;
    for (int j0 = 0; j0 < n; j0 += KEY_TILE, kp += tile_bytes, vp += tile_bytes) {
        const int nj = n - j0 < KEY_TILE ? n - j0 : KEY_TILE;
        __syncthreads(); // every warp is done with the previous tile
        stage_tile(kt, vt, kp, vp, sh.kv_dtype, nj, D, S);
        if (!Q3_MUTANT(1)) __syncthreads();
        float sc = -INFINITY;
        if (lane < nj) {
            const float4 *kr = (const float4 *)(kt + lane * S), *qv = (const float4 *)qs;
            float4 d = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 2 // (and 1 below, 1 in stage_tile): the unrolling that stays within 64 registers
            for (int c = 0; c < C; c++) {
                const float4 a = qv[c], b = kr[c];
                d.x = fmaf(a.x, b.x, d.x);
                d.y = fmaf(a.y, b.y, d.y);
                d.z = fmaf(a.z, b.z, d.z);
                d.w = fmaf(a.w, b.w, d.w);
            }
            sc = ((d.x + d.y) + (d.z + d.w)) * sh.scale;
            if (Q3_MUTANT(7)) __syncthreads();
        }
        const uint8_t *hk = flags;
        if (hk && lane < nj && hk[j0 + lane]) sc = -INFINITY; // a hidden key: as one past the tile
        const uint8_t *tr = tree_row;
        if (tr && lane < nj && j0 + lane >= tree_skip && !tr[j0 + lane - tree_skip]) sc = -INFINITY; // off its tree
        const float mt = fmaxf(m, q3_warp_max(sc));
        // mt is -inf only while every key so far was hidden: then each lane's p is 0 too
        const float p = lane < nj ? expf(sc - (mt == -INFINITY ? 0.0f : mt)) : 0.0f;
        const float corr = m == -INFINITY ? 0.0f : expf(m - mt);
        l = l * corr + q3_warp_sum(p);
        m = mt;
#pragma unroll
        for (int i = 0; i < MAX_CHUNKS; i++) {
            acc[i].x *= corr;
            acc[i].y *= corr;
            acc[i].z *= corr;
            acc[i].w *= corr;
        }
#pragma unroll 1
        for (int j = 0; j < nj; j++) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            const float4 *vr = (const float4 *)(vt + j * S);
#pragma unroll
            for (int i = 0; i < MAX_CHUNKS; i++) {
                if (lane + 32 * i < C) {
                    const float4 v = vr[lane + 32 * i];
                    acc[i].x = fmaf(pj, v.x, acc[i].x);
                    acc[i].y = fmaf(pj, v.y, acc[i].y);
                    acc[i].z = fmaf(pj, v.z, acc[i].z);
                    acc[i].w = fmaf(pj, v.w, acc[i].w);
                }
            }
        }
    }
    // one slice: the output row; several: this slice's partial, unnormalised
    const int64_t r = rows[warp];
    float *dst = splits == 1 ? out + r * D : partial + (r * splits + slice) * (D + 2);
    const float div = splits == 1 ? l : 1.0f;
#pragma unroll
    for (int i = 0; i < MAX_CHUNKS; i++) {
        const int d = 4 * (lane + 32 * i);
        if (d < D) {
            dst[d] = acc[i].x / div;
            dst[d + 1] = acc[i].y / div; // D is even
            if (d + 2 < D) dst[d + 2] = acc[i].z / div;
            if (d + 3 < D) dst[d + 3] = acc[i].w / div;
        }
    }
    if (splits > 1 && lane == 0) {
        dst[D] = m;
        dst[D + 1] = l;
    }
}

// out[row] = merge of the row's slices: one warp per query head row
__global__ void combine_kernel(float *out, const float *partial, int64_t rows, int D, int splits) {
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float *p = partial + row * splits * (D + 2);
    float m = -INFINITY;
    for (int j = 0; j < splits; j++) m = fmaxf(m, p[j * (D + 2) + D]);
    float l = 0.0f;
    for (int j = 0; j < splits; j++) {
        const float mj = p[j * (D + 2) + D];
        l += mj == -INFINITY ? 0.0f : p[j * (D + 2) + D + 1] * expf(mj - m);
    }
    for (int dim = lane; dim < D; dim += 32) {
        float a = 0.0f;
        for (int j = 0; j < splits; j++) {
            const float mj = p[j * (D + 2) + D];
            if (mj != -INFINITY) a += p[j * (D + 2) + dim] * expf(mj - m);
        }
        out[row * D + dim] = a / l;
    }
}

extern "C" int q3_attention_tc_fits(const q3_attn_shape *sh);
extern "C" int q3_attention_tc_cuda(float *out, const float *q, const q3_attn_seq *seqs, int n_seqs,
                                    const q3_attn_shape *sh, void *stream);

// out, q [n_seqs, L, Hq, D]; seqs: a device array of n_seqs entries (their hidden flags and
// trees, where not NULL, in device memory too: [n_past + L] and [tree_tokens, tree_tokens]). Calls of more tokens
// per sequence than split-KV takes go to tensor cores where the shape fits (attention_tc.cu).
// D even, at most MAX_D; G at most Q3_CUDA_MAX_GROUP (csrc/cuda/layer.c refuses layers past them).
extern "C" int q3_attention_cuda(float *out, const float *q, const q3_attn_seq *seqs, int n_seqs,
                                 const q3_attn_shape *shape, float *partial, void *stream) {
    const int D = shape->head_dim;
    if (shape->kv_heads < 1 || shape->heads % shape->kv_heads || D < 2 || D % 2 || D > MAX_D)
        return (int)cudaErrorInvalidValue;
    const int G = shape->heads / shape->kv_heads;
    if (G < 1 || G > Q3_CUDA_MAX_GROUP) return (int)cudaErrorInvalidValue;
    if (shape->L > Q3_SPLIT_MAX_TOKENS && q3_attention_tc_fits(shape))
        return q3_attention_tc_cuda(out, q, seqs, n_seqs, shape, stream);
    const unsigned items = (unsigned)((int64_t)n_seqs * shape->kv_heads * shape->L);
    if (items == 0) return 0;
    int splits = 1;
    if (partial && shape->L <= Q3_SPLIT_MAX_TOKENS && shape->max_keys > 2 * Q3_SPLIT_MIN_KEYS) {
        const int64_t want = shape->max_keys / Q3_SPLIT_MIN_KEYS;
        splits = (int)(want < Q3_SPLIT_MAX ? want : Q3_SPLIT_MAX);
    }
    cudaStream_t s = (cudaStream_t)stream;
    // at most (64 + 32) * 260 * 4 = 99,840 bytes (D = 256, G = 32), within the 99 KiB a block
    // may opt into on every target (sm_80: 163, sm_90: 227, sm_86/89/120: 99 KiB). Past the
    // default 48 KiB (D >= 190 at any G, D = 128 from G = 30) the kernel's limit is raised
    // first: a host-side setting, so allowed while a graph is being captured.
    const size_t smem = (size_t)(2 * KEY_TILE + G) * row_stride(D) * sizeof(float);
    if (smem > 48 * 1024 && !Q3_MUTANT(8)) {
        const cudaError_t e = cudaFuncSetAttribute((const void *)attention_kernel,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return (int)e;
    }
    Q3_LAUNCH(attention_kernel, dim3(items, (unsigned)splits), G * 32, smem, s)(out, partial, q, seqs, *shape, splits);
    if (splits > 1) {
        const int64_t rows = (int64_t)n_seqs * shape->L * shape->heads;
        Q3_LAUNCH(combine_kernel, (unsigned)((rows + 7) / 8), 256, 0, s)(out, partial, rows, shape->head_dim, splits);
    }
    return q3_launch_status();
}

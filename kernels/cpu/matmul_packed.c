/* Many-token matmul on packed weight panels (the avx2 and avx512 variants; the portable one
 * keeps matmul.c's generic kernel): y [T, N] (+)= x [T, K] W^T, x fp32, W fp32 or bf16.
 *
 * The generic kernel converts each bf16 weight every time a 4-token tile reads it, and the
 * conversion takes the ports the multiply-adds need. Here a thread converts a panel of NR
 * weight rows by KC columns to fp32 once (pack_panel, rows kept k-contiguous: a conversion,
 * not a transpose), and every token of the block reads it from L1: MR tokens x NR rows of
 * accumulators in registers, vectorised along k, each step MR x loads, NR weight loads and
 * MR x NR multiply-adds; the horizontal sums once a tile and k block. fp32 weights are read
 * in place (their rows are already fp32 and k-contiguous: the FP8 prefill's dequantized
 * chunks come this way).
 *
 * Blocking, from the machine's caches (sysconf, read once): KC so a panel fills L1d (the 4
 * tokens' x rows stream past it from L2 in any case; on an Intel Xeon with a 48 KiB L1d, KC
 * 512, 1024, 2048 ran 118, 120, 138 GFLOP/s on avx2's [32 x 1536 x 4096]; 1024 -> 2048 on
 * avx512: 169 -> 175 there and 173 -> 203 on [32 x 4096 x 1536]),
 * MC tokens so their x rows of one k block fill half of L2 and stay there while the threads
 * sweep their panels. Threads split the panels of each k block (static, the same panels to
 * the same thread every block, so a thread's partial sums in y are its own): each weight
 * byte is converted once per token block, by one thread. QWEN3LAYER_PACKED_KC sets KC instead
 * (q3_matmul_packed_set_kc: the tests run other machines' k blocks here).
 *
 * Other weight formats bring their own panel source (matmul_packed.h): the FP8 prefill packs
 * e4m3 rows times their block scales straight into the panel (kernels/cpu/matmul_fp8.c), so
 * a weight is decoded once per token block, as a bf16 one is converted.
 *
 * Sums: fp32, per k block in lanes then across them, k blocks in order; not the generic
 * kernel's order (every path is compared with float64 by tests/ops/test_matmul_paths.py). */
#include "cache_sizes.h"
#include "matmul_packed.h"
#include "ops.h"
#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* the sum of v's lanes, by halves */
static inline float hsum(q3_vf v) {
#if Q3_LANES == 16
    return _mm512_reduce_add_ps((__m512)v);
#else
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#endif
}

#ifndef MR
#define MR 4                              /* tokens a tile */
#endif
#ifndef NR
#define NR (Q3_LANES == 16 ? 6 : 3)       /* weight rows a tile (at most 6): 24 (zmm) or 12 (ymm) accumulators */
#endif
#define KC_MAX Q3_PACKED_KC_MAX

/* the k block and the token block, from L1d and L2 (fallbacks where sysconf does not know);
 * threads may race to compute them the first time (the FP8 prefill calls this from its own
 * parallel region): each computes the same values, stored atomically */
static int64_t kc_once, mc_once, kc_forced;

void Q3_CPU_FN(q3_matmul_packed_set_kc)(int64_t kc) {
    __atomic_store_n(&kc_forced, kc, __ATOMIC_RELAXED);
    __atomic_store_n(&kc_once, 0, __ATOMIC_RELEASE); /* recomputed at the next call */
}

static void blocking(int64_t *kc, int64_t *mc) {
    if (!__atomic_load_n(&kc_once, __ATOMIC_ACQUIRE)) {
        long l1, l2;
        q3_cache_sizes(&l1, &l2);
        int64_t k = (int64_t)l1 / (NR * (int64_t)sizeof(float)) / 64 * 64;
        k = k < 256 ? 256 : k > KC_MAX ? KC_MAX : k;
        const int64_t forced = __atomic_load_n(&kc_forced, __ATOMIC_RELAXED);
        if (forced >= 1 && forced <= KC_MAX) k = forced;
        int64_t m = (int64_t)l2 / 2 / (k * (int64_t)sizeof(float)) / MR * MR;
        __atomic_store_n(&mc_once, m < MR ? MR : m > 1024 ? 1024 : m, __ATOMIC_RELAXED);
        __atomic_store_n(&kc_once, k, __ATOMIC_RELEASE);
    }
    *kc = __atomic_load_n(&kc_once, __ATOMIC_ACQUIRE);
    *mc = __atomic_load_n(&mc_once, __ATOMIC_RELAXED);
}

/* A panel's rows lie ldp floats apart: kc rounded up to a cache line and one line more, so
 * that the NR rows a tile step reads do not fall in one L1 set (a kc of 1024 or 2048 floats
 * puts them a multiple of 4 KiB apart, the span of an L1 way on the CPUs here: with the x
 * rows, K floats apart, the step's NR + MR lines shared the 8 ways of a 32 KiB L1d) */
#define PANEL_SKEW 16
static inline int64_t panel_stride(int64_t kc) { return (kc + 15) / 16 * 16 + PANEL_SKEW; }

typedef struct {
    const uint16_t *w; /* [N, K] bf16 */
    int64_t K;
} bf16_rows;

/* the bf16 panel source: panel [nr][ldp] fp32 <- W rows [n0, n0 + nr) x columns [k0, k0 + kc).
 * avx2: 8 weights a load, each placed above a zero word by 128-bit unpacks (the fp32 of a bf16
 * is its bits << 16) and stored as two halves: on an AMD EPYC (Zen 1: 256-bit ops are two
 * halves, one 16-byte store a cycle) 0.31 cycles a weight, against 0.50 for the compiler's
 * vpmovzxwd + vpslld over ymm; the pack runs at about the store limit (0.25) */
static void pack_bf16(float *panel, int64_t ldp, const void *src, int64_t n0, int nr, int64_t k0, int64_t kc) {
    const bf16_rows *b = src;
    for (int r = 0; r < nr; r++) {
        const uint16_t *row = b->w + (n0 + r) * b->K + k0;
        float *out = panel + r * ldp;
        int64_t k = 0;
#if Q3_LANES == 8
        const __m128i zero = _mm_setzero_si128();
        for (; k + 8 <= kc; k += 8) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(row + k));
            _mm_storeu_si128((__m128i *)(out + k), _mm_unpacklo_epi16(zero, v));
            _mm_storeu_si128((__m128i *)(out + k + 4), _mm_unpackhi_epi16(zero, v));
        }
#endif
        for (; k < kc; k++) out[k] = q3_bf16_to_f32(row[k]);
    }
}

/* the fp16 panel source, as pack_bf16 (rows of a bf16_rows holding fp16 words): 8 or 16
 * weights a load widened by vcvtph2ps (exact; F16C in both x86 variants) */
static void pack_f16(float *panel, int64_t ldp, const void *src, int64_t n0, int nr, int64_t k0, int64_t kc) {
    const bf16_rows *b = src;
    for (int r = 0; r < nr; r++) {
        const uint16_t *row = b->w + (n0 + r) * b->K + k0;
        float *out = panel + r * ldp;
        int64_t k = 0;
#if Q3_LANES == 16
        for (; k + 16 <= kc; k += 16)
            _mm512_storeu_ps(out + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + k))));
#elif Q3_LANES == 8
        for (; k + 8 <= kc; k += 8)
            _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + k))));
#endif
        for (; k < kc; k++) out[k] = q3_f16_to_f32(row[k]);
    }
}

/* the lines of the next panel a tile fetches towards L2 as it runs: line i of [first, end) is
 * cache line i / rows of that panel's row i % rows */
typedef struct {
    const char *base; /* the next panel's first row at the k block's first column; NULL: none */
    int64_t row_bytes, rows, first, end;
} next_lines;

/* one step along k: MR x NR multiply-adds of Q3_LANES each */
#define TILE_STEP(k)                                                                  \
    do {                                                                              \
        q3_vf wv[NR];                                                                 \
        for (int r = 0; r < RR; r++) wv[r] = q3_vload(panel + r * ldp + (k));         \
        for (int t = 0; t < TT; t++) {                                                \
            const q3_vf xv = q3_vload(x + t * K + (k));                               \
            for (int r = 0; r < RR; r++) acc[t][r] += xv * wv[r];                     \
        }                                                                             \
    } while (0)
#define PREFETCH_EVERY 8 /* steps between two of a tile's prefetches */

/* y[t * N + r] (+)= sum_k x[t * K + k] panel[r * ldp + k] for t < TT, r < RR over one k block
 * of kc columns (x and panel at the block's first column); first: the block that starts y;
 * one line of pf every PREFETCH_EVERY steps */
static inline __attribute__((always_inline)) void tile(float *y, int64_t N, const float *x, int64_t K,
                                                       const float *panel, int64_t ldp, int64_t kc, int TT,
                                                       int RR, int first, int accumulate, const next_lines *pf) {
    q3_vf acc[MR][NR];
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < RR; r++) acc[t][r] = q3_vsplat(0.0f);
    int64_t k = 0, line = pf->first;
    for (; k + PREFETCH_EVERY * Q3_LANES <= kc; k += PREFETCH_EVERY * Q3_LANES) {
        if (line < pf->end) {
            __builtin_prefetch(pf->base + line % pf->rows * pf->row_bytes + line / pf->rows * 64, 0, 2);
            line++;
        }
        for (int u = 0; u < PREFETCH_EVERY; u++) TILE_STEP(k + u * Q3_LANES);
    }
    for (; k + Q3_LANES <= kc; k += Q3_LANES) TILE_STEP(k);
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < RR; r++) {
            float s = hsum(acc[t][r]);
            for (int64_t j = k; j < kc; j++) s += x[t * K + j] * panel[r * ldp + j]; /* the k tail */
            float *out = y + t * N + r;
            *out = (first && !accumulate ? 0.0f : *out) + s;
        }
}

/* the tokens [t0, t1) against one packed panel of RR rows at column n0 (each tile fetches pf) */
static inline __attribute__((always_inline)) void panel_tokens(float *y, const float *x, const float *panel,
                                                               int64_t ldp, int64_t t0, int64_t t1, int64_t n0,
                                                               int64_t N, int64_t K, int64_t kc, int RR, int first,
                                                               int accumulate, const next_lines *pf) {
    int64_t t = t0;
    for (; t + MR <= t1; t += MR)
        tile(y + t * N + n0, N, x + t * K, K, panel, ldp, kc, MR, RR, first, accumulate, pf);
    switch (t1 - t) {
#if MR > 3
    case 3: tile(y + t * N + n0, N, x + t * K, K, panel, ldp, kc, 3, RR, first, accumulate, pf); break;
#endif
#if MR > 2
    case 2: tile(y + t * N + n0, N, x + t * K, K, panel, ldp, kc, 2, RR, first, accumulate, pf); break;
#endif
    case 1: tile(y + t * N + n0, N, x + t * K, K, panel, ldp, kc, 1, RR, first, accumulate, pf); break;
    default: break;
    }
}

/* rr (1 .. NR) rows as a compile-time count, so each tile's accumulators stay in registers */
static void panel_any(float *y, const float *x, const float *panel, int64_t ldp, int64_t t0, int64_t t1, int64_t n0,
                      int64_t N, int64_t K, int64_t kc, int rr, int first, int accumulate, const next_lines *pf) {
#define PANEL_ROWS(R) \
    case R: panel_tokens(y, x, panel, ldp, t0, t1, n0, N, K, kc, R, first, accumulate, pf); break;
    switch (rr) {
#if NR > 5
        PANEL_ROWS(6)
#endif
#if NR > 4
        PANEL_ROWS(5)
#endif
#if NR > 3
        PANEL_ROWS(4)
#endif
#if NR > 2
        PANEL_ROWS(3)
#endif
        PANEL_ROWS(2)
        default: panel_tokens(y, x, panel, ldp, t0, t1, n0, N, K, kc, 1, first, accumulate, pf); break;
    }
#undef PANEL_ROWS
}

/* one packed panel (rows [n0, n0 + rr) of a k block) against the tokens [t0, t1), a tile row of
 * MR tokens at a time, each tile fetching its share of the next panel's bytes (the thread's
 * next panel, with the static split): a panel's rows are too short a stream for the hardware
 * prefetcher to run ahead of the next pack, which had waited on memory a fifth of the time at
 * 32 tokens an expert (perf, avx2) */
static void panel_run(float *y, const float *x, const float *panel, int64_t ldp, const q3_panel_source *w, int64_t t0,
                      int64_t t1, int64_t n0, int rr, int64_t N, int64_t K, int64_t k0, int64_t kc, int accumulate) {
    next_lines pf = {NULL, 0, 1, 0, 0};
    const int64_t tile_rows = (t1 - t0 + MR - 1) / MR, next = n0 + NR; /* the next panel: rows [next, N) */
    const int64_t rows = next >= N ? 0 : N - next < NR ? N - next : NR;
    const int64_t lines = w->bytes ? rows * ((kc * w->col_bytes + 63) / 64) : 0, share = (lines + tile_rows - 1) / tile_rows;
    if (lines) pf = (next_lines){(const char *)w->bytes + next * w->row_bytes + k0 * w->col_bytes, w->row_bytes, rows, 0, 0};
    for (int64_t i = 0; i < tile_rows; i++) {
        const int64_t a = t0 + i * MR, e = a + MR < t1 ? a + MR : t1;
        pf.first = i * share < lines ? i * share : lines;
        pf.end = pf.first + share < lines ? pf.first + share : lines;
        panel_any(y, x + k0, panel, ldp, a, e, n0, N, K, kc, rr, k0 == 0, accumulate, &pf);
    }
}

/* the packed matmul; w->pack NULL: w_f32 [N, K] fp32 rows, read in place as their own panels */
static void packed(float *y, const float *x, const q3_panel_source *w, const float *w_f32, int64_t T, int64_t N,
                   int64_t K, int accumulate, int threads) {
    int64_t KC, MC;
    blocking(&KC, &MC);
    const int64_t panels = (N + NR - 1) / NR;
    const next_lines none = {NULL, 0, 1, 0, 0};
#pragma omp parallel num_threads(threads) if (T * N * K > (1 << 18))
    {
        float panel[NR * (KC_MAX + PANEL_SKEW)] __attribute__((aligned(64)));
        for (int64_t t0 = 0; t0 < T; t0 += MC) {
            const int64_t t1 = t0 + MC < T ? t0 + MC : T;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kc = K - k0 < KC ? K - k0 : KC, ldp = panel_stride(kc);
#pragma omp for schedule(static) nowait
                for (int64_t p = 0; p < panels; p++) {
                    const int64_t n0 = p * NR;
                    const int rr = N - n0 < NR ? (int)(N - n0) : NR;
                    if (w->pack) {
                        w->pack(panel, ldp, w->src, n0, rr, k0, kc);
                        panel_run(y, x, panel, ldp, w, t0, t1, n0, rr, N, K, k0, kc, accumulate);
                    } else { /* fp32 rows are their own panel: read in place, a row stride apart */
                        panel_any(y, x + k0, w_f32 + n0 * K + k0, K, t0, t1, n0, N, K, kc, rr, k0 == 0,
                                  accumulate, &none);
                    }
                }
            }
        }
    }
}

void Q3_CPU_FN(q3_matmul_packed)(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N,
                                 int64_t K, int accumulate) {
    const bf16_rows b = {(const uint16_t *)w, K};
    const q3_panel_source bf16 = {pack_bf16, &b, w, 2 * K, 2}, f16 = {pack_f16, &b, w, 2 * K, 2},
                          f32 = {NULL, NULL, NULL, 0, 0};
    packed(y, x, w_dt == Q3_BF16 ? &bf16 : w_dt == Q3_F16 ? &f16 : &f32, (const float *)w, T, N, K, accumulate,
           q3_packed_threads());
}

void Q3_CPU_FN(q3_matmul_packed_from)(float *y, const float *x, const q3_panel_source *w, int64_t T, int64_t N,
                                      int64_t K, int accumulate, int threads) {
    packed(y, x, w, NULL, T, N, K, accumulate, threads);
}

#endif

/* AMX bf16 matmul for 4 tokens or more (the "amx" level of the avx512 variant).
 *
 * Computed transposed, so that the weights need no packing: C^T [n, t] += W [n, k] x^T [k, t].
 * A tiles are 16 rows of W read in place (32 bf16 of k each); B tiles hold x rounded to
 * bf16 in the pair-interleaved layout TDPBF16PS expects, packed once per call into xb:
 *     xb[((tb * Ks + s) * 16 + r) * 32 + 2 * i + j] = bf16(x[16 tb + i, 32 s + 2 r + j])
 * (token block tb of 16, k step s of 32, pair r, token i, j in {0, 1}), zero-padded.
 * A block of 32 weight rows x 32 tokens keeps 4 C tiles; threads split the weight rows.
 * Shapes with N % 16 or K % 32 left over go to the AVX512-BF16 kernel. Other weight formats
 * come through a row source (matmul_amx.h: the FP8 prefill, kernels/cpu/matmul_fp8.c), which a
 * thread converts 32 rows at a time into its scratch for the tiles; a source whose rows are the
 * columns of what it stores (the GPTQ int4 prefill, matmul_int4_amx.c) is read in panels: a
 * stretch of inputs across all of a thread's rows, the C tiles parked in the scratch between
 * stretches (q3_matmul_amx_panels). Linux grants AMX
 * per process on request: csrc/engine/cpu_dispatch.c asks before this level is offered. */
#ifdef _OPENMP
#include <omp.h>
#endif

#include "matmul_amx.h"
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
#define AMX_MIN_TOKENS 4 /* below, the GEMV; AMX pads the token block to 16 */
#ifndef AMX_PREFETCH_STEPS
#define AMX_PREFETCH_STEPS 4 /* k steps of 32 ahead */
#endif

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tiles 0-3: C (16 x 16 fp32); 4, 5: A (16 rows x 32 bf16); 6, 7: B (16 pairs x 16 tokens) */
static AMX_TARGET void tiles_configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

static void pack_x(uint16_t *xb, const float *x, int64_t T, int64_t K) {
    const int64_t blocks = (T + 15) / 16, Ks = K / 32;
    uint32_t *dst = (uint32_t *)xb; /* one bf16 pair per 32-bit word */
#pragma omp parallel for schedule(static) if (T * K > (1 << 15))
    for (int64_t tb = 0; tb < blocks; tb++) {
        uint32_t *blk = dst + tb * Ks * 256;
        for (int i = 0; i < 16; i++) {
            const int64_t t = tb * 16 + i;
            for (int64_t p = 0; p < K / 2; p++) {
                uint32_t v = 0;
                if (t < T)
                    v = (uint32_t)q3_f32_to_bf16(x[t * K + 2 * p]) |
                        (uint32_t)q3_f32_to_bf16(x[t * K + 2 * p + 1]) << 16;
                blk[(p / 16) * 256 + (p % 16) * 16 + i] = v;
            }
        }
    }
}

/* y[t0 + i, n0 + r] (+)= c[r][i] for the valid tokens */
static void store_transposed(float *y, int64_t N, const float c[16][16], int64_t t0, int64_t T,
                             int64_t n0, int accumulate) {
    for (int i = 0; i < 16 && t0 + i < T; i++) {
        float *row = y + (t0 + i) * N + n0;
        for (int r = 0; r < 16; r++) row[r] = accumulate ? row[r] + c[r][i] : c[r][i];
    }
}

/* the tiles C (0-3) of token blocks tb, tb + 1 (nt of them) and row tiles a < na into y's
 * columns [0, 16 * na) */
static AMX_TARGET void store_tiles(float *y, int64_t N, int64_t T, int64_t tb, int na, int nt, int accumulate) {
    float c[16][16] __attribute__((aligned(64)));
    for (int a = 0; a < na; a++)
        for (int b = 0; b < nt; b++) {
            switch (2 * a + b) {
            case 0: _tile_stored(0, c, 64); break;
            case 1: _tile_stored(1, c, 64); break;
            case 2: _tile_stored(2, c, 64); break;
            default: _tile_stored(3, c, 64); break;
            }
            store_transposed(y, N, (const float(*)[16])c, (tb + b) * 16, T, 16 * a, accumulate);
        }
}

/* C (0-3) += one k step: row tiles a0 (and a1 when na == 2) of stride lda bytes against the
 * step's x tiles b0 (and the next token block's, Ks steps on, when nt == 2) */
static inline __attribute__((always_inline)) AMX_TARGET void tiles_step(const uint16_t *a0, const uint16_t *a1,
                                                                       int64_t lda, const uint16_t *b0,
                                                                       int64_t Ks, int na, int nt) {
    _tile_loadd(4, a0, lda);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (nt == 2) {
        _tile_loadd(7, b0 + Ks * 512, 64);
        _tile_dpbf16ps(1, 4, 7);
    }
    if (na == 2) {
        _tile_loadd(5, a1, lda);
        _tile_dpbf16ps(2, 5, 6);
        if (nt == 2) _tile_dpbf16ps(3, 5, 7);
    }
}

static AMX_TARGET void tiles_zero(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* weight rows w [16 * na, K] against every token block, into y's columns [0, 16 * na) (y and w
 * at the block's first row); na, nt in {1, 2} */
static AMX_TARGET void amx_rows(float *y, const uint16_t *w, const uint16_t *xb, int64_t T, int64_t N,
                                int64_t K, int na, int accumulate) {
    const int64_t Ks = K / 32, blocks = (T + 15) / 16, wstride = K * 2;
    for (int64_t tb = 0; tb < blocks; tb += 2) {
        const int nt = blocks - tb >= 2 ? 2 : 1;
        tiles_zero();
        for (int64_t s = 0; s < Ks; s++) {
            /* the weight rows come from memory as 16 * na strided streams: fetch ahead */
            if (s + AMX_PREFETCH_STEPS < Ks)
                for (int r = 0; r < 16 * na; r++)
                    _mm_prefetch((const char *)(w + r * K + (s + AMX_PREFETCH_STEPS) * 32), _MM_HINT_T0);
            tiles_step(w + s * 32, w + 16 * K + s * 32, wstride, xb + (tb * Ks + s) * 512, Ks, na, nt);
        }
        store_tiles(y, N, T, tb, na, nt, accumulate);
    }
}

static AMX_TARGET void amx_thread(float *y, const uint16_t *w, const uint16_t *xb, int64_t T, int64_t N,
                                  int64_t K, int accumulate) {
    tiles_configure();
    const int64_t pairs = (N / 16 + 1) / 2;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t n0 = 32 * p;
        amx_rows(y + n0, w + n0 * K, xb, T, N, K, N - n0 >= 32 ? 2 : 1, accumulate);
    }
    _tile_release();
}

#define STEP_COLS 128 /* columns the stepwise conversion takes at a time: one FP8 scale block */

/* up to 2 token blocks: rows [n0, n0 + 16 * na) from the source STEP_COLS columns at a time
 * into one half of `buf` while the tiles read the other half (the last stretch). A stretch
 * takes whole cache lines of each row: rows K apart may share an L1 set (K = 4096) */
static AMX_TARGET void amx_rows_stepwise(float *y, q3_amx_rows_fn *rows, const void *src, int64_t n0,
                                         const uint16_t *xb, int64_t T, int64_t N, int64_t K, int na,
                                         int accumulate, int64_t n_next) {
    uint16_t buf[2][Q3_AMX_ROWS * STEP_COLS] __attribute__((aligned(64))); /* [32 rows][STEP_COLS] each */
    const int64_t Ks = K / 32, stretches = (K + STEP_COLS - 1) / STEP_COLS;
    const int nt = T > 16 ? 2 : 1;
    tiles_zero();
    rows(buf[0], STEP_COLS, src, n0, 16 * na, 0, K < STEP_COLS ? K : STEP_COLS);
    for (int64_t c = 0; c < stretches; c++) {
        const int64_t c0 = c * STEP_COLS, next = c0 + STEP_COLS;
        if (c + 1 < stretches)
            rows(buf[(c + 1) & 1], STEP_COLS, src, n0, 16 * na, next, K - next < STEP_COLS ? K - next : STEP_COLS);
        if (n_next < N) /* the same stretch of the thread's next rows, towards L2 */
            rows(NULL, 0, src, n_next, N - n_next < 32 ? 16 : 32, c0, K - c0 < STEP_COLS ? K - c0 : STEP_COLS);
        const uint16_t *a = buf[c & 1];
        const int64_t steps = (K - c0 < STEP_COLS ? K - c0 : STEP_COLS) / 32;
        for (int64_t j = 0; j < steps; j++)
            tiles_step(a + 32 * j, a + 16 * STEP_COLS + 32 * j, STEP_COLS * 2, xb + (c0 / 32 + j) * 512, Ks, na, nt);
    }
    store_tiles(y, N, T, 0, na, nt, accumulate);
}

/* as amx_thread, the rows from a row source */
static AMX_TARGET void amx_thread_from(float *y, q3_amx_rows_fn *rows, const void *src, const uint16_t *xb,
                                       int64_t T, int64_t N, int64_t K, int accumulate, uint16_t *scratch) {
    tiles_configure();
    const int64_t pairs = (N / 16 + 1) / 2;
#ifdef _OPENMP
    const int64_t first = omp_get_thread_num(), step = omp_get_num_threads();
#else
    const int64_t first = 0, step = 1;
#endif
    for (int64_t p = first; p < pairs; p += step) { /* in turn: a thread knows its next rows, to fetch them */
        const int64_t n0 = 32 * p;
        const int na = N - n0 >= 32 ? 2 : 1;
        if (T <= 32) {
            amx_rows_stepwise(y + n0, rows, src, n0, xb, T, N, K, na, accumulate, 32 * (p + step));
        } else {
            rows(scratch, K, src, n0, 16 * na, 0, K);
            amx_rows(y + n0, scratch, xb, T, N, K, na, accumulate);
        }
    }
    _tile_release();
}

/* C (0-3) of a strip's token blocks tb, tb + 1 from or to acc, tile (a, b) at acc + (2 b + a) * 256 */
static AMX_TARGET void tiles_move(float *acc, int na, int nt, int load) {
    for (int a = 0; a < na; a++)
        for (int b = 0; b < nt; b++) {
            float *c = acc + (2 * b + a) * 256;
            switch ((2 * a + b) | load << 2) {
            case 0: _tile_stored(0, c, 64); break;
            case 1: _tile_stored(1, c, 64); break;
            case 2: _tile_stored(2, c, 64); break;
            case 3: _tile_stored(3, c, 64); break;
            case 4: _tile_loadd(0, c, 64); break;
            case 5: _tile_loadd(1, c, 64); break;
            case 6: _tile_loadd(2, c, 64); break;
            default: _tile_loadd(3, c, 64); break;
            }
        }
}

/* inputs of a stretch: a strip's converted rows (32 x 128 bf16, 8 KB) stay in L1, and 16 word
 * rows of qweight are read along at once. The real layer's int4 prefill of 512 tokens (Intel
 * Xeon with AMX, 2 threads, bench_ab.py): depth 64 461 ms, 128 393-408, 256 466, 512 603 (too
 * many streams for the prefetcher); the C tiles' trips to the scratch cost less than the
 * memory waits they save */
#define PANEL_DEPTH 128

static int64_t panel_depth(int64_t K) { return K < PANEL_DEPTH ? K : PANEL_DEPTH; }

/* a strip's parked C tiles: 2 row tiles x the token blocks, rounded up to a pair, of 256 floats */
static int64_t panel_strip_floats(int64_t T) { return 2 * 256 * (((T + 15) / 16 + 1) & ~(int64_t)1); }

/* q3_matmul_amx_panels' thread: its strips of 32 rows [s0, s1), in chunks whose C tiles fit its
 * scratch, a stretch of PANEL_DEPTH inputs at a time across the chunk's strips */
static AMX_TARGET void amx_thread_panels(float *y, q3_amx_rows_fn *rows, const void *src, const uint16_t *xb,
                                         int64_t T, int64_t N, int64_t K, int accumulate, uint16_t *scratch,
                                         int64_t stride, int64_t s0, int64_t s1) {
    tiles_configure();
    const int64_t depth = panel_depth(K), Ks = K / 32, blocks = (T + 15) / 16, strip_floats = panel_strip_floats(T);
    float *acc = (float *)(scratch + Q3_AMX_ROWS * depth);
    int64_t chunk = (stride - Q3_AMX_ROWS * depth) / 2 / strip_floats;
    if (chunk < 1) chunk = 1; /* (q3_matmul_amx_panels checks that one strip fits) */
    for (int64_t c = s0; c < s1; c += chunk) {
        const int64_t ce = s1 - c < chunk ? s1 : c + chunk;
        for (int64_t k0 = 0; k0 < K; k0 += depth) {
            const int64_t kc = K - k0 < depth ? K - k0 : depth;
            for (int64_t p = c; p < ce; p++) {
                const int na = N - 32 * p >= 32 ? 2 : 1;
                rows(scratch, depth, src, 32 * p, 16 * na, k0, kc);
                for (int64_t tb = 0; tb < blocks; tb += 2) {
                    const int nt = blocks - tb >= 2 ? 2 : 1;
                    float *tiles = acc + (p - c) * strip_floats + tb * 512;
                    if (k0) tiles_move(tiles, na, nt, 1);
                    else tiles_zero();
                    for (int64_t j = 0; j < kc / 32; j++)
                        tiles_step(scratch + 32 * j, scratch + 16 * depth + 32 * j, depth * 2,
                                   xb + (tb * Ks + k0 / 32 + j) * 512, Ks, na, nt);
                    if (k0 + kc < K) tiles_move(tiles, na, nt, 0);
                    else store_tiles(y + 32 * p, N, T, tb, na, nt, accumulate);
                }
            }
        }
    }
    _tile_release();
}

int64_t q3_matmul_amx_panels_stride(int64_t T, int64_t K) {
    return Q3_AMX_ROWS * panel_depth(K) + 2 * panel_strip_floats(T); /* a strip's stretch and its C tiles */
}

void q3_matmul_amx_panels(float *y, const float *x, q3_amx_rows_fn *rows, const void *src, int64_t T, int64_t N,
                          int64_t K, int accumulate, uint16_t *xb, uint16_t *scratch, int64_t stride, int threads) {
    if (stride < q3_matmul_amx_panels_stride(T, K)) {
        q3_matmul_amx_from(y, x, rows, src, T, N, K, accumulate, xb, scratch, stride, threads);
        return;
    }
    pack_x(xb, x, T, K);
    const int64_t strips = (N + 31) / 32;
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int64_t id = omp_get_thread_num(), n_th = omp_get_num_threads();
#else
        const int64_t id = 0, n_th = 1;
#endif
        amx_thread_panels(y, rows, src, xb, T, N, K, accumulate, scratch + id * stride, stride, strips * id / n_th,
                          strips * (id + 1) / n_th);
    }
}

void q3_matmul_amx_from(float *y, const float *x, q3_amx_rows_fn *rows, const void *src, int64_t T, int64_t N,
                        int64_t K, int accumulate, uint16_t *xb, uint16_t *scratch, int64_t stride, int threads) {
    pack_x(xb, x, T, K);
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        uint16_t *mine = scratch + omp_get_thread_num() * stride;
#else
        uint16_t *mine = scratch;
#endif
        amx_thread_from(y, rows, src, xb, T, N, K, accumulate, mine);
    }
}

void q3_matmul_cpu_amx(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N,
                       int64_t K, int accumulate, uint16_t *xb) {
    if (T < AMX_MIN_TOKENS || w_dt != Q3_BF16 || !xb || N % 16 || K % 32) {
        q3_matmul_cpu_avx512bf16(y, x, w, w_dt, T, N, K, accumulate, xb);
        return;
    }
    pack_x(xb, x, T, K);
#pragma omp parallel
    amx_thread(y, (const uint16_t *)w, xb, T, N, K, accumulate);
}

#endif

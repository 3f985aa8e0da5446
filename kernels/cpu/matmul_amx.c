/* AMX bf16 matmul for 4 tokens or more (the "amx" level of the avx512 variant).
 *
 * Computed transposed, so that the weights need no packing: C^T [n, t] += W [n, k] x^T [k, t].
 * A tiles are 16 rows of W read in place (32 bf16 of k each); B tiles hold x rounded to
 * bf16 in the pair-interleaved layout TDPBF16PS expects, packed once per call into xb:
 *     xb[((tb * Ks + s) * 16 + r) * 32 + 2 * i + j] = bf16(x[16 tb + i, 32 s + 2 r + j])
 * (token block tb of 16, k step s of 32, pair r, token i, j in {0, 1}), zero-padded.
 * A block of 32 weight rows x 32 tokens keeps 4 C tiles; threads split the weight rows.
 * Shapes with N % 16 or K % 32 left over go to the AVX512-BF16 kernel. Linux grants AMX
 * per process on request: csrc/engine/cpu_dispatch.c asks before this level is offered. */
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

/* weight rows [n0, n0 + 16 * na) against every token block; na, nt in {1, 2} */
static AMX_TARGET void amx_rows(float *y, const uint16_t *w, const uint16_t *xb, int64_t T, int64_t N,
                                int64_t K, int64_t n0, int na, int accumulate) {
    const int64_t Ks = K / 32, blocks = (T + 15) / 16, wstride = K * 2;
    float c[16][16] __attribute__((aligned(64)));
    for (int64_t tb = 0; tb < blocks; tb += 2) {
        const int nt = blocks - tb >= 2 ? 2 : 1;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < Ks; s++) {
            const uint16_t *b0 = xb + (tb * Ks + s) * 512;
            /* the weight rows come from memory as 16 * na strided streams: fetch ahead */
            if (s + AMX_PREFETCH_STEPS < Ks)
                for (int r = 0; r < 16 * na; r++)
                    _mm_prefetch((const char *)(w + (n0 + r) * K + (s + AMX_PREFETCH_STEPS) * 32), _MM_HINT_T0);
            _tile_loadd(4, w + n0 * K + s * 32, wstride);
            _tile_loadd(6, b0, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (nt == 2) {
                _tile_loadd(7, b0 + Ks * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (na == 2) {
                _tile_loadd(5, w + (n0 + 16) * K + s * 32, wstride);
                _tile_dpbf16ps(2, 5, 6);
                if (nt == 2) _tile_dpbf16ps(3, 5, 7);
            }
        }
        for (int a = 0; a < na; a++)
            for (int b = 0; b < nt; b++) {
                switch (2 * a + b) {
                case 0: _tile_stored(0, c, 64); break;
                case 1: _tile_stored(1, c, 64); break;
                case 2: _tile_stored(2, c, 64); break;
                default: _tile_stored(3, c, 64); break;
                }
                store_transposed(y, N, (const float(*)[16])c, (tb + b) * 16, T, n0 + 16 * a, accumulate);
            }
    }
}

static AMX_TARGET void amx_thread(float *y, const uint16_t *w, const uint16_t *xb, int64_t T, int64_t N,
                                  int64_t K, int accumulate) {
    tiles_configure();
    const int64_t pairs = (N / 16 + 1) / 2;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t n0 = 32 * p;
        amx_rows(y, w, xb, T, N, K, n0, N - n0 >= 32 ? 2 : 1, accumulate);
    }
    _tile_release();
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

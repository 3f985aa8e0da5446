/* The FP8 reference dequantization (q3_dequantize_fp8, q3.h), and random FP8 weights
 * (q3_fill_random_fp8, q3.h): each 128 x 128 block drawn into an fp32 tile,
 * its amax taken, then quantized. w [N, K] e4m3 bytes row-major, scale [ceil(N/128),
 * ceil(K/128)] fp32, the last row and column of blocks possibly partial. */
#include "q3.h"

#include "../../kernels/fp8.h"
#include "../../kernels/random.h"

#define B Q3_FP8_BLOCK

/* block (bi, bj) of w [N, K]: rows [bi B, + nr), columns [bj B, + nc); element (i, j) is draw
 * offset + i K + j of the stream of `key`. The engine is built for baseline x86-64, where the
 * draws' 64-bit mixing runs ~3x slower than with AVX2: a clone for x86-64-v3 (picked at load)
 * makes the 2.4 G weights of the real layer's experts in seconds, as the kernels' fill does.
 * Its FMA may round mean + std z once where the baseline rounds twice, like the kernels'
 * ISA-specific fills. */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static void fill_block(uint8_t *w, float *scale, int64_t N, int64_t K, int64_t bi, int64_t bj, uint64_t key,
                       int64_t offset, float mean, float std) {
    float tile[B * B]; /* [nr, nc] at row stride B: 64 KiB of the thread's stack, drawn once */
    const int64_t r0 = bi * B, c0 = bj * B;
    const int64_t nr = N - r0 < B ? N - r0 : B, nc = K - c0 < B ? K - c0 : B;
    float amax = 0.0f;
    for (int64_t r = 0; r < nr; r++) {
        const uint64_t first = (uint64_t)(offset + (r0 + r) * K + c0);
        float *t = tile + r * B;
        for (int64_t j = 0; j < nc; j++) {
            t[j] = mean + std * q3_normal_at(key, first + (uint64_t)j);
            const float a = t[j] < 0.0f ? -t[j] : t[j];
            amax = a > amax ? a : amax;
        }
    }
    /* amax / 448 maps the largest magnitude onto e4m3's largest finite value; amax / s may
     * come out one fp32 ulp above 448, which still rounds to 448 (the next tie is 464) */
    const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    scale[bi * q3_fp8_blocks(K) + bj] = s;
    for (int64_t r = 0; r < nr; r++) {
        const float *t = tile + r * B;
        uint8_t *row = w + (r0 + r) * K + c0;
        for (int64_t j = 0; j < nc; j++) row[j] = q3_f32_to_e4m3(t[j] / s);
    }
}

void q3_fill_random_fp8(uint8_t *w, float *scale, int64_t N, int64_t K, uint64_t seed, uint64_t stream,
                        int64_t offset, float mean, float std) {
    const uint64_t key = q3_normal_key(seed, stream);
    const int64_t nb = q3_fp8_blocks(N), kb = q3_fp8_blocks(K);
    /* blocks are independent; threads only for a matrix worth it (a test's 3 x 2 blocks is not) */
#pragma omp parallel for schedule(static) if (nb * kb >= 16)
    for (int64_t b = 0; b < nb * kb; b++) fill_block(w, scale, N, K, b / kb, b % kb, key, offset, mean, std);
}

void q3_dequantize_fp8(float *dst, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t count, int64_t n,
                       int64_t K) {
    const int64_t blocks = q3_fp8_blocks(n) * q3_fp8_blocks(K); /* of one matrix */
    const size_t ssz = q3_dtype_size(sdt);
    for (int64_t i = 0; i < count; i++)
        q3_fp8_dequant_rows(dst + i * n * K, w + i * n * K, (const char *)scale + (size_t)(i * blocks) * ssz, sdt, 0,
                            n, K);
}

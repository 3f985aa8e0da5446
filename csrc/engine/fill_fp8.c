/* The FP8 reference dequantization (q3_dequantize_fp8, q3.h; of views, their shapes checked:
 * q3_dequantize_fp8_check, q3_dequantize_fp8_views), and random FP8 weights
 * (q3_fill_random_fp8, q3.h): each 128 x 128 block drawn into an fp32 tile,
 * its amax taken, then quantized. w [N, K] e4m3 bytes row-major, scale [ceil(N/128),
 * ceil(K/128)] fp32, the last row and column of blocks possibly partial. */
#include <stdio.h>

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
#if defined(__x86_64__)
#define FILL_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FILL_CLONES /* (aarch64's baseline has ASIMD) */
#endif
FILL_CLONES
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

q3_status q3_dequantize_fp8_check(const q3_view *w, const q3_view *scale, int parts, q3_error *err) {
    char ws[96], ss[96];
    q3_format_shape(ws, sizeof ws, w->ndim, w->shape);
    q3_format_shape(ss, sizeof ss, scale->ndim, scale->shape);
    if (w->dtype != Q3_E4M3 || !w->contiguous || !scale->contiguous || w->ndim < 2 || scale->ndim != w->ndim)
        return q3_fail(err, Q3_ERR_VALUE, "dequantize_fp8: expected a contiguous float8_e4m3fn weight of rank >= 2 "
                       "and a contiguous scale_inv of the same rank, got %s %s and %s %s", q3_dtype_name(w->dtype), ws,
                       q3_dtype_name(scale->dtype), ss);
    const int r = w->ndim;
    const int64_t rows = w->shape[r - 2], K = w->shape[r - 1];
    if (parts < 1 || rows % parts)
        return q3_fail(err, Q3_ERR_VALUE, "parts: expected a positive divisor of the weight's rows (%lld), got %d",
                       (long long)rows, parts);
    const int64_t dims[2] = {rows / parts, K};
    int64_t blocks[2]; /* of one matrix [n, K]; parts x blocks[0] <= rows + parts fits */
    q3_fp8_scale_shape(dims, blocks);
    int ok = scale->shape[r - 2] == parts * blocks[0] && scale->shape[r - 1] == blocks[1];
    for (int d = 0; d < r - 2; d++) ok = ok && scale->shape[d] == w->shape[d];
    if (!ok)
        return q3_fail(err, Q3_ERR_VALUE, "scale_inv: expected the block shape of weight %s in %d part(s), got %s", ws,
                       parts, ss);
    return Q3_OK;
}

void q3_dequantize_fp8_views(float *dst, const q3_view *w, const q3_view *scale, int parts) {
    const int r = w->ndim;
    /* the matrices [n, K]: M (the leading dims) x parts <= M x rows, prefixes of the element
     * count the import checked (q3_numel stops at the first product that overflows): both fit */
    int64_t M;
    q3_numel(r - 2, w->shape, &M);
    q3_dequantize_fp8(dst, w->data, scale->data, scale->dtype, M * parts, w->shape[r - 2] / parts, w->shape[r - 1]);
}

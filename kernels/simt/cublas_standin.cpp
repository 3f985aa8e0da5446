// A stand-in for the cuBLAS entry points kernels/cuda/blas.cu opens at run time
// (cublasCreate_v2, cublasSetStream_v2, cublasGemmEx, cublasGemmGroupedBatchedEx), exported by
// libq3simt.so: opening the
// executor's own library as "cuBLAS" (q3.cuda.emulate(cublas=True)) runs blas.cu's path and
// the kernel check's cuBLAS cases on the CPU. Column-major, as cuBLAS:
//     C [m, n] = alpha op(A) [m, k] op(B) [k, n] + beta C,  op(X) = X or X^T,
// bf16 or fp32 inputs, fp32 output and accumulation; anything else is NOT_SUPPORTED.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <library_types.h>

#include <vector>

#include "block.h"

namespace {

enum { STATUS_SUCCESS = 0, STATUS_INVALID_VALUE = 7, STATUS_NOT_SUPPORTED = 15, OP_N = 0, OP_T = 1 };

struct Handle {
    void *stream;
};

struct Gemm {
    int transa, transb, m, n, k;
    float alpha, beta;
    const void *a, *b;
    cudaDataType_t a_type, b_type;
    int lda, ldb, ldc;
    float *c;
};

float element(const void *p, cudaDataType_t t, int64_t i) {
    if (t == CUDA_R_32F) return ((const float *)p)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// op(X) as a float matrix [rows, k], each row contiguous along k
std::vector<float> rows_of(const void *x, cudaDataType_t t, bool transposed, int rows, int k, int ld) {
    std::vector<float> out((size_t)rows * k);
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < k; l++)
            out[(size_t)r * k + l] = element(x, t, transposed ? l + (int64_t)r * ld : r + (int64_t)l * ld);
    return out;
}

// the GEMM's inner loop: plain host arithmetic on buffers the stand-in made itself, kept fast
// (optimised, not instrumented) in the sanitized build, where it dominated the kernel check
__attribute__((optimize("O2"), no_sanitize("address", "undefined"))) float dot(const float *a, const float *b,
                                                                               int k) {
    float acc[8] = {0};
    int l = 0;
    for (; l + 8 <= k; l += 8)
        for (int u = 0; u < 8; u++) acc[u] += a[l + u] * b[l + u];
    for (; l < k; l++) acc[0] += a[l] * b[l];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

void run_gemm(void *args) {
    const Gemm *g = (const Gemm *)args;
    // op(A) [m, k]: A^T when transa is T (A stored [k, m] column-major); op(B)^T [n, k] likewise
    const std::vector<float> a = rows_of(g->a, g->a_type, g->transa == OP_T, g->m, g->k, g->lda);
    const std::vector<float> b = rows_of(g->b, g->b_type, g->transb == OP_N, g->n, g->k, g->ldb);
    for (int j = 0; j < g->n; j++)
        for (int i = 0; i < g->m; i++) {
            const float s = dot(&a[(size_t)i * g->k], &b[(size_t)j * g->k], g->k);
            float *c = g->c + i + (int64_t)j * g->ldc;
            *c = g->alpha * s + (g->beta != 0.0f ? g->beta * *c : 0.0f);
        }
}

void free_gemm(void *args) { delete (Gemm *)args; }

// a grouped call's problems: sizes from the host arrays, taken at the call; the matrices'
// pointers from the device arrays, read when the call runs in stream order (as on a GPU)
struct Grouped {
    std::vector<Gemm> gemms;
    const void *const *a, *const *b;
    void *const *c;
};

void run_grouped(void *args) {
    const Grouped *g = (const Grouped *)args;
    for (size_t i = 0; i < g->gemms.size(); i++) {
        Gemm one = g->gemms[i];
        one.a = g->a[i];
        one.b = g->b[i];
        one.c = (float *)g->c[i];
        run_gemm(&one);
    }
}

void free_grouped(void *args) { delete (Grouped *)args; }

bool types_ok(cudaDataType_t a_type, cudaDataType_t b_type, cudaDataType_t c_type) {
    return (a_type == CUDA_R_16BF || a_type == CUDA_R_32F) && (b_type == CUDA_R_16BF || b_type == CUDA_R_32F) &&
           c_type == CUDA_R_32F;
}

bool sizes_ok(int transa, int transb, int m, int n, int k, int ldc) {
    return m >= 0 && n >= 0 && k >= 0 && (transa == OP_N || transa == OP_T) && (transb == OP_N || transb == OP_T) &&
           ldc >= (m > 1 ? m : 1);
}

} // namespace

extern "C" int cublasCreate_v2(void **handle) {
    *handle = new Handle{nullptr};
    return STATUS_SUCCESS;
}

extern "C" int cublasSetStream_v2(void *handle, cudaStream_t stream) {
    ((Handle *)handle)->stream = stream;
    return STATUS_SUCCESS;
}

extern "C" int cublasGemmEx(void *handle, int transa, int transb, int m, int n, int k, const void *alpha, const void *a,
                            cudaDataType_t a_type, int lda, const void *b, cudaDataType_t b_type, int ldb,
                            const void *beta, void *c, cudaDataType_t c_type, int ldc, int compute, int algo) {
    (void)compute;
    (void)algo;
    if (!types_ok(a_type, b_type, c_type)) return STATUS_NOT_SUPPORTED;
    if (!sizes_ok(transa, transb, m, n, k, ldc)) return STATUS_INVALID_VALUE;
    Gemm *g = new Gemm{transa, transb, m, n, k, *(const float *)alpha, *(const float *)beta, a, b, a_type, b_type,
                       lda, ldb, ldc, (float *)c};
    return simt::submit_host(((Handle *)handle)->stream, "cublasGemmEx (stand-in)", run_gemm, g, free_gemm) == 0
               ? STATUS_SUCCESS
               : STATUS_INVALID_VALUE;
}

extern "C" int cublasGemmGroupedBatchedEx(void *handle, const int *transa, const int *transb, const int *m,
                                          const int *n, const int *k, const void *alpha, const void *const *a,
                                          cudaDataType_t a_type, const int *lda, const void *const *b,
                                          cudaDataType_t b_type, const int *ldb, const void *beta, void *const *c,
                                          cudaDataType_t c_type, const int *ldc, int groups, const int *group_size,
                                          int compute) {
    (void)compute;
    // a test's switch: refuse, as a cuBLAS without bf16 in and fp32 out for this call would
    if (getenv("Q3_STANDIN_REFUSE_GROUPED")) return STATUS_NOT_SUPPORTED;
    if (!types_ok(a_type, b_type, c_type)) return STATUS_NOT_SUPPORTED;
    if (groups < 0) return STATUS_INVALID_VALUE;
    Grouped *g = new Grouped{{}, a, b, c};
    for (int i = 0; i < groups; i++) {
        if (!sizes_ok(transa[i], transb[i], m[i], n[i], k[i], ldc[i]) || group_size[i] < 0) {
            delete g;
            return STATUS_INVALID_VALUE;
        }
        for (int j = 0; j < group_size[i]; j++)
            g->gemms.push_back(Gemm{transa[i], transb[i], m[i], n[i], k[i], ((const float *)alpha)[i],
                                    ((const float *)beta)[i], nullptr, nullptr, a_type, b_type, lda[i], ldb[i],
                                    ldc[i], nullptr});
    }
    return simt::submit_host(((Handle *)handle)->stream, "cublasGemmGroupedBatchedEx (stand-in)", run_grouped, g,
                             free_grouped) == 0
               ? STATUS_SUCCESS
               : STATUS_INVALID_VALUE;
}

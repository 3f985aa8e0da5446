// cuBLAS for the prefill GEMMs, opened at run time: the build machine need not have cuBLAS
// (this project's CI has only the CUDA runtime and compiler), and a machine that has it (as a
// system library or the nvidia-cublas Python package) gets tensor-core GEMMs tuned for its
// GPU. The few entry points used are declared here from the cuBLAS documentation; the grouped
// GEMM (cublasGemmGroupedBatchedEx, cuBLAS 12.5 on) is used where the found library has it.
// y [T, N] (+)= xb [T, K] W^T with bf16 inputs and fp32 output and accumulation is, in
// cuBLAS's column-major terms, C [N, T] = op_T(W as [K, N]) * xb as [K, T].
#include <dlfcn.h>
#include <library_types.h>

#include "common.cuh"
#include "ops_cuda.h" // Q3_BLAS_REFUSED

typedef void *blas_handle;
enum { BLAS_OP_N = 0, BLAS_OP_T = 1, BLAS_COMPUTE_32F = 68, BLAS_GEMM_DEFAULT = -1 };
enum { MAX_DEVICES = 16, MAX_GROUPS = 512 };
typedef int (*blas_create_fn)(blas_handle *);
typedef int (*blas_set_stream_fn)(blas_handle, cudaStream_t);
typedef int (*blas_gemm_ex_fn)(blas_handle, int, int, int, int, int, const void *, const void *, cudaDataType_t, int,
                               const void *, cudaDataType_t, int, const void *, void *, cudaDataType_t, int, int, int);
// cublasGemmGroupedBatchedEx (cuBLAS 12.5 on): per group, transposes, sizes, leading dimensions,
// alpha and beta in host arrays; the matrices' pointers in device arrays (all groups' problems)
typedef int (*blas_gemm_grouped_fn)(blas_handle, const int *, const int *, const int *, const int *, const int *,
                                    const void *, const void *const *, cudaDataType_t, const int *,
                                    const void *const *, cudaDataType_t, const int *, const void *, void *const *,
                                    cudaDataType_t, const int *, int, const int *, int);

static struct {
    void *lib;
    blas_create_fn create;
    blas_set_stream_fn set_stream;
    blas_gemm_ex_fn gemm_ex;
    blas_gemm_grouped_fn gemm_grouped; // NULL where the found cuBLAS predates it
    blas_handle handle[MAX_DEVICES];
    int enabled;
} blas;

// 0 when cuBLAS is usable; path NULL tries the usual library names
extern "C" int q3_blas_open(const char *path) {
    if (blas.lib) return 0;
    const char *names[] = {path, "libcublas.so.13", "libcublas.so.12", "libcublas.so"};
    for (int i = 0; i < 4 && !blas.lib; i++)
        if (names[i]) blas.lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!blas.lib) return 1;
    blas.create = (blas_create_fn)dlsym(blas.lib, "cublasCreate_v2");
    blas.set_stream = (blas_set_stream_fn)dlsym(blas.lib, "cublasSetStream_v2");
    blas.gemm_ex = (blas_gemm_ex_fn)dlsym(blas.lib, "cublasGemmEx");
    blas.gemm_grouped = (blas_gemm_grouped_fn)dlsym(blas.lib, "cublasGemmGroupedBatchedEx");
    if (!blas.create || !blas.set_stream || !blas.gemm_ex) {
        dlclose(blas.lib);
        blas.lib = NULL;
        return 2;
    }
    blas.enabled = 1;
    return 0;
}

// turns the cuBLAS path on or off (for comparisons; on < 0 only reads it); returns whether it
// is on now
extern "C" int q3_blas_enable(int on) {
    if (on >= 0) blas.enabled = on && blas.lib;
    return blas.enabled;
}

// the handle of the current device, on `stream`; NULL when cuBLAS cannot serve (*code says why)
static blas_handle handle_on(void *stream, int *code) {
    int device = 0;
    cudaGetDevice(&device);
    *code = -1;
    if (device >= MAX_DEVICES) return NULL;
    *code = (int)cudaErrorUnknown;
    if (!blas.handle[device] && blas.create(&blas.handle[device]) != 0) return NULL;
    if (blas.set_stream(blas.handle[device], (cudaStream_t)stream) != 0) return NULL;
    *code = 0;
    return blas.handle[device];
}

// y (+)= xb W^T through cuBLAS; returns -1 when cuBLAS is not in use (the caller falls back)
extern "C" int q3_blas_gemm_bf16(float *y, const uint16_t *xb, const uint16_t *w, int64_t T, int64_t N, int64_t K,
                                 int accumulate, void *stream) {
    if (!blas.enabled) return -1;
    int code;
    blas_handle h = handle_on(stream, &code);
    if (!h) return code;
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    const int status = blas.gemm_ex(h, BLAS_OP_T, BLAS_OP_N, (int)N, (int)T, (int)K, &alpha, w, CUDA_R_16BF, (int)K,
                                    xb, CUDA_R_16BF, (int)K, &beta, y, CUDA_R_32F, (int)N, BLAS_COMPUTE_32F,
                                    BLAS_GEMM_DEFAULT);
    return status == 0 ? 0 : (int)cudaErrorUnknown;
}

// whether cuBLAS is on and has the grouped GEMM
extern "C" int q3_blas_grouped_available(void) { return blas.enabled && blas.gemm_grouped != NULL; }

// y[g] [T[g], N] = xb[g] [T[g], K] w[g]^T for g < groups, one GEMM a group in one cuBLAS call: y,
// xb and w device arrays of `groups` pointers (read when the call runs on the stream), T a host
// array; -1 when the grouped GEMM is not in use, Q3_BLAS_REFUSED when cuBLAS refused the call
// (nothing was queued; the grouped GEMM is then off for good)
extern "C" int q3_blas_gemm_grouped_bf16(float *const *y, const uint16_t *const *xb, const uint16_t *const *w,
                                         const int *T, int groups, int64_t N, int64_t K, void *stream) {
    if (!q3_blas_grouped_available() || groups < 1 || groups > MAX_GROUPS) return -1;
    int code;
    blas_handle h = handle_on(stream, &code);
    if (!h) return code;
    int op_t[MAX_GROUPS], op_n[MAX_GROUPS], m[MAX_GROUPS], k[MAX_GROUPS], ones[MAX_GROUPS];
    float alpha[MAX_GROUPS], beta[MAX_GROUPS];
    for (int g = 0; g < groups; g++) { // the host arrays cuBLAS reads at the call; m and k are ldc and lda too
        op_t[g] = BLAS_OP_T;
        op_n[g] = BLAS_OP_N;
        m[g] = (int)N;
        k[g] = (int)K;
        ones[g] = 1;
        alpha[g] = 1.0f;
        beta[g] = 0.0f;
    }
    const int status = blas.gemm_grouped(h, op_t, op_n, m, T, k, alpha, (const void *const *)w, CUDA_R_16BF, k,
                                         (const void *const *)xb, CUDA_R_16BF, k, beta, (void *const *)y, CUDA_R_32F,
                                         m, groups, ones, BLAS_COMPUTE_32F);
    if (status == 0) return 0;
    // refused (a cuBLAS without bf16 in and fp32 out for the grouped GEMM, say): not offered again
    blas.gemm_grouped = NULL;
    return Q3_BLAS_REFUSED;
}

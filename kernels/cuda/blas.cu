// cuBLAS for the prefill GEMMs, opened at run time: the build machine need not have cuBLAS
// (this project's CI has only the CUDA runtime and compiler), and a machine that has it (as a
// system library or the nvidia-cublas Python package) gets tensor-core GEMMs tuned for its
// GPU. The few entry points used are declared here from the cuBLAS documentation.
// y [T, N] (+)= xb [T, K] W^T with bf16 inputs and fp32 output and accumulation is, in
// cuBLAS's column-major terms, C [N, T] = op_T(W as [K, N]) * xb as [K, T].
#include <dlfcn.h>
#include <library_types.h>

#include "common.cuh"

typedef void *blas_handle;
enum { BLAS_OP_N = 0, BLAS_OP_T = 1, BLAS_COMPUTE_32F = 68, BLAS_GEMM_DEFAULT = -1, MAX_DEVICES = 16 };
typedef int (*blas_create_fn)(blas_handle *);
typedef int (*blas_set_stream_fn)(blas_handle, cudaStream_t);
typedef int (*blas_gemm_ex_fn)(blas_handle, int, int, int, int, int, const void *, const void *, cudaDataType_t, int,
                               const void *, cudaDataType_t, int, const void *, void *, cudaDataType_t, int, int, int);

static struct {
    void *lib;
    blas_create_fn create;
    blas_set_stream_fn set_stream;
    blas_gemm_ex_fn gemm_ex;
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

// y (+)= xb W^T through cuBLAS; returns -1 when cuBLAS is not in use (the caller falls back)
extern "C" int q3_blas_gemm_bf16(float *y, const uint16_t *xb, const uint16_t *w, int64_t T, int64_t N, int64_t K,
                                 int accumulate, void *stream) {
    if (!blas.enabled) return -1;
    int device = 0;
    cudaGetDevice(&device);
    if (device >= MAX_DEVICES) return -1;
    if (!blas.handle[device] && blas.create(&blas.handle[device]) != 0) return (int)cudaErrorUnknown;
    if (blas.set_stream(blas.handle[device], (cudaStream_t)stream) != 0) return (int)cudaErrorUnknown;
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    const int status = blas.gemm_ex(blas.handle[device], BLAS_OP_T, BLAS_OP_N, (int)N, (int)T, (int)K, &alpha, w,
                                    CUDA_R_16BF, (int)K, xb, CUDA_R_16BF, (int)K, &beta, y, CUDA_R_32F, (int)N,
                                    BLAS_COMPUTE_32F, BLAS_GEMM_DEFAULT);
    return status == 0 ? 0 : (int)cudaErrorUnknown;
}

// The CUDA runtime API on the SIMT executor: the functions kernels/cuda/*.cu call, defined
// with CUDA's own declarations (<cuda_runtime.h>). "Device" memory is host memory, one heap
// block per allocation of exactly its bytes (AddressSanitizer sees an access past it);
// streams run their work at once, in order; events read the host clock. Graph capture is
// strict, as CUDA's thread-local mode: while this thread captures, launches and device-side
// copies and memsets on the capturing stream are recorded, and anything a capture forbids
// (allocation, freeing, synchronisation, copies from or to host memory) fails and
// invalidates it; a replay runs the recorded work in order.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "block.h"

struct CUstream_st {
    bool capturing;
    bool broken; // a forbidden call during the capture
    std::vector<simt::Launch> *tape;
};
struct CUgraph_st {
    std::vector<simt::Launch> ops;
};
struct CUgraphExec_st {
    std::vector<simt::Launch> ops;
};
struct CUevent_st {
    double seconds;
};

namespace simt {

// ---- errors ------------------------------------------------------------------------------------

static std::mutex g_error_mutex;
static thread_local int tl_last_error = cudaSuccess;
static int g_detail_code = cudaSuccess;
static char g_detail[1024];

void record_error(int code, const std::string &message) {
    tl_last_error = code;
    std::lock_guard<std::mutex> lock(g_error_mutex);
    g_detail_code = code;
    snprintf(g_detail, sizeof g_detail, "%s (SIMT executor)", message.c_str());
}

static thread_local CUstream_st *tl_capturing; // the stream this thread captures on

// a call that a capture forbids: fails it, and the capture
static bool forbidden_in_capture(const char *what) {
    if (!tl_capturing) return false;
    tl_capturing->broken = true;
    record_error(cudaErrorStreamCaptureUnsupported,
                 std::string(what) + " while this thread captures a CUDA graph (not permitted in a capture)");
    return true;
}

bool capture_launch(void *stream, const Launch *launch) {
    CUstream_st *s = (CUstream_st *)stream;
    if (!s || !s->capturing) {
        if (tl_capturing && !s) { // the legacy default stream from a capturing thread: CUDA refuses it
            tl_capturing->broken = true;
            record_error(cudaErrorStreamCaptureImplicit, "work on the default stream while this thread captures");
        }
        return false;
    }
    s->tape->push_back(*launch);
    return true;
}

static void free_ops(std::vector<Launch> &ops) {
    for (Launch &l : ops) l.free_args(l.args);
    ops.clear();
}

// device-side copies and memsets as operations a graph can hold
struct CopyArgs {
    void *dst;
    const void *src;
    size_t bytes;
    int value; // memset
};
static void copy_body(void *a) {
    CopyArgs *c = (CopyArgs *)a;
    memmove(c->dst, c->src, c->bytes);
}
static void memset_body(void *a) {
    CopyArgs *c = (CopyArgs *)a;
    memset(c->dst, c->value, c->bytes);
}
static void free_copy(void *a) { delete (CopyArgs *)a; }

// a 2-D copy: rows of `width` bytes, `pitch` bytes apart on each side
struct Copy2DArgs {
    void *dst;
    size_t dst_pitch;
    const void *src;
    size_t src_pitch, width, rows;
};
static void copy_2d_body(void *a) {
    Copy2DArgs *c = (Copy2DArgs *)a;
    for (size_t r = 0; r < c->rows; r++)
        memmove((char *)c->dst + r * c->dst_pitch, (const char *)c->src + r * c->src_pitch, c->width);
}
static void free_copy_2d(void *a) { delete (Copy2DArgs *)a; }

int submit_host(void *stream, const char *name, void (*body)(void *), void *args, void (*free_args)(void *)) {
    Launch l = {name, dim3(1), dim3(1), 0, nullptr, body, args, free_args};
    if (capture_launch(stream, &l)) return cudaSuccess;
    if (tl_capturing && tl_capturing->broken) {
        free_args(args);
        return cudaErrorStreamCaptureImplicit;
    }
    body(args);
    free_args(args);
    return cudaSuccess;
}

static cudaError_t queue(cudaStream_t stream, void (*body)(void *), CopyArgs args, const char *name) {
    return (cudaError_t)submit_host(stream, name, body, new CopyArgs(args), free_copy);
}

} // namespace simt

using namespace simt;

extern "C" {

cudaError_t cudaGetLastError(void) {
    const int e = tl_last_error;
    tl_last_error = cudaSuccess;
    return (cudaError_t)e;
}
cudaError_t cudaPeekAtLastError(void) { return (cudaError_t)tl_last_error; }

const char *cudaGetErrorString(cudaError_t code) {
    {
        std::lock_guard<std::mutex> lock(g_error_mutex);
        if (code == g_detail_code && code != cudaSuccess) return g_detail;
    }
    switch (code) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidPitchValue: return "invalid pitch argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing stream";
    default: return "CUDA error (SIMT executor)";
    }
}
const char *cudaGetErrorName(cudaError_t code) { return cudaGetErrorString(code); }

cudaError_t cudaGetDeviceCount(int *count) {
    *count = 1;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaGetDevice(int *device) {
    *device = 0;
    return cudaSuccess;
}

// device allocations made and freed so far, for tests of a steady state (no allocation
// after the first call of each shape): q3_simt_allocations below
static std::atomic<long long> g_mallocs{0}, g_frees{0};

cudaError_t cudaMalloc(void **p, size_t bytes) {
    *p = nullptr;
    if (forbidden_in_capture("cudaMalloc")) return cudaErrorStreamCaptureUnsupported;
    // 256-byte aligned as cudaMalloc's, exactly `bytes` long
    if (posix_memalign(p, 256, bytes ? bytes : 1) != 0) {
        *p = nullptr;
        return cudaErrorMemoryAllocation;
    }
    g_mallocs++;
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
    if (forbidden_in_capture("cudaFree")) return cudaErrorStreamCaptureUnsupported;
    if (p) g_frees++;
    free(p);
    return cudaSuccess;
}

// the successful cudaMalloc calls and the cudaFree calls of a block so far, in this process
// (not CUDA's: the executor's own, read by the tests through ctypes)
void q3_simt_allocations(long long *mallocs, long long *frees) {
    *mallocs = g_mallocs.load();
    *frees = g_frees.load();
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind) {
    (void)kind;
    if (forbidden_in_capture("cudaMemcpy")) return cudaErrorStreamCaptureUnsupported;
    memmove(dst, src, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind, cudaStream_t s) {
    if (kind != cudaMemcpyDeviceToDevice && forbidden_in_capture("cudaMemcpyAsync from or to host memory"))
        return cudaErrorStreamCaptureUnsupported;
    return queue(s, copy_body, CopyArgs{dst, src, bytes, 0}, "cudaMemcpyAsync");
}
// As CUDA: each pitch at least the width and at most the device's memPitch (2^31 - 1 bytes on
// every GPU so far), else cudaErrorInvalidPitchValue; no rows or an empty row copy nothing
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind kind, cudaStream_t s) {
    const size_t max_pitch = 2147483647;
    if (dpitch < width || spitch < width || dpitch > max_pitch || spitch > max_pitch) {
        char what[160];
        snprintf(what, sizeof what, "cudaMemcpy2DAsync: width %zu bytes, dpitch %zu, spitch %zu (a pitch below the "
                 "width or above %zu)", width, dpitch, spitch, max_pitch);
        record_error(cudaErrorInvalidPitchValue, what);
        return cudaErrorInvalidPitchValue;
    }
    if (width == 0 || height == 0) return cudaSuccess;
    if (!dst || !src) {
        record_error(cudaErrorInvalidValue, "cudaMemcpy2DAsync: a NULL pointer");
        return cudaErrorInvalidValue;
    }
    if (kind != cudaMemcpyDeviceToDevice && forbidden_in_capture("cudaMemcpy2DAsync from or to host memory"))
        return cudaErrorStreamCaptureUnsupported;
    return (cudaError_t)submit_host(s, "cudaMemcpy2DAsync", copy_2d_body,
                                    new Copy2DArgs{dst, dpitch, src, spitch, width, height}, free_copy_2d);
}
cudaError_t cudaMemset(void *p, int value, size_t bytes) {
    if (forbidden_in_capture("cudaMemset")) return cudaErrorStreamCaptureUnsupported;
    memset(p, value, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s) {
    return queue(s, memset_body, CopyArgs{p, nullptr, bytes, value}, "cudaMemsetAsync");
}

cudaError_t cudaDeviceSynchronize(void) {
    return forbidden_in_capture("cudaDeviceSynchronize") ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    (void)s;
    return forbidden_in_capture("cudaStreamSynchronize") ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *s) {
    *s = new CUstream_st{false, false, nullptr};
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
    (void)flags;
    return cudaStreamCreate(s);
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    if (s && s->tape) {
        free_ops(*s->tape);
        delete s->tape;
    }
    if (tl_capturing == s) tl_capturing = nullptr;
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode) {
    (void)mode; // thread-local is the strictest the engine uses; modelled for every mode
    if (!s) {
        record_error(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture on the legacy default stream");
        return cudaErrorStreamCaptureUnsupported;
    }
    if (s->capturing || tl_capturing) {
        record_error(cudaErrorIllegalState, "cudaStreamBeginCapture while this thread already captures");
        return cudaErrorIllegalState;
    }
    s->capturing = true;
    s->broken = false;
    s->tape = new std::vector<Launch>();
    tl_capturing = s;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph) {
    *graph = nullptr;
    if (!s || !s->capturing) return cudaErrorIllegalState;
    s->capturing = false;
    if (tl_capturing == s) tl_capturing = nullptr;
    std::vector<Launch> *tape = s->tape;
    s->tape = nullptr;
    if (s->broken) {
        free_ops(*tape);
        delete tape;
        return cudaErrorStreamCaptureInvalidated;
    }
    *graph = new CUgraph_st{std::move(*tape)};
    delete tape;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags) {
    (void)flags;
    *exec = new CUgraphExec_st{std::move(graph->ops)};
    graph->ops.clear();
    return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    free_ops(graph->ops);
    delete graph;
    return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    free_ops(exec->ops);
    delete exec;
    return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
    (void)s;
    if (forbidden_in_capture("cudaGraphLaunch")) return cudaErrorStreamCaptureUnsupported;
    for (const Launch &l : exec->ops) {
        if (l.kernel == nullptr) { // a copy or memset
            l.body(l.args);
            continue;
        }
        const int code = run_launch(&l);
        if (code != cudaSuccess) return (cudaError_t)code;
    }
    return cudaSuccess;
}

static double now_seconds() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
cudaError_t cudaEventCreate(cudaEvent_t *e) {
    *e = new CUevent_st{0.0};
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    (void)s;
    // legal in a capture on hardware, but no pass records one there: kept strict, as before
    if (forbidden_in_capture("cudaEventRecord")) return cudaErrorStreamCaptureUnsupported;
    e->seconds = now_seconds();
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    (void)e;
    return forbidden_in_capture("cudaEventSynchronize") ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = (float)((b->seconds - a->seconds) * 1e3);
    return cudaSuccess;
}

} // extern "C"

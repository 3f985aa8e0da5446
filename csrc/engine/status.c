/* Error reporting and small engine utilities: allocation, strided copy, build facts. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu_dispatch.h"

q3_status q3_vfail(q3_error *err, q3_status status, const char *fmt, va_list ap) {
    if (err) {
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        err->status = status;
    }
    return status;
}

q3_status q3_fail(q3_error *err, q3_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    q3_vfail(err, status, fmt, ap);
    va_end(ap);
    return status;
}

/* Exactly `bytes` (no rounding up to the alignment), so that AddressSanitizer sees an access
 * one byte past a tensor. From HUGE_MIN bytes (weights, caches) aligned to 2 MiB, and its
 * whole 2 MiB pages asked to be huge pages: Linux gives anonymous memory huge pages only on
 * request where transparent huge pages are "madvise" (as on the project's VMs), and a decode
 * step streams ~446 MB through 4 KiB pages otherwise (a [1536, 4096] GEMV from memory on an
 * AMD Zen 5, 2 threads: 31.1-33.0 -> 34.2-34.7 GB/s). An advice only: refused, nothing changes. */
#define HUGE_PAGE ((size_t)2 << 20)
#define HUGE_MIN (2 * HUGE_PAGE)
void *q3_alloc(size_t bytes) {
    void *p = NULL;
    const size_t align = bytes >= HUGE_MIN ? HUGE_PAGE : 64;
    if (posix_memalign(&p, align, bytes ? bytes : 1)) return NULL;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align == HUGE_PAGE) (void)madvise(p, bytes / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE);
#endif
    return p;
}

void q3_free(void *p) { free(p); }

void q3_copy_strided(void *dst, q3_dtype dst_dt, const void *src, q3_dtype src_dt, int ndim,
                     const int64_t *shape, const int64_t *strides) {
    int64_t n = 1, idx[8] = {0};
    for (int d = 0; d < ndim; d++) n *= shape[d];
    for (int64_t i = 0; i < n; i++) {
        int64_t off = 0;
        for (int d = 0; d < ndim; d++) off += idx[d] * strides[d];
        q3_float_put(dst, dst_dt, i, q3_float_at(src, src_dt, off));
        for (int d = ndim - 1; d >= 0; d--) {
            if (++idx[d] < shape[d]) break;
            idx[d] = 0;
        }
    }
}

void q3_fill_random(void *dst, q3_dtype dt, int64_t n, uint64_t seed, uint64_t stream,
                    float mean, float std) {
    q3_cpu_ops_active()->fill_normal(dst, dt, n, seed, stream, 0, mean, std);
}

void q3_fill_random_from(void *dst, q3_dtype dt, int64_t n, uint64_t seed, uint64_t stream, int64_t first,
                         float mean, float std) {
    q3_cpu_ops_active()->fill_normal(dst, dt, n, seed, stream, (uint64_t)first, mean, std);
}

int q3_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

const char *q3_build_compiler(void) {
#if defined(__clang__)
    return "clang " __clang_version__;
#elif defined(__GNUC__)
    return "gcc " __VERSION__;
#else
    return "unknown";
#endif
}

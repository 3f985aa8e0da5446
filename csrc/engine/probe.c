/* Timed machine probes (kernels/probe.h) for the benchmarks' "machine limit" columns. */
#include <string.h>
#include <time.h>

#include "cpu_dispatch.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double q3_probe_read_gbs(size_t bytes, int repeats) {
    bytes = bytes / 4096 * 4096;
    char *buf = q3_alloc(bytes);
    if (!buf || bytes == 0) {
        q3_free(buf);
        return 0.0;
    }
    memset(buf, 1, bytes); /* fault every page in before timing */
    const q3_cpu_ops *k = q3_cpu_ops_active();
    double best = 0.0;
    volatile uint64_t sink = 0;
    for (int r = 0; r < repeats; r++) {
        const double t0 = now();
        sink ^= k->probe_read(buf, bytes);
        const double gbs = (double)bytes / (now() - t0) / 1e9;
        best = gbs > best ? gbs : best;
    }
    (void)sink;
    q3_free(buf);
    return best;
}

double q3_probe_fma_gflops(double seconds) {
    const q3_cpu_ops *k = q3_cpu_ops_active();
    float sink;
    int64_t iters = 1 << 16;
    double best = 0.0, spent = 0.0;
    while (spent < seconds) {
        const double t0 = now();
        const int64_t fmas = k->probe_fma(iters, &sink);
        const double dt = now() - t0;
        spent += dt;
        best = 2.0 * (double)fmas / dt / 1e9 > best ? 2.0 * (double)fmas / dt / 1e9 : best;
        if (dt < 0.05) iters *= 2;
    }
    return best;
}

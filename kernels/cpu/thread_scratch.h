/* A parallel region's per-thread scratch: each thread its own slice of per_thread floats. */
#ifndef Q3_KERNELS_CPU_THREAD_SCRATCH_H
#define Q3_KERNELS_CPU_THREAD_SCRATCH_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* the calling thread's slice of scratch (a build without OpenMP: one thread, the first) */
static inline float *q3_thread_scratch(float *scratch, int64_t per_thread) {
#ifdef _OPENMP
    return scratch + omp_get_thread_num() * per_thread;
#else
    (void)per_thread;
    return scratch;
#endif
}

#endif

/* Whether a kernel's loop opens an OpenMP team or runs inline on the calling thread.
 *
 * libgomp ends every parallel region with a futex wake, a system call, also a region that runs
 * on one thread: an `if` clause false, one thread asked for or allowed, or a region nested in
 * another (about 0.4 us each in a VM; a decode step of a small layer opens 37, strace). So a
 * kernel whose work is below its threshold, or that would run on one thread, runs its loop
 * inline: the same iterations in the same order, each writing its own outputs, so the same
 * numbers on any thread count. */
#ifndef Q3_KERNELS_CPU_TEAM_H
#define Q3_KERNELS_CPU_TEAM_H

#ifdef _OPENMP
#include <omp.h>
#endif

/* 1 where a team pays: the work is big (the kernel's threshold), no team is running here, and
 * more than one thread would run it (threads: the kernel's count, 0: OpenMP's default) */
static inline int q3_team(int big, int threads) {
#ifdef _OPENMP
    return big && !omp_in_parallel() && (threads > 1 || (threads == 0 && omp_get_max_threads() > 1));
#else
    (void)big;
    (void)threads;
    return 0;
#endif
}

#endif

/* The L1 data and L2 cache sizes the many-token matmuls block for (matmul_packed.c,
 * matmul_dot.c's bf16 dot products): sysconf's, or 32 KiB and 512 KiB where it does not
 * know them or reports something implausible. */
#ifndef Q3_KERNELS_CPU_CACHE_SIZES_H
#define Q3_KERNELS_CPU_CACHE_SIZES_H

#include <unistd.h>

static inline void q3_cache_sizes(long *l1, long *l2) {
    *l1 = *l2 = 0;
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
    *l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    *l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    if (*l1 < 16 * 1024 || *l1 > 1024 * 1024) *l1 = 32 * 1024;
    if (*l2 < 128 * 1024 || *l2 > 64 * 1024 * 1024) *l2 = 512 * 1024;
}

#endif

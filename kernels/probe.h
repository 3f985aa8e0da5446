/* Probes of the machine's own limits, for benchmarks: how fast the cores can stream memory
 * and how many fp32 multiply-adds they can retire. Each is compiled per CPU variant, so the
 * active path probes with its own vector width. The caller times them. */
#ifndef Q3_KERNELS_PROBE_H
#define Q3_KERNELS_PROBE_H

#include "dtype.h"

/* reads buf [bytes] (64-byte aligned, bytes a multiple of 4096) once with every thread;
 * returns a checksum so the reads cannot be dropped */
typedef uint64_t q3_probe_read_fn(const void *buf, size_t bytes);
/* iters rounds of independent fp32 multiply-add chains on every thread; returns the
 * multiply-adds done in all (2 FLOP each) and a value to keep them alive in *sink */
typedef int64_t q3_probe_fma_fn(int64_t iters, float *sink);

#endif

/* The emulated CUDA device's two halves (emulated_device.c: memory, copies, streams and
 * the graph tape; emulated_kernels.c: the launchers, as CPU twins). */
#ifndef Q3_CHECK_EMULATED_DEVICE_H
#define Q3_CHECK_EMULATED_DEVICE_H

#include <stddef.h>

#include "../cuda/backend.h"
#include "q3_check.h"

/* Runs a launch now, or records it (its arguments copied) while a stream is capturing:
 * a replay of the graph runs the recorded launches in order, as a CUDA graph would. */
typedef int q3_emu_run_fn(const void *args);
int q3_emu_submit(q3_emu_run_fn *run, const void *args, size_t size);

/* fills the kernel launchers of the table */
void q3_emu_kernels(q3_cuda_ops *table);

#endif
